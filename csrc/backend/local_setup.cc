// Shared memory among the ranks of one host (ProcessGroupHetcomm::attachLocal / detachLocal).
//
// The host's first rank (lowest group rank) creates the segment under a name nobody else can
// guess or collide with (a random 64-bit tag: two groups, and two jobs on one machine, never
// meet; the name carries the group's incarnation too). It publishes the name in the group's store
// *before* creating the segment, and then whether it made it; the keys carry the group's
// incarnation (from its fresh secret), so a name an earlier group under the same prefix left
// behind is never read. The name is unlinked as soon as every rank of the host has tried to open
// it, so that from then on only the mappings hold the memory: by the creator, and by the last
// rank to open it (the creator may have died in between). A rank that gives up waiting for the
// creator to say whether it made the segment unlinks the name too: a creator killed between
// creating and unlinking leaves nothing in /dev/shm once the others give up (at the group's
// timeout; a launcher that kills them all first leaves the segment, as any process killed while
// holding a name would).
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
void maybeDieAfterCreate() {
  if (envInt("HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE", 0) != 0) {
    HC_LOG(kError, "HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE is set: this rank kills itself (a test hook)");
    ::raise(SIGKILL);
  }
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
  // What is left of the set-up's time (every wait shares one deadline).
  auto remaining = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  auto key = [&](const char* what) { return shmKey(incarnation_, leader, what); };
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
          maybeDieAfterCreate();
        } catch (const CommError& e) {
          error = e.what();
        }
      }
      if (!error.empty()) made = "!" + error;
      store_->set(key("made"), std::vector<uint8_t>(made.begin(), made.end()));
      store_->add(key("done"), 1);
      // Unlink once everyone has tried to open it, so that nothing outlives the ranks.
      while (store_->add(key("done"), 0) < L && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      unlinkAtExit.unlinkNow();
      if (Clock::now() >= deadline && error.empty()) {
        error = strCat("the other ranks of this host did not open the shared memory segment within ",
                       options_.timeout.count(), " ms");
      }
      for (const char* what : {"name", "made", "done"}) store_->deleteKey(key(what));
    } else {
      store_->wait({key("name")}, remaining());
      const std::vector<uint8_t> n = store_->get(key("name"));
      const std::string name(n.begin(), n.end());
      unlinkAtExit.arm(name);  // the creator may die before it says whether it made the segment
      store_->wait({key("made")}, remaining());
      const std::vector<uint8_t> v = store_->get(key("made"));
      const std::string made(v.begin(), v.end());
      // The creator is there: from now on only the last rank to open the segment unlinks it, so a
      // rank that fails here does not take the name from the others still opening it.
      unlinkAtExit.arm("");
      if (!made.empty()) {
        error = strCat("rank ", leader, " could not create it: ", made.substr(made[0] == '!' ? 1 : 0));
      } else if (!isSegmentName(name, incarnation_)) {
        error = strCat("the store names no segment of this group (", name.size(), " bytes)");
      } else if (error.empty()) {
        try {
          channel = std::make_unique<ShmChannel>(ShmSegment::open(name, bytes), me, L, slot, kDepth, false);
        } catch (const CommError& e) {
          error = e.what();
        }
      }
      if (store_->add(key("done"), 1) >= L) unlinkAtExit.arm(name);  // the last to open it
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
  std::lock_guard<std::mutex> lock(mu_);
  if (use) local_ = std::move(pendingLocal_);
  pendingLocal_.reset();
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
