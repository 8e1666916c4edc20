// Memory bandwidth reached by hetcomm's CUDA reduce kernel (reduceIntoCuda: dst = op(dst, src)),
// beside cudaMemcpy device to device on the same buffers: the kernel is memory bound, so the
// copy is the yardstick.
//
//   bench_reduce [--mb 256] [--iters 50] > benchmarks/results/reduce_cuda_<gpu>.json
//
// Bytes counted as in benchmarks/test_reduce_kernels.py: a reduce reads dst and src and writes
// dst, 3 x the buffer; a copy reads one buffer and writes the other, 2 x. GB/s = bytes / median
// time of `iters` launches, each timed with its own pair of cudaEvents after `kWarmup` untimed ones.
// Prints compact JSON Lines on stdout (the records of hetcomm.bench.records): a "run" header (device,
// compute capability, buffer size, iterations), then one "result" per kernel, each with the command.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/reduce_cuda.h"

using namespace hetcomm;

namespace {

constexpr int kWarmup = 3;

void cudaCheck(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "bench_reduce: %s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

struct Timing {
  double medianMs, minMs;
};

// Median and minimum of `iters` timed runs of `body` on `stream`.
Timing timeOnStream(cudaStream_t stream, int iters, const std::function<void()>& body) {
  cudaEvent_t start, stop;
  cudaCheck(cudaEventCreate(&start), "cudaEventCreate");
  cudaCheck(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < kWarmup; ++i) body();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    cudaCheck(cudaEventRecord(start, stream), "cudaEventRecord");
    body();
    cudaCheck(cudaEventRecord(stop, stream), "cudaEventRecord");
    cudaCheck(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float elapsed = 0;
    cudaCheck(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
    ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return Timing{ms[ms.size() / 2], ms.front()};
}

std::string resultJson(const std::string& name, const std::string& extra, double bytesMoved, Timing t) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "{\"name\":\"%s\",%s\"bytes_moved\":%.0f,\"median_ms\":%.4f,\"min_ms\":%.4f,\"GB/s\":%.1f}",
                name.c_str(), extra.c_str(), bytesMoved, t.medianMs, t.minMs, bytesMoved / (t.medianMs * 1e-3) / 1e9);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mb = 256;
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mb") == 0 && i + 1 < argc) {
      mb = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--mb MEGABYTES_PER_BUFFER] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  if (mb == 0 || iters <= 0) {
    std::fprintf(stderr, "bench_reduce: --mb and --iters must be positive\n");
    return 2;
  }
  const size_t nbytes = mb << 20;

  int device = 0;
  cudaCheck(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop;
  cudaCheck(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  void *dst = nullptr, *src = nullptr;
  cudaCheck(cudaMalloc(&dst, nbytes), "cudaMalloc");
  cudaCheck(cudaMalloc(&src, nbytes), "cudaMalloc");
  // 0x3c bytes are ordinary finite values in every float format (fp32 ~0.0115, fp16/bf16 ~1.06).
  cudaCheck(cudaMemset(dst, 0x3c, nbytes), "cudaMemset");
  cudaCheck(cudaMemset(src, 0x3c, nbytes), "cudaMemset");
  cudaStream_t stream;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  std::vector<std::string> results;
  const Timing copy = timeOnStream(stream, iters, [&] {
    cudaCheck(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  results.push_back(resultJson("cudaMemcpy D2D", "", 2.0 * nbytes, copy));
  const double copyGBs = 2.0 * nbytes / (copy.medianMs * 1e-3) / 1e9;

  struct Case {
    DType dtype;
    RedOp op;
  };
  // float32 SUM is the headline (what gradient buckets do); the others show the cost of the
  // fp16/bf16 conversions and of the bit-exact MIN/MAX.
  const Case cases[] = {{DType::kFloat32, RedOp::kSum}, {DType::kFloat32, RedOp::kMax}, {DType::kFloat16, RedOp::kSum},
                        {DType::kBFloat16, RedOp::kSum}, {DType::kFloat64, RedOp::kSum}, {DType::kInt8, RedOp::kSum}};
  for (const Case& c : cases) {
    const size_t count = nbytes / elementSize(c.dtype);
    Timing t{0, 0};
    try {
      t = timeOnStream(stream, iters, [&] { reduceIntoCuda(dst, src, count, c.dtype, c.op, stream); });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_reduce: %s\n", e.what());
      return 1;
    }
    const double gbs = 3.0 * nbytes / (t.medianMs * 1e-3) / 1e9;
    char extra[160];
    std::snprintf(extra, sizeof(extra), "\"dtype\":\"%s\",\"op\":\"%s\",\"fraction_of_memcpy\":%.3f,",
                  dtypeName(c.dtype), redOpName(c.op), gbs / copyGBs);
    results.push_back(resultJson(std::string("reduceIntoCuda ") + dtypeName(c.dtype) + " " + redOpName(c.op), extra,
                                 3.0 * nbytes, t));
  }
  cudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  char command[96];
  std::snprintf(command, sizeof(command), "bench_reduce --mb %zu --iters %d", mb, iters);
  std::printf("{\"kind\":\"run\",\"command\":\"%s\",\"device\":\"%s\",\"compute_capability\":\"%d.%d\","
              "\"bytes_per_buffer\":%zu,\"iters\":%d}\n",
              command, prop.name, prop.major, prop.minor, nbytes, iters);
  for (const std::string& result : results) {  // each is "{...}": the record's fields follow its stamp
    std::printf("{\"kind\":\"result\",\"command\":\"%s\",%s\n", command, result.c_str() + 1);
  }
  cudaStreamDestroy(stream);
  cudaFree(dst);
  cudaFree(src);
  return 0;
}
