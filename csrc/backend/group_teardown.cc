// How a group fails and goes: the failure report a rank leaves for its peers (failWith,
// failGroup, peerAbortReason), abort, and the shutdown that removes the group's store keys once
// the last rank has left (shutdown, and the exit handlers). The rest of the group:
// process_group_hetcomm.cc (creation, the queue, the worker), collective_ops.cc (the collectives).
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <future>
#include <mutex>
#include <set>

#include "backend/live_groups.h"
#include "backend/peer_records.h"
#include "backend/process_group_hetcomm.h"
#include "common/logging.h"
#include "common/threads.h"

namespace hetcomm {
namespace {

// Which ranks of this incarnation have left, one key each: the last to leave removes the group's
// keys (a rank may still look a peer's address up until it leaves itself). Not a counter: the
// store closes the connection of a client that adds to a value a store writer filled with garbage.
std::string leftKey(const std::string& incarnation, int rank) { return strCat("hetcomm/left/", incarnation, "/", rank); }
// How long a failing rank waits for its report to reach the store before it shuts its links.
constexpr std::chrono::milliseconds kReportWait{300};
// Where a rank leaves the reason it gave up, for the peers that only see its connection close.
std::string abortKey(const std::string& incarnation, int rank) {
  return strCat("hetcomm/abort/", incarnation, "/", rank);
}
// How long a rank that lost a peer waits for that peer's reason to appear in the store. A rank
// that fails writes its reason before it closes its links (failGroup), so a short wait suffices;
// a killed one leaves none, and every survivor would wait this long for nothing.
constexpr std::chrono::milliseconds kAbortReasonWait{500};

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
  completions_->stop();
  {
    // The staging memory goes with the group (torch's destroy_process_group shuts it down while
    // Python may still hold the group object): nothing runs on it any more. Before the segment
    // is unmapped, which a device may have registered (HETCOMM_SHM_PIN).
    std::vector<std::unique_ptr<DeviceOps>> staging;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& entry : devices_) staging.push_back(std::move(entry.second.ops));
      staging.push_back(std::move(emulatedDevice_));
    }
  }  // destroyed here, outside the lock (a CUDA one waits for its stream)
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.reset();  // unmaps this rank's view of the host's segment
    pendingLocal_.reset();
  }
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
