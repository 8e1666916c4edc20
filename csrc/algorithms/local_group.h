#pragma once
// The ranks of one host within a process group, as the collectives see them: which group rank
// each local rank is, whether a local peer's process is still there, and the inner levels that
// join them (inner_level.h): one for host memory, and optionally one for device memory.
#include <functional>
#include <memory>
#include <vector>

#include "algorithms/device_ops.h"
#include "algorithms/inner_level.h"
#include "transport/shm/channel.h"

namespace hetcomm {

struct LocalGroup {
  // The shared-memory channel (null unless the host level, or the device level, is shm).
  std::unique_ptr<ShmChannel> channel;
  // Group rank of each local rank, ascending: local rank l is ranks[l].
  std::vector<int> ranks;
  int me = 0;  // this rank's local index
  // Whether local rank l's process is still there (asked while waiting for it; null: not known).
  std::function<bool(int local)> peerAlive;
  // The inner level for host memory (never null), and for device memory (null: as the host's).
  std::shared_ptr<InnerLevel> host;
  std::shared_ptr<InnerLevel> device;

  int localRank() const { return me; }
  int localSize() const { return static_cast<int>(ranks.size()); }
  // True when this host holds every rank of the group: then local rank == group rank.
  bool coversGroup(int groupSize) const { return static_cast<int>(ranks.size()) == groupSize; }
  // The level that works on the memory of a collective (ctx.device: device memory), or null when
  // none takes that memory directly (then the caller stages it through host memory).
  InnerLevel* levelFor(const DeviceOps* dev) const {
    if (dev == nullptr) return host.get();
    if (device && device->takesDevice(*dev)) return device.get();
    return host && host->takesDevice(*dev) ? host.get() : nullptr;
  }
  // Wakes the peers waiting in any level (a failed group); never throws.
  void abort() noexcept {
    if (channel) channel->abort(me);
    if (host) host->abort(me);
    if (device) device->abort(me);
  }
};

}  // namespace hetcomm
