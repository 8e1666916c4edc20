// CPU reduce kernels. Plain loops over __restrict__ pointers, written so that GCC/Clang
// auto-vectorise them at -O3; fp16/bf16 go through fp32 per element.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>

#include "common/error.h"
#include "kernels/reduce.h"
#include "kernels/reduce_ops.h"

namespace hetcomm {
namespace {

using ops::Band;
using ops::Bf16Limits;
using ops::Bor;
using ops::Bxor;
using ops::HalfLimits;
using ops::Prod;
using ops::SaturatingSum;
using ops::Sum;

// MIN/MAX are symmetric bit for bit: NaN wins (two NaNs give the canonical quiet NaN), and of
// two equal values (+0 and -0) MIN takes the negative one, MAX the positive one.
template <typename T, bool kMin>
inline T minMax(T a, T b) {
  if (std::is_floating_point<T>::value) {
    const bool an = a != a, bn = b != b;
    if (an || bn) return (an && bn) ? std::numeric_limits<T>::quiet_NaN() : (an ? a : b);
    if (a == b) return (std::signbit(a) == kMin) ? a : b;
  }
  return kMin ? (b < a ? b : a) : (b > a ? b : a);
}
struct Min { template <typename T> static T apply(T a, T b) { return minMax<T, true>(a, b); } };
struct Max { template <typename T> static T apply(T a, T b) { return minMax<T, false>(a, b); } };

template <typename Op, typename T>
void loop(T* __restrict__ dst, const T* __restrict__ src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], src[i]);
}

template <typename Op, float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void loop16(uint16_t* __restrict__ dst, const uint16_t* __restrict__ src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = FromF(Op::apply(ToF(dst[i]), ToF(src[i])));
}

// fp32/fp64 MIN/MAX in a branch-free form the compiler vectorises, with the same results as
// minMax: when neither value is smaller they are equal or +-0, and OR of the bits picks -0 (MIN),
// AND picks +0 (MAX); a NaN on either side gives the canonical quiet NaN.
template <typename T, typename Bits, bool kMin>
void minMaxFloatLoop(T* __restrict__ dst, const T* __restrict__ src, size_t n) {
  const T qnan = std::numeric_limits<T>::quiet_NaN();
  Bits nanBits;
  std::memcpy(&nanBits, &qnan, sizeof(nanBits));
  for (size_t i = 0; i < n; ++i) {
    const T a = dst[i], b = src[i];
    Bits ua, ub;
    std::memcpy(&ua, &a, sizeof(ua));
    std::memcpy(&ub, &b, sizeof(ub));
    const Bits tie = kMin ? (ua | ub) : (ua & ub);
    const bool aWins = kMin ? (a < b) : (a > b);
    const bool bWins = kMin ? (b < a) : (b > a);
    Bits r = aWins ? ua : (bWins ? ub : tie);
    r = ((a != a) | (b != b)) ? nanBits : r;
    std::memcpy(&dst[i], &r, sizeof(r));
  }
}

template <typename T>
void reduceArith(T* dst, const T* src, size_t n, RedOp op) {
  using Bits = typename std::conditional<sizeof(T) == 8, uint64_t, uint32_t>::type;
  switch (op) {
    case RedOp::kSum: case RedOp::kAvg: return loop<Sum>(dst, src, n);
    case RedOp::kProduct: return loop<Prod>(dst, src, n);
    case RedOp::kMin:
      if (std::is_floating_point<T>::value) return minMaxFloatLoop<T, Bits, true>(dst, src, n);
      return loop<Min>(dst, src, n);
    case RedOp::kMax:
      if (std::is_floating_point<T>::value) return minMaxFloatLoop<T, Bits, false>(dst, src, n);
      return loop<Max>(dst, src, n);
    default: break;
  }
  throw CommError(strCat("hetcomm: reduce op ", redOpName(op), " is not supported here"));
}

template <typename T>
void reduceInteger(T* dst, const T* src, size_t n, RedOp op) {
  switch (op) {
    case RedOp::kBand: return loop<Band>(dst, src, n);
    case RedOp::kBor: return loop<Bor>(dst, src, n);
    case RedOp::kBxor: return loop<Bxor>(dst, src, n);
    default: return reduceArith(dst, src, n, op);
  }
}

#if defined(__x86_64__)
enum class HalfArith { kSum, kAvg, kProduct };

// fp16 SUM/AVG/PRODUCT with the F16C conversion instructions, 8 lanes at a time (the scalar
// conversion costs ~20x more). Same results as the scalar path: exact fp32 op, (AVG: the
// saturation of ops::SaturatingSum,) one RNE rounding.
template <HalfArith kOp>
__attribute__((target("avx,f16c"))) void halfArithF16C(uint16_t* dst, const uint16_t* src, size_t n) {
  const __m256 limit = _mm256_set1_ps(HalfLimits::maxFinite());
  const __m256 fltMax = _mm256_set1_ps(FLT_MAX);
  const __m256 signBit = _mm256_set1_ps(-0.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    __m256 r = kOp == HalfArith::kProduct ? _mm256_mul_ps(a, b) : _mm256_add_ps(a, b);
    // AVG: clamp the finite lanes (|r| <= FLT_MAX; NaN compares false). A sum of two fp16 values
    // is finite exactly when both are (fp32 holds any such sum), as SaturatingSum asks.
    if (kOp == HalfArith::kAvg) {
      const __m256 clamped = _mm256_max_ps(_mm256_min_ps(r, limit), _mm256_xor_ps(limit, signBit));
      const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(signBit, r), fltMax, _CMP_LE_OQ);
      r = _mm256_blendv_ps(r, clamped, finite);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    const float a = halfToFloat(dst[i]), b = halfToFloat(src[i]);
    switch (kOp) {
      case HalfArith::kSum: dst[i] = floatToHalf(Sum::apply(a, b)); break;
      case HalfArith::kAvg: dst[i] = floatToHalf(SaturatingSum<HalfLimits>::apply(a, b)); break;
      case HalfArith::kProduct: dst[i] = floatToHalf(Prod::apply(a, b)); break;
    }
  }
}
bool haveF16C() {
  static const bool have = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return have;
}
#endif

template <typename Limits, float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce16(uint16_t* dst, const uint16_t* src, size_t n, RedOp op) {
#if defined(__x86_64__)
  if (ToF == &halfToFloat && haveF16C()) {
    if (op == RedOp::kSum) return halfArithF16C<HalfArith::kSum>(dst, src, n);
    if (op == RedOp::kAvg) return halfArithF16C<HalfArith::kAvg>(dst, src, n);
    if (op == RedOp::kProduct) return halfArithF16C<HalfArith::kProduct>(dst, src, n);
  }
#endif
  switch (op) {
    case RedOp::kSum: return loop16<Sum, ToF, FromF>(dst, src, n);
    case RedOp::kAvg: return loop16<SaturatingSum<Limits>, ToF, FromF>(dst, src, n);
    case RedOp::kProduct: return loop16<Prod, ToF, FromF>(dst, src, n);
    case RedOp::kMin: return loop16<Min, ToF, FromF>(dst, src, n);
    case RedOp::kMax: return loop16<Max, ToF, FromF>(dst, src, n);
    default: break;
  }
  throw CommError(strCat("hetcomm: reduce op ", redOpName(op), " is not supported for 16-bit floats"));
}

// bool: SUM/MAX/BOR are logical or, PRODUCT/MIN/BAND logical and, BXOR exclusive or; values are
// kept canonical (0 or 1).
void reduceBool(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, size_t n, RedOp op) {
  switch (op) {
    case RedOp::kSum: case RedOp::kMax: case RedOp::kBor:
      for (size_t i = 0; i < n; ++i) dst[i] = (dst[i] | src[i]) != 0;
      return;
    case RedOp::kProduct: case RedOp::kMin: case RedOp::kBand:
      for (size_t i = 0; i < n; ++i) dst[i] = (dst[i] != 0) & (src[i] != 0);
      return;
    case RedOp::kBxor:
      for (size_t i = 0; i < n; ++i) dst[i] = (dst[i] != 0) ^ (src[i] != 0);
      return;
    case RedOp::kAvg: break;
  }
  throw CommError("hetcomm: AVG is not supported for bool");
}

}  // namespace

void checkReduceSupported(DType dtype, RedOp op) {
  const bool bitwise = op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor;
  if (bitwise && isFloating(dtype)) {
    throw CommError(strCat("hetcomm: reduce op ", redOpName(op), " is only defined for integer and bool tensors, got ",
                           dtypeName(dtype)));
  }
  if (op == RedOp::kAvg && !isFloating(dtype)) {
    throw CommError(strCat("hetcomm: reduce op AVG needs a floating-point tensor, got ", dtypeName(dtype),
                           " (use SUM and divide)"));
  }
}

void reduceInto(void* dst, const void* src, size_t n, DType dtype, RedOp op) {
  switch (dtype) {
    case DType::kFloat32: return reduceArith(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DType::kFloat64: return reduceArith(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DType::kFloat16:
      return reduce16<HalfLimits, halfToFloat, floatToHalf>(static_cast<uint16_t*>(dst),
                                                            static_cast<const uint16_t*>(src), n, op);
    case DType::kBFloat16:
      return reduce16<Bf16Limits, bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(dst),
                                                            static_cast<const uint16_t*>(src), n, op);
    case DType::kInt8: return reduceInteger(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n, op);
    case DType::kUInt8: return reduceInteger(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
    case DType::kInt32: return reduceInteger(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DType::kInt64: return reduceInteger(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    case DType::kBool: return reduceBool(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
  }
}

void divideInPlace(void* data, size_t n, DType dtype, double divisor) {
  switch (dtype) {
    case DType::kFloat32: {
      float* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::kFloat64: {
      double* p = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return;
    }
    case DType::kFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = floatToHalf(halfToFloat(p[i]) / static_cast<float>(divisor));
      return;
    }
    case DType::kBFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = floatToBf16(bf16ToFloat(p[i]) / static_cast<float>(divisor));
      return;
    }
    default:
      throw CommError(strCat("hetcomm: AVG needs a floating-point tensor, got ", dtypeName(dtype)));
  }
}

}  // namespace hetcomm
