// CUDA reduce kernels, element for element the same functions as reduce_cpu.cc.
//
// One grid-stride kernel per (op, dtype). An elementwise reduce is bound by memory bandwidth, so
// the kernel moves 16 bytes per load and store (4 floats, 8 halves, 16 int8) when dst and src
// share their offset modulo 16: the elements before the first 16-byte boundary ("head") and after
// the last one ("tail") go one at a time, and buffers with different offsets go wholly one at a
// time. The grid is capped at what the device holds resident at once (kBlocksPerSm full blocks
// per SM); each thread then walks the buffer with the grid's stride, so a launch costs the same
// for 1 KB and 1 GB and every SM stays busy.
//
// Exactness: the arithmetic is IEEE round-to-nearest-even with subnormals kept (nvcc's default:
// no -use_fast_math, no -ftz), one operation per element, as on the CPU. fp16/bf16 are combined
// in fp32 and rounded once (cvt.rn), the same rounding as floatToHalf / floatToBf16; their AVG
// saturates finite sums at the format's largest value, as on the CPU (ops::SaturatingSum).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/error.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cuda.h"
#include "kernels/reduce_ops.h"

namespace hetcomm {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kBlocksPerSm = 2048 / kThreads;  // 2048 resident threads per SM on sm_80 and sm_90
constexpr size_t kVecBytes = 16;

// --- element codecs: how a stored element becomes the value an op combines, and back ------------

// AvgSum: how the codec's AVG combines two values (reduce.h: SUM, saturating for fp16/bf16).
template <typename T>
struct Native {
  using Storage = T;
  using Value = T;
  using AvgSum = ops::Sum;
  __device__ static T decode(T x) { return x; }
  __device__ static T encode(T x) { return x; }
};
struct Half {
  using Storage = uint16_t;
  using Value = float;
  using AvgSum = ops::SaturatingSum<ops::HalfLimits>;
  __device__ static float decode(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  __device__ static uint16_t encode(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct BFloat16 {
  using Storage = uint16_t;
  using Value = float;
  using AvgSum = ops::SaturatingSum<ops::Bf16Limits>;
  __device__ static float decode(uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); }
  __device__ static uint16_t encode(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

// --- ops: SUM, PRODUCT and the bitwise ops from reduce_ops.h; MIN/MAX in the same bit-exact form as
// reduce_cpu.cc's minMaxFloatLoop -----------------------------------------------------------------

using ops::Band;
using ops::Bor;
using ops::Bxor;
using ops::Prod;
using ops::Sum;

__device__ inline uint32_t toBits(float x) { return __float_as_uint(x); }
__device__ inline unsigned long long toBits(double x) { return static_cast<unsigned long long>(__double_as_longlong(x)); }
__device__ inline float fromBits(uint32_t b, float) { return __uint_as_float(b); }
__device__ inline double fromBits(unsigned long long b, double) { return __longlong_as_double(static_cast<long long>(b)); }
__device__ inline uint32_t canonicalNaNBits(float) { return 0x7fc00000u; }            // quiet_NaN() on the CPU
__device__ inline unsigned long long canonicalNaNBits(double) { return 0x7ff8000000000000ull; }

// MIN/MAX symmetric bit for bit (reduce.h): a NaN on either side gives the canonical quiet NaN; of
// two equal values (only +0 and -0 differ in bits) OR of the bits picks -0 for MIN, AND picks +0
// for MAX. Integers compare plainly.
template <bool kMin>
struct MinMax {
  template <typename T>
  __device__ static T apply(T a, T b) {
    if constexpr (std::is_floating_point<T>::value) {
      const auto ua = toBits(a), ub = toBits(b);
      auto r = (kMin ? a < b : a > b) ? ua : ((kMin ? b < a : b > a) ? ub : (kMin ? (ua | ub) : (ua & ub)));
      if (a != a || b != b) r = canonicalNaNBits(a);
      return fromBits(r, a);
    } else {
      return kMin ? (b < a ? b : a) : (b > a ? b : a);
    }
  }
};
using Min = MinMax<true>;
using Max = MinMax<false>;
// bool: results are canonical (0 or 1) whatever non-zero bytes came in.
struct BoolOr { __device__ static uint8_t apply(uint8_t a, uint8_t b) { return (a | b) != 0; } };
struct BoolAnd { __device__ static uint8_t apply(uint8_t a, uint8_t b) { return (a != 0) & (b != 0); } };
struct BoolXor { __device__ static uint8_t apply(uint8_t a, uint8_t b) { return (a != 0) ^ (b != 0); } };

// --- what the kernel applies per element ------------------------------------------------------------

template <typename Op, typename Codec>
struct Combine {
  using Storage = typename Codec::Storage;
  static constexpr bool kReadsSrc = true;
  __device__ Storage operator()(Storage a, Storage b) const {
    return Codec::encode(Op::apply(Codec::decode(a), Codec::decode(b)));
  }
};

template <typename Codec>
struct DivideBy {
  using Storage = typename Codec::Storage;
  static constexpr bool kReadsSrc = false;
  typename Codec::Value divisor;
  __device__ Storage operator()(Storage a, Storage) const { return Codec::encode(Codec::decode(a) / divisor); }
};

// Elements [0, head) one at a time, then `vectors` 16-byte packs, then `tail` elements.
struct Split {
  size_t head, vectors, tail;
};

template <typename F>
__global__ void __launch_bounds__(kThreads)
    elementwiseKernel(typename F::Storage* __restrict__ dst, const typename F::Storage* __restrict__ src, Split split, F f) {
  using S = typename F::Storage;
  constexpr size_t kLanes = kVecBytes / sizeof(S);
  union Pack {
    uint4 raw;
    S lane[kLanes];
  };
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  auto one = [&](size_t i) {
    if constexpr (F::kReadsSrc) {
      dst[i] = f(dst[i], src[i]);
    } else {
      dst[i] = f(dst[i], S());
    }
  };
  for (size_t i = first; i < split.head; i += stride) one(i);
  uint4* vdst = reinterpret_cast<uint4*>(dst + split.head);
  for (size_t v = first; v < split.vectors; v += stride) {
    Pack a, b;
    a.raw = vdst[v];
    if constexpr (F::kReadsSrc) {
      b.raw = reinterpret_cast<const uint4*>(src + split.head)[v];
    } else {
      b.raw = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (size_t l = 0; l < kLanes; ++l) a.lane[l] = f(a.lane[l], b.lane[l]);
    vdst[v] = a.raw;
  }
  const size_t tailStart = split.head + split.vectors * kLanes;
  for (size_t i = first; i < split.tail; i += stride) one(tailStart + i);
}

// The vector path needs dst and src at the same offset modulo 16 (then the same head brings both
// to a 16-byte boundary); `src` is dst itself for the in-place kernels.
Split splitForVectors(const void* dst, const void* src, size_t count, size_t elemSize) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d % kVecBytes != s % kVecBytes) return Split{count, 0, 0};
  const size_t head = std::min(count, (kVecBytes - d % kVecBytes) % kVecBytes / elemSize);
  const size_t lanes = kVecBytes / elemSize;
  const size_t vectors = (count - head) / lanes;
  return Split{head, vectors, count - head - vectors * lanes};
}

template <typename F>
cudaError_t launch(void* dst, const void* src, size_t count, F f, cudaStream_t stream) {
  using S = typename F::Storage;
  const Split split = splitForVectors(dst, F::kReadsSrc ? src : dst, count, sizeof(S));
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const size_t work = std::max({split.head, split.vectors, split.tail});
  const size_t blocks = std::min<size_t>((work + kThreads - 1) / kThreads, static_cast<size_t>(sms) * kBlocksPerSm);
  elementwiseKernel<F><<<static_cast<unsigned>(std::max<size_t>(blocks, 1)), kThreads, 0, stream>>>(
      static_cast<S*>(dst), static_cast<const S*>(src), split, f);
  return cudaGetLastError();
}

// The dispatch mirrors reduce_cpu.cc: AVG reduces as SUM (saturating for fp16/bf16);
// checkReduceSupported has already turned away bitwise ops on floats and AVG on integers and bool.
template <typename Codec>
cudaError_t reduceArith(void* dst, const void* src, size_t n, RedOp op, cudaStream_t stream) {
  switch (op) {
    case RedOp::kSum: return launch(dst, src, n, Combine<Sum, Codec>{}, stream);
    case RedOp::kAvg: return launch(dst, src, n, Combine<typename Codec::AvgSum, Codec>{}, stream);
    case RedOp::kProduct: return launch(dst, src, n, Combine<Prod, Codec>{}, stream);
    case RedOp::kMin: return launch(dst, src, n, Combine<Min, Codec>{}, stream);
    case RedOp::kMax: return launch(dst, src, n, Combine<Max, Codec>{}, stream);
    default: break;
  }
  throw CommError(strCat("hetcomm: reduce op ", redOpName(op), " is not supported here"));
}

template <typename T>
cudaError_t reduceInteger(void* dst, const void* src, size_t n, RedOp op, cudaStream_t stream) {
  switch (op) {
    case RedOp::kBand: return launch(dst, src, n, Combine<Band, Native<T>>{}, stream);
    case RedOp::kBor: return launch(dst, src, n, Combine<Bor, Native<T>>{}, stream);
    case RedOp::kBxor: return launch(dst, src, n, Combine<Bxor, Native<T>>{}, stream);
    default: return reduceArith<Native<T>>(dst, src, n, op, stream);
  }
}

// bool: SUM/MAX/BOR are logical or, PRODUCT/MIN/BAND logical and, BXOR exclusive or.
cudaError_t reduceBool(void* dst, const void* src, size_t n, RedOp op, cudaStream_t stream) {
  using B = Native<uint8_t>;
  switch (op) {
    case RedOp::kSum: case RedOp::kMax: case RedOp::kBor: return launch(dst, src, n, Combine<BoolOr, B>{}, stream);
    case RedOp::kProduct: case RedOp::kMin: case RedOp::kBand: return launch(dst, src, n, Combine<BoolAnd, B>{}, stream);
    case RedOp::kBxor: return launch(dst, src, n, Combine<BoolXor, B>{}, stream);
    case RedOp::kAvg: break;
  }
  throw CommError("hetcomm: AVG is not supported for bool");
}

void checkElementAligned(const void* p, DType dtype, const char* what, const char* name) {
  if (reinterpret_cast<uintptr_t>(p) % elementSize(dtype) != 0) {
    throw CommError(strCat("hetcomm ", what, ": ", name, " pointer ", p, " is not aligned to the ", elementSize(dtype),
                           "-byte size of ", dtypeName(dtype)));
  }
}

[[noreturn]] void throwCudaError(cudaError_t err, const char* what, const char* opName, size_t n, DType dtype) {
  throw CommError(strCat("hetcomm ", what, ": ", opName, " of ", n, " ", dtypeName(dtype), " elements: kernel launch failed: ",
                         cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

}  // namespace

void reduceIntoCuda(void* dst, const void* src, size_t n, DType dtype, RedOp op, cudaStream_t stream) {
  checkReduceSupported(dtype, op);
  checkElementAligned(dst, dtype, "reduceIntoCuda", "dst");
  checkElementAligned(src, dtype, "reduceIntoCuda", "src");
  if (n == 0) return;
  cudaError_t err = cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: err = reduceArith<Native<float>>(dst, src, n, op, stream); break;
    case DType::kFloat64: err = reduceArith<Native<double>>(dst, src, n, op, stream); break;
    case DType::kFloat16: err = reduceArith<Half>(dst, src, n, op, stream); break;
    case DType::kBFloat16: err = reduceArith<BFloat16>(dst, src, n, op, stream); break;
    case DType::kInt8: err = reduceInteger<int8_t>(dst, src, n, op, stream); break;
    case DType::kUInt8: err = reduceInteger<uint8_t>(dst, src, n, op, stream); break;
    case DType::kInt32: err = reduceInteger<int32_t>(dst, src, n, op, stream); break;
    case DType::kInt64: err = reduceInteger<int64_t>(dst, src, n, op, stream); break;
    case DType::kBool: err = reduceBool(dst, src, n, op, stream); break;
  }
  if (err != cudaSuccess) throwCudaError(err, "reduceIntoCuda", redOpName(op), n, dtype);
}

void divideInPlaceCuda(void* data, size_t n, DType dtype, double divisor, cudaStream_t stream) {
  if (!isFloating(dtype)) throw CommError(strCat("hetcomm: AVG needs a floating-point tensor, got ", dtypeName(dtype)));
  checkElementAligned(data, dtype, "divideInPlaceCuda", "data");
  if (n == 0) return;
  // As on the CPU: fp32 and the 16-bit floats divide by the divisor rounded to float.
  const float divisorF = static_cast<float>(divisor);
  cudaError_t err = cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: err = launch(data, nullptr, n, DivideBy<Native<float>>{divisorF}, stream); break;
    case DType::kFloat64: err = launch(data, nullptr, n, DivideBy<Native<double>>{divisor}, stream); break;
    case DType::kFloat16: err = launch(data, nullptr, n, DivideBy<Half>{divisorF}, stream); break;
    case DType::kBFloat16: err = launch(data, nullptr, n, DivideBy<BFloat16>{divisorF}, stream); break;
    default: break;
  }
  if (err != cudaSuccess) throwCudaError(err, "divideInPlaceCuda", "divide", n, dtype);
}

}  // namespace hetcomm
