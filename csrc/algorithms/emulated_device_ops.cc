#include "algorithms/emulated_device_ops.h"

#include <chrono>
#include <cstring>

#include "common/error.h"
#include "common/threads.h"
#include "kernels/reduce.h"

namespace hetcomm {

EmulatedDeviceOps::EmulatedDeviceOps(size_t slotBytes, int slotCount, int jitterUs)
    : slotMemory_(slotBytes * static_cast<size_t>(slotCount)), jitterUs_(jitterUs) {
  slots_.base = slotMemory_.data();
  slots_.slotBytes = slotBytes;
  slots_.queueReadsUntil.assign(slotCount, 0);
  thread_ = startThread("emulated device", [this] { loop(); });
  countStagingHostBytes(static_cast<int64_t>(slotMemory_.size()));
}

EmulatedDeviceOps::~EmulatedDeviceOps() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  countStagingHostBytes(-static_cast<int64_t>(slotMemory_.size() + bulk_.size()));
}

void EmulatedDeviceOps::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    HC_ENFORCE(!stopping_, "emulated device used after shutdown");
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  cv_.notify_all();
}

void EmulatedDeviceOps::loop() {
  std::minstd_rand rng(std::random_device{}());
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    if (jitterUs_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % (jitterUs_ + 1)));
    task();  // plain memory operations on valid ranges: they do not throw
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++done_;
    }
    cv_.notify_all();
  }
}

void EmulatedDeviceOps::copyToHost(void* host, const void* device, size_t bytes) {
  enqueue([=] { std::memcpy(host, device, bytes); });
}

void EmulatedDeviceOps::copyToDevice(void* device, const void* host, size_t bytes) {
  enqueue([=] { std::memcpy(device, host, bytes); });
}

void EmulatedDeviceOps::copyWithinDevice(void* dst, const void* src, size_t bytes) {
  enqueue([=] { std::memmove(dst, src, bytes); });
}

void EmulatedDeviceOps::reduceFromHost(void* device, const void* host, size_t count, DType dtype, RedOp op) {
  HC_ENFORCE(count * elementSize(dtype) <= slots_.slotBytes, "reduceFromHost of more than a slot");
  enqueue([=] { reduceInto(device, host, count, dtype, op); });
}

void EmulatedDeviceOps::divide(void* device, size_t count, DType dtype, double divisor) {
  enqueue([=] { divideInPlace(device, count, dtype, divisor); });
}

DeviceOps::Ticket EmulatedDeviceOps::mark() {
  std::lock_guard<std::mutex> lock(mu_);
  return enqueued_;
}

bool EmulatedDeviceOps::reached(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ >= ticket;
}

void EmulatedDeviceOps::waitFor(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ >= ticket; });
}

char* EmulatedDeviceOps::hostBuffer(size_t bytes) {
  if (bulk_.size() < bytes) {
    waitFor(mark());  // the queue may still read the old buffer
    const auto before = static_cast<int64_t>(bulk_.size());
    bulk_.assign(bytes, 0);
    countStagingHostBytes(static_cast<int64_t>(bytes) - before);
  }
  return bulk_.data();
}

void EmulatedDeviceOps::settle() noexcept { waitFor(mark()); }

}  // namespace hetcomm
