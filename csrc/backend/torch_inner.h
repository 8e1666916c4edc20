#pragma once
// A torch process group over the ranks of one host as the host's inner level (inner_level.h):
// Gloo for CPU tensors, NCCL for CUDA tensors. hetcomm creates it (python/hetcomm/hosts.py: one
// per host and group, on its own store prefix) and runs each host step through it on the
// collective's worker thread, where the caller's stream is current: NCCL's work is ordered after
// what the caller queued, and the steps that follow (the copy of this rank's chunk to host
// memory, the all-gather) after NCCL's.
//
// Failures: every wait is bounded by the collective's deadline; an error of the library becomes a
// CommError that names the rank of the host whose process is gone (asked through the liveness
// connections of LocalGroup::peerAlive), so the group fails on every rank as after any other
// dead peer.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "algorithms/inner_level.h"
#include "algorithms/local_group.h"

namespace hetcomm {

class TorchInnerLevel : public InnerLevel {
 public:
  // name: "gloo" (its tensors are CPU memory: host memory, and the emulated device's) or "nccl"
  // (CUDA memory).
  TorchInnerLevel(c10::intrusive_ptr<c10d::Backend> backend, std::string name);

  const char* name() const override { return name_.c_str(); }
  CollectivePath path() const override { return cuda_ ? CollectivePath::kNccl : CollectivePath::kGloo; }
  bool takesDevice(const DeviceOps& device) const override { return cuda_ != device.hostAddressable(); }
  bool takes(DType dtype, RedOp op) const override;

  void allreduce(const CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                 double divisor) override;
  void reduceScatterv(const CollectiveContext& ctx, char* work, const std::vector<size_t>& counts, DType dtype,
                      RedOp op, double divisor) override;
  void allgatherv(const CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes) override;
  void broadcast(const CollectiveContext& ctx, char* buf, size_t bytes, int root) override;
  void gather(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) override;
  void scatter(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) override;
  void alltoallv(const CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
                 const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
                 const std::vector<size_t>& recvBytes) override;
  void barrier(const CollectiveContext& ctx) override;
  void abort(int localRank) noexcept override;

 private:
  // A flat tensor over `bytes`/`count` of the collective's memory (CPU, or the current CUDA device).
  at::Tensor tensorOver(const CollectiveContext& ctx, const void* data, size_t count, DType dtype) const;
  // Before the library reads memory the emulated device's queue may still write: wait for it.
  void settle(const CollectiveContext& ctx) const;
  // Issues the call and waits for it until the deadline, polling: the group's abort and a local
  // peer whose liveness connection hung up end the wait at once. A failure or a timeout becomes a
  // CommError (PeerClosedError naming the rank, when one is gone) about `what`.
  void finish(const CollectiveContext& ctx, const std::function<c10::intrusive_ptr<c10d::Work>()>& issue,
              const char* what) const;
  // Throws PeerClosedError if a rank of the host is gone.
  void deadPeer(const CollectiveContext& ctx, const char* what, const std::string& why) const;
  [[noreturn]] void fail(const CollectiveContext& ctx, const char* what, const std::string& why) const;
  std::chrono::milliseconds remaining(const CollectiveContext& ctx) const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::string name_;
  bool cuda_;
  std::atomic<bool> aborted_{false};
};

}  // namespace hetcomm
