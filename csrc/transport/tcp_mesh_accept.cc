// The accepting side of TcpMesh: the listener thread, the greetings it progresses side by side
// (cleartext on the listener, TLS on a short-lived thread each), the challenge, and the checks
// before a connection is taken as a rank's (tcp_mesh.h). The connecting side: tcp_mesh.cc.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <system_error>
#include <thread>

#include "common/env.h"
#include "common/logging.h"
#include "common/threads.h"
#include "transport/hmac.h"
#include "transport/tcp_mesh.h"

namespace hetcomm {

namespace {

// A legitimate peer sends its hello right after connecting; anything slower is not one of ours.
HETCOMM_PARAM(paramHandshakeTimeoutMs, "HETCOMM_HANDSHAKE_TIMEOUT_MS", 3000)

// A descriptor held in reserve: when accept() fails for lack of descriptors, closing it makes room
// to take the connection off the queue and close it. Otherwise the listener would stay readable
// and its loop would spin until a descriptor frees up.
Socket openSpareDescriptor() { return Socket(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

std::string peerHost(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, host, sizeof(host));
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, host, sizeof(host));
  }
  return host;
}

}  // namespace

// Handshakes are progressed side by side: a connection that sends nothing (or trickles) holds
// only its own slot until its deadline, never the peers connecting after it. At most
// kMaxPendingGreetings are in progress; further connections wait in the kernel's backlog (and a
// flood of silent connections costs one slot each for HETCOMM_HANDSHAKE_TIMEOUT_MS).
void TcpMesh::listenLoop() {
  std::vector<Greeting> greetings;
  Socket spare = openSpareDescriptor();
  Deadline acceptPausedUntil{};
  while (true) {
    const Deadline now = Clock::now();
    // TLS greetings (on threads of their own) count too: a flood of them must not take every
    // thread or descriptor of the process.
    size_t tlsGreetings;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tlsGreetings = tlsGreeters_.size();
    }
    const bool accepting = greetings.size() + tlsGreetings < kMaxPendingGreetings && now >= acceptPausedUntil;
    std::vector<pollfd> fds = {{wakePipe_[0], POLLIN, 0}, {listener_.fd(), static_cast<short>(accepting ? POLLIN : 0), 0}};
    int timeoutMs = now < acceptPausedUntil ? msUntil(acceptPausedUntil) : -1;
    for (const Greeting& g : greetings) {
      fds.push_back({g.link ? g.link->pollFd() : g.socket.fd(), POLLIN, 0});
      const int ms = msUntil(g.deadline);
      timeoutMs = timeoutMs < 0 ? ms : std::min(timeoutMs, ms);
    }
    int rc = ::poll(fds.data(), fds.size(), timeoutMs);
    if (rc < 0 && errno != EINTR) {
      // Not expected (ENOMEM, ...): do not spin on it.
      HC_LOG(kError, "rank ", rank_, ": the listener's poll failed: ", std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    if (rc > 0 && fds[0].revents != 0) return;
    // Progress (or expire) the pending handshakes; fds[2 + k] belongs to greetings[k].
    std::vector<Greeting> still;
    for (size_t k = 0; k < greetings.size(); ++k) {
      Greeting& g = greetings[k];
      const bool readable = rc > 0 && fds[2 + k].revents != 0;
      if (readable && progressGreeting(g)) continue;
      if (!readable && Clock::now() >= g.deadline) {
        reject(g.from, strCat("no complete handshake within ", paramHandshakeTimeoutMs(), " ms"));
        continue;
      }
      still.push_back(std::move(g));
    }
    greetings.swap(still);
    reapGreeters();
    if (rc > 0 && accepting && (fds[1].revents & POLLIN) != 0) acceptOne(greetings, spare, acceptPausedUntil);
  }
}

void TcpMesh::acceptOne(std::vector<Greeting>& greetings, Socket& spare, Deadline& pausedUntil) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  int fd = ::accept4(listener_.fd(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      if (spare.valid()) {
        spare.close();
        len = sizeof(ss);
        fd = ::accept4(listener_.fd(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
        if (fd >= 0) {
          ::close(fd);
          reject(peerHost(ss), "this process is out of file descriptors");
        }
        spare = openSpareDescriptor();
      }
      if (!spare.valid()) pausedUntil = Clock::now() + std::chrono::milliseconds(100);
    } else if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR && err != ECONNABORTED) {
      HC_LOG(kError, "rank ", rank_, ": accept failed: ", std::strerror(err));
      pausedUntil = Clock::now() + std::chrono::milliseconds(100);
    }
    return;
  }
  Greeting g;
  g.socket = Socket(fd);  // inherits the listener's buffer sizes
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  g.from = peerHost(ss);
  g.deadline = Clock::now() + std::chrono::milliseconds(paramHandshakeTimeoutMs());
  greetings.push_back(std::move(g));
}

void TcpMesh::reject(const std::string& from, const std::string& why, bool quiet) {
  std::lock_guard<std::mutex> lock(mu_);
  ++rejected_;
  if (quiet) {
    HC_LOG(kDebug, "rank ", rank_, ": a connection from ", from, " ", why);
    return;
  }
  // A flood of strangers must not flood the log too: one line a second, with a count.
  const Deadline now = Clock::now();
  if (now < nextRejectLog_) {
    ++rejectsNotLogged_;
    return;
  }
  nextRejectLog_ = now + std::chrono::seconds(1);
  if (rejectsNotLogged_ > 0) {
    HC_LOG(kWarn, "rank ", rank_, ": rejected a connection from ", from, ": ", why, " (and ", rejectsNotLogged_,
           " more in the last second)");
  } else {
    HC_LOG(kWarn, "rank ", rank_, ": rejected a connection from ", from, ": ", why);
  }
  rejectsNotLogged_ = 0;
}

void TcpMesh::reapGreeters() {
  std::vector<Greeter> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto split = std::partition(tlsGreeters_.begin(), tlsGreeters_.end(), [](const Greeter& t) { return !t.done->load(); });
    std::move(split, tlsGreeters_.end(), std::back_inserter(finished));
    tlsGreeters_.erase(split, tlsGreeters_.end());
  }
  for (Greeter& t : finished) t.thread.join();  // finished: returns at once
}

int TcpMesh::firstByte(const Socket& socket) {
  uint8_t first = 0;
  const ssize_t n = ::recv(socket.fd(), &first, 1, MSG_PEEK);
  if (n == 1) return first;
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? kNoByteYet : kClosed;
}

bool TcpMesh::progressGreeting(Greeting& g) {
  const int first = g.link ? kClosed : firstByte(g.socket);
  if (!g.link && first == kNoByteYet) return false;
  if (!g.link && first == 0x16) {  // a TLS handshake record
    if (!tls_) {
      reject(g.from, "it opened a TLS connection, but HETCOMM_TLS is off on this rank (a rank with HETCOMM_TLS "
                     "set, or not a hetcomm rank)");
      return true;
    }
    const std::string from = g.from;
    std::string refused;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return true;
      // The TLS handshake takes round trips of its own: on a thread of its own, so that it holds
      // up no other connection's greeting.
      try {
        auto done = std::make_shared<std::atomic<bool>>(false);
        tlsGreeters_.push_back({startThread("TLS greeting", [this, done, greeting = std::move(g)]() mutable {
                                  greetTls(std::move(greeting));
                                  done->store(true);
                                }),
                                done});
      } catch (const std::system_error& e) {  // out of threads: this connection is refused, nothing else
        refused = strCat("no thread for its TLS handshake: ", e.what());
      }
    }
    if (!refused.empty()) reject(from, refused);
    return true;
  }
  if (!g.link) g.link = tcpLink(std::move(g.socket));  // a cleartext greeting (or a closed one: recv says)
  uint8_t* buf = g.challenged ? g.proof.data() : g.hello.data();
  const size_t want = g.challenged ? g.proof.size() : g.hello.size();
  ssize_t n = g.link->recv(buf + g.got, want - g.got);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  if (n <= 0) {
    // A connection that closes before sending a byte is usually one of ours given up (a probe or a
    // connect cancelled by an abort): counted, but not worth a warning.
    const bool silent = n == 0 && g.got == 0 && !g.challenged;
    reject(g.from, n == 0 ? "closed before completing the handshake" : std::strerror(errno), silent);
    return true;
  }
  g.got += static_cast<size_t>(n);
  if (g.got < want) return false;
  try {
    if (!g.challenged) {
      challenge(g);
      return false;  // now the proof
    }
    acceptGreeting(g);
  } catch (const std::exception& e) {
    reject(g.from, e.what());
  }
  return true;
}

void TcpMesh::greetTls(Greeting g) {
  const Cancelled cancelled = [this] { return stopConnects_.load(); };
  auto what = [&] { return strCat("a connection from ", g.from); };
  try {
    const int fd = g.socket.fd();
    g.link = tlsLink(std::move(g.socket), tls::Session::handshake(*tls_, fd, /*server=*/true, g.deadline, cancelled, what));
    recvAll(*g.link, g.hello.data(), g.hello.size(), g.deadline, what, cancelled);
    challenge(g);
    recvAll(*g.link, g.proof.data(), g.proof.size(), g.deadline, what, cancelled);
    acceptGreeting(g);
  } catch (const CancelledError&) {
    // The mesh is closing.
  } catch (const std::exception& e) {
    reject(g.from, e.what());
  }
}

void TcpMesh::challenge(Greeting& g) {
  std::string err = Hello::decode(g.hello.data(), g.parsed);
  const Hello& hello = g.parsed;
  if (err.empty() && hello.worldSize != size_) err = strCat("world size ", hello.worldSize, " != ", size_);
  if (err.empty() && (hello.rank < 0 || hello.rank >= size_ || hello.rank == rank_)) {
    err = strCat("invalid peer rank ", hello.rank);
  }
  if (err.empty() && hello.channel == Channel::kCollective && hello.rank < rank_) {
    err = strCat("rank ", hello.rank, " must not open a collective connection to a higher rank");
  }
  if (!err.empty()) throw CommError(err);
  g.challenge.rank = rank_;
  g.challenge.nonce = freshNonce();
  g.challenge.mac = handshakeMac(HandshakeRole::kAcceptor, secret_, g.hello, g.challenge);
  const auto bytes = g.challenge.encode();
  // 56 bytes into an empty socket buffer: immediate in practice; bounded all the same.
  sendAll(*g.link, bytes.data(), bytes.size(), g.deadline, [&] { return strCat("challenging rank ", hello.rank); });
  g.challenged = true;
  g.got = 0;
}

void TcpMesh::refuse(Greeting& g, const std::string& why) {
  const int from = g.parsed.rank;
  const auto head = HelloAck::encodeRefusal(why.size());
  sendAll(*g.link, head.data(), head.size(), g.deadline, [&] { return strCat("refusing rank ", from); });
  sendAll(*g.link, why.data(), std::min(why.size(), HelloAck::kMaxReasonBytes), g.deadline,
          [&] { return strCat("refusing rank ", from); });
  throw CommError(why);
}

void TcpMesh::acceptGreeting(Greeting& g) {
  const Hello& hello = g.parsed;
  const auto want = handshakeMac(HandshakeRole::kConnector, secret_, g.hello, g.challenge);
  if (!constantTimeEqual(want.data(), g.proof.data(), kMacBytes)) {
    throw CommError(strCat("it claimed to be rank ", hello.rank, " but could not prove that it knows the group secret"));
  }
  // A member on a link that needs TLS, in clear: told why (it proved it is one of ours), then closed.
  // The policy is asked without waiting (deadline: now; its store lookup is one request, not a
  // poll). This runs on the listener thread, which progresses every other greeting too, and a
  // rank publishes its site (tlsPolicy, peer_records.cc, a store set in the group's
  // constructor) before it connects anywhere, and every connector asks the same store for the
  // acceptor's address first, which the store answers after that set: a site not there yet means
  // no member is asking (a rank without HETCOMM_TLS publishes none: refused, as it would be).
  // Waiting for it (up to the handshake timeout) let anyone with the secret stall every incoming
  // handshake. A member refused anyway tries again (connectAndGreet), so none is refused for good.
  if (g.link->kind() != Link::Kind::kTls && tls_ && needsTls_(hello.rank, Clock::now(), [this] { return stopConnects_.load(); })) {
    refuse(g, strCat("rank ", hello.rank, " connected without TLS, but HETCOMM_TLS=", tlsMode_, " on rank ", rank_,
                     " requires it on this link (is HETCOMM_TLS the same on every rank?)"));
  }
  // HETCOMM_TLS_VERIFY_NAME=host: the certificate must name the host of the rank it proved to be.
  // This runs on the TLS greeting's own thread (greetTls), so waiting for the address holds up no
  // other greeting.
  if (g.link->kind() == Link::Kind::kTls && tls_->verifiesHost()) {
    const HostPort addr = lookup_(hello.rank, g.deadline, [this] { return stopConnects_.load(); });
    std::string names;
    if (!g.link->tlsSession()->namesHost(addr.host, &names)) {
      refuse(g, strCat("the certificate of rank ", hello.rank, " (", names, ") does not name ", excerpt(addr.host, 80),
                       ", the host that rank published, and HETCOMM_TLS_VERIFY_NAME=host on rank ", rank_, kNamesHint));
    }
  }

  HelloAck ack;
  ack.rank = rank_;
  auto ackBytes = ack.encode();
  // 8 bytes into an empty socket buffer: immediate in practice; bounded all the same.
  sendAll(*g.link, ackBytes.data(), ackBytes.size(), g.deadline,
          [&] { return strCat("answering rank ", hello.rank); });

  if (hello.channel == Channel::kProbe) return;  // answered: that was all it asked
  std::unique_lock<std::mutex> lock(mu_);
  if (hello.channel == Channel::kCollective) {
    if (collective_[hello.rank]) throw CommError(strCat("duplicate collective connection from rank ", hello.rank));
    if (aborted_) g.link->shutdown();
    if (pacing_[hello.rank] != 0) g.link->pace(pacing_[hello.rank]);
    collective_[hello.rank] = std::move(g.link);
    cv_.notify_all();
    return;
  }
  InboundP2P handler = inboundP2P_;
  lock.unlock();
  if (!handler) throw CommError("point-to-point connection before the engine was ready");
  handler(hello.rank, std::move(g.link));
}

}  // namespace hetcomm
