#pragma once
// Element ops shared by the CPU (reduce_cpu.cc) and CUDA (reduce_cuda.cu) kernels, so that both
// define the integer arithmetic the same way. MIN/MAX live with each kernel: each has the
// bit-exact form that suits its hardware.
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

}  // namespace ops
}  // namespace hetcomm
