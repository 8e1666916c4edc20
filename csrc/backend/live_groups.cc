#include "backend/live_groups.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
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

struct Registry {
  std::mutex mu;
  std::vector<Entry> entries;
};

Registry* registryNow = nullptr;

void forgetRegistryInChild() {
  // The parent's groups are not this process's (their threads are not here), and the mutex may
  // have been inherited locked: a fresh registry; the parent's copy is left untouched.
  registryNow = new Registry;
}

Registry& registry() {
  static const bool ready = [] {
    registryNow = new Registry;  // never destroyed: usable from any thread until the very end
    ::pthread_atfork(nullptr, nullptr, forgetRegistryInChild);
    return true;
  }();
  (void)ready;
  return *registryNow;
}

std::vector<c10::intrusive_ptr<ProcessGroupHetcomm>> aliveGroups() {
  std::vector<c10::intrusive_ptr<ProcessGroupHetcomm>> groups;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const pid_t me = ::getpid();
  for (Entry& e : r.entries) {
    if (e.pid != me) continue;
    auto strong = e.group.lock();  // null for a group being released (it shuts down on its own)
    if (strong) groups.push_back(std::move(strong));
  }
  return groups;
}

}  // namespace

void registerLiveGroup(const c10::intrusive_ptr<ProcessGroupHetcomm>& group) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // Entries of groups already released go (they cannot be the last reference: see forget).
  r.entries.erase(std::remove_if(r.entries.begin(), r.entries.end(), [](const Entry& e) { return e.group.expired(); }),
                  r.entries.end());
  r.entries.push_back({::getpid(), c10::weak_intrusive_ptr<ProcessGroupHetcomm>(group)});
}

void forgetLiveGroup(const ProcessGroupHetcomm* group) noexcept {
  // Called from release_resources, inside c10::intrusive_ptr's release: the weak count still
  // counts the strong side, so dropping this reference never deletes the group here.
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.erase(std::remove_if(r.entries.begin(), r.entries.end(),
                                 [group](const Entry& e) { return e.group._unsafe_get_target() == group; }),
                  r.entries.end());
}

void shutdownLiveGroupsAtExit(int64_t maxWaitMs) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(maxWaitMs);
  // Again while groups remain: a callback run by a shutdown may create one. Bounded, in case a
  // group cannot be shut down (its shutdown throws).
  for (int round = 0; round < 4; ++round) {
    auto groups = aliveGroups();
    if (groups.empty()) break;
    // First fail every busy group, then shut them all down: a callback of one group waiting on
    // an operation of another must not hold the exit for that operation's timeout.
    for (auto& group : groups) {
      try {
        group->failIfBusyAtExit();
      } catch (const std::exception&) {
        // Exiting anyway.
      }
    }
    for (auto& group : groups) {
      try {
        group->shutdown();
      } catch (const std::exception&) {
        // Exiting anyway; the group is gone either way.
      }
    }
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
  CompletionPool::waitForCallbackThreads(std::max(left, std::chrono::milliseconds(0)));
}

}  // namespace hetcomm
