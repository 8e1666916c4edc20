#pragma once
// A kernel that keeps a stream busy for a while: the test seam behind HETCOMM_TEST_DEVICE_DELAY_MS
// (device_ops.h), which makes "the caller read the result before the backend's stream wrote it"
// reproducible instead of a race.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace hetcomm {

// Enqueues on `stream` a one-thread kernel that returns after `nanoseconds` of GPU time.
void spinCuda(uint64_t nanoseconds, cudaStream_t stream);

}  // namespace hetcomm
