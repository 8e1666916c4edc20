#pragma once
// What a process group has put on and taken off its sockets, per peer, since it was created.
//
// Counted: every byte of hetcomm's messages that this rank writes to or reads from a peer's
// socket, headers included, as the send()/recv() system calls return them: collective messages
// (algorithms/pipeline.cc sendSome/recvSome, used by the host and the staged pipeline) and
// point-to-point messages (transport/p2p_engine.cc). Not counted: the connection handshakes
// (Hello/HelloAck, transport/tcp_mesh.cc and tcp_mesh_accept.cc), the liveness probes of the
// point-to-point engine, and what TCP/IP adds below. So bytesSent[b] on rank a equals bytesReceived[a] on rank b once both
// have finished the operations that moved them.
//
// Writers add with relaxed atomics (one per system call: negligible next to the call itself);
// readers take a snapshot field by field, so a snapshot taken while an operation runs may hold
// part of its bytes and not yet its count. Per-peer entries are indexed by group rank.
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace hetcomm {

// How a collective moved its data: over TCP only, through the shared memory of one host only,
// through the inner level of each host (inner_level.h) and TCP between hosts, or, with every rank
// on one host, through torch's NCCL or Gloo as the host's inner level.
enum class CollectivePath : uint8_t { kTcp = 0, kSharedMemory, kHierarchical, kNccl, kGloo, kCount };
const char* collectivePathName(CollectivePath path);

struct TrafficSnapshot {
  std::vector<uint64_t> bytesSent;      // [peer]: bytes this rank wrote to peer's sockets
  std::vector<uint64_t> bytesReceived;  // [peer]: bytes this rank read from peer's sockets
  uint64_t collectives = 0;             // collectives whose body ran (failed ones included)
  uint64_t collectiveNanos = 0;         // wall time spent running them
  uint64_t p2pSentMessages = 0;         // point-to-point messages wholly written
  uint64_t p2pReceivedMessages = 0;     // point-to-point messages wholly read (claimed or not)
  std::vector<uint64_t> collectivesByPath;  // [CollectivePath]: collectives that took each path
  uint64_t sharedMemoryBytes = 0;       // bytes this rank copied into its shared-memory slots
  uint64_t inlineCollectives = 0;       // collectives run on the caller's thread (of `collectives`)
};

class TrafficCounters {
 public:
  explicit TrafficCounters(int size)
      : size_(size), sent_(new std::atomic<uint64_t>[size]), received_(new std::atomic<uint64_t>[size]) {
    for (int i = 0; i < size; ++i) {
      sent_[i].store(0, std::memory_order_relaxed);
      received_[i].store(0, std::memory_order_relaxed);
    }
  }
  TrafficCounters(const TrafficCounters&) = delete;
  TrafficCounters& operator=(const TrafficCounters&) = delete;

  int size() const { return size_; }

  // peer: a group rank in [0, size()) (callers pass validated ranks).
  void addSent(int peer, uint64_t bytes) { sent_[peer].fetch_add(bytes, std::memory_order_relaxed); }
  void addReceived(int peer, uint64_t bytes) { received_[peer].fetch_add(bytes, std::memory_order_relaxed); }
  void addCollective(uint64_t nanos) {
    collectives_.fetch_add(1, std::memory_order_relaxed);
    collectiveNanos_.fetch_add(nanos, std::memory_order_relaxed);
  }
  void addPath(CollectivePath path) { byPath_[static_cast<int>(path)].fetch_add(1, std::memory_order_relaxed); }
  void addSharedMemory(uint64_t bytes) { shmBytes_.fetch_add(bytes, std::memory_order_relaxed); }
  void addInline() { inline_.fetch_add(1, std::memory_order_relaxed); }
  void addP2PSent() { p2pSent_.fetch_add(1, std::memory_order_relaxed); }
  void addP2PReceived() { p2pReceived_.fetch_add(1, std::memory_order_relaxed); }

  TrafficSnapshot snapshot() const {
    TrafficSnapshot s;
    s.bytesSent.resize(size_);
    s.bytesReceived.resize(size_);
    for (int i = 0; i < size_; ++i) {
      s.bytesSent[i] = sent_[i].load(std::memory_order_relaxed);
      s.bytesReceived[i] = received_[i].load(std::memory_order_relaxed);
    }
    s.collectives = collectives_.load(std::memory_order_relaxed);
    s.collectiveNanos = collectiveNanos_.load(std::memory_order_relaxed);
    s.p2pSentMessages = p2pSent_.load(std::memory_order_relaxed);
    s.p2pReceivedMessages = p2pReceived_.load(std::memory_order_relaxed);
    for (const auto& n : byPath_) s.collectivesByPath.push_back(n.load(std::memory_order_relaxed));
    s.sharedMemoryBytes = shmBytes_.load(std::memory_order_relaxed);
    s.inlineCollectives = inline_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  const int size_;
  // Written by the collective worker and the point-to-point engine thread alike; the cache line
  // they may share costs nothing measurable next to the system call each add follows.
  std::unique_ptr<std::atomic<uint64_t>[]> sent_;
  std::unique_ptr<std::atomic<uint64_t>[]> received_;
  std::atomic<uint64_t> collectives_{0};
  std::atomic<uint64_t> collectiveNanos_{0};
  std::atomic<uint64_t> p2pSent_{0};
  std::atomic<uint64_t> p2pReceived_{0};
  std::atomic<uint64_t> byPath_[static_cast<int>(CollectivePath::kCount)] = {};
  std::atomic<uint64_t> shmBytes_{0};
  std::atomic<uint64_t> inline_{0};
};

inline const char* collectivePathName(CollectivePath path) {
  switch (path) {
    case CollectivePath::kTcp: return "tcp";
    case CollectivePath::kSharedMemory: return "shm";
    case CollectivePath::kHierarchical: return "hierarchical";
    case CollectivePath::kNccl: return "nccl";
    case CollectivePath::kGloo: return "gloo";
    default: return "?";
  }
}

}  // namespace hetcomm
