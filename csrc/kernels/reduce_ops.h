#pragma once
// Element ops shared by the CPU (reduce_cpu.cc) and CUDA (reduce_cuda.cu) kernels, so that both
// define the integer arithmetic and the 16-bit AVG the same way. MIN/MAX live with each kernel:
// each has the bit-exact form that suits its hardware.
#include <cfloat>
#include <type_traits>

#if defined(__CUDACC__)
#define HC_HOST_DEVICE __host__ __device__
#else
#define HC_HOST_DEVICE
#endif

namespace hetcomm {
namespace ops {

// Signed integers add and multiply in their unsigned type: two's-complement wraparound, without
// the undefined behaviour of signed overflow.
template <typename T, bool = std::is_integral<T>::value>
struct WrapType { using type = T; };
template <typename T>
struct WrapType<T, true> { using type = typename std::make_unsigned<T>::type; };
template <typename T>
using Wrap = typename WrapType<T>::type;

struct Sum {
  template <typename T> HC_HOST_DEVICE static T apply(T a, T b) { return static_cast<T>(static_cast<Wrap<T>>(a) + static_cast<Wrap<T>>(b)); }
};
struct Prod {
  template <typename T> HC_HOST_DEVICE static T apply(T a, T b) { return static_cast<T>(static_cast<Wrap<T>>(a) * static_cast<Wrap<T>>(b)); }
};
struct Band { template <typename T> HC_HOST_DEVICE static T apply(T a, T b) { return a & b; } };
struct Bor { template <typename T> HC_HOST_DEVICE static T apply(T a, T b) { return a | b; } };
struct Bxor { template <typename T> HC_HOST_DEVICE static T apply(T a, T b) { return a ^ b; } };

// The largest finite fp16 and bf16 values, as floats.
struct HalfLimits { HC_HOST_DEVICE static constexpr float maxFinite() { return 0x1.ffcp15f; } };  // 65504
struct Bf16Limits { HC_HOST_DEVICE static constexpr float maxFinite() { return 0x1.fep127f; } };  // 3.39e38

HC_HOST_DEVICE inline bool isFiniteFloat(float v) { return v <= FLT_MAX && v >= -FLT_MAX; }  // NaN: false
HC_HOST_DEVICE inline float clampMagnitude(float v, float limit) { return v > limit ? limit : (v < -limit ? -limit : v); }

// v, or +-limit where v is finite but beyond it; inf and NaN pass through.
HC_HOST_DEVICE inline float saturateFinite(float v, float limit) { return isFiniteFloat(v) ? clampMagnitude(v, limit) : v; }

// AVG of fp16/bf16, combined in fp32 (one rounding to the format afterwards). The engine divides
// every contribution by the group size before it enters the sum (avgScalesInputs, reduce.h), so a
// partial sum of finite contributions is at most the largest input's magnitude, plus rounding: a
// sum of finite values beyond the format's largest comes from rounding alone (three fp16 ranks
// averaging 65504 add 21840 three times: 65520, which rounds to inf). It saturates there instead,
// also where fp32 itself overflowed (bf16 has fp32's range); inf and NaN operands pass through.
template <typename Limits>
struct SaturatingSum {
  HC_HOST_DEVICE static float apply(float a, float b) {
    const float r = a + b;
    return isFiniteFloat(a) && isFiniteFloat(b) ? clampMagnitude(r, Limits::maxFinite()) : r;
  }
};

}  // namespace ops
}  // namespace hetcomm
