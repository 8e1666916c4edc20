// The CUDA DeviceOps (cuda_device_ops.h). Compiled only into a CUDA build of hetcomm.
#ifdef HETCOMM_WITH_CUDA

#include "backend/cuda_device_ops.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/env.h"
#include "common/error.h"
#include "common/logging.h"
#include "kernels/reduce_cuda.h"
#include "kernels/spin_cuda.h"

namespace hetcomm {
namespace {

// 4 slots per direction, of paramDeviceSlotBytes (1 MB by default): large enough that a copy is
// far from its launch latency and the socket calls per byte stay few, and 4 slots in flight per
// direction keep a loopback or 100 Gbit/s link busy while the copies of the next slots run.
constexpr int kSlots = 8;
size_t slotBytes() {
  const int64_t bytes = std::max<int64_t>(64 * 1024, paramDeviceSlotBytes());
  return static_cast<size_t>((bytes + 15) / 16 * 16);
}
// Tickets are CUDA events used round robin. A ticket whose event was recorded again later reads as
// "not yet" until the later point is reached too: never wrong, only late, and a pipeline holds
// far fewer tickets than this at once.
constexpr int kEvents = 64;

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so that it does not surface elsewhere
  throw CommError(strCat("hetcomm: ", what, " failed: ", cudaGetErrorString(err), " (CUDA error ", int(err), ")"));
}

class CudaDeviceOps final : public DeviceOps {
 public:
  explicit CudaDeviceOps(const c10::Stream& stream)
      : stream_(c10::cuda::CUDAStream(stream)),
        raw_(stream_.stream()),
        device_(stream.device_index()),
        slotBytes_(slotBytes()),
        delayNs_(static_cast<uint64_t>(std::max<int64_t>(0, envInt("HETCOMM_TEST_DEVICE_DELAY_MS", 0))) * 1000000) {
    c10::cuda::CUDAGuard guard(device_);
    events_.assign(kEvents, nullptr);
    for (cudaEvent_t& e : events_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    {
      // Allocated while our stream is current: the caching allocator then ties the block to it.
      c10::cuda::CUDAStreamGuard streamGuard(stream_);
      scratch_ = c10::cuda::CUDACachingAllocator::get()->allocate(slotBytes_ + 16);
    }
    // Last, so that nothing allocated here is left behind (uncounted or leaked) if a step fails.
    void* slots = nullptr;
    check(cudaHostAlloc(&slots, slotBytes_ * kSlots, cudaHostAllocDefault), "cudaHostAlloc of the staging slots");
    countStagingHostBytes(static_cast<int64_t>(slotBytes_ * kSlots));
    slots_.base = static_cast<char*>(slots);
    slots_.slotBytes = slotBytes_;
    slots_.queueReadsUntil.assign(kSlots, 0);
  }

  ~CudaDeviceOps() override {
    // Nothing queued may still use our memory when it goes: wait for our stream (not the device).
    // Errors are ignored: at process exit the CUDA runtime may already be shutting down.
    c10::cuda::CUDAGuard guard(device_);  // the device it registered on (shutdown may run elsewhere)
    cudaStreamSynchronize(raw_);
    for (const auto& [p, bytes] : registered_) {
      const cudaError_t err = cudaHostUnregister(p);
      if (err != cudaSuccess) {
        HC_LOG(kWarn, "hetcomm: cudaHostUnregister of shared memory failed (", cudaGetErrorString(err), ")");
      }
      countRegisteredHostBytes(-static_cast<int64_t>(bytes));
    }
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (slots_.base != nullptr) cudaFreeHost(slots_.base);
    if (bulk_ != nullptr) cudaFreeHost(bulk_);
    countStagingHostBytes(-static_cast<int64_t>((slots_.base != nullptr ? slotBytes_ * kSlots : 0) + bulkBytes_));
    (void)cudaGetLastError();
  }

  void copyToHost(void* host, const void* device, size_t bytes) override {
    check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, raw_), "cudaMemcpyAsync device-to-host");
  }

  void copyToDevice(void* device, const void* host, size_t bytes) override {
    check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, raw_), "cudaMemcpyAsync host-to-device");
  }

  void copyWithinDevice(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, raw_), "cudaMemcpyAsync device-to-device");
  }

  void reduceFromHost(void* device, const void* host, size_t count, DType dtype, RedOp op) override {
    const size_t bytes = count * elementSize(dtype);
    HC_ENFORCE(bytes <= slotBytes_, "reduceFromHost of more than a slot");
    // The scratch copy sits at the destination's offset modulo 16, so that the kernel takes its
    // 16-byte vector path. One scratch buffer is enough: the stream runs the next copy into it
    // only after this kernel read it.
    char* scratch = static_cast<char*>(scratch_.get()) + reinterpret_cast<uintptr_t>(device) % 16;
    check(cudaMemcpyAsync(scratch, host, bytes, cudaMemcpyHostToDevice, raw_), "cudaMemcpyAsync host-to-device");
    reduceIntoCuda(device, scratch, count, dtype, op, raw_);
  }

  void divide(void* device, size_t count, DType dtype, double divisor) override {
    divideInPlaceCuda(device, count, dtype, divisor, raw_);
  }

  Ticket mark() override {
    check(cudaEventRecord(events_[issued_ % kEvents], raw_), "cudaEventRecord");
    return ++issued_;
  }

  bool reached(Ticket ticket) override {
    if (ticket <= reached_) return true;
    const cudaError_t err = cudaEventQuery(events_[(ticket - 1) % kEvents]);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check(err, "cudaEventQuery");
    reached_ = ticket;
    return true;
  }

  void waitFor(Ticket ticket) override {
    if (ticket <= reached_) return;
    check(cudaEventSynchronize(events_[(ticket - 1) % kEvents]), "cudaEventSynchronize");
    reached_ = ticket;
  }

  StagingSlots& slots() override { return slots_; }

  char* hostBuffer(size_t bytes) override {
    if (bytes <= bulkBytes_) return bulk_;
    // Small buffers double (a run of growing small messages reallocates rarely); from 4 MiB on,
    // exactly what is asked (a piece at most, across hosts or sites): pinned memory is scarce.
    const size_t grown = std::max({bytes, std::min<size_t>(bulkBytes_ * 2, 4 << 20), size_t{64 * 1024}});
    check(cudaStreamSynchronize(raw_), "cudaStreamSynchronize");  // the old buffer may still be read
    if (bulk_ != nullptr) check(cudaFreeHost(bulk_), "cudaFreeHost");
    countStagingHostBytes(-static_cast<int64_t>(bulkBytes_));
    bulk_ = nullptr;
    bulkBytes_ = 0;
    void* p = nullptr;
    check(cudaHostAlloc(&p, grown, cudaHostAllocDefault), "cudaHostAlloc of a staging buffer");
    bulk_ = static_cast<char*>(p);
    bulkBytes_ = grown;
    countStagingHostBytes(static_cast<int64_t>(grown));
    return bulk_;
  }

  void settle() noexcept override {}

  bool registerHostMemory(void* base, size_t bytes) override {
    c10::cuda::CUDAGuard guard(device_);
    const cudaError_t err = cudaHostRegister(base, bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      HC_LOG(kWarn, "hetcomm: cudaHostRegister of ", bytes, " bytes of shared memory failed (",
             cudaGetErrorString(err), "): its copies stay pageable");
      (void)cudaGetLastError();
      return false;
    }
    registered_.emplace_back(base, bytes);
    countRegisteredHostBytes(static_cast<int64_t>(bytes));
    return true;
  }

  void testDelay() override {
    if (delayNs_ > 0) spinCuda(delayNs_, raw_);
  }

 private:
  c10::cuda::CUDAStream stream_;
  cudaStream_t raw_;
  c10::DeviceIndex device_;
  const size_t slotBytes_;
  const uint64_t delayNs_;
  std::vector<cudaEvent_t> events_;
  Ticket issued_ = 0, reached_ = 0;
  StagingSlots slots_;
  c10::DataPtr scratch_;
  char* bulk_ = nullptr;
  size_t bulkBytes_ = 0;
  std::vector<std::pair<void*, size_t>> registered_;  // host memory registered with registerHostMemory
};

}  // namespace

std::unique_ptr<DeviceOps> makeCudaDeviceOps(const c10::Stream& stream) {
  return std::make_unique<CudaDeviceOps>(stream);
}

}  // namespace hetcomm

#endif  // HETCOMM_WITH_CUDA
