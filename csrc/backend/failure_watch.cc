// The failure watcher: a detached thread per group that, while operations are pending, looks for
// another rank's failure record in the store (a rank that shares no connection with the one that
// failed learns it from there), and with an out-of-band secret puts back this rank's records when
// a store writer replaced or removed them.
#include <algorithm>
#include <system_error>

#include "backend/process_group_hetcomm.h"
#include "backend/sealed_store.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/threads.h"

namespace hetcomm {
namespace {

// How often a rank with operations pending looks at kFailedKey, and how long one look may take.
HETCOMM_PARAM(paramFailurePollMs, "HETCOMM_FAILURE_POLL_MS", 500)
constexpr std::chrono::milliseconds kWatchStoreTimeout{2000};

}  // namespace

void ProcessGroupHetcomm::startFailureWatch() {
  c10::intrusive_ptr<SealedStore> store;
  try {
    store = store_->cloneSealed();
    store->setTimeout(kWatchStoreTimeout);
  } catch (const std::exception& e) {
    // A store that cannot be cloned (a Python store): failures reach the other ranks over the links only.
    HC_LOG(kInfo, "rank ", rank_, ": the store cannot be cloned (", e.what(), "): failures of ranks this one shares "
           "no connection with reach it only at its own timeout");
    return;
  }
  auto watch = std::make_shared<FailureWatch>();
  watch->busy = [this] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!brokenReason_.empty()) return false;  // failed already: nothing more to learn
      if (!queue_.empty() || running_) return true;
    }
    return !p2p_->idle();
  };
  watch->failed = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return !brokenReason_.empty();
  };
  watch->fail = [this](const std::string& why) { failGroup(why); };
  watch->kept = kept_;
  try {
    startThread("failure watcher", [watch, store, incarnation = incarnation_, rank = rank_] {
      watchFailures(watch, store, incarnation, rank);
    }).detach();
  } catch (const std::system_error& e) {
    HC_LOG(kWarn, "rank ", rank_, ": no thread to watch for other ranks' failures: ", e.what());
    return;
  }
  watch_ = std::move(watch);
}

void ProcessGroupHetcomm::stopFailureWatch() {
  if (!watch_) return;
  {
    // Waits for a call into this group in progress; the watcher then touches nothing of it.
    std::lock_guard<std::mutex> lock(watch_->mu);
    watch_->stop = true;
    watch_->busy = nullptr;
    watch_->failed = nullptr;
    watch_->fail = nullptr;
  }
  watch_->cv.notify_all();
}

void ProcessGroupHetcomm::restoreKept(FailureWatch& watch, SealedStore& store, int rank) {
  for (const auto& [key, raw] : watch.kept) {
    try {
      if (!putBack(*store.inner(), key, raw)) continue;
    } catch (const std::exception&) {
      return;  // the store is unreachable now
    }
    if (watch.restored.insert(key).second) {
      HC_LOG(kWarn, "hetcomm: rank ", rank, " put its record '", key, "' back in the store: someone replaced or "
             "removed it");
    }
  }
}

// Detached, and holding only `watch` and its own store clone: a store call that outlasts the group
// (a store host that stopped answering) keeps nothing of the group alive or waiting.
void ProcessGroupHetcomm::watchFailures(std::shared_ptr<FailureWatch> watch, c10::intrusive_ptr<SealedStore> store,
                                        std::string incarnation, int rank) {
  {
    const auto poll = std::chrono::milliseconds(std::max<int64_t>(10, paramFailurePollMs()));
    const std::string tag = incarnation + "|";
    while (true) {
      {
        std::unique_lock<std::mutex> lock(watch->mu);
        watch->cv.wait_for(lock, poll, [&] { return watch->stop; });
        if (watch->stop) return;
        // Under the lock: never after shutdown went on to remove the group's keys.
        // Every poll while the group is young (creation, first connections), then every tenth:
        // each look is a store round trip per record, on every rank.
        const bool look = watch->polls < 60 || watch->polls % 10 == 0;
        ++watch->polls;
        if (look && !watch->kept.empty() && !watch->failed()) restoreKept(*watch, *store, rank);
        if (!watch->busy()) continue;  // nothing waits: nothing to fail
      }
      std::string failed;
      try {
        // One that fails its seal (a store writer's) is ignored: only a member can fail the group.
        std::vector<uint8_t> v;
        if (store->tryGet(kFailedKey, v) == SealedStore::Read::kValue) failed.assign(v.begin(), v.end());
      } catch (const std::exception&) {
        continue;  // the store is unreachable now: the links still tell what they know
      }
      if (failed.rfind(tag, 0) != 0) continue;  // none, or an earlier group's
      std::lock_guard<std::mutex> lock(watch->mu);
      if (watch->stop) return;
      watch->fail(strCat("hetcomm: rank ", rank, " stops: the process group failed on ",
                         excerpt(failed.substr(tag.size()), kMaxAbortReasonBytes)));
    }
  }
}

}  // namespace hetcomm
