#pragma once
#include "kernels/dtype.h"

namespace hetcomm {

// Throws CommError (with a message naming the op and dtype) for combinations that make no sense,
// e.g. BXOR on floats or AVG on integers. Call on the caller's thread before enqueueing.
void checkReduceSupported(DType dtype, RedOp op);

// How AVG is finished. A sum whose partial results travel in the tensor's dtype (ring hops,
// recursive doubling, the site schedule) would overflow fp16/bf16 for values the average
// represents well (two ranks averaging 40000 in fp16 sum 80000 > 65504). So for the 16-bit floats
// every rank divides its own contribution by the group size first (in fp32, rounded once, with
// divideInPlace), the sum runs as AVG (below: SUM that saturates) and nothing is divided at the
// end; NCCL pre-scales the same way. fp32/fp64 sum first and divide the result, as accurate as
// before: only values within a factor P of their largest (3.4e38, 1.8e308) could overflow there.
inline bool avgScalesInputs(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

// dst[i] = op(dst[i], src[i]) for i < count. AVG reduces as SUM, except that for fp16/bf16 a sum
// of finite values beyond the format's largest finite value saturates to it (its inputs are
// pre-scaled, see avgScalesInputs, so only rounding can take it there: ops::SaturatingSum).
// The op is symmetric in its arguments, bit for bit, so two ranks that combine the same pair of
// values in either order get identical results (recursive doubling relies on this).
// fp16/bf16 are combined in fp32 and rounded once per combination.
void reduceInto(void* dst, const void* src, size_t count, DType dtype, RedOp op);

// x[i] /= divisor, for AVG on floating types (fp16/bf16: in fp32, rounded once).
void divideInPlace(void* data, size_t count, DType dtype, double divisor);

// dst[i] = op(srcs[0][i], srcs[1][i], ..., srcs[n-1][i]), combined in that order, for i < count;
// then, when divisor > 0 (AVG over a whole group), divided by it before the result is stored.
// fp16/bf16 accumulate in fp32 across all sources and round once at the end, so an AVG of large
// values does not overflow on the way: fp16 sums first and divides once (fp32 holds any sum of
// fp16 values); bf16, whose range is fp32's, divides each source first. AVG saturates finite
// results at the format's largest value, as reduceInto does. dst may alias any source: each block
// of elements is read from every source before it is written. Every caller that combines the same
// sources in the same order gets the same bits (reduceInto's bitwise symmetry is not needed here).
void reduceMany(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, RedOp op,
                double divisor = 0.0);

}  // namespace hetcomm
