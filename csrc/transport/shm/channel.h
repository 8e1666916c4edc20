#pragma once
// ShmChannel: the shared memory of one host's ranks in one process group, and how they wait
// for each other in it.
//
// Layout of the segment (every rank computes the same from localSize, slotBytes and depth):
//
//   control block   magic, version, the sizes below, and the abort word (who gave up, if anyone)
//   rank words      per local rank, on its own cache line: its progress counter, the number of
//                   ranks asleep waiting on it, and whether it has mapped the segment
//   headers         [depth][localSize] x 64 bytes: each rank's description of the chunk it wrote
//   slots           [localSize][depth] x slotBytes: the data
//
// Protocol. The collectives (algorithms/local_collectives.h) move data in *chunks* through the
// slots. Chunks are numbered g = 0, 1, 2, ... over the life of the channel, in the same order on
// every local rank (the group's worker runs collectives in issue order), and chunk g uses slot
// buffer g % depth of every rank. A rank's progress counter says how far it got: 3g + 1 once its
// part of chunk g is in its slot, 3g + 2 once it has done its middle step (reduced its slice),
// 3g + 3 once it no longer reads chunk g anywhere. A rank writes its slot for chunk g only after
// every rank reached 3(g - depth) + 3, i.e. consumed the chunk that used that buffer before. A
// counter is 32 bits and compared by wrapping difference: ranks are never more than `depth`
// chunks apart, so the difference is always small.
//
// Waiting. A waiter spins for a few microseconds (HETCOMM_SHM_SPIN_US), then yields the CPU for a
// while (HETCOMM_SHM_YIELD_US: on a host with more ranks than cores the peer needs that CPU), then
// sleeps on the peer's counter with futex: the peer, after raising its counter, wakes sleepers
// only if one registered itself (Dekker-style: both sides use sequentially consistent operations,
// so either the waiter sees the new value or the waker sees the waiter). An idle group burns no
// CPU. Sleeps are bounded (50 ms) so that the deadline, the abort word and the peer's liveness
// (checked every 100 ms through `peerAlive`) are noticed however the peer fails.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "transport/shm/segment.h"
#include "transport/socket.h"

namespace hetcomm {

class ShmChannel {
 public:
  static constexpr size_t kHeaderBytes = 64;
  static constexpr size_t kAlignBytes = 64;  // slots and slices start on cache lines

  // Bytes of the segment for this configuration.
  static size_t segmentBytes(int localSize, size_t slotBytes, int depth);

  // `create`: this rank made the segment and writes the control block; the others check it.
  ShmChannel(ShmSegment segment, int localRank, int localSize, size_t slotBytes, int depth, bool create);
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  int localRank() const { return localRank_; }
  int localSize() const { return localSize_; }
  size_t slotBytes() const { return slotBytes_; }
  int depth() const { return depth_; }
  // Where the segment is mapped (for registering it with a device).
  char* base() const { return segment_.data(); }
  size_t bytes() const { return segment_.size(); }
  // ShmSegment::removeNameWhenClosed: the name goes when this channel does (or at exit).
  void removeNameWhenClosed(const std::string& name) { segment_.removeNameWhenClosed(name); }

  // Rank l's slot for chunk g, and its header for chunk g.
  char* slot(int l, uint64_t g) const;
  uint8_t* header(int l, uint64_t g) const;

  // The chunk counter: the next chunk this rank will use (see the protocol above).
  uint64_t takeChunk() { return nextChunk_++; }

  // Whether local rank l has mapped the segment (a rank that opened it says so in its word).
  bool attached(int l) const;

  uint32_t progress(int l) const;
  // Operations issued: this rank has issued operation `op` (numbered from 1 by its group, the
  // same on every rank; never 0), and whether every other local rank has issued `op` (or a
  // later one), spinning then yielding for at most `within`. For the backend's choice of thread
  // (a caller that would wait for its peers hands the operation to its worker instead); the
  // collectives themselves never look at it.
  void announce(uint32_t op);
  bool othersIssued(uint32_t op, std::chrono::microseconds within) const;
  // Sets this rank's progress (release) and wakes whoever sleeps on it.
  void publish(uint32_t value);

  enum class Wait { kReached, kTimedOut, kAborted, kPeerGone };
  // Blocks until local rank `peer`'s progress has reached `target`, or a reason not to wait on.
  // peerAlive(peer) is asked every 100 ms of waiting (null: never).
  Wait waitFor(int peer, uint32_t target, Deadline deadline, const std::function<bool(int)>& peerAlive);

  // Records that local rank `by` gave up (the first caller wins) and wakes every sleeper.
  void abort(int by);
  // Whether anyone aborted the channel, and which local rank did: -1 when none did, or when the
  // word names no local rank (it is shared memory: never used as an index unchecked).
  bool aborted() const;
  int abortedBy() const;

  static bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

 private:
  struct Control;
  struct RankWord;
  Control* control() const;
  RankWord* word(int l) const;

  ShmSegment segment_;
  const int localRank_;
  const int localSize_;
  const size_t slotBytes_;
  const int depth_;
  size_t headersOffset_ = 0;
  size_t slotsOffset_ = 0;
  uint64_t nextChunk_ = 0;
};

}  // namespace hetcomm
