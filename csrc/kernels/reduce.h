#pragma once
#include "kernels/dtype.h"

namespace hetcomm {

// Throws CommError (with a message naming the op and dtype) for combinations that make no sense,
// e.g. BXOR on floats or AVG on integers. Call on the caller's thread before enqueueing.
void checkReduceSupported(DType dtype, RedOp op);

// dst[i] = op(dst[i], src[i]) for i < count. AVG reduces as SUM (see scaleInPlace).
// The op is symmetric in its arguments, bit for bit, so two ranks that combine the same pair of
// values in either order get identical results (recursive doubling relies on this).
// fp16/bf16 are combined in fp32 and rounded once per combination.
void reduceInto(void* dst, const void* src, size_t count, DType dtype, RedOp op);

// x[i] /= divisor, for AVG on floating types.
void divideInPlace(void* data, size_t count, DType dtype, double divisor);

}  // namespace hetcomm
