#include "transport/shm/ring_link.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common/logging.h"
#include "transport/group_secret.h"  // freshNonce
#include "transport/shm/segment.h"

namespace hetcomm {
namespace {

constexpr size_t kControlBytes = 4096;  // the ring's indices and flags, each on a cache line of its own
constexpr size_t kMinRingBytes = 64 << 10;
constexpr size_t kMaxRingBytes = size_t{1} << 30;
constexpr size_t kMaxBellBytes = 4096;
constexpr const char* kNamePrefix = "hetcomm-p2p-";
constexpr int kRandomBits = 40;  // of a ring's id; the creator's pid above them
constexpr char kYes = 'Y';
constexpr char kNo = 'N';

// The control page. Indices count bytes since the start and never wrap (2^64 bytes).
struct Control {
  alignas(64) std::atomic<uint64_t> tail;          // written by the sender: bytes put in
  alignas(64) std::atomic<uint64_t> head;          // written by the receiver: bytes taken out
  alignas(64) std::atomic<uint32_t> readerWaits;   // the receiver found the ring empty and sleeps
  alignas(64) std::atomic<uint32_t> writerWaits;   // the sender found it full and sleeps
  alignas(64) std::atomic<uint32_t> closed;        // either end shut its side down or went away cleanly
};
static_assert(sizeof(Control) <= kControlBytes, "the control block fits its page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");

void put16(uint8_t* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// One end of the ring. The sender end only sends, the receiver end only receives.
class RingLink final : public Link {
 public:
  RingLink(std::unique_ptr<Link> tcp, ShmSegment segment, size_t ringBytes, bool sender)
      : tcp_(std::move(tcp)),
        segment_(std::move(segment)),
        ctl_(reinterpret_cast<Control*>(segment_.data())),
        data_(segment_.data() + kControlBytes),
        cap_(ringBytes),
        sender_(sender) {}
  ~RingLink() override { ctl_->closed.store(1, std::memory_order_release); }

  Kind kind() const override { return Kind::kShm; }
  int pollFd() const override { return tcp_->pollFd(); }
  // Both ends sleep on the doorbell: bytes arriving on the TCP socket.
  short pollEvents(bool send, bool recv) const override { return (send || recv) ? POLLIN : 0; }
  bool receivable() const override {
    return !sender_ && ctl_->tail.load(std::memory_order_acquire) != ctl_->head.load(std::memory_order_relaxed);
  }
  bool sendable() const override {
    return sender_ && ctl_->tail.load(std::memory_order_relaxed) - ctl_->head.load(std::memory_order_acquire) < cap_;
  }
  void shutdown() override {
    ctl_->closed.store(1, std::memory_order_release);
    tcp_->shutdown();
  }

  ssize_t send(const void* data, size_t len) override {
    if (!sender_) return fail(EBADF);
    if (len == 0) return 0;
    // A receiver that closed the link takes nothing more (one that died: the doorbell, below).
    if (ctl_->closed.load(std::memory_order_acquire) != 0) return fail(EPIPE);
    // The doorbell also carries the news of a receiver that died: look at every send, so that
    // messages to a dead rank fail instead of filling the ring.
    const int gone = drainBells();
    if (gone != 0) return fail(gone);
    const uint64_t tail = mine_;
    if (ctl_->tail.load(std::memory_order_relaxed) != tail) return fail(EPROTO);  // someone else wrote our index
    uint64_t head = ctl_->head.load(std::memory_order_acquire);
    if (!sane(head, tail)) return fail(EPROTO);
    if (tail - head == cap_) {
      // Full: raise the flag, look once more.
      ctl_->writerWaits.store(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      head = ctl_->head.load(std::memory_order_acquire);
      if (!sane(head, tail)) return fail(EPROTO);
      if (tail - head == cap_) return fail(EAGAIN);
      ctl_->writerWaits.store(0, std::memory_order_relaxed);
    }
    const size_t n = std::min<uint64_t>(len, cap_ - (tail - head));
    copyIn(tail, static_cast<const char*>(data), n);
    mine_ = tail + n;
    ctl_->tail.store(mine_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (ctl_->readerWaits.load(std::memory_order_relaxed) != 0 && ctl_->readerWaits.exchange(0) != 0) ring();
    return static_cast<ssize_t>(n);
  }

  ssize_t recv(void* data, size_t len) override {
    if (sender_) return fail(EBADF);
    if (len == 0) return 0;
    const uint64_t head = mine_;
    if (ctl_->head.load(std::memory_order_relaxed) != head) return fail(EPROTO);  // someone else wrote our index
    uint64_t tail = ctl_->tail.load(std::memory_order_acquire);
    if (!sane(head, tail)) return fail(EPROTO);
    if (tail == head) {
      // Empty: drain the doorbell; a closed peer with nothing left in the ring is the end.
      const int gone = drainBells();
      tail = ctl_->tail.load(std::memory_order_acquire);
      if (!sane(head, tail)) return fail(EPROTO);
      if (tail == head) {
        if (gone == EPIPE || ctl_->closed.load(std::memory_order_acquire) != 0) return 0;
        if (gone != 0) return fail(gone);
        ctl_->readerWaits.store(1, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        tail = ctl_->tail.load(std::memory_order_acquire);
        if (!sane(head, tail)) return fail(EPROTO);
        if (tail == head) return fail(EAGAIN);
        ctl_->readerWaits.store(0, std::memory_order_relaxed);
      }
    }
    const size_t n = std::min<uint64_t>(len, tail - head);
    copyOut(head, static_cast<char*>(data), n);
    mine_ = head + n;
    ctl_->head.store(mine_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (ctl_->writerWaits.load(std::memory_order_relaxed) != 0 && ctl_->writerWaits.exchange(0) != 0) ring();
    return static_cast<ssize_t>(n);
  }

 private:
  static ssize_t fail(int err) {
    errno = err;
    return -1;
  }
  // The peer writes these indices: never trust more bytes in the ring than it holds.
  bool sane(uint64_t head, uint64_t tail) const { return tail - head <= cap_ && tail >= head; }

  void copyIn(uint64_t at, const char* src, size_t n) {
    const size_t off = static_cast<size_t>(at % cap_);
    const size_t first = std::min(n, cap_ - off);
    std::memcpy(data_ + off, src, first);
    if (n > first) std::memcpy(data_, src + first, n - first);
  }
  void copyOut(uint64_t at, char* dst, size_t n) const {
    const size_t off = static_cast<size_t>(at % cap_);
    const size_t first = std::min(n, cap_ - off);
    std::memcpy(dst, data_ + off, first);
    if (n > first) std::memcpy(dst + first, data_, n - first);
  }

  // Reads the doorbell bytes waiting on the TCP link, at most kMaxBellBytes of them a call (bells
  // are only hints: a peer that floods them costs wake-ups, never a thread stuck here). 0, or
  // EPIPE when the peer closed the link, or the link's error.
  int drainBells() {
    char buf[256];
    for (size_t read = 0; read < kMaxBellBytes;) {
      const ssize_t n = tcp_->recv(buf, sizeof(buf));
      if (n > 0) {
        read += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) return EPIPE;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      if (errno == EINTR) continue;
      return errno;
    }
    return 0;
  }

  // One doorbell byte. A full socket (EAGAIN) already holds bells the peer has not read; a failed
  // link shows at the next drain.
  void ring() {
    const char bell = 1;
    while (tcp_->send(&bell, 1) < 0 && errno == EINTR) {
    }
  }

  std::unique_ptr<Link> tcp_;
  ShmSegment segment_;
  Control* ctl_;
  char* data_;
  const size_t cap_;
  const bool sender_;
  uint64_t mine_ = 0;  // this end's own index (tail of a sender, head of a receiver): the shared copy must match
};

// A link that stays on TCP is slower, not wrong: said once per process as a warning (a /dev/shm
// too small for every pair's ring is the likely cause), then at info level.
void fellBack(const std::string& why) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    HC_LOG(kWarn, "a point-to-point link between ranks of one host stays on loopback TCP: ", why,
           " (each such link reserves HETCOMM_P2P_SHM_BYTES of /dev/shm; this warning is given once)");
  } else {
    HC_LOG(kInfo, "a point-to-point link stays on loopback TCP: ", why);
  }
}

void waitAnswer(Link& tcp, char& answer, Deadline deadline, const Cancelled& cancelled) {
  recvAll(tcp, &answer, 1, deadline, [] { return std::string("waiting for the answer to a shared-memory offer"); },
          cancelled);
}

}  // namespace

std::array<uint8_t, ShmOffer::kBytes> ShmOffer::encode() const {
  std::array<uint8_t, kBytes> out{};
  put32(out.data(), kMagic);
  put16(out.data() + 4, kVersion);
  put64(out.data() + 8, ringBytes);
  put64(out.data() + 16, id);
  return out;
}

bool ShmOffer::looksLikeOffer(const uint8_t* bytes) { return get(bytes, 4) == kMagic; }

std::string ShmOffer::decode(const uint8_t* bytes, ShmOffer& out) {
  if (get(bytes, 4) != kMagic) return "not a shared-memory offer";
  const uint64_t version = get(bytes + 4, 2);
  if (version != kVersion) return strCat("shared-memory offer of version ", version, ", this build speaks ", kVersion);
  if (get(bytes + 6, 2) != 0) return "a shared-memory offer with reserved bits set";
  out.ringBytes = get(bytes + 8, 8);
  out.id = get(bytes + 16, 8);
  if (out.ringBytes < kMinRingBytes || out.ringBytes > kMaxRingBytes || out.ringBytes % 4096 != 0) {
    return strCat("a shared-memory offer of a ", out.ringBytes, "-byte ring");
  }
  return "";
}

std::string ringSegmentName(uint64_t id) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/%s%llu-%010llx", kNamePrefix, static_cast<unsigned long long>(id >> kRandomBits),
                static_cast<unsigned long long>(id & ((uint64_t{1} << kRandomBits) - 1)));
  return buf;
}

size_t ringBytesSetting() {
  const char* v = std::getenv("HETCOMM_P2P_SHM_BYTES");
  if (v == nullptr || *v == '\0') return 4 << 20;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(v, &end, 10);
  const bool inRange = parsed == 0 || (parsed >= static_cast<long long>(kMinRingBytes) &&
                                       parsed <= static_cast<long long>(kMaxRingBytes) && parsed % 4096 == 0);
  if (end == v || *end != '\0' || errno != 0 || !inRange) {
    throw CommError(strCat("hetcomm: HETCOMM_P2P_SHM_BYTES=", v, " is not a ring size: a byte count from ", kMinRingBytes,
                           " to ", kMaxRingBytes, ", a multiple of 4096 (0 turns the shared-memory point-to-point "
                           "links off)"));
  }
  return static_cast<size_t>(parsed);
}

void removeStaleRings() {
  // A ring's name lives from its offer to its answer. When the whole job was killed in between,
  // the name stays: remove those of this user whose creator no longer runs.
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const size_t prefix = std::strlen(kNamePrefix);
  while (const dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, kNamePrefix, prefix) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(e->d_name + prefix, &end, 10);
    if (end == e->d_name + prefix || *end != '-' || pid <= 0 || pid == static_cast<long>(::getpid())) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    struct stat st {};
    const std::string path = strCat("/dev/shm/", e->d_name);
    if (::stat(path.c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    ShmSegment::unlink(strCat("/", e->d_name));
  }
  ::closedir(dir);
}

std::unique_ptr<Link> offerRing(std::unique_ptr<Link> tcp, size_t ringBytes, Deadline deadline,
                                const Cancelled& cancelled) {
  if (ringBytes == 0 || tcp->kind() != Link::Kind::kTcp) return tcp;
  ShmOffer offer;
  offer.ringBytes = ringBytes;
  const Nonce nonce = freshNonce();
  uint64_t random = 0;
  std::memcpy(&random, nonce.data(), sizeof(random));
  // The creator's pid in the name, so that a name left by a killed job can be told stale.
  offer.id = (static_cast<uint64_t>(::getpid()) << kRandomBits) | (random & ((uint64_t{1} << kRandomBits) - 1));
  const std::string name = ringSegmentName(offer.id);
  ShmSegment segment;
  try {
    segment = ShmSegment::create(name, kControlBytes + ringBytes);
  } catch (const ShmUnavailableError& e) {
    fellBack(e.what());
    return tcp;
  }
  new (segment.data()) Control{};
  const auto frame = offer.encode();
  char answer = 0;
  try {
    sendAll(*tcp, frame.data(), frame.size(), deadline, [] { return std::string("offering a shared-memory ring"); },
            cancelled);
    waitAnswer(*tcp, answer, deadline, cancelled);
  } catch (...) {
    ShmSegment::unlink(name);
    throw;
  }
  ShmSegment::unlink(name);  // the receiver did already when it opened it; either way, gone now
  if (answer == kYes) return std::make_unique<RingLink>(std::move(tcp), std::move(segment), ringBytes, true);
  if (answer != kNo) throw CommError(strCat("hetcomm: garbage in answer to a shared-memory offer (byte ", int(answer), ")"));
  fellBack("the receiver could not open the shared-memory ring");
  return tcp;
}

namespace {
void answer(Link& tcp, char a) {
  // The first bytes this side ever writes on a fresh connection: the socket takes them at once.
  const ssize_t n = tcp.send(&a, 1);
  if (n != 1) {
    throw CommError(strCat("hetcomm: cannot answer a shared-memory offer: ", n < 0 ? std::strerror(errno) : "nothing taken"));
  }
}
}  // namespace

std::unique_ptr<Link> acceptRing(std::unique_ptr<Link> tcp, const ShmOffer& offer) {
  const std::string name = ringSegmentName(offer.id);
  ShmSegment segment;
  try {
    segment = ShmSegment::open(name, kControlBytes + offer.ringBytes);
  } catch (const ShmUnavailableError& e) {
    fellBack(e.what());
    answer(*tcp, kNo);
    return tcp;
  }
  ShmSegment::unlink(name);
  answer(*tcp, kYes);
  return std::make_unique<RingLink>(std::move(tcp), std::move(segment), offer.ringBytes, false);
}

void refuseRing(Link& tcp) { answer(tcp, kNo); }

}  // namespace hetcomm
