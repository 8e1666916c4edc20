// CUDA reduce kernels (csrc/kernels/reduce_cuda.cu) against the CPU kernels (reduce_cpu.cc), bit
// for bit: every dtype and op, counts around the 16-byte vector width, and the three alignment
// cases the kernel tells apart (aligned, equally misaligned: a scalar head, differently
// misaligned: all scalar). A NaN result only has to be a NaN (reduce_cuda.h says why).
//
// Needs a CUDA device. Without one the tests that need it report SKIP with the reason and the
// program exits check::kSkipExitCode, which ctest shows as "Skipped", never as passed.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "common/error.h"
#include "kernels/dtype.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cuda.h"
#include "reduce_test_data.h"

using namespace hetcomm;
using namespace hetcomm::test;

namespace {

// 2^21 + 5 elements: larger than the grid of an H100 (132 SMs x 2048 threads) for every dtype on
// the scalar path and for 4- and 8-byte types on the vector path, so the grid-stride loops turn.
const size_t kCounts[] = {0, 1, 2, 7, 15, 16, 17, 33, 1023, 4099, (size_t(1) << 21) + 5};
// Element offsets of dst and src inside their buffers.
struct Offsets {
  size_t dst, src;
};
const Offsets kOffsets[] = {{0, 0}, {1, 1}, {3, 3}, {0, 1}};
const size_t kGuard = 4;  // elements around each range that must stay untouched

#define CUDA_REQUIRE(expr)                                                                                       \
  do {                                                                                                           \
    const cudaError_t hc_err_ = (expr);                                                                          \
    if (hc_err_ != cudaSuccess) {                                                                                \
      ::check::fail(__FILE__, __LINE__, std::string(#expr " failed: ") + cudaGetErrorString(hc_err_));           \
      throw ::check::Abort{};                                                                                    \
    }                                                                                                            \
  } while (0)

void requireCudaDevice() {
  static const std::string reason = [] {
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess) {
      return strCat("needs a CUDA device: cudaGetDeviceCount failed with ", cudaGetErrorName(err), " (",
                    cudaGetErrorString(err), ")");
    }
    return devices == 0 ? std::string("needs a CUDA device: cudaGetDeviceCount found none") : std::string();
  }();
  if (!reason.empty()) SKIP_TEST(reason);
}

// Device memory and a non-blocking stream, freed on every exit from a test.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CUDA_REQUIRE(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
};
struct Stream {
  cudaStream_t stream = nullptr;
  Stream() { CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream); }
};

bool isNaNElement(DType t, const uint8_t* p) {
  uint64_t bits = 0;
  std::memcpy(&bits, p, elementSize(t));
  switch (t) {
    case DType::kFloat32: return (bits & 0x7fffffffu) > 0x7f800000u;
    case DType::kFloat64: return (bits & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
    case DType::kFloat16: return (bits & 0x7fffu) > 0x7c00u;
    case DType::kBFloat16: return (bits & 0x7fffu) > 0x7f80u;
    default: return false;
  }
}

// Compares `got` with `want` element by element (bits, or NaN for NaN); reports the first few
// differences, each with the operands that produced it.
void expectSameElements(DType t, const char* what, const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
                        const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const size_t es = elementSize(t);
  int reported = 0;
  for (size_t i = 0; i * es < want.size() && reported < 3; ++i) {
    const uint8_t* w = &want[i * es];
    const uint8_t* g = &got[i * es];
    if (std::memcmp(w, g, es) == 0 || (isNaNElement(t, w) && isNaNElement(t, g))) continue;
    ++reported;
    uint64_t wb = 0, gb = 0, ab = 0, bb = 0;
    std::memcpy(&wb, w, es);
    std::memcpy(&gb, g, es);
    std::memcpy(&ab, &a[i * es], es);
    if (!b.empty()) std::memcpy(&bb, &b[i * es], es);
    CHECK_MSG(false, what, " element ", i, ": want bits 0x", std::hex, wb, " got 0x", gb, " (operands 0x", ab,
              ", 0x", bb, ")");
  }
}

// Runs reduceIntoCuda on copies of `a` (dst) and `b` (src) placed at the given element offsets,
// in stream order only (copies in, kernel, copy out), and checks it against reduceInto.
void checkAgainstCpu(DType t, RedOp op, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t n,
                     Offsets off, cudaStream_t stream) {
  const size_t es = elementSize(t);
  const size_t dstStart = (kGuard + off.dst) * es, srcStart = (kGuard + off.src) * es;
  const size_t dstBytes = dstStart + (n + kGuard) * es, srcBytes = srcStart + (n + kGuard) * es;
  std::vector<uint8_t> dstHost(a.begin(), a.begin() + dstBytes);
  std::vector<uint8_t> srcHost(b.begin(), b.begin() + srcBytes);
  DeviceBuffer dst(dstBytes), src(srcBytes);
  CUDA_REQUIRE(cudaMemcpyAsync(dst.ptr, dstHost.data(), dstBytes, cudaMemcpyHostToDevice, stream));
  CUDA_REQUIRE(cudaMemcpyAsync(src.ptr, srcHost.data(), srcBytes, cudaMemcpyHostToDevice, stream));
  reduceIntoCuda(dst.bytes() + dstStart, src.bytes() + srcStart, n, t, op, stream);
  std::vector<uint8_t> got(dstBytes);
  CUDA_REQUIRE(cudaMemcpyAsync(got.data(), dst.ptr, dstBytes, cudaMemcpyDeviceToHost, stream));
  CUDA_REQUIRE(cudaStreamSynchronize(stream));

  std::vector<uint8_t> want = dstHost;
  reduceInto(want.data() + dstStart, srcHost.data() + srcStart, n, t, op);
  // Operands aligned with `want`, for the messages: src shifted to dst's offsets.
  std::vector<uint8_t> srcAtDst(dstBytes, 0);
  std::memcpy(srcAtDst.data() + dstStart, srcHost.data() + srcStart, n * es);
  const std::string what = strCat(dtypeName(t), " ", redOpName(op), " n=", n, " offsets ", off.dst, "/", off.src);
  expectSameElements(t, what.c_str(), want, got, dstHost, srcAtDst);
}

}  // namespace

TEST_CASE(cuda_reduce_matches_cpu_for_every_dtype_and_op) {
  requireCudaDevice();
  Stream stream;
  std::mt19937_64 rng(17);
  const size_t maxElements = kCounts[sizeof(kCounts) / sizeof(kCounts[0]) - 1] + 2 * kGuard + 4;
  for (DType t : kAllDTypes) {
    // Random values with the specials mixed in, then a pool where +0/-0 and equal values meet
    // (MIN/MAX ties); prefixes of one draw serve every count.
    const std::vector<uint8_t> randomA = randomData(t, maxElements, rng), randomB = randomData(t, maxElements, rng);
    const std::vector<uint8_t> poolA = poolData(t, 4099 + 2 * kGuard + 4, rng), poolB = poolData(t, 4099 + 2 * kGuard + 4, rng);
    for (RedOp op : kAllOps) {
      if (!supported(t, op)) continue;
      for (size_t n : kCounts) {
        for (Offsets off : kOffsets) checkAgainstCpu(t, op, randomA, randomB, n, off, stream.stream);
      }
      for (Offsets off : kOffsets) checkAgainstCpu(t, op, poolA, poolB, 4099, off, stream.stream);
    }
  }
}

TEST_CASE(cuda_divide_matches_cpu) {
  requireCudaDevice();
  Stream stream;
  std::mt19937_64 rng(23);
  const size_t n = 4099;
  for (DType t : kAllDTypes) {
    if (!isFloating(t)) continue;
    const size_t es = elementSize(t);
    const std::vector<uint8_t> data = randomData(t, n + 1, rng);
    for (double divisor : {2.0, 3.0, 7.0, 0.1}) {
      for (size_t offset : {0, 1}) {  // aligned, and a scalar head
        const size_t count = n + 1 - offset;
        DeviceBuffer buf(data.size());
        CUDA_REQUIRE(cudaMemcpyAsync(buf.ptr, data.data(), data.size(), cudaMemcpyHostToDevice, stream.stream));
        divideInPlaceCuda(buf.bytes() + offset * es, count, t, divisor, stream.stream);
        std::vector<uint8_t> got(data.size());
        CUDA_REQUIRE(cudaMemcpyAsync(got.data(), buf.ptr, data.size(), cudaMemcpyDeviceToHost, stream.stream));
        CUDA_REQUIRE(cudaStreamSynchronize(stream.stream));
        std::vector<uint8_t> want = data;
        divideInPlace(want.data() + offset * es, count, t, divisor);
        const std::string what = strCat(dtypeName(t), " / ", divisor, " offset ", offset);
        expectSameElements(t, what.c_str(), want, got, data, {});
      }
    }
  }
}

// AVG of fp16/bf16 as the staged pipeline runs it on a device (kernels/reduce.h,
// avgScalesInputs): every rank's contribution divided by P with divideInPlaceCuda, the partial sum
// combined hop by hop with reduceIntoCuda(kAvg). Values near the format's largest, mixed in sign
// by rank: the average is finite everywhere (three fp16 ranks averaging 65504 reach 65520 before
// rounding, inf unless AVG saturates), and the bits are those of the CPU kernels.
TEST_CASE(cuda_avg_of_prescaled_16_bit_values_does_not_overflow) {
  requireCudaDevice();
  Stream stream;
  const float halfMax = 65504.0f, bf16Max = 0x1.fep127f;
  struct Case {
    DType dtype;
    std::vector<float> values;
  };
  const Case cases[] = {{DType::kFloat16, {40000.0f, halfMax, -halfMax, 60000.0f, -1.0f, 0.0f}},
                        {DType::kBFloat16, {3e38f, bf16Max, -bf16Max, -3e38f, 1e38f, 1.0f}}};
  const size_t n = 4099;  // 16-byte lanes and a scalar tail
  for (const Case& c : cases) {
    const bool half = c.dtype == DType::kFloat16;
    for (int P : {2, 3, 4}) {
      std::vector<std::vector<uint16_t>> inputs(P, std::vector<uint16_t>(n));
      for (int r = 0; r < P; ++r) {
        for (size_t i = 0; i < n; ++i) {
          const float v = c.values[i % c.values.size()] * ((r % 2 == 1 && i % 2 == 1) ? -1.0f : 1.0f);
          inputs[r][i] = half ? floatToHalf(v) : floatToBf16(v);
        }
      }
      // The device: one buffer per rank, each divided by P, then summed into the first.
      std::vector<std::unique_ptr<DeviceBuffer>> device;
      for (int r = 0; r < P; ++r) {
        device.push_back(std::make_unique<DeviceBuffer>(n * 2));
        CUDA_REQUIRE(cudaMemcpyAsync(device[r]->ptr, inputs[r].data(), n * 2, cudaMemcpyHostToDevice, stream.stream));
        divideInPlaceCuda(device[r]->ptr, n, c.dtype, P, stream.stream);
      }
      for (int r = 1; r < P; ++r) reduceIntoCuda(device[0]->ptr, device[r]->ptr, n, c.dtype, RedOp::kAvg, stream.stream);
      std::vector<uint8_t> got(n * 2);
      CUDA_REQUIRE(cudaMemcpyAsync(got.data(), device[0]->ptr, n * 2, cudaMemcpyDeviceToHost, stream.stream));
      CUDA_REQUIRE(cudaStreamSynchronize(stream.stream));
      // The CPU, the same steps.
      std::vector<std::vector<uint16_t>> scaled = inputs;
      for (auto& x : scaled) divideInPlace(x.data(), n, c.dtype, P);
      for (int r = 1; r < P; ++r) reduceInto(scaled[0].data(), scaled[r].data(), n, c.dtype, RedOp::kAvg);
      std::vector<uint8_t> want(n * 2), first(n * 2);
      std::memcpy(want.data(), scaled[0].data(), n * 2);
      std::memcpy(first.data(), inputs[0].data(), n * 2);
      const std::string what = strCat(dtypeName(c.dtype), " AVG of ", P, " pre-scaled contributions");
      expectSameElements(c.dtype, what.c_str(), want, got, first, {});
      int reported = 0;
      for (size_t i = 0; i < n && reported < 3; ++i) {
        uint16_t h;
        std::memcpy(&h, &got[i * 2], 2);
        const float g = half ? halfToFloat(h) : bf16ToFloat(h);
        if (std::isfinite(g)) continue;
        ++reported;
        CHECK_MSG(false, what, " element ", i, ": ", g, " (inputs ", c.values[i % c.values.size()], " and mixed signs)");
      }
    }
  }
}

// Validation happens on the caller's thread before anything touches the device, so this test
// runs on machines without a GPU too.
TEST_CASE(cuda_rejects_what_the_cpu_rejects) {
  alignas(16) static uint8_t host[64];
  for (DType t : kAllDTypes) {
    for (RedOp op : kAllOps) {
      if (supported(t, op)) continue;
      CHECK_THROWS_AS(reduceIntoCuda(host, host + 16, 1, t, op, nullptr), CommError);
    }
    if (!isFloating(t)) CHECK_THROWS_AS(divideInPlaceCuda(host, 1, t, 2.0, nullptr), CommError);
    if (elementSize(t) > 1) {
      CHECK_THROWS_AS(reduceIntoCuda(host + 1, host + 16, 1, t, RedOp::kMax, nullptr), CommError);
      CHECK_THROWS_AS(reduceIntoCuda(host, host + 17, 1, t, RedOp::kMax, nullptr), CommError);
    }
  }
  CHECK_THROWS_AS(divideInPlaceCuda(host + 2, 1, DType::kFloat32, 2.0, nullptr), CommError);
}
