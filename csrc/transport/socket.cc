#include "transport/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <pthread.h>

#include <climits>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "common/env.h"
#include "common/error.h"

namespace hetcomm {

int msUntil(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

namespace {

// The descriptors Socket objects own, for the fork handler below. A plain mutex held across
// fork() by the prepare handler, so that the child never finds it locked by a thread that no
// longer exists there.
std::mutex& registryMutex() {
  static std::mutex* mu = new std::mutex;  // never destroyed: a fork may come during exit
  return *mu;
}
std::unordered_set<int>& registry() {
  static auto* fds = new std::unordered_set<int>;
  return *fds;
}

void lockRegistry() { registryMutex().lock(); }
void unlockRegistry() { registryMutex().unlock(); }

// /dev/null, opened once in the parent (the child may have no descriptor left to open it with).
int& devNull() {
  static int fd = -1;
  return fd;
}

// In the child: point every owned socket's descriptor at /dev/null (dup3 keeps the number, and
// close-on-exec as the socket had it).
void releaseInChild() {
  const int null = devNull();
  if (null >= 0) {
    for (int fd : registry()) ::dup3(null, fd, O_CLOEXEC);
  }
  registryMutex().unlock();
}

void registerFd(int fd) {
  static std::once_flag once;
  std::call_once(once, [] {
    devNull() = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    ::pthread_atfork(lockRegistry, unlockRegistry, releaseInChild);
  });
  std::lock_guard<std::mutex> lock(registryMutex());
  registry().insert(fd);
}

void unregisterFd(int fd) {
  std::lock_guard<std::mutex> lock(registryMutex());
  registry().erase(fd);
}

}  // namespace

Socket::Socket(int fd) : fd_(fd) {
  if (fd_ >= 0) registerFd(fd_);
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) {
    unregisterFd(fd_);
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::shutdownBoth() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

std::string HostPort::str() const {
  return host.find(':') != std::string::npos ? strCat("[", host, "]:", port) : strCat(host, ":", port);
}

HostPort HostPort::parse(const std::string& text) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 >= text.size()) {
    throw CommError(strCat("hetcomm: malformed address '", excerpt(text, 80), "' (expected host:port)"));
  }
  HostPort hp;
  hp.host = text.substr(0, colon);
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') hp.host = hp.host.substr(1, hp.host.size() - 2);
  // Digits only, 1..65535: an address comes from the store, and "h:70000" must not become 4464
  // (stoi's exceptions are no CommError either).
  const std::string port = text.substr(colon + 1);
  uint32_t value = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || value > 65535) {
      value = 0;
      break;
    }
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  if (value == 0 || value > 65535 || port.size() > 5) {
    throw CommError(strCat("hetcomm: malformed address '", excerpt(text, 80),
                           "' (the port must be a number from 1 to 65535)"));
  }
  hp.port = static_cast<uint16_t>(value);
  return hp;
}

namespace {

std::string errnoText(int err) { return std::strerror(err); }

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head != nullptr) freeaddrinfo(head);
  }
};

void resolve(const std::string& host, uint16_t port, int flags, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  if (rc != 0) throw CommError(strCat("hetcomm: cannot resolve '", host, "': ", gai_strerror(rc)));
}

}  // namespace

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw CommError(strCat("hetcomm: fcntl(O_NONBLOCK) failed: ", errnoText(errno)));
  }
}

namespace {

bool isLoopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
  }
  return false;
}

}  // namespace

void tuneSocket(int fd, bool loopback) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const int64_t configured = paramSocketBufferBytes();
  const int buf = static_cast<int>(configured >= 0 ? configured : (loopback ? 256 * 1024 : 0));
  if (buf > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  }
}

Socket listenOn(const std::string& ip, uint16_t port, int backlog) {
  AddrInfo ai;
  resolve(ip, port, AI_PASSIVE | AI_NUMERICHOST, ai);
  std::string lastError = "no address";
  for (addrinfo* p = ai.head; p != nullptr; p = p->ai_next) {
    Socket s(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
    if (!s.valid()) continue;
    int one = 1;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // Set buffer sizes before listen() so that accepted sockets inherit them (window scaling).
    tuneSocket(s.fd(), isLoopback(p->ai_addr));
    if (::bind(s.fd(), p->ai_addr, p->ai_addrlen) == 0 && ::listen(s.fd(), backlog) == 0) {
      setNonBlocking(s.fd());
      return s;
    }
    lastError = errnoText(errno);
  }
  throw CommError(strCat("hetcomm: cannot listen on ", ip, ":", port, ": ", lastError));
}

HostPort boundAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    throw CommError(strCat("hetcomm: getsockname failed: ", errnoText(errno)));
  }
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  int rc = getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), serv, sizeof(serv),
                       NI_NUMERICHOST | NI_NUMERICSERV);
  if (rc != 0) throw CommError(strCat("hetcomm: getnameinfo failed: ", gai_strerror(rc)));
  HostPort hp;
  hp.host = host;
  hp.port = static_cast<uint16_t>(std::stoi(serv));
  return hp;
}

namespace {

// Waits for `events` on fd; throws on timeout, cancellation or a poll error. Returns false when
// the deadline passed (the caller words the error), true on readiness (or a socket error, which
// the following syscall reports).
bool pollUntil(int fd, short events, Deadline deadline, const Cancelled& cancelled, const std::function<std::string()>& what) {
  while (true) {
    if (cancelled && cancelled()) throw CancelledError(strCat("hetcomm: gave up ", what(), ": the process group is shutting down"));
    const int left = msUntil(deadline);
    pollfd pfd{fd, events, 0};
    const int rc = ::poll(&pfd, 1, cancelled ? std::min(left, kCancelPollMs) : left);
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) throw CommError(strCat("hetcomm: poll failed ", what(), ": ", errnoText(errno)));
    if (rc == 0 && Clock::now() >= deadline) return false;
  }
}

}  // namespace

Socket connectTo(const HostPort& addr, Deadline deadline, bool retryRefused, const Cancelled& cancelled) {
  std::string lastError = "no address";
  auto backoff = std::chrono::milliseconds(5);
  auto what = [&] { return strCat("connecting to ", addr.str()); };
  while (true) {
    AddrInfo ai;
    resolve(addr.host, addr.port, 0, ai);
    bool refused = false;
    for (addrinfo* p = ai.head; p != nullptr; p = p->ai_next) {
      Socket s(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
      if (!s.valid()) continue;
      tuneSocket(s.fd(), isLoopback(p->ai_addr));
      setNonBlocking(s.fd());
      int rc = ::connect(s.fd(), p->ai_addr, p->ai_addrlen);
      int err = rc == 0 ? 0 : errno;
      if (rc != 0 && err == EINPROGRESS) {
        if (pollUntil(s.fd(), POLLOUT, deadline, cancelled, what)) {
          socklen_t len = sizeof(err);
          getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        } else {
          err = ETIMEDOUT;
        }
      }
      if (err == 0) return s;
      refused = refused || err == ECONNREFUSED;
      lastError = errnoText(err);
    }
    if (refused && !retryRefused) {
      throw ConnectionRefusedError(strCat("hetcomm: ", addr.str(), " refused the connection: nothing listens there any more"));
    }
    if (Clock::now() + backoff >= deadline) break;
    if (cancelled && cancelled()) throw CancelledError(strCat("hetcomm: gave up ", what(), ": the process group is shutting down"));
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  throw CommError(strCat("hetcomm: cannot connect to ", addr.str(), ": ", lastError));
}

std::string interfaceAddress(const std::string& ifname) {
  ifaddrs* head = nullptr;
  if (getifaddrs(&head) != 0) throw CommError(strCat("hetcomm: getifaddrs failed: ", errnoText(errno)));
  std::string found;
  for (ifaddrs* p = head; p != nullptr && found.empty(); p = p->ifa_next) {
    if (p->ifa_addr == nullptr || ifname != p->ifa_name || p->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    auto* sin = reinterpret_cast<sockaddr_in*>(p->ifa_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf)) != nullptr) found = buf;
  }
  freeifaddrs(head);
  if (found.empty()) {
    throw CommError(strCat("hetcomm: HETCOMM_SOCKET_IFNAME=", ifname, " names no interface with an IPv4 address"));
  }
  return found;
}

std::string localAddressReaching(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  AddrInfo ai;
  if (getaddrinfo(host.c_str(), "9", &hints, &ai.head) != 0 || ai.head == nullptr) {
    throw CommError(strCat("hetcomm: cannot resolve store host '", host, "'"));
  }
  Socket s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s.valid() || ::connect(s.fd(), ai.head->ai_addr, ai.head->ai_addrlen) != 0) {
    throw CommError(strCat("hetcomm: no route to store host '", host, "': ", errnoText(errno)));
  }
  return boundAddress(s.fd()).host;
}

std::string numericAddress(const std::string& host) {
  AddrInfo ai;
  resolve(host, 0, 0, ai);
  if (ai.head == nullptr) throw CommError(strCat("hetcomm: cannot resolve '", host, "'"));
  char text[NI_MAXHOST];
  int rc = getnameinfo(ai.head->ai_addr, ai.head->ai_addrlen, text, sizeof(text), nullptr, 0, NI_NUMERICHOST);
  if (rc != 0) throw CommError(strCat("hetcomm: getnameinfo failed for '", host, "': ", gai_strerror(rc)));
  return text;
}

}  // namespace hetcomm
