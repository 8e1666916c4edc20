#pragma once
// CUDA reduce kernels: the GPU twins of reduce.h, for every dtype and op the CPU path supports.
// Plain CUDA runtime API, no torch headers, so that they build (and are checked by CI) with nvcc
// alone.
//
// Results are bit for bit those of reduceInto / divideInPlace on the CPU, except the payload and
// sign of a NaN result (NaN stays NaN): x86 and the GPU already disagree there for a plain fp32
// NaN + x, so no caller can rely on them.
#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/dtype.h"

namespace hetcomm {

// dst[i] = op(dst[i], src[i]) for i < count, on device memory, enqueued on `stream` and returning
// before the kernel runs. AVG reduces as SUM, saturating for fp16/bf16 as reduceInto does (the
// division: divideInPlaceCuda, before the sum for fp16/bf16, see avgScalesInputs). dst and src must not
// overlap (as for reduceInto), must be aligned to the element size, and belong to the current device,
// which must be the stream's device. The 16-byte vector path is taken when dst and src have the
// same offset modulo 16 bytes (as any two buffers from the CUDA caching allocator do, at equal
// element offsets); otherwise the kernel runs element by element.
//
// Throws CommError for an unsupported dtype/op (same rules and message as checkReduceSupported),
// for pointers not aligned to the element size, and when the launch fails. Errors that happen
// while the kernel runs surface on the stream, as for any kernel.
void reduceIntoCuda(void* dst, const void* src, size_t count, DType dtype, RedOp op, cudaStream_t stream);

// data[i] /= divisor for floating dtypes (the division of AVG), asynchronously on `stream`; same
// requirements and errors as reduceIntoCuda.
void divideInPlaceCuda(void* data, size_t count, DType dtype, double divisor, cudaStream_t stream);

}  // namespace hetcomm
