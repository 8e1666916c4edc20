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

// dst[i] = op(srcs[0][i], srcs[1][i], ..., srcs[n-1][i]), combined in that order, for i < count;
// then, when divisor > 0 (AVG over a whole group), divided by it before the result is stored.
// fp16/bf16 accumulate in fp32 across all sources and round once at the end (so an AVG of
// large fp16 values does not overflow on the way). dst may alias any source: each block of
// elements is read from every source before it is written. Every caller that combines the same
// sources in the same order gets the same bits (reduceInto's bitwise symmetry is not needed here).
void reduceMany(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, RedOp op,
                double divisor = 0.0);

}  // namespace hetcomm
