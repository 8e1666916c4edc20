#pragma once
// Thin POSIX TCP helpers: RAII sockets, deadline-bounded blocking I/O built on poll(), address
// discovery. Every wait is bounded by a deadline and ends in a CommError naming what it waited for.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace hetcomm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
// Asked while a blocking operation waits (at least every kCancelPollMs): true gives up at once
// with CancelledError. Lets an abort or a shutdown interrupt connects and handshakes.
using Cancelled = std::function<bool()>;
constexpr int kCancelPollMs = 50;

// Milliseconds left until `deadline`, clamped to [0, INT_MAX] for poll().
int msUntil(Deadline deadline);

// Owns a socket descriptor. Every socket a Socket owns is let go of in a child this process forks
// (a data loader's worker, say): there its descriptor is pointed at /dev/null, so that a rank that
// dies with children still running closes its connections at once and its peers see the hang-up
// (instead of waiting for their timeout while the child holds the sockets open), and a child
// never answers on the rank's listening socket. The number stays taken, so nothing in the child
// that closes it later can hit another file.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd);
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up the descriptor to another Socket (moves only: it stays in the fork registry).
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void close();
  // Wakes up anything blocked on this socket (both directions) without freeing the descriptor.
  void shutdownBoth() const;

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string str() const;
  // Accepts "host:port" and "[v6]:port".
  static HostPort parse(const std::string& text);
};

// A non-blocking listening socket bound to ip (port 0 picks one).
Socket listenOn(const std::string& ip, uint16_t port, int backlog = 128);
HostPort boundAddress(int fd);
// Connects; the result is non-blocking and tuned (TCP_NODELAY, large buffers). A refused
// connection is retried with backoff until the deadline when retryRefused, else it throws
// ConnectionRefusedError at once: an address a peer published after it started listening that
// refuses connections means the peer is gone, and waiting for it would only delay the error.
Socket connectTo(const HostPort& addr, Deadline deadline, bool retryRefused = true, const Cancelled& cancelled = {});
void setNonBlocking(int fd);
// TCP_NODELAY and buffer sizes (see HETCOMM_SOCKET_BUFFER_BYTES). On loopback there is no
// bandwidth-delay product to cover, and small buffers keep the data in cache while it crosses
// from one process to the other (measured: 64 MB allreduce on 4 local ranks ~15% faster with
// 256 KB than 4 MB); real links need buffers of the order of bandwidth x RTT, which the kernel's
// autotuning provides and a fixed setsockopt() would switch off.
void tuneSocket(int fd, bool loopback);

// The IPv4 address of a network interface, e.g. "eth0" -> "10.0.0.5"; throws if it has none.
std::string interfaceAddress(const std::string& ifname);
// The local address the kernel would use to reach host (no packet is sent).
std::string localAddressReaching(const std::string& host);
// The numeric form of host's first address (resolved now, once); throws CommError if none.
std::string numericAddress(const std::string& host);

}  // namespace hetcomm
