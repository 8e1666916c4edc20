#include "backend/live_groups.h"

#include <unistd.h>

#include <chrono>
#include <mutex>
#include <utility>
#include <vector>

#include "backend/completion_pool.h"
#include "backend/process_group_hetcomm.h"

namespace hetcomm {
namespace {

struct Entry {
  pid_t pid;  // a forked child inherits the entries, not the threads: it must not touch them
  c10::weak_intrusive_ptr<ProcessGroupHetcomm> group;
};

std::mutex& registryMutex() {
  static auto* mu = new std::mutex;  // never destroyed: usable from any thread until the very end
  return *mu;
}

std::vector<Entry>& registry() {
  static auto* entries = new std::vector<Entry>;
  return *entries;
}

}  // namespace

void registerLiveGroup(const c10::intrusive_ptr<ProcessGroupHetcomm>& group) {
  std::lock_guard<std::mutex> lock(registryMutex());
  auto& entries = registry();
  std::vector<Entry> alive;
  alive.reserve(entries.size() + 1);
  for (Entry& e : entries) {
    if (!e.group.expired()) alive.push_back(std::move(e));
  }
  alive.push_back({::getpid(), c10::weak_intrusive_ptr<ProcessGroupHetcomm>(group)});
  entries.swap(alive);
}

void forgetLiveGroup(const ProcessGroupHetcomm* group) {
  std::vector<Entry> gone;  // released after the lock: nothing runs under it
  std::lock_guard<std::mutex> lock(registryMutex());
  auto& entries = registry();
  for (auto it = entries.begin(); it != entries.end();) {
    if (it->group._unsafe_get_target() == group) {
      gone.push_back(std::move(*it));
      it = entries.erase(it);
    } else {
      ++it;
    }
  }
}

void shutdownLiveGroupsAtExit(int64_t maxWaitMs) {
  std::vector<c10::intrusive_ptr<ProcessGroupHetcomm>> groups;
  {
    std::lock_guard<std::mutex> lock(registryMutex());
    const pid_t me = ::getpid();
    for (Entry& e : registry()) {
      if (e.pid != me) continue;
      auto strong = e.group.lock();
      if (strong) groups.push_back(std::move(strong));
    }
  }
  // Outside the registry's lock: a group's shutdown joins threads that may create or destroy
  // other groups.
  for (auto& group : groups) {
    try {
      group->shutdownAtExit();
    } catch (const std::exception&) {
      // Exiting anyway; the group is gone either way.
    }
  }
  groups.clear();
  CompletionPool::waitForDetachedCallbacks(std::chrono::milliseconds(maxWaitMs));
}

}  // namespace hetcomm
