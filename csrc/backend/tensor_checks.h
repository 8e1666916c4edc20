#pragma once
// Caller-thread validation and conversions between torch and the core's types. Every failure is
// a c10::Error whose message starts with "hetcomm <operation>:".
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <vector>

#include "kernels/dtype.h"

namespace hetcomm {

DType toDType(const at::Tensor& t, const char* op);
RedOp toRedOp(const c10d::ReduceOp& reduceOp, const char* op);
// Rejects what the core cannot move: sparse and other non-strided layouts, unsupported dtypes,
// and devices other than the CPU and (in a build with CUDA) CUDA GPUs.
void checkDense(const at::Tensor& t, const char* op);
// dtype and op together (BXOR on floats, AVG on integers, ...).
void checkReduce(DType dtype, RedOp op, const char* op_name);
// Exactly `n` tensors were passed.
void checkCount(const std::vector<at::Tensor>& tensors, size_t n, const char* op, const char* what);
// Every tensor of `list` has `dtype` and, if numel >= 0, that many elements.
void checkSame(const std::vector<at::Tensor>& list, at::ScalarType dtype, int64_t numel, const char* op,
               const char* what);
// A valid root rank for a rooted collective.
void checkRoot(int64_t root, int size, const char* op);
// The tensor list only the root passes (gather's outputs, scatter's inputs): at the root, one list
// of `size` tensors like `like` (dtype and numel); elsewhere, nothing. Returns the root's list.
std::vector<at::Tensor> rootOnlyList(const std::vector<std::vector<at::Tensor>>& lists, bool isRoot, int size,
                                     const at::Tensor& like, const char* op, const char* what);
// A contiguous tensor with the same data (the tensor itself when already contiguous).
inline at::Tensor contiguousOf(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
// Copies `result` back into `t` unless they are the same tensor (the non-contiguous case).
inline void copyBackIfNeeded(const at::Tensor& t, const at::Tensor& result) {
  if (!t.is_same(result)) const_cast<at::Tensor&>(t).copy_(result.view(t.sizes()));
}
// A contiguous tensor's bytes, as a flat uint8 tensor sharing its memory.
inline at::Tensor asBytes(const at::Tensor& contiguous) { return contiguous.reshape({-1}).view(at::kByte); }
// One flat tensor holding the given tensors back to back.
at::Tensor flattenAll(const std::vector<at::Tensor>& tensors);

}  // namespace hetcomm
