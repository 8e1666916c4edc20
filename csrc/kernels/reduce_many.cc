// reduceMany: one output from several inputs, for the shared-memory collectives, where a rank
// reduces its slice straight from every local rank's slot.
//
// Works block by block (kBlock elements, a few KB): the running result lives in an accumulator
// that stays in L1 while every source block streams through it once, and dst is written once per
// block. Native types accumulate in their own type with reduceInto (same vectorised loops, same
// semantics as every other reduction of the engine); fp16/bf16 convert each source block to fp32
// (F16C for fp16 where the CPU has it), accumulate in fp32 and round once. An AVG over the group
// (divisor > 0) divides fp16 once at the end; bf16 divides every source before adding it, since
// bf16 values near their largest (fp32's largest too) would overflow the fp32 sum.
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/error.h"
#include "kernels/reduce.h"
#include "kernels/reduce_ops.h"

namespace hetcomm {
namespace {

constexpr size_t kBlock = 2048;

#if defined(__x86_64__)
bool haveF16C() {
  static const bool have = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return have;
}
__attribute__((target("avx,f16c"))) void halfToFloatF16C(float* out, const uint16_t* in, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = halfToFloat(in[i]);
}
__attribute__((target("avx,f16c"))) void floatToHalfF16C(uint16_t* out, const float* in, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = floatToHalf(in[i]);
}
#endif

void toFloat(float* out, const uint16_t* in, size_t n, DType dtype) {
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
      std::memcpy(&out[i], &bits, sizeof(float));
    }
    return;
  }
#if defined(__x86_64__)
  if (haveF16C()) return halfToFloatF16C(out, in, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = halfToFloat(in[i]);
}

void fromFloat(uint16_t* out, const float* in, size_t n, DType dtype) {
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) out[i] = floatToBf16(in[i]);
    return;
  }
#if defined(__x86_64__)
  if (haveF16C()) return floatToHalfF16C(out, in, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = floatToHalf(in[i]);
}

void reduceManyHalf(uint16_t* dst, const void* const* srcs, int n, size_t count, DType dtype, RedOp op,
                    double divisor) {
  alignas(64) float acc[kBlock];
  alignas(64) float tmp[kBlock];
  const bool divideFirst = divisor > 0 && dtype == DType::kBFloat16;
  const float limit = dtype == DType::kBFloat16 ? ops::Bf16Limits::maxFinite() : ops::HalfLimits::maxFinite();
  for (size_t at = 0; at < count; at += kBlock) {
    const size_t m = std::min(kBlock, count - at);
    toFloat(acc, static_cast<const uint16_t*>(srcs[0]) + at, m, dtype);
    if (divideFirst) divideInPlace(acc, m, DType::kFloat32, divisor);
    for (int k = 1; k < n; ++k) {
      toFloat(tmp, static_cast<const uint16_t*>(srcs[k]) + at, m, dtype);
      if (divideFirst) divideInPlace(tmp, m, DType::kFloat32, divisor);
      reduceInto(acc, tmp, m, DType::kFloat32, op);
    }
    if (divisor > 0 && !divideFirst) divideInPlace(acc, m, DType::kFloat32, divisor);
    if (op == RedOp::kAvg) {
      for (size_t i = 0; i < m; ++i) acc[i] = ops::saturateFinite(acc[i], limit);
    }
    fromFloat(dst + at, acc, m, dtype);
  }
}

}  // namespace

void reduceMany(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, RedOp op, double divisor) {
  HC_ENFORCE(nsrcs >= 1, "reduceMany needs a source");
  if (count == 0) return;
  if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
    reduceManyHalf(static_cast<uint16_t*>(dst), srcs, nsrcs, count, dtype, op, divisor);
    return;
  }
  const size_t es = elementSize(dtype);
  alignas(64) char acc[kBlock * 8];
  for (size_t at = 0; at < count; at += kBlock) {
    const size_t m = std::min(kBlock, count - at);
    const size_t off = at * es;
    std::memcpy(acc, static_cast<const char*>(srcs[0]) + off, m * es);
    for (int k = 1; k < nsrcs; ++k) reduceInto(acc, static_cast<const char*>(srcs[k]) + off, m, dtype, op);
    if (divisor > 0) divideInPlace(acc, m, dtype, divisor);
    std::memcpy(static_cast<char*>(dst) + off, acc, m * es);
  }
}

}  // namespace hetcomm
