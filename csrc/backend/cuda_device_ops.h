#pragma once
// The DeviceOps of a CUDA device (see algorithms/device_ops.h): staging copies with
// cudaMemcpyAsync through pinned host slots, reductions with the kernels of
// kernels/reduce_cuda.cu, tickets as CUDA events; everything on one stream, the process group's
// stream for the device. Calls must come from a thread whose current device is the stream's.
#include <c10/core/Stream.h>

#include <memory>

#include "algorithms/device_ops.h"

namespace hetcomm {

// True when this build of hetcomm can move CUDA tensors.
constexpr bool kBuiltWithCuda =
#ifdef HETCOMM_WITH_CUDA
    true;
#else
    false;
#endif

#ifdef HETCOMM_WITH_CUDA
std::unique_ptr<DeviceOps> makeCudaDeviceOps(const c10::Stream& stream);
#endif

}  // namespace hetcomm
