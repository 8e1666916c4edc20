#include "transport/link.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "transport/tls.h"

#ifndef SO_MAX_PACING_RATE
#define SO_MAX_PACING_RATE 47  // Linux asm-generic/socket.h
#endif

namespace hetcomm {
namespace {

class TcpLink final : public Link {
 public:
  explicit TcpLink(Socket socket) : socket_(std::move(socket)) {}
  Kind kind() const override { return Kind::kTcp; }
  ssize_t send(const void* data, size_t len) override { return ::send(socket_.fd(), data, len, MSG_NOSIGNAL); }
  ssize_t recv(void* data, size_t len) override { return ::recv(socket_.fd(), data, len, 0); }
  void shutdown() override { socket_.shutdownBoth(); }
  int pollFd() const override { return socket_.fd(); }

 private:
  Socket socket_;
};

class TlsLink final : public Link {
 public:
  TlsLink(Socket socket, std::unique_ptr<tls::Session> session) : socket_(std::move(socket)), session_(std::move(session)) {
    HC_ENFORCE(session_ != nullptr && session_->fd() == socket_.fd(), "a TLS link needs the session of its own socket");
  }
  Kind kind() const override { return Kind::kTls; }
  const tls::Session* tlsSession() const override { return session_.get(); }
  ssize_t send(const void* data, size_t len) override { return session_->write(data, len); }
  ssize_t recv(void* data, size_t len) override { return session_->read(data, len); }
  void shutdown() override { socket_.shutdownBoth(); }
  int pollFd() const override { return socket_.fd(); }
  bool receivable() const override { return session_->pending(); }

 private:
  // Destroyed in reverse order: the session first, which must never outlive the descriptor it uses.
  Socket socket_;
  std::unique_ptr<tls::Session> session_;
};

timespec toTimespec(std::chrono::nanoseconds t) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(t.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(t.count() % 1000000000);
  return ts;
}

// Waits until the link can move `events` (POLLIN or POLLOUT); throws on the deadline, cancellation
// or a failed wait.
void waitOne(Link& link, bool send, Deadline deadline, const std::function<std::string()>& what,
             const Cancelled& cancelled) {
  while (true) {
    if (cancelled && cancelled()) throw CancelledError(strCat("hetcomm: gave up ", what(), ": the process group is shutting down"));
    const int left = msUntil(deadline);
    LinkWait w{&link, send, !send};
    const int rc = waitLinks(&w, 1, std::chrono::milliseconds(cancelled ? std::min(left, kCancelPollMs) : left));
    if (rc > 0) return;
    if (rc < 0 && errno != EINTR) throw CommError(strCat("hetcomm: poll failed ", what(), ": ", std::strerror(errno)));
    if (rc == 0 && Clock::now() >= deadline) throw TimeoutError(strCat("hetcomm: timed out ", what()));
  }
}

}  // namespace

std::unique_ptr<Link> tcpLink(Socket socket) { return std::make_unique<TcpLink>(std::move(socket)); }

std::unique_ptr<Link> tlsLink(Socket socket, std::unique_ptr<tls::Session> session) {
  return std::make_unique<TlsLink>(std::move(socket), std::move(session));
}

short Link::pollEvents(bool send, bool recv) const {
  return static_cast<short>((send ? POLLOUT : 0) | (recv ? POLLIN : 0));
}

bool Link::hungUp() const {
  const int fd = pollFd();
  pollfd p{fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    // Readable: data, or the end of the stream (a TLS record is bytes like any other here).
    char c;
    if (::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return true;
  }
  return false;
}

bool Link::pace(uint64_t bytesPerSecond) {
  if (kind() == Kind::kShm) return true;
  // The 32-bit form every kernel since 3.13 takes; ~0U means no cap. Rates past 4 GB/s are
  // no cap for hetcomm's purposes (spreading a transfer over seconds on a WAN link).
  const unsigned int rate = bytesPerSecond == 0 || bytesPerSecond >= 0xFFFFFFFFull
                                ? ~0U
                                : static_cast<unsigned int>(std::max<uint64_t>(bytesPerSecond, 1));
  return ::setsockopt(pollFd(), SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate)) == 0;
}

uint64_t Link::pacing() const {
  if (kind() == Kind::kShm) return 0;
  uint64_t value = 0;  // the kernel answers in 64 bits where it keeps them so, else 32
  socklen_t len = sizeof(value);
  if (::getsockopt(pollFd(), SOL_SOCKET, SO_MAX_PACING_RATE, &value, &len) != 0) return 0;
  if (len == sizeof(uint32_t)) {
    uint32_t low = 0;
    std::memcpy(&low, &value, sizeof(low));
    value = low;
  }
  return value >= 0xFFFFFFFFull ? 0 : value;
}

int waitLinks(LinkWait* waits, size_t n, std::chrono::nanoseconds timeout, int wakeFd, bool* woken) {
  if (woken != nullptr) *woken = false;
  // One pollfd per link (two entries for one link, a send and a receive, share it), then the
  // wake-up descriptor. A pipeline waits on one or two links a segment: those stay on the stack.
  constexpr size_t kOnStack = 4;
  std::array<pollfd, kOnStack + 1> fdsOnStack;
  std::array<size_t, kOnStack> slotOnStack;
  std::vector<pollfd> fdsOnHeap;
  std::vector<size_t> slotOnHeap;
  if (n > kOnStack) {
    fdsOnHeap.resize(n + 1);
    slotOnHeap.resize(n);
  }
  pollfd* fds = n > kOnStack ? fdsOnHeap.data() : fdsOnStack.data();
  size_t* slot = n > kOnStack ? slotOnHeap.data() : slotOnStack.data();
  size_t nfds = 0;
  bool movableNow = false;
  auto movable = [](const LinkWait& w) {
    return (w.recv && w.link->receivable()) || (w.send && w.link->sendable());
  };
  for (size_t i = 0; i < n; ++i) {
    waits[i].ready = false;
    const short events = waits[i].link->pollEvents(waits[i].send, waits[i].recv);
    const int fd = waits[i].link->pollFd();
    size_t k = 0;
    while (k < nfds && fds[k].fd != fd) ++k;
    if (k == nfds) fds[nfds++] = {fd, 0, 0};
    fds[k].events = static_cast<short>(fds[k].events | events);
    slot[i] = k;
    movableNow = movableNow || movable(waits[i]);
  }
  const size_t wakeSlot = nfds;
  if (wakeFd >= 0) fds[nfds++] = {wakeFd, POLLIN, 0};
  // Bytes already decrypted, or bytes (room) in a ring, are not in the socket: look at the others
  // without sleeping.
  const timespec zero{0, 0};
  const timespec ts = toTimespec(timeout);
  const int rc = ::ppoll(fds, nfds, movableNow ? &zero : (timeout.count() < 0 ? nullptr : &ts), nullptr);
  if (rc < 0 && errno != EINTR) return -1;
  int ready = 0;
  for (size_t i = 0; i < n; ++i) {
    const short revents = rc > 0 ? fds[slot[i]].revents : 0;
    const short sendEvents = waits[i].send ? waits[i].link->pollEvents(true, false) : 0;
    const short recvEvents = waits[i].recv ? waits[i].link->pollEvents(false, true) : 0;
    const bool moves = (waits[i].send && (revents & (sendEvents | POLLERR | POLLHUP)) != 0) ||
                       (waits[i].recv && (revents & (recvEvents | POLLERR | POLLHUP)) != 0) || movable(waits[i]);
    const bool failed = (revents & POLLNVAL) != 0;
    waits[i].ready = moves || failed;
    if (waits[i].ready) ++ready;
  }
  if (wakeFd >= 0 && rc > 0 && fds[wakeSlot].revents != 0) {
    if (woken != nullptr) *woken = true;
  }
  if (rc < 0 && ready == 0) {
    errno = EINTR;
    return 0;
  }
  return ready;
}

void sendAll(Link& link, const void* data, size_t len, Deadline deadline, const std::function<std::string()>& what,
             const Cancelled& cancelled) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = link.send(p, len);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      waitOne(link, /*send=*/true, deadline, what, cancelled);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      throw CommError(strCat("hetcomm: send failed ", what(), ": ", std::strerror(n < 0 ? errno : EPIPE)));
    }
  }
}

void recvAll(Link& link, void* data, size_t len, Deadline deadline, const std::function<std::string()>& what,
             const Cancelled& cancelled) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    const ssize_t n = link.recv(p, len);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (n == 0) {
      throw CommError(strCat("hetcomm: connection closed by peer ", what()));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      waitOne(link, /*send=*/false, deadline, what, cancelled);
    } else if (errno != EINTR) {
      throw CommError(strCat("hetcomm: recv failed ", what(), ": ", std::strerror(errno)));
    }
  }
}

}  // namespace hetcomm
