#pragma once
// The ranks of one host within a process group, as the collectives see them: their shared-memory
// channel, and which group rank each local rank is.
#include <functional>
#include <memory>
#include <vector>

#include "transport/shm/channel.h"

namespace hetcomm {

struct LocalGroup {
  std::unique_ptr<ShmChannel> channel;
  // Group rank of each local rank, ascending: local rank l is ranks[l].
  std::vector<int> ranks;
  // Whether local rank l's process is still there (asked while waiting for it; null: not known).
  std::function<bool(int local)> peerAlive;

  int localRank() const { return channel->localRank(); }
  int localSize() const { return static_cast<int>(ranks.size()); }
  // True when this host holds every rank of the group: then local rank == group rank.
  bool coversGroup(int groupSize) const { return static_cast<int>(ranks.size()) == groupSize; }
};

}  // namespace hetcomm
