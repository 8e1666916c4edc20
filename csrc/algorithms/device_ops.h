#pragma once
// Collectives on device memory (CUDA tensors): how the algorithms reach memory they cannot touch.
//
// The transport moves host bytes. When a collective's buffers live on a device, the algorithms
// never dereference them; they ask a DeviceOps to copy between them and host staging memory, to
// reduce received host bytes into them and to scale them. Every request is enqueued, in order,
// on one queue (for CUDA: the backend's stream) and returns at once; a Ticket names "everything
// enqueued so far", and the algorithms poll or wait for tickets only where the host needs the
// bytes (before a staged segment goes on the wire, before a staging slot is written again).
// Because the queue is in order, a device-side dependency (forward a segment only after it was
// reduced) costs no host round trip: the copy that reads the segment is simply enqueued after
// the reduction that writes it.
//
// Torch-free, so that the algorithms and their tests build without torch; the CUDA
// implementation lives in backend/cuda_device_ops.cc and an emulation on host memory (for
// machines without a GPU) in algorithms/emulated_device_ops.h.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"

namespace hetcomm {

// Host staging memory of fixed-size slots that the device queue copies from and to (pinned for
// CUDA, so that copies are asynchronous and run at full PCIe speed). The queue may still read a
// slot after the host handed it over: `queueReadsUntil[i]` is the ticket after which slot i's last
// device read is done (0: none pending); the host waits for it before writing into the slot again,
// also in a later collective.
struct StagingSlots {
  char* base = nullptr;
  size_t slotBytes = 0;
  std::vector<uint64_t> queueReadsUntil;

  int count() const { return static_cast<int>(queueReadsUntil.size()); }
  char* slot(int i) const { return base + static_cast<size_t>(i) * slotBytes; }
};

class DeviceOps {
 public:
  using Ticket = uint64_t;
  virtual ~DeviceOps() = default;

  // --- enqueued on the queue, in order; each returns before the work runs ----------------------
  virtual void copyToHost(void* host, const void* device, size_t bytes) = 0;
  virtual void copyToDevice(void* device, const void* host, size_t bytes) = 0;
  virtual void copyWithinDevice(void* dst, const void* src, size_t bytes) = 0;
  // device[i] = op(device[i], host[i]) for i < count; bytes <= slots().slotBytes. AVG reduces as
  // reduceInto does (the division is `divide`, before or after the sum: avgScalesInputs).
  virtual void reduceFromHost(void* device, const void* host, size_t count, DType dtype, RedOp op) = 0;
  virtual void divide(void* device, size_t count, DType dtype, double divisor) = 0;

  // --- tickets --------------------------------------------------------------------------------
  // Everything enqueued so far. Tickets grow from 1; 0 is always reached.
  virtual Ticket mark() = 0;
  virtual bool reached(Ticket ticket) = 0;  // never blocks
  virtual void waitFor(Ticket ticket) = 0;  // blocks the calling thread (not the device)

  // --- host memory ----------------------------------------------------------------------------
  virtual StagingSlots& slots() = 0;
  // A staging buffer of at least `bytes` for a whole message (small allreduces that are reduced on
  // the host). Its contents do not survive the next call. The host must not write into it before
  // a ticket marked after the buffer's last device read is reached.
  virtual char* hostBuffer(size_t bytes) = 0;

  // Called when a collective is done with the device memory, before the backend's own tensor
  // operations touch it. A real device needs nothing (those operations go on the same queue); the
  // emulation, whose "device memory" the host touches directly, waits for its queue here.
  virtual void settle() noexcept = 0;

  // True when the "device memory" is host memory the CPU may touch (the emulation): a library
  // that works on CPU tensors can take it, after settle().
  virtual bool hostAddressable() const { return false; }

  // Registers host memory that the queue copies to and from (a host's shared-memory segment), so
  // that those copies run asynchronously at full speed (CUDA: page-locked by cudaHostRegister);
  // undone when the DeviceOps goes, which must be before the memory is unmapped. False when it
  // could not: the copies still work, from pageable memory. Nothing to do for the emulation.
  virtual bool registerHostMemory(void* base, size_t bytes) {
    (void)base;
    (void)bytes;
    return false;
  }

  // Test seam (HETCOMM_TEST_DEVICE_DELAY_MS): makes the queue stall before the last writes of a
  // collective, so that a caller that reads the result without waiting for the backend's stream
  // sees stale data, deterministically. No-op unless the variable is set.
  virtual void testDelay() {}
};

// Bytes of host staging memory (pinned, for CUDA) that this process's DeviceOps hold now: their
// slots and whole-message buffers. Each implementation counts what it allocates and frees, so a
// test or benchmark can check that staging stays bounded by a piece and returns to 0 once every
// group is destroyed (hetcomm.staging_host_bytes()).
int64_t stagingHostBytes();
void countStagingHostBytes(int64_t delta);
// Bytes of host memory (shared-memory segments) registered with a device now (registerHostMemory).
int64_t registeredHostBytes();
void countRegisteredHostBytes(int64_t delta);

// Settles `ops` (if any) when a collective returns or throws.
class SettleOnExit {
 public:
  explicit SettleOnExit(DeviceOps* ops) : ops_(ops) {}
  ~SettleOnExit() {
    if (ops_ != nullptr) ops_->settle();
  }
  SettleOnExit(const SettleOnExit&) = delete;
  SettleOnExit& operator=(const SettleOnExit&) = delete;

 private:
  DeviceOps* ops_;
};

}  // namespace hetcomm
