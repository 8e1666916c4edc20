// The point-to-point engine (transport/p2p_engine.h) against a peer that sends what it likes on
// its inbound link: sizes off the wire are never added where the sum can wrap; and when it says a
// message arrived.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "check.h"
#include "common/error.h"
#include "common/traffic.h"
#include "transport/framing.h"
#include "transport/link.h"
#include "transport/p2p_engine.h"
#include "transport/tcp_mesh.h"

using namespace hetcomm;

namespace {

// What the callback of one operation reported.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
  Clock::time_point at;
  void set(std::exception_ptr e, Clock::time_point when = {}) {
    at = when;
    std::string what;
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = x.what();
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    error = what;
    done = true;
    cv.notify_all();
  }
  bool wait(std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return done; });
  }
};

// Waits until the engine has read `n` whole messages (claimed or kept).
void waitForMessages(const TrafficCounters& traffic, uint64_t n) {
  const Deadline until = Clock::now() + std::chrono::seconds(20);
  while (traffic.snapshot().p2pReceivedMessages < n) {
    REQUIRE(Clock::now() < until);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Writes a message (header and payload) as the peer would.
void writeMessage(int fd, int64_t tag, const std::string& payload);

void writeAll(int fd, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    REQUIRE(n > 0);
    p += n;
    len -= static_cast<size_t>(n);
  }
}

void writeMessage(int fd, int64_t tag, const std::string& payload) {
  P2PHeader h;
  h.tag = tag;
  h.bytes = payload.size();
  const auto head = h.encode();
  writeAll(fd, head.data(), head.size());
  writeAll(fd, payload.data(), payload.size());
}

}  // namespace

// A 16-byte message nobody asked for is kept (16 bytes of the budget in use), then a header that
// claims 2^64 - 8 bytes: 16 + that wraps to 8, which fit the budget, and the engine tried to
// allocate it; vector's length_error escaped its out-of-memory handler and failed the engine
// thread. Now the claim does not fit the budget: it waits in the socket for a receive, and a
// receive of another tag stuck behind it says so when it times out.
TEST_CASE(a_huge_claimed_size_does_not_wrap_the_budget) {
  TcpMesh::Secret secret{};
  TcpMesh mesh(0, 2, "127.0.0.1", secret,
               [](int, Deadline, const Cancelled&) -> HostPort { throw CommError("no store in this test"); });
  TrafficCounters traffic(2);
  P2PEngine engine(0, 2, &mesh, &traffic);
  std::string groupFailure;
  engine.setFailureHandler([&](const std::string& why) { groupFailure = why; });
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  engine.addInbound(1, tcpLink(Socket(fds[0])));

  P2PHeader small;
  small.tag = 7;
  small.bytes = 16;
  const auto smallBytes = small.encode();
  writeAll(fds[1], smallBytes.data(), smallBytes.size());
  const char payload[16] = "sixteen bytes..";
  writeAll(fds[1], payload, sizeof(payload));
  waitForMessages(traffic, 1);  // read with no receive posted: kept, 16 bytes of the budget in use
  P2PHeader huge;
  huge.tag = 8;
  huge.bytes = ~uint64_t{0} - 7;
  const auto hugeBytes = huge.encode();
  writeAll(fds[1], hugeBytes.data(), hugeBytes.size());

  // The kept message is there for its receive.
  char got[16] = {};
  Outcome first;
  engine.postRecv(1, 7, got, sizeof(got), Clock::now() + std::chrono::seconds(10), 10000,
                  [&](std::exception_ptr e, int, Clock::time_point) { first.set(e); });
  REQUIRE(first.wait(std::chrono::seconds(20)));
  CHECK_MSG(first.error.empty(), first.error);
  CHECK(std::string(got) == payload);

  // A receive of another tag waits behind the huge claim until its timeout, and says why.
  char other[4];
  Outcome second;
  engine.postRecv(1, 9, other, sizeof(other), Clock::now() + std::chrono::milliseconds(300), 300,
                  [&](std::exception_ptr e, int, Clock::time_point) { second.set(e); });
  REQUIRE(second.wait(std::chrono::seconds(20)));
  CHECK_MSG(second.error.find("timed out") != std::string::npos, second.error);
  CHECK_MSG(second.error.find("does not fit") != std::string::npos, second.error);
  CHECK_MSG(groupFailure.find("engine thread") == std::string::npos, groupFailure);  // the timeout, not a crash
  engine.stop("the test is over");
  ::close(fds[1]);
}

// Messages that arrived before their receives were posted report when their last byte was read,
// not when a receive claimed them later (the probe times flows with this): three kept messages,
// claimed out of order, each with its own time.
TEST_CASE(buffered_messages_report_when_they_arrived) {
  TcpMesh::Secret secret{};
  TcpMesh mesh(0, 2, "127.0.0.1", secret,
               [](int, Deadline, const Cancelled&) -> HostPort { throw CommError("no store in this test"); });
  TrafficCounters traffic(2);
  P2PEngine engine(0, 2, &mesh, &traffic);
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  engine.addInbound(1, tcpLink(Socket(fds[0])));
  Clock::time_point written[3];
  for (int k = 0; k < 3; ++k) {
    written[k] = Clock::now();
    writeMessage(fds[1], k + 1, std::string(4, static_cast<char>('a' + k)));
    waitForMessages(traffic, static_cast<uint64_t>(k) + 1);  // read and kept before the next is written
  }
  const Clock::time_point posted = Clock::now();
  Clock::time_point at[3];
  for (int k : {1, 2, 0}) {
    char got[4];
    Outcome o;
    engine.postRecv(1, k + 1, got, sizeof(got), Clock::now() + std::chrono::seconds(10), 10000,
                    [&](std::exception_ptr e, int, Clock::time_point when) { o.set(e, when); });
    REQUIRE(o.wait(std::chrono::seconds(20)));
    CHECK_MSG(o.error.empty(), o.error);
    CHECK(std::string(got, 4) == std::string(4, static_cast<char>('a' + k)));
    at[k] = o.at;
  }
  for (int k = 0; k < 3; ++k) {
    CHECK(written[k] <= at[k]);
    CHECK(at[k] <= posted);  // read before any receive was posted (the counters said so)
  }
  CHECK(at[0] < at[1]);
  CHECK(at[1] < at[2]);
  engine.stop("the test is over");
  ::close(fds[1]);
}
