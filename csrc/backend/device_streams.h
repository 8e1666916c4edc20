#pragma once
// Stream semantics of operations on CUDA tensors, as NCCL users expect them (design.md §5):
//
//   * an operation runs on the group's own stream for the device, after everything the caller
//     had queued on its current stream when it issued the operation (an event recorded at issue,
//     waited for by the group's stream before the first device work of the operation);
//   * the tensors' memory is marked as in use on the group's stream (recordStream), so that the
//     caching allocator does not hand it out again before the group's stream is done with it,
//     even if the caller drops its tensors at once;
//   * wait() makes the caller's current stream wait for the group's stream (see WorkHetcomm),
//     and the future is marked completed with the device, so DDP reads a bucket only once the
//     data is there. No device-wide synchronisation anywhere.
//
// Written with c10's device-generic API (Stream, Event, VirtualGuardImpl), so that this file
// builds against a CPU-only torch as well; it is only called for CUDA tensors.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <vector>

namespace hetcomm {

// The one device every tensor of an operation is on; a clear error if they differ.
c10::Device commonDevice(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                         const char* op);
// An event recorded now on the calling thread's current stream for `device`.
c10::Event markCurrentStream(c10::Device device);
// recordStream for every tensor: their memory stays reserved until `stream` is past this point.
void keepAliveOnStream(const std::vector<at::Tensor>& tensors, const c10::Stream& stream);
// A high-priority stream of torch's pool for `device` (as ProcessGroupGloo takes its streams).
c10::Stream poolStream(c10::Device device);
// The caller's current stream for `device`.
c10::Stream currentStream(c10::Device device);

}  // namespace hetcomm
