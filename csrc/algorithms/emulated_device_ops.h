#pragma once
// A DeviceOps whose "device memory" is ordinary host memory and whose queue is a thread.
//
// It runs the staged (device) path of every collective on a machine without a GPU: each request
// is executed later, in order, by the queue thread, after a random pause of up to `jitterUs`
// microseconds, so that a collective that reads a staging slot before its copy finished, or
// forwards a segment before its reduction ran, gets wrong bytes in the tests instead of passing by
// luck. Enabled for CPU tensors by HETCOMM_DEBUG_EMULATE_DEVICE=1 (tests only: it is slower than
// the direct host path and gains nothing).
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "algorithms/device_ops.h"

namespace hetcomm {

class EmulatedDeviceOps final : public DeviceOps {
 public:
  EmulatedDeviceOps(size_t slotBytes, int slotCount, int jitterUs);
  ~EmulatedDeviceOps() override;

  void copyToHost(void* host, const void* device, size_t bytes) override;
  void copyToDevice(void* device, const void* host, size_t bytes) override;
  void copyWithinDevice(void* dst, const void* src, size_t bytes) override;
  void reduceFromHost(void* device, const void* host, size_t count, DType dtype, RedOp op) override;
  void divide(void* device, size_t count, DType dtype, double divisor) override;

  Ticket mark() override;
  bool reached(Ticket ticket) override;
  void waitFor(Ticket ticket) override;

  StagingSlots& slots() override { return slots_; }
  char* hostBuffer(size_t bytes) override;
  void settle() noexcept override;
  bool hostAddressable() const override { return true; }

 private:
  void enqueue(std::function<void()> task);
  void loop();

  std::vector<char> slotMemory_;
  StagingSlots slots_;
  std::vector<char> bulk_;
  const int jitterUs_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;  // tasks ever enqueued: the ticket mark() returns
  uint64_t done_ = 0;      // tasks finished
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace hetcomm
