#include "transport/shm/channel.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <thread>

#include "common/env.h"

namespace hetcomm {

namespace {

constexpr uint64_t kMagic = 0x68657463'6f6d6d31ull;  // "hetcomm1"
constexpr uint32_t kVersion = 3;  // 2: rank words carry `attached`; 3: and `issued`
constexpr auto kMaxSleep = std::chrono::milliseconds(50);
constexpr auto kLivenessEvery = std::chrono::milliseconds(100);

size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Shared (not FUTEX_PRIVATE): the waiters are other processes.
void futexWait(uint32_t* addr, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  ::syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);  // EAGAIN/EINTR/ETIMEDOUT: recheck
}

void futexWakeAll(uint32_t* addr) { ::syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

// Spin and yield budgets of a waiter before it sleeps (see channel.h).
HETCOMM_PARAM(paramShmSpinUs, "HETCOMM_SHM_SPIN_US", 2)
HETCOMM_PARAM(paramShmYieldUs, "HETCOMM_SHM_YIELD_US", 50)

struct ShmChannel::Control {
  uint64_t magic;
  uint32_t version;
  uint32_t localSize;
  uint64_t slotBytes;
  uint32_t depth;
  uint32_t abortedBy;  // 0: nobody; else local rank + 1
};

struct alignas(128) ShmChannel::RankWord {
  uint32_t progress;
  uint32_t waiters;
  uint32_t attached;  // 1 once this rank has mapped the segment and checked its layout
  uint32_t issued;    // the last operation this rank issued, as announce() was given it
};

size_t ShmChannel::segmentBytes(int localSize, size_t slotBytes, int depth) {
  size_t at = alignUp(sizeof(Control), 128);
  at += sizeof(RankWord) * static_cast<size_t>(localSize);
  at += kHeaderBytes * static_cast<size_t>(localSize) * static_cast<size_t>(depth);
  at = alignUp(at, 4096);
  return at + slotBytes * static_cast<size_t>(localSize) * static_cast<size_t>(depth);
}

ShmChannel::ShmChannel(ShmSegment segment, int localRank, int localSize, size_t slotBytes, int depth, bool create)
    : segment_(std::move(segment)), localRank_(localRank), localSize_(localSize), slotBytes_(slotBytes), depth_(depth) {
  HC_ENFORCE(localSize >= 1 && localRank >= 0 && localRank < localSize && depth >= 1);
  HC_ENFORCE(slotBytes % kAlignBytes == 0, "slot size must be a multiple of ", kAlignBytes);
  HC_ENFORCE(segment_.size() == segmentBytes(localSize, slotBytes, depth), "segment size does not match the layout");
  headersOffset_ = alignUp(sizeof(Control), 128) + sizeof(RankWord) * static_cast<size_t>(localSize);
  slotsOffset_ = alignUp(headersOffset_ + kHeaderBytes * static_cast<size_t>(localSize) * depth, 4096);
  Control* c = control();
  if (create) {
    // ftruncate zeroed the memory: progress, waiters and the abort word start at 0.
    c->version = kVersion;
    c->localSize = static_cast<uint32_t>(localSize);
    c->slotBytes = slotBytes;
    c->depth = static_cast<uint32_t>(depth);
    __atomic_store_n(&c->magic, kMagic, __ATOMIC_RELEASE);
  } else if (__atomic_load_n(&c->magic, __ATOMIC_ACQUIRE) != kMagic || c->version != kVersion ||
             c->localSize != static_cast<uint32_t>(localSize) || c->slotBytes != slotBytes ||
             c->depth != static_cast<uint32_t>(depth)) {
    throw ShmUnavailableError(strCat("hetcomm: the shared memory segment of this host describes another layout (",
                                     c->localSize, " ranks, ", c->slotBytes, "-byte slots, depth ", c->depth,
                                     ") than this rank expects (", localSize, ", ", slotBytes, ", ", depth,
                                     "): do the ranks of this host run different hetcomm versions or settings?"));
  } else {
    __atomic_store_n(&word(localRank)->attached, 1u, __ATOMIC_RELEASE);
  }
}

bool ShmChannel::attached(int l) const {
  return l >= 0 && l < localSize_ && __atomic_load_n(&word(l)->attached, __ATOMIC_ACQUIRE) != 0;
}

ShmChannel::Control* ShmChannel::control() const { return reinterpret_cast<Control*>(segment_.data()); }

ShmChannel::RankWord* ShmChannel::word(int l) const {
  return reinterpret_cast<RankWord*>(segment_.data() + alignUp(sizeof(Control), 128)) + l;
}

char* ShmChannel::slot(int l, uint64_t g) const {
  const size_t index = static_cast<size_t>(l) * depth_ + static_cast<size_t>(g % depth_);
  return segment_.data() + slotsOffset_ + index * slotBytes_;
}

uint8_t* ShmChannel::header(int l, uint64_t g) const {
  const size_t index = static_cast<size_t>(g % depth_) * localSize_ + static_cast<size_t>(l);
  return reinterpret_cast<uint8_t*>(segment_.data() + headersOffset_ + index * kHeaderBytes);
}

uint32_t ShmChannel::progress(int l) const { return __atomic_load_n(&word(l)->progress, __ATOMIC_ACQUIRE); }

void ShmChannel::announce(uint32_t op) { __atomic_store_n(&word(localRank_)->issued, op, __ATOMIC_RELEASE); }

bool ShmChannel::othersIssued(uint32_t op, std::chrono::microseconds within) const {
  auto all = [&] {
    for (int l = 0; l < localSize_; ++l) {
      if (l != localRank_ && !reached(__atomic_load_n(&word(l)->issued, __ATOMIC_ACQUIRE), op)) return false;
    }
    return true;
  };
  if (all()) return true;
  // Spin, then yield (as waitFor does: ranks may outnumber cores), until `within` has passed.
  const auto start = Clock::now();
  const auto spinUntil = start + std::min<std::chrono::microseconds>(within, std::chrono::microseconds(paramShmSpinUs()));
  const auto until = start + within;
  for (int i = 0;; ++i) {
    if (all()) return true;
    if ((i & 63) == 0) {
      const auto now = Clock::now();
      if (now >= until || aborted()) return false;
      if (now >= spinUntil) sched_yield();
    }
    cpuRelax();
  }
}

void ShmChannel::publish(uint32_t value) {
  RankWord* w = word(localRank_);
  __atomic_store_n(&w->progress, value, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&w->waiters, __ATOMIC_SEQ_CST) != 0) futexWakeAll(&w->progress);
}

ShmChannel::Wait ShmChannel::waitFor(int peer, uint32_t target, Deadline deadline,
                                     const std::function<bool(int)>& peerAlive) {
  RankWord* w = word(peer);
  auto done = [&] { return reached(__atomic_load_n(&w->progress, __ATOMIC_ACQUIRE), target); };
  if (done()) return Wait::kReached;
  // Spin, then yield, then sleep.
  const auto start = Clock::now();
  const auto spinUntil = start + std::chrono::microseconds(paramShmSpinUs());
  const auto yieldUntil = spinUntil + std::chrono::microseconds(paramShmYieldUs());
  for (int i = 0;; ++i) {
    if (done()) return Wait::kReached;
    if ((i & 63) == 0) {
      const auto now = Clock::now();
      if (now >= yieldUntil) break;
      if (aborted()) return Wait::kAborted;
      if (now >= spinUntil) sched_yield();
    }
    cpuRelax();
  }
  auto nextLivenessCheck = start + kLivenessEvery;
  while (true) {
    if (aborted()) return Wait::kAborted;
    const auto now = Clock::now();
    if (now >= deadline) return Wait::kTimedOut;
    if (peerAlive && now >= nextLivenessCheck) {
      if (!peerAlive(peer)) return done() ? Wait::kReached : Wait::kPeerGone;
      nextLivenessCheck = now + kLivenessEvery;
    }
    __atomic_fetch_add(&w->waiters, 1, __ATOMIC_SEQ_CST);
    const uint32_t seen = __atomic_load_n(&w->progress, __ATOMIC_SEQ_CST);
    if (!reached(seen, target) && !aborted()) {
      const auto sleep = std::min<std::chrono::nanoseconds>(kMaxSleep, deadline - now);
      futexWait(&w->progress, seen, sleep);
    }
    __atomic_fetch_sub(&w->waiters, 1, __ATOMIC_SEQ_CST);
    if (done()) return Wait::kReached;
  }
}

void ShmChannel::abort(int by) {
  uint32_t expected = 0;
  __atomic_compare_exchange_n(&control()->abortedBy, &expected, static_cast<uint32_t>(by + 1), false,
                              __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  // Sleepers wait on the rank words' progress: wake them all so that they read the abort word.
  for (int l = 0; l < localSize_; ++l) futexWakeAll(&word(l)->progress);
}

bool ShmChannel::aborted() const { return __atomic_load_n(&control()->abortedBy, __ATOMIC_ACQUIRE) != 0; }

int ShmChannel::abortedBy() const {
  // Every rank of the host can write this word: anything but a local rank + 1 (a bug, or a segment
  // someone else wrote into) still means aborted, but by no rank it can name.
  const uint32_t v = __atomic_load_n(&control()->abortedBy, __ATOMIC_ACQUIRE);
  return v >= 1 && v <= static_cast<uint32_t>(localSize_) ? static_cast<int>(v) - 1 : -1;
}

}  // namespace hetcomm
