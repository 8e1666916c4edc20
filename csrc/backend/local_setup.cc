// Shared memory among the ranks of one host (ProcessGroupHetcomm::attachLocal / detachLocal).
//
// The host's first rank (lowest group rank) creates the segment under a name nobody else can
// guess or collide with (a random 64-bit tag: two groups, and two jobs on one machine, never
// meet; the name carries the group's incarnation too). It publishes the name in the group's store
// *before* creating the segment, and then whether it made it; the keys carry the group's
// incarnation (from its fresh secret), so a name an earlier group under the same prefix left
// behind is never read; with an out-of-band secret they are sealed too (backend/sealed_store.h),
// so a store writer can neither name another segment nor make a host fall back to TCP (a forged
// record fails the set-up instead). The name is unlinked as soon as every rank of the host has
// tried to open it, so that from then on only the mappings hold the memory: by the creator, and by the last
// rank to open it (the creator may have died in between). A rank that gives up waiting for the
// creator to say whether it made the segment unlinks the name too: a creator killed between
// creating and unlinking leaves nothing in /dev/shm once the others give up (at the group's
// timeout; a launcher that kills them all first leaves the segment, as any process killed while
// holding a name would). A rank that mapped the segment but was not the last to open it removes
// the name when its group goes, or at its exit (ShmSegment::removeNameWhenClosed): should the
// creator die after saying it made the segment, and another rank before opening it, nobody else
// would.
//
// Liveness: a rank waiting for a peer in shared memory asks every 100 ms whether the peer's
// process is still there. The answer comes from the collective TCP connection to that peer, opened
// here for this purpose: when a process dies the kernel closes its sockets, and when a rank gives
// up (failGroup) it shuts its connections down, so the peer's end reports a hang-up either way. It
// works across PID namespaces, where a pid would not.
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <random>
#include <thread>

#include "backend/process_group_hetcomm.h"
#include "backend/torch_inner.h"
#include "common/env.h"
#include "common/logging.h"
#include "transport/shm/channel.h"
#include "transport/shm/segment.h"

namespace hetcomm {
namespace {

constexpr int kDepth = 2;  // slot buffers per rank: one being filled while the other is read
constexpr size_t kMinSlotBytes = 4096;
constexpr size_t kMaxReasonBytes = 1024;  // of the creator's error, as quoted in the others' (from the store)

std::string shmKey(const std::string& incarnation, int leader, const char* what) {
  return strCat("hetcomm/shm/", incarnation, "/", leader, "/", what);
}

// Only names this code makes for this group are opened or unlinked, whatever the store says.
bool isSegmentName(const std::string& name, const std::string& incarnation) {
  const std::string prefix = strCat("/hetcomm-", incarnation, "-");
  if (incarnation.size() != 16 || name.size() != prefix.size() + 16 || name.compare(0, prefix.size(), prefix) != 0) {
    return false;
  }
  return std::all_of(name.begin() + prefix.size(), name.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// Unlinks the segment's name when it goes out of scope, unless released: every way out of the
// set-up, an exception included, leaves no name behind.
class UnlinkGuard {
 public:
  explicit UnlinkGuard(std::string incarnation) : incarnation_(std::move(incarnation)) {}
  void arm(const std::string& name) { name_ = isSegmentName(name, incarnation_) ? name : ""; }
  void unlinkNow() {
    if (!name_.empty()) ShmSegment::unlink(name_);
    name_.clear();
  }
  ~UnlinkGuard() { unlinkNow(); }

 private:
  std::string incarnation_;
  std::string name_;
};

// Debug hook for the tests of a creator killed mid-setup: HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE=1
// kills the host's first rank right after it created the segment.
// HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE=made kills it after it said that it made the segment, and
// HETCOMM_DEBUG_DIE_BEFORE_SHM_OPEN=R kills group rank R as it is about to say that it opened it.
void dieForTest(const char* variable) {
  HC_LOG(kError, variable, " is set: this rank kills itself (a test hook)");
  ::raise(SIGKILL);
}
void maybeDieAfterCreate(const char* when) {
  if (envStr("HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE") == when) dieForTest("HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE");
}
void maybeDieBeforeOpen(int rank) {
  if (envInt("HETCOMM_DEBUG_DIE_BEFORE_SHM_OPEN", -1) == rank) dieForTest("HETCOMM_DEBUG_DIE_BEFORE_SHM_OPEN");
}

// "/hetcomm-" + the group's incarnation (16 hex digits) + "-" + a random 64-bit tag: two groups,
// and two jobs on one machine, never meet, and a name from the store that does not carry this
// group's incarnation is never opened or unlinked (a store writer cannot point the ranks at
// another group's segment).
std::string randomSegmentName(const std::string& incarnation) {
  std::random_device rd;
  const uint64_t tag = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(tag));
  return strCat("/hetcomm-", incarnation, "-", buf);
}

}  // namespace

std::string ProcessGroupHetcomm::attachLocal(const std::vector<int64_t>& hostOf, int64_t maxSegmentBytes,
                                             int64_t slotBytes) {
  TORCH_CHECK_VALUE(static_cast<int>(hostOf.size()) == size_, "hetcomm: ", hostOf.size(), " host labels for a group of ",
                    size_);
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r) {
    if (hostOf[r] == hostOf[rank_]) ranks.push_back(r);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(local_ == nullptr && pendingLocal_ == nullptr,
                "hetcomm: this group already shares memory within its hosts");
  }
  const int L = static_cast<int>(ranks.size());
  if (L < 2) return "";
  const int me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  const int leader = ranks[0];
  const Deadline deadline = Clock::now() + options_.timeout;

  // The largest slot (a multiple of 4 KB) that keeps the segment within maxSegmentBytes.
  const size_t fixed = ShmChannel::segmentBytes(L, 0, kDepth);
  size_t slot = static_cast<size_t>(std::max<int64_t>(0, slotBytes)) / kMinSlotBytes * kMinSlotBytes;
  if (maxSegmentBytes > 0 && static_cast<size_t>(maxSegmentBytes) > fixed) {
    const size_t fit = (static_cast<size_t>(maxSegmentBytes) - fixed) / (static_cast<size_t>(L) * kDepth);
    slot = std::min(slot, fit / kMinSlotBytes * kMinSlotBytes);
  } else {
    slot = 0;
  }
  const size_t needSlot = std::max<size_t>(kMinSlotBytes, ShmChannel::kAlignBytes * 2 * L);
  std::string error;
  if (slot < needSlot) {
    error = strCat("HETCOMM_SHM_BYTES=", maxSegmentBytes, " leaves no room for slots of at least ", needSlot,
                   " bytes for the ", L, " ranks of this host (with HETCOMM_SHM_SLOT_BYTES=", slotBytes, ")");
  }
  const size_t bytes = ShmChannel::segmentBytes(L, slot, kDepth);
  std::unique_ptr<ShmChannel> channel;
  UnlinkGuard unlinkAtExit(incarnation_);
  auto key = [&](const char* what) { return shmKey(incarnation_, leader, what); };
  // One of the leader's records, polled until one opens (sealed with an out-of-band secret) or the
  // set-up's deadline. A forged one is ignored and, should no authentic one come, fails the group
  // rather than falling back: a store writer must not quietly push a host onto TCP.
  auto leaderRecord = [&](const char* what) {
    bool forged = false;
    while (true) {
      std::vector<uint8_t> v;
      const SealedStore::Read read = store_->tryGet(key(what), v);
      if (read == SealedStore::Read::kValue) return std::string(v.begin(), v.end());
      forged = forged || read == SealedStore::Read::kForged;
      if (Clock::now() >= deadline) {
        throw TimeoutError(strCat("no ", forged ? "authentic " : "", "record '", what, "' of the host's first rank ",
                                  leader, " within ", options_.timeout.count(), " ms",
                                  forged ? " (the one in the store fails its MAC)" : ""));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  // Each other rank of the host says in the store that it has tried to open the segment: one key
  // each, set and read, never a counter (the store closes the connection of a client that adds to a
  // value a store writer filled with garbage). A key counts only when it opens (sealed with an
  // out-of-band secret): a forged one could make a rank unlink the name before a slow one opened it.
  std::vector<std::string> doneKeys;
  for (int i = 1; i < L; ++i) doneKeys.push_back(shmKey(incarnation_, leader, strCat("done/", i).c_str()));
  auto saidDone = [&](int l) {
    std::vector<uint8_t> v;
    return store_->tryGet(doneKeys[l - 1], v) == SealedStore::Read::kValue;
  };
  // Whether every other rank of the host is past opening the segment: one that mapped it says so
  // in the segment itself (where no store writer reaches), one that could not in the store (asked
  // only when `askStore`: polled every millisecond, the segment costs nothing, the store a round
  // trip per rank).
  auto settled = [&](bool askStore) {
    for (int l = 1; l < L; ++l) {
      if (!(channel && channel->attached(l)) && !(askStore && saidDone(l))) return false;
    }
    return true;
  };
  try {
    if (me == 0) {
      const std::string name = error.empty() ? randomSegmentName(incarnation_) : "";
      // The name first, so that the others can remove it should this rank die before it does.
      store_->set(key("name"), std::vector<uint8_t>(name.begin(), name.end()));
      unlinkAtExit.arm(name);
      std::string made;
      if (error.empty()) {
        try {
          channel = std::make_unique<ShmChannel>(ShmSegment::create(name, bytes), 0, L, slot, kDepth, true);
          maybeDieAfterCreate("1");
        } catch (const CommError& e) {
          error = e.what();
        }
      }
      if (!error.empty()) made = "!" + error;
      store_->set(key("made"), std::vector<uint8_t>(made.begin(), made.end()));
      maybeDieAfterCreate("made");
      // Unlink once everyone has tried to open it, so that nothing outlives the ranks. Meanwhile the
      // two records stay as written (with an out-of-band secret, the others ignore forged ones and
      // wait for these).
      StoreRecords records;
      for (const auto& [what, value] : {std::pair<const char*, const std::string&>{"name", name}, {"made", made}}) {
        records.emplace_back(key(what), store_->sealed(key(what), std::vector<uint8_t>(value.begin(), value.end())));
      }
      for (int i = 1; !settled(i % 10 == 0) && Clock::now() < deadline; ++i) {
        if (store_->sealing() && i % 20 == 0) {
          for (const auto& [k, raw] : records) putBack(*store_->inner(), k, raw);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      unlinkAtExit.unlinkNow();
      if (Clock::now() >= deadline && error.empty()) {
        error = strCat("the other ranks of this host did not open the shared memory segment within ",
                       options_.timeout.count(), " ms");
      }
      for (const char* what : {"name", "made"}) store_->deleteKey(key(what));
      for (const std::string& done : doneKeys) store_->deleteKey(done);
    } else {
      const std::string name = leaderRecord("name");
      unlinkAtExit.arm(name);  // the creator may die before it says whether it made the segment
      const std::string made = leaderRecord("made");
      maybeDieBeforeOpen(rank_);
      // The creator is there: from now on only the last rank to open the segment unlinks it, so a
      // rank that fails here does not take the name from the others still opening it.
      unlinkAtExit.arm("");
      if (!made.empty()) {
        error = strCat("rank ", leader, " could not create it: ", excerpt(made.substr(made[0] == '!' ? 1 : 0), kMaxReasonBytes));
      } else if (!isSegmentName(name, incarnation_)) {
        error = strCat("the store names no segment of this group (", name.size(), " bytes)");
      } else if (error.empty()) {
        try {
          channel = std::make_unique<ShmChannel>(ShmSegment::open(name, bytes), me, L, slot, kDepth, false);
        } catch (const CommError& e) {
          error = e.what();
        }
      }
      // Mapped: the segment says so (no store key to leak). Not mapped: say so in the store.
      if (!channel) store_->set(doneKeys[me - 1], std::vector<uint8_t>{1});
      if (settled(true)) {
        unlinkAtExit.arm(name);  // the last to open it (or one of the last)
      } else if (channel) {
        // Not the last: the creator removes the name once the others have opened it. Should it die
        // first, and another rank of the host with it before it opened the segment, nobody would:
        // this rank removes the name when its group goes (or at its exit). A failure later in
        // this rank's set-up removes it too, before slower ranks open it: the group fails anyway.
        channel->removeNameWhenClosed(name);
      }
    }
  } catch (const std::exception& e) {
    // The store failed: that is not a reason to fall back, it is a broken group.
    TORCH_CHECK(false, "hetcomm: rank ", rank_, " could not set up shared memory with its host: ", e.what());
  }
  if (!error.empty()) return error;

  auto group = newLocalGroup(ranks, deadline);
  group->channel = std::move(channel);
  group->host = std::make_shared<ShmInnerLevel>();
  std::lock_guard<std::mutex> lock(mu_);
  pendingLocal_ = std::move(group);
  HC_LOG(kInfo, "rank ", rank_, ": shared memory with the ", L, " ranks of its host (", slot, "-byte slots, ", bytes,
         " bytes)");
  return "";
}

std::shared_ptr<LocalGroup> ProcessGroupHetcomm::newLocalGroup(const std::vector<int>& ranks, Deadline deadline) {
  const int L = static_cast<int>(ranks.size());
  // The connections that tell whether a local peer is alive (see the top of this file).
  auto links = std::make_shared<std::vector<Link*>>(L, nullptr);  // owned by the mesh
  try {
    for (int l = 0; l < L; ++l) {
      if (ranks[l] != rank_) (*links)[l] = &mesh_->collectiveLink(ranks[l], deadline);
    }
  } catch (const CommError& e) {
    TORCH_CHECK(false, "hetcomm: rank ", rank_, " could not connect to the ranks of its host: ", e.what());
  }
  auto group = std::make_shared<LocalGroup>();
  group->ranks = ranks;
  group->me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  group->peerAlive = [links](int l) { return (*links)[l] == nullptr || !(*links)[l]->hungUp(); };
  return group;
}

void ProcessGroupHetcomm::attachInner(const std::vector<int64_t>& hostOf,
                                      const c10::intrusive_ptr<c10d::Backend>& backend, const std::string& name,
                                      bool forDevice) {
  TORCH_CHECK_VALUE(static_cast<int>(hostOf.size()) == size_, "hetcomm: ", hostOf.size(), " host labels for a group of ",
                    size_);
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r) {
    if (hostOf[r] == hostOf[rank_]) ranks.push_back(r);
  }
  TORCH_CHECK_VALUE(backend && backend->getSize() == static_cast<int>(ranks.size()),
                    "hetcomm: the ", name, " inner level must span the ", ranks.size(), " ranks of this host");
  auto level = std::make_shared<TorchInnerLevel>(backend, name);
  std::shared_ptr<LocalGroup> group;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(local_ == nullptr, "hetcomm: this group's hosts already have their inner level");
    group = pendingLocal_;
  }
  if (group == nullptr) {
    TORCH_CHECK(!forDevice, "hetcomm: a device level needs the host level attached first");
    group = newLocalGroup(ranks, Clock::now() + options_.timeout);
  }
  TORCH_CHECK(group->ranks == ranks, "hetcomm: the inner levels of this host disagree about its ranks");
  (forDevice ? group->device : group->host) = std::move(level);
  std::lock_guard<std::mutex> lock(mu_);
  pendingLocal_ = std::move(group);
  HC_LOG(kInfo, "rank ", rank_, ": ", name, " is the inner level of its host (", ranks.size(), " ranks) for ",
         forDevice ? "CUDA tensors" : "host memory");
}

void ProcessGroupHetcomm::enableLocal(bool use) {
  std::vector<int> sharing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (use) local_ = std::move(pendingLocal_);
    pendingLocal_.reset();
    if (use && local_) sharing = local_->ranks;
  }
  // Point-to-point links between ranks of this host go through shared memory from now on.
  if (!sharing.empty()) p2p_->setSharedMemoryPeers(sharing);
}

void ProcessGroupHetcomm::detachLocal() {
  std::lock_guard<std::mutex> lock(mu_);
  local_.reset();
  pendingLocal_.reset();
}

std::vector<int> ProcessGroupHetcomm::localRanks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return local_ ? local_->ranks : std::vector<int>{};
}

std::vector<std::string> ProcessGroupHetcomm::innerLevels() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  if (local_ && local_->host) out.push_back(local_->host->name());
  if (local_ && local_->device) out.push_back(local_->device->name());
  return out;
}

}  // namespace hetcomm
