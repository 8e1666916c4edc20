#pragma once
// The inner level of a host: how the ranks of one host run a collective among themselves. The
// collectives that stay inside a host (a group on one machine) and the host steps of the host,
// site and three-level schedules (hierarchical.h: the reduce-scatter before the hosts exchange
// their blocks, the all-gather after) call this interface and nothing below it, so a host's ranks
// can be joined by whatever suits their memory:
//
//   shm    hetcomm's shared memory (local_collectives.h), for host memory; device memory is
//          copied through its slots (the default);
//   gloo   torch's Gloo process group over the host's ranks (backend/torch_inner.h): CPU tensors,
//          so the whole composition runs in CI with another library at the inner level;
//   nccl   torch's NCCL process group over the host's GPUs: CUDA tensors stay on the device, and
//          only each rank's slice of the host's reduce-scatter crosses to the host for the levels
//          above.
//
// Every call takes the collective's context (its deadline, its device queue) and must end in an
// exception by that deadline when a peer of the host fails. Buffers are device memory when
// ctx.device is set and `takesDevice` said yes, host memory otherwise. Local ranks are numbered
// by group rank; roots and blocks are local indices.
#include <cstddef>
#include <vector>

#include "algorithms/context.h"
#include "kernels/dtype.h"

namespace hetcomm {

class InnerLevel {
 public:
  virtual ~InnerLevel() = default;
  virtual const char* name() const = 0;  // "shm", "gloo", "nccl"
  // The path a collective of a group inside one host took through this level.
  virtual CollectivePath path() const = 0;
  // Whether this level can work on the memory ctx.device names (without staging it).
  virtual bool takesDevice(const DeviceOps& device) const = 0;
  // Whether this level reduces `dtype` with `op` (the same answer on every rank of a host: the
  // callers fall back to another path when not).
  virtual bool takes(DType dtype, RedOp op) const { (void)dtype; (void)op; return true; }
  // Whether device memory is better staged whole into host memory before this level's steps
  // (shared memory copies device memory through its slots anyway) than kept on the device.
  virtual bool stagesDevice() const { return false; }

  // In place; `divisor` > 0: the result is divided by it (an AVG over the whole group).
  virtual void allreduce(const CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                         double divisor) = 0;
  // work holds counts[0] + ... + counts[L-1] elements (block l at the prefix offset); afterwards
  // this rank's block holds the block's reduction over the host (divided as above). The other
  // blocks are left undefined.
  virtual void reduceScatterv(const CollectiveContext& ctx, char* work, const std::vector<size_t>& counts,
                              DType dtype, RedOp op, double divisor) = 0;
  // out holds every local rank's block back to back; this rank's block is already in place.
  virtual void allgatherv(const CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes) = 0;
  virtual void broadcast(const CollectiveContext& ctx, char* buf, size_t bytes, int root) = 0;
  virtual void gather(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) = 0;
  virtual void scatter(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) = 0;
  virtual void alltoallv(const CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
                         const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
                         const std::vector<size_t>& recvBytes) = 0;
  virtual void barrier(const CollectiveContext& ctx) = 0;

  // The group failed: wake this rank's peers of the host that wait in this level (best effort,
  // never throws; the group is unusable afterwards).
  virtual void abort(int localRank) noexcept = 0;
};

// hetcomm's shared memory (ctx.local->channel) behind the interface.
class ShmInnerLevel : public InnerLevel {
 public:
  const char* name() const override { return "shm"; }
  CollectivePath path() const override { return CollectivePath::kSharedMemory; }
  bool takesDevice(const DeviceOps&) const override { return true; }
  bool stagesDevice() const override { return true; }
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
  void abort(int) noexcept override {}  // the channel is aborted by its owner (LocalGroup::abort)
};

}  // namespace hetcomm
