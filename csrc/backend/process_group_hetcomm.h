#pragma once
// ProcessGroupHetcomm: the c10d::Backend behind dist.init_process_group("hetcomm").
//
// Every operation goes through three phases (as in ProcessGroupGloo): it is validated on the
// caller's thread and fails fast with a message that names the operation; a single worker thread
// runs the collectives in issue order (the order is what every rank agrees on); the Work is
// finished there and its future completed on a completion-pool thread. One exception: a small
// collective on one host's shared memory, issued while nothing runs, by a program that waited for
// its last one right away, once every local rank has issued it, runs on the caller's thread
// (enqueue); still one at a time, in issue order. Point-to-point operations
// go to their own engine and connections. Any communication failure aborts the group's
// connections, so that peers blocked on this rank fail promptly too, and every later operation
// fails with the original reason.
//
// CUDA tensors (when built with CUDA) go through the same worker: their data crosses the transport
// through pinned host slots, segment by segment (algorithms/staged_pipeline.cc), reductions run
// on the GPU, and everything device-side is queued on the group's stream for the device, with the
// stream semantics described in device_streams.h.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "algorithms/collectives.h"
#include "algorithms/device_ops.h"
#include "algorithms/local_group.h"
#include "backend/completion_pool.h"
#include "backend/sealed_store.h"
#include "backend/work.h"
#include "common/traffic.h"
#include "transport/p2p_engine.h"
#include "transport/tcp_mesh.h"

namespace hetcomm {

class ProcessGroupHetcomm : public c10d::Backend {
 public:
  struct Options {
    std::chrono::milliseconds timeout{30 * 60 * 1000};
    std::string listenIp;  // empty: HETCOMM_SOCKET_IFNAME, else the address that reaches the store
    // Each group rank's rank in the job (empty: unknown), for HETCOMM_SITES, which is per job rank.
    std::vector<int64_t> globalRanks;
  };

  ProcessGroupHetcomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Options options);
  ~ProcessGroupHetcomm() override;

  const std::string getBackendName() const override { return "hetcomm"; }
  void setTimeout(std::chrono::milliseconds timeout) override { options_.timeout = timeout; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                            const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                  const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                         const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                 std::vector<std::vector<at::Tensor>>& inputs,
                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                       const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                std::vector<int64_t>& outputSplitSizes,
                                                std::vector<int64_t>& inputSplitSizes,
                                                const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // A barrier that names the ranks that did not arrive in time (as gloo's): rank 0 collects a
  // check-in from every rank, then releases them. Blocking, on point-to-point connections.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;
  void abort() override;
  void shutdown() override;
  // At interpreter exit, for a group the program did not destroy: shutdown() when nothing is
  // queued or running, else abort() (operations issued and never waited for would otherwise hold
  // the exit for up to their timeout).
  void shutdownAtExit();
  // Its first half: fails the group (every pending operation ends) unless it is idle.
  void failIfBusyAtExit();

  // hetcomm's own API (bound in Python).
  std::string listenAddress() const { return mesh_->listenAddress().str(); }
  int64_t rejectedConnections() const { return mesh_->rejectedConnections(); }
  // Caps this rank's send rate to each group rank (bytes/s; 0: none) on its TCP/TLS links
  // (TcpMesh::setPacing); returns how many open links the kernel refused it on.
  int setPacing(const std::vector<uint64_t>& bytesPerSecond) {
    if (bytesPerSecond.size() != static_cast<size_t>(getSize())) {
      throw std::invalid_argument(strCat("hetcomm: set_pacing takes one rate per rank of the group (",
                                         getSize(), "), got ", bytesPerSecond.size()));
    }
    return mesh_->setPacing(bytesPerSecond);
  }
  std::vector<int64_t> pacing() const { return mesh_->pacing(); }
  std::vector<int> collectiveLinkSecurity() const { return mesh_->collectiveLinkSecurity(); }
  RingPlan plan() const;
  // Bytes this rank moved to and from each peer, collectives run and their time, point-to-point
  // messages: cumulative since the group was created (what is counted: common/traffic.h).
  TrafficSnapshot traffic() const { return traffic_->snapshot(); }
  // Point-to-point links open now, by kind (tcp, tls, shm), both directions.
  std::array<int64_t, 3> p2pLinkKinds() const { return p2p_->linkKinds(); }
  // Takes effect for operations issued after the call; every rank must set the same plan at the
  // same point of its program (a mismatch is detected and reported by the next allreduce).
  void setPlan(RingPlan plan);

  // Shared memory among the ranks of this rank's host (hostOf[r]: a host label per group rank;
  // local_setup.cc). The host's first rank creates a segment of at most maxSegmentBytes with
  // slots of at most slotBytes, publishes its name in the store, the others open it, and it is
  // unlinked once all have mapped it. A collective over each host's ranks: call it on every rank
  // of the group, with no collective in flight (at group creation). Returns "" when this host's
  // ranks share memory now (or this rank is alone on its host), else why they cannot.
  std::string attachLocal(const std::vector<int64_t>& hostOf, int64_t maxSegmentBytes, int64_t slotBytes);
  // The shared memory attachLocal prepared takes effect (use) or is dropped (!use), on every rank
  // of the group at the same point, once all know whether every host succeeded; detachLocal
  // drops it again (back to TCP between the ranks of every host).
  // A torch process group over this host's ranks (hostOf as for attachLocal) as the host's inner
  // level (backend/torch_inner.h): for host memory, replacing shared memory (gloo), or for CUDA
  // tensors beside it (nccl; forDevice). Takes effect with enableLocal, as attachLocal's.
  void attachInner(const std::vector<int64_t>& hostOf, const c10::intrusive_ptr<c10d::Backend>& backend,
                   const std::string& name, bool forDevice);
  void enableLocal(bool use);
  // Creation is over: how its own operations were waited for says nothing of the program's.
  void forgetWaitPattern() { waits_->prompt.store(false); }
  void detachLocal();
  // The group ranks this rank shares memory with (itself included), or empty.
  std::vector<int> localRanks() const;
  // The inner levels in use: {host memory's, CUDA tensors'} ("shm", "gloo", "nccl"; the second
  // omitted when CUDA tensors use the first); empty when the ranks of each host talk over TCP.
  std::vector<std::string> innerLevels() const;
  const std::string& incarnation() const { return incarnation_; }
  // The group's store as hetcomm uses it: values sealed with an out-of-band secret (for the torch
  // groups it makes as a host's inner level), else the store it was given.
  c10::intrusive_ptr<c10d::Store> sealedStore() const { return store_; }
  // Whether the group has an out-of-band secret (its store values are sealed).
  bool sealing() const { return store_->sealing(); }

  // Called when the last strong reference goes while weak ones remain (the registry of live
  // groups, backend/live_groups.h, holds one): the group is unused from here, so it shuts down
  // now, as the destructor would, and drops the registry's reference (the object is then freed).
  // Public: c10::intrusive_ptr calls it through this type.
  void release_resources() override;

 private:
  // The group's first failure, "rank R: cause", written by the first rank that fails (compare-and-set):
  // the ranks that share no connection with it learn it from here (watchFailures).
  static constexpr const char* kFailedKey = "hetcomm/failed";
  // The longest reason a rank reads from the store (a failure or another rank's abort).
  static constexpr size_t kMaxAbortReasonBytes = 2048;
  using Body = std::function<void(CollectiveContext&)>;
  struct Pending {
    c10::intrusive_ptr<WorkHetcomm> work;
    CollectiveHeader header;
    std::chrono::milliseconds timeout;
    Body body;
    // CUDA operations: the group's stream on the tensors' device, and the point the caller's
    // current stream had reached when it issued the operation.
    std::optional<c10::Stream> stream;
    std::optional<c10::Event> inputsReady;
    // The host's shared memory as it was when the operation was issued (every rank issues its
    // operations in the same order relative to attach/detach, so all take the same path).
    std::shared_ptr<LocalGroup> local;
  };
  // Per CUDA device: the streams the group works on and, created by the worker on first use, the
  // staging machinery of its collectives.
  struct DeviceState {
    std::optional<c10::Stream> collectiveStream;
    std::optional<c10::Stream> p2pStream;
    std::unique_ptr<DeviceOps> ops;
  };

  // `inputs` and `outputs` are every tensor the body touches (the outputs are also the future's
  // value); they must all be on one device.
  c10::intrusive_ptr<WorkHetcomm> enqueue(c10d::OpType type, const char* profilingTitle, CollectiveKind kind,
                                          std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                          CollectiveHeader header, std::chrono::milliseconds timeout, Body body);
  c10::Stream collectiveStream(c10::Device device);
  c10::Stream p2pStream(c10::Device device);
  // The DeviceOps of a device (worker thread only).
  DeviceOps* deviceOps(const c10::Stream& stream);
  // A CUDA tensor's bytes in pinned host memory, copied after what the caller had queued.
  at::Tensor stageForSend(const at::Tensor& data);
  // recv and recvAnysource (srcRank == P2PEngine::kAnySource).
  c10::intrusive_ptr<c10d::Work> postReceive(std::vector<at::Tensor>& tensors, int srcRank, int tag);
  std::chrono::milliseconds effectiveTimeout(std::chrono::milliseconds requested) const;
  void runWorker();
  // Runs one operation (on the worker, or on the caller's thread); returns its error. `broken`:
  // the group's failure when the operation was taken up ("" if none).
  std::exception_ptr runOperation(Pending& op, const std::string& broken);
  // Whether the caller's thread runs an operation issued with nothing queued or running (and the
  // caller waited for the last one right away, waits_): CPU tensors of at most inlineBytes_,
  // within one host's shared memory (or a group of one).
  bool runsInline(const Pending& op, const std::vector<at::Tensor>& inputs,
                  const std::vector<at::Tensor>& outputs) const;
  void failGroup(const std::string& reason);
  // The error of an operation that failed with `msg`: fails the group with it, unless the group had
  // failed already, then names that first cause.
  std::string failWith(const CollectiveContext& ctx, const std::string& msg);
  // The reason `peer` gave up, if it left one in the store within a short wait ("" otherwise).
  std::string peerAbortReason(int peer);
  // The worker thread stopped on an unexpected error: the group fails, and what it would have run
  // completes with that error.
  void workerDied(const std::string& what);
  // What the failure watcher (a detached thread) shares with the group; busy and fail are cleared,
  // under mu, when the group shuts down.
  struct FailureWatch {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    std::function<bool()> busy;
    std::function<bool()> failed;  // the group failed (its records are left alone then)
    std::function<void(const std::string&)> fail;
    // With an out-of-band secret: this rank's records as they stand in the store, put back when
    // someone replaced or removed them (readers ignore a forged one and wait for the real one).
    StoreRecords kept;
    std::set<std::string> restored;  // keys put back at least once (said once each)
    uint64_t polls = 0;              // the watcher's wake-ups so far
  };
  // Fails the group when another rank wrote its failure to the store (while operations are pending).
  // Puts back what a store writer replaced of watch.kept (with watch.mu held).
  static void restoreKept(FailureWatch& watch, SealedStore& store, int rank);
  static void watchFailures(std::shared_ptr<FailureWatch> watch, c10::intrusive_ptr<SealedStore> store,
                            std::string incarnation, int rank);
  void startFailureWatch();
  void stopFailureWatch();

  // The group's store, sealing hetcomm's values with an out-of-band secret (backend/sealed_store.h).
  c10::intrusive_ptr<SealedStore> store_;
  HostPort storeAddress_;  // the TCPStore's numeric address, resolved at creation (empty: another store)
  Options options_;
  std::shared_ptr<CompletionPool> completions_;
  // Declared before the engine and the worker that write to it, so that it outlives them.
  std::shared_ptr<TrafficCounters> traffic_;
  std::unique_ptr<TcpMesh> mesh_;
  std::unique_ptr<P2PEngine> p2p_;
  // This host's ranks and their shared memory (null: TCP only); replaced only by attachLocal and
  // detachLocal, while no collective runs. Guarded by mu_; the worker holds a copy per operation.
  std::shared_ptr<LocalGroup> local_;
  std::shared_ptr<LocalGroup> pendingLocal_;  // attached, not yet enabled
  // This host's ranks with the liveness connections to them (local_setup.cc), no level yet.
  std::shared_ptr<LocalGroup> newLocalGroup(const std::vector<int>& ranks, Deadline deadline);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  uint64_t nextSeq_ = 0;
  bool stopping_ = false;
  // An operation runs, on the worker or on the caller's thread (guarded by mu_): one at a time.
  bool running_ = false;
  // HETCOMM_INLINE_BYTES (read at creation; 0: every operation goes through the worker).
  int64_t inlineBytes_ = 0;
  // Whether the caller waited for its last operation right away (backend/work.h).
  std::shared_ptr<WaitPattern> waits_;
  std::string brokenReason_;  // set once the group failed; every later operation fails with it
  RingPlan plan_;
  std::map<c10::DeviceIndex, DeviceState> devices_;  // guarded by mu_; ops touched by the worker only
  // HETCOMM_DEBUG_EMULATE_DEVICE=1: CPU tensors take the staged (device) path, on an emulated
  // device, so that machines without a GPU test it.
  std::unique_ptr<DeviceOps> emulatedDevice_;
  std::string workerError_;  // set if the worker died; guarded by mu_
  std::thread worker_;
  std::string incarnation_;  // this group's tag in store keys and failure reports (from its keys)
  StoreRecords kept_;        // what the failure watcher keeps in the store (FailureWatch::kept)
  GroupKeys keys_;           // agreed at creation (backend/sealed_store.h)
  // The process that built the group: a child forked from it has a copy of the object but none of
  // its threads, and must not shut it down (joining threads that are not there).
  const pid_t creatorPid_ = ::getpid();
  std::shared_ptr<FailureWatch> watch_;  // null without a watcher
  std::mutex shutdownMu_;  // serialises shutdown(): an abort and the destructor may race
  bool shutDown_ = false;  // guarded by shutdownMu_
};

}  // namespace hetcomm
