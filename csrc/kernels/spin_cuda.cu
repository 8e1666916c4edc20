#include "kernels/spin_cuda.h"

#include <cuda_runtime.h>

#include "common/error.h"

namespace hetcomm {
namespace {

__device__ uint64_t globalNanoseconds() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spinKernel(uint64_t nanoseconds) {
  const uint64_t start = globalNanoseconds();
  while (globalNanoseconds() - start < nanoseconds) __nanosleep(1000);
}

}  // namespace

void spinCuda(uint64_t nanoseconds, cudaStream_t stream) {
  spinKernel<<<1, 1, 0, stream>>>(nanoseconds);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw CommError(strCat("hetcomm: launching the spin kernel failed: ", cudaGetErrorString(err)));
}

}  // namespace hetcomm
