#include "backend/tensor_checks.h"

#include <c10/util/Exception.h>

#include "backend/cuda_device_ops.h"
#include "common/error.h"
#include "kernels/reduce.h"

namespace hetcomm {

DType toDType(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kChar: return DType::kInt8;
    case at::kByte: return DType::kUInt8;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kBool: return DType::kBool;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "hetcomm ", op, ": unsupported dtype ", t.scalar_type(),
                   " (supported: float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool)");
}

RedOp toRedOp(const c10d::ReduceOp& reduceOp, const char* op) {
  switch (reduceOp.op_) {
    case c10d::ReduceOp::SUM: return RedOp::kSum;
    case c10d::ReduceOp::AVG: return RedOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return RedOp::kProduct;
    case c10d::ReduceOp::MIN: return RedOp::kMin;
    case c10d::ReduceOp::MAX: return RedOp::kMax;
    case c10d::ReduceOp::BAND: return RedOp::kBand;
    case c10d::ReduceOp::BOR: return RedOp::kBor;
    case c10d::ReduceOp::BXOR: return RedOp::kBxor;
    default: break;
  }
  TORCH_CHECK(false, "hetcomm ", op, ": unsupported reduce op (supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)");
}

void checkDense(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "hetcomm ", op, ": got an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "hetcomm ", op, ": only dense (strided) tensors are supported, got layout ",
              t.layout());
  if (t.device().is_cuda()) {
    TORCH_CHECK(kBuiltWithCuda, "hetcomm ", op, ": got a tensor on ", t.device(),
                ", but this build of hetcomm has no CUDA support (it was built against a CPU-only torch or without "
                "nvcc); rebuild it where both are present, or move the tensor to the CPU");
  } else {
    TORCH_CHECK(t.device().is_cpu(), "hetcomm ", op, ": tensors on ", t.device(), " are not supported (",
                kBuiltWithCuda ? "CPU and CUDA only" : "CPU only in this build", ")");
  }
  toDType(t, op);
}

void checkReduce(DType dtype, RedOp op, const char* opName) {
  try {
    checkReduceSupported(dtype, op);
  } catch (const CommError& e) {
    TORCH_CHECK_VALUE(false, "hetcomm ", opName, ": ", e.what());
  }
}

void checkCount(const std::vector<at::Tensor>& tensors, size_t n, const char* op, const char* what) {
  TORCH_CHECK_VALUE(tensors.size() == n, "hetcomm ", op, ": expects ", n, " ", what, " tensor(s) per process, got ",
                    tensors.size());
}

void checkSame(const std::vector<at::Tensor>& list, at::ScalarType dtype, int64_t numel, const char* op,
               const char* what) {
  for (size_t i = 0; i < list.size(); ++i) {
    checkDense(list[i], op);
    TORCH_CHECK_TYPE(list[i].scalar_type() == dtype, "hetcomm ", op, ": ", what, "[", i, "] has dtype ",
                     list[i].scalar_type(), " but the input has ", dtype);
    TORCH_CHECK_VALUE(numel < 0 || list[i].numel() == numel, "hetcomm ", op, ": ", what, "[", i, "] has ",
                      list[i].numel(), " elements, expected ", numel);
  }
}

void checkRoot(int64_t root, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "hetcomm ", op, ": invalid root rank ", root, " (group of ", size, ")");
}

std::vector<at::Tensor> rootOnlyList(const std::vector<std::vector<at::Tensor>>& lists, bool isRoot, int size,
                                     const at::Tensor& like, const char* op, const char* what) {
  if (!isRoot) {
    TORCH_CHECK_VALUE(lists.empty() || lists[0].empty(), "hetcomm ", op, ": only the root takes ", what, " tensors");
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1, "hetcomm ", op, ": the root needs one list of ", what, " tensors");
  checkCount(lists[0], static_cast<size_t>(size), op, what);
  checkSame(lists[0], like.scalar_type(), like.numel(), op, what);
  return lists[0];
}

at::Tensor flattenAll(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const at::Tensor& t : tensors) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

}  // namespace hetcomm
