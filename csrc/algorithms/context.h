#pragma once
// What one collective call needs from the group: who we are, the connections, the deadline, and
// the header that identifies the call on the wire.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "common/traffic.h"
#include "transport/framing.h"
#include "transport/link.h"

namespace hetcomm {

class DeviceOps;
struct LocalGroup;

enum class CollectiveKind : uint8_t {
  kAllreduce = 1,
  kBroadcast,
  kAllgather,
  kReduceScatter,
  kReduce,
  kGather,
  kScatter,
  kAlltoall,
  kBarrier,
};
const char* collectiveName(uint8_t kind);

struct CollectiveContext {
  int rank = 0;
  int size = 1;
  Deadline deadline;
  int64_t timeoutMs = 0;
  size_t segmentBytes = 0;  // 0: adaptive (segmentBytesFor), else forced
  // The plan's largest segment (0: none): bounds the adaptive size, never raises it.
  size_t segmentCap = 0;
  // seq, opcode, dtype, redop, algo, bytes, aux: the fields every participant must agree on.
  CollectiveHeader header;
  // The collective link to a peer (opened on first use, bounded by the deadline; transport/link.h).
  std::function<Link&(int peer)> linkOf;
  // Null: the buffers are host memory. Else they are device memory, reached only through this
  // (see device_ops.h).
  DeviceOps* device = nullptr;
  // Where the bytes this collective moves are counted (per peer); null: nowhere.
  TrafficCounters* traffic = nullptr;
  // The ranks of this rank's host and their shared memory (algorithms/local_group.h); null when
  // the group moves everything over TCP.
  LocalGroup* local = nullptr;
  // Set by the algorithm to the path it took (counted by the backend once the body returns).
  CollectivePath path = CollectivePath::kTcp;

  // "hetcomm allreduce #42: rank 2"
  std::string prefix() const;
  // Segment size for a pipeline whose largest chunk is chunkBytes: segmentBytes when forced,
  // else the adaptive size, at most segmentCap when set.
  size_t segmentBytesFor(size_t chunkBytes) const;
  // This context with a plan's segment cap (RingPlan::segmentBytes, SitePlan::segmentBytes).
  CollectiveContext withSegmentCap(size_t cap) const {
    CollectiveContext capped = *this;
    capped.segmentCap = cap;
    return capped;
  }
};

}  // namespace hetcomm
