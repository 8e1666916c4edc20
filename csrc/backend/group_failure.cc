// How a process group fails and ends (ProcessGroupHetcomm): the first failure, reported to the
// peers over the links and through the store (failGroup); the failure watcher that learns of
// failures of ranks this one shares no connection with (watchFailures), and puts this rank's
// sealed records back when someone replaced them (restoreKept); abort; and shutdown, where the
// last rank to leave removes the group's keys.
#include <sys/types.h>
#include <unistd.h>

#include <future>
#include <mutex>
#include <set>

#include "backend/dist_error.h"
#include "backend/peer_records.h"
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
// How long a failing rank waits for its report to reach the store before it shuts its links.
constexpr std::chrono::milliseconds kReportWait{300};
// How long a rank that lost a peer waits for that peer's reason to appear in the store. A rank
// that fails writes its reason before it closes its links (failGroup), so a short wait suffices;
// a killed one leaves none, and every survivor would wait this long for nothing.
constexpr std::chrono::milliseconds kAbortReasonWait{500};
constexpr size_t kMaxAbortReasonBytes = 2048;

// Whether nothing serves the group's store any more. A TCPStore served by a rank's own process
// (rank 0's, under env:// or a plain torchrun) goes when that rank exits, often before the others
// shut down; the first operation on a client whose server is gone logs a warning with a C++ stack
// trace before it throws, on every rank that tries. A fresh connection to the store's address as
// resolved at creation tells instead, without that client: refused means gone (and the group's
// keys with it). Anything else -- it answers, a timeout, an error of this process -- counts as
// serving, so that the last rank out cleans the keys as before; only a refusal skips that. A
// store found gone stays gone: the next group of this process to shut down does not ask again.
bool storeGone(const HostPort& address) {
  if (address.host.empty()) return false;
  static std::mutex mu;
  static std::set<std::string> gone;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (gone.count(address.str()) != 0) return true;
  }
  try {
    connectTo(address, Clock::now() + std::chrono::seconds(2), /*retryRefused=*/false);
    return false;
  } catch (const ConnectionRefusedError&) {
    std::lock_guard<std::mutex> lock(mu);
    gone.insert(address.str());
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

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

void ProcessGroupHetcomm::workerDied(const std::string& what) {
  failGroup(what);
  std::deque<Pending> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workerError_ = what;
    orphans.swap(queue_);
    running_ = false;
  }
  for (Pending& op : orphans) op.work->complete(distError(what));
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

std::string ProcessGroupHetcomm::failWith(const CollectiveContext& ctx, const std::string& msg) {
  {
    // Failed already (another operation, or a peer through the store) while this one ran: this
    // one's own error is a consequence (connections shut down); name the first cause.
    std::lock_guard<std::mutex> lock(mu_);
    if (!brokenReason_.empty()) {
      return strCat(ctx.prefix(), ": the process group is unusable after an earlier failure: ", brokenReason_);
    }
  }
  failGroup(msg);
  return msg;
}

std::string ProcessGroupHetcomm::peerAbortReason(int peer) {
  try {
    const std::string key = abortKey(incarnation_, peer);
    store_->wait({key}, kAbortReasonWait);
    std::vector<uint8_t> v;
    if (store_->tryGet(key, v) != SealedStore::Read::kValue) return "";
    // Bounded and printable: it ends up in every error message of this rank.
    return excerpt(std::string(v.begin(), v.end()), kMaxAbortReasonBytes);
  } catch (const std::exception&) {
    return "";  // it left none (killed?), or the store is gone with it
  }
}

void ProcessGroupHetcomm::failGroup(const std::string& reason) {
  std::shared_ptr<LocalGroup> local;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!brokenReason_.empty()) return;
    brokenReason_ = reason;
    local = local_;
  }
  HC_LOG(kError, reason);
  if (watch_) watch_->cv.notify_all();  // the failure watcher goes idle
  // The ranks of this host waiting on us in shared memory fail now too.
  if (local) local->abort();
  // Leave the reason for the peers, and the group's first failure for the ranks that share no
  // connection with us, before they see our connections close (so that the first cause, not a
  // consequence, is what they read): waited for briefly. Detached: a store whose host died must
  // not delay the abort any longer; the store outlives the thread's short work.
  auto store = store_;
  const std::string key = abortKey(incarnation_, rank_);
  const std::string first = strCat(incarnation_, "|rank ", rank_, ": ", reason);
  auto reported = std::make_shared<std::promise<void>>();
  std::future<void> done = reported->get_future();
  try {
    startThread("failure report", [store, key, reason, first, reported] {
      try {
        store->compareSet(kFailedKey, std::vector<uint8_t>{}, std::vector<uint8_t>(first.begin(), first.end()));
        store->set(key, std::vector<uint8_t>(reason.begin(), reason.end()));
      } catch (const std::exception&) {
        // The store's host is gone: the links tell what they can.
      }
      reported->set_value();
    }).detach();
    done.wait_for(kReportWait);
  } catch (const std::system_error& e) {
    HC_LOG(kWarn, "rank ", rank_, ": could not report the failure to the other ranks through the store: ", e.what());
  }
  // Every pending and later point-to-point operation fails with this cause, and the peers blocked
  // on us (collective or point-to-point) fail now instead of at their timeout.
  p2p_->fail(reason);
  mesh_->abort();
}

void ProcessGroupHetcomm::abort() {
  failGroup("the process group was aborted");
  shutdown();
}

void ProcessGroupHetcomm::failIfBusyAtExit() {
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = queue_.empty() && !running_;
  }
  if (!idle) failGroup("the process is exiting with operations of this group still queued or running");
}

void ProcessGroupHetcomm::shutdownAtExit() {
  failIfBusyAtExit();
  shutdown();
}

void ProcessGroupHetcomm::shutdown() {
  // Two threads may get here (a watchdog's abort and the destructor): the second waits for the
  // first, so that nobody joins a thread twice.
  std::lock_guard<std::mutex> once(shutdownMu_);
  if (shutDown_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  // The worker finishes what was issued (each operation bounded by its timeout), then exits.
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
  stopFailureWatch();  // after the worker: failures still end its queued operations early
  if (p2p_) p2p_->stop("the process group was shut down");
  if (mesh_) mesh_->close();
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.reset();  // unmaps this rank's view of the host's segment
    pendingLocal_.reset();
  }
  completions_->stop();
  // The last rank to leave cleans the group's keys: before that, a rank still in the group may look
  // a peer's address up (lazily, at its first message to that peer), or still be starting. A rank
  // that crashed never leaves, and its group's keys stay until the store goes. A store that has
  // already gone (its host rank exited first) is left alone, quietly: see storeGone.
  try {
    if (storeGone(storeAddress_)) {
      HC_LOG(kInfo, "hetcomm: rank ", rank_, ": the store at ", storeAddress_.str(),
             " has gone (refused); the group's keys went with it");
    } else {
      std::vector<std::string> left;
      for (int r = 0; r < size_; ++r) left.push_back(leftKey(incarnation_, r));
      store_->set(left[rank_], std::vector<uint8_t>{1});
      // Every rank has left (the last few may all see it: deleting twice is harmless). With an
      // out-of-band secret each mark must open: a store writer must not make a rank remove the keys
      // (the failure record among them) while the others still run.
      auto allLeft = [&] {
        if (!store_->check(left)) return false;
        if (!store_->sealing()) return true;
        std::vector<uint8_t> v;
        for (const std::string& key : left) {
          if (store_->tryGet(key, v) != SealedStore::Read::kValue) return false;
        }
        return true;
      };
      if (allLeft()) {
        for (int r = 0; r < size_; ++r) {
          for (const std::string& key : {addressKey(incarnation_, r), siteKey(incarnation_, r), abortKey(incarnation_, r),
                                         left[r]}) {
            store_->deleteKey(key);
          }
        }
        // The keys every incarnation shares, only while they are still this group's (a group
        // made again under this prefix, by a rank that left first, may have written them).
        std::vector<uint8_t> failed;
        if (store_->tryGet(kFailedKey, failed) == SealedStore::Read::kValue &&
            std::string(failed.begin(), failed.end()).rfind(incarnation_ + "|", 0) == 0) {
          store_->deleteKey(kFailedKey);
        }
        deleteGroupKeyRecords(*store_->inner(), keys_);
      }
    }
  } catch (const std::exception&) {
    // The store's host already exited; the keys went with it.
  }
  shutDown_ = true;
}


}  // namespace hetcomm
