#include "transport/tcp_mesh.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <random>
#include <system_error>
#include <thread>

#include "common/env.h"
#include "common/logging.h"
#include "common/threads.h"
#include "transport/hmac.h"

namespace hetcomm {
namespace {

// A legitimate peer sends its hello right after connecting; anything slower is not one of ours.
HETCOMM_PARAM(paramHandshakeTimeoutMs, "HETCOMM_HANDSHAKE_TIMEOUT_MS", 3000)
// A collective waiting for a higher rank to connect asks whether it lives after this long, then
// ever less often (as the point-to-point engine does for a silent sender).
constexpr std::chrono::milliseconds kFirstLivenessProbe{1000};
constexpr std::chrono::milliseconds kMaxLivenessProbeInterval{8000};
constexpr std::chrono::milliseconds kLivenessProbeTimeout{2000};

}  // namespace

std::array<uint8_t, kMacBytes> handshakeMac(HandshakeRole role, const TcpMesh::Secret& secret,
                                            const std::array<uint8_t, Hello::kBytes>& hello, const Challenge& challenge) {
  static const char kAccept[] = "hetcomm accept";
  static const char kConnect[] = "hetcomm connect";
  const char* label = role == HandshakeRole::kAcceptor ? kAccept : kConnect;
  const size_t labelLen = role == HandshakeRole::kAcceptor ? sizeof(kAccept) : sizeof(kConnect);
  const auto body = challenge.encode();  // its first kBodyBytes: magic, rank, nonce
  return hmacSha256(secret.data(), secret.size(),
                    {{label, labelLen}, {hello.data(), hello.size()}, {body.data(), Challenge::kBodyBytes}});
}

TcpMesh::TcpMesh(int rank, int size, const std::string& listenIp, const Secret& secret, PeerLookup lookup)
    : rank_(rank), size_(size), secret_(secret), lookup_(std::move(lookup)), collective_(size), connecting_(size, false) {
  listener_ = listenOn(listenIp, 0);
  listenAddress_ = boundAddress(listener_.fd());
  if (::pipe2(wakePipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw CommError("hetcomm: pipe2 failed");
  // A listener that dies stops new connections: the group's operations fail (setFailureHandler).
  listenThread_ = startThread("listener", [this] { listenLoop(); }, [this](const std::string& what) {
    std::function<void(const std::string&)> handler;
    {
      std::lock_guard<std::mutex> lock(mu_);
      handler = onFailure_;
    }
    if (handler) handler(what);
  });
}

TcpMesh::~TcpMesh() { close(); }

void TcpMesh::setFailureHandler(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mu_);
  onFailure_ = std::move(handler);
}

void TcpMesh::setTls(std::shared_ptr<tls::Context> context, const char* mode, LinkPolicy needsTls) {
  std::string names;
  if (context && context->verifiesHost() && !context->namesHost(listenAddress_.host, &names)) {
    const std::string address = listenAddress_.host.substr(0, listenAddress_.host.find('%'));
    throw tls::TlsError(strCat("hetcomm: HETCOMM_TLS_VERIFY_NAME=host, but this rank's own certificate (", names,
                               ") does not name ", listenAddress_.host, ", the address it listens on and publishes, "
                               "so every peer would refuse it: give it a certificate whose subjectAltName has IP:",
                               address, " (or listen elsewhere: HETCOMM_SOCKET_IFNAME)"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  tls_ = std::move(context);
  tlsMode_ = mode;
  needsTls_ = std::move(needsTls);
}

void TcpMesh::setInboundP2PHandler(InboundP2P handler) {
  std::lock_guard<std::mutex> lock(mu_);
  inboundP2P_ = std::move(handler);
}

std::vector<int> TcpMesh::collectiveLinkSecurity() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out(size_, -1);
  for (int peer = 0; peer < size_; ++peer) {
    if (collective_[peer]) out[peer] = collective_[peer]->kind() == Link::Kind::kTls ? 1 : 0;
  }
  return out;
}

int64_t TcpMesh::rejectedConnections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rejected_;
}

namespace {

// The ack was garbage or came from the wrong rank: another process owns that port now, and
// trying again would only fail again.
class HandshakeMismatch : public CommError {
 public:
  using CommError::CommError;
};

// Why a certificate with the right DNS name is refused all the same.
constexpr char kNamesHint[] = " (ranks publish IP addresses: a certificate names them with IP entries in its subjectAltName)";

}  // namespace

std::unique_ptr<Link> TcpMesh::connectAndGreet(int peer, Channel channel, Deadline deadline, const Cancelled& callerCancelled) {
  const Cancelled cancelled = [this, &callerCancelled] {
    return stopConnects_.load() || (callerCancelled && callerCancelled());
  };
  const HostPort addr = lookup_(peer, deadline, cancelled);
  auto what = [&] { return strCat("(rank ", rank_, " connecting to rank ", peer, " at ", addr.str(), ")"); };
  auto backoff = std::chrono::milliseconds(100);
  for (int attempt = 1;; ++attempt) {
    try {
      Socket s = connectTo(addr, deadline, /*retryRefused=*/false, cancelled);
      std::unique_ptr<Link> link;
      if (tls_ && needsTls_(peer, deadline, cancelled)) {
        const int fd = s.fd();
        link = tlsLink(std::move(s), tls::Session::handshake(*tls_, fd, /*server=*/false, deadline, cancelled,
                                                             [&] { return strCat("rank ", peer, " at ", addr.str()); }));
        std::string names;
        if (tls_->verifiesHost() && !link->tlsSession()->namesHost(addr.host, &names)) {
          throw tls::TlsError(strCat("the certificate presented at ", excerpt(addr.str(), 100), " (the address rank ", peer,
                                     " published; ", names, ") does not name ", excerpt(addr.host, 80),
                                     ", and HETCOMM_TLS_VERIFY_NAME=host on rank ", rank_, kNamesHint));
        }
      } else {
        link = tcpLink(std::move(s));
      }
      Hello hello;
      hello.channel = channel;
      hello.rank = rank_;
      hello.worldSize = size_;
      hello.nonce = freshNonce();
      const auto helloBytes = hello.encode();
      sendAll(*link, helloBytes.data(), helloBytes.size(), deadline, what, cancelled);
      std::array<uint8_t, Challenge::kBytes> challengeBytes{};
      recvAll(*link, challengeBytes.data(), challengeBytes.size(), deadline, what, cancelled);
      Challenge challenge;
      std::string err = Challenge::decode(challengeBytes.data(), challenge);
      if (err.empty() && challenge.rank != peer) err = strCat("it answered as rank ", challenge.rank);
      if (err.empty()) {
        const auto want = handshakeMac(HandshakeRole::kAcceptor, secret_, helloBytes, challenge);
        if (!constantTimeEqual(want.data(), challenge.mac.data(), kMacBytes)) {
          err = "it could not prove that it knows the group secret (another job's process, or not a hetcomm rank)";
        }
      }
      if (err.empty()) {
        const auto proof = handshakeMac(HandshakeRole::kConnector, secret_, helloBytes, challenge);
        sendAll(*link, proof.data(), proof.size(), deadline, what, cancelled);
        std::array<uint8_t, HelloAck::kBytes> ackBytes{};
        recvAll(*link, ackBytes.data(), ackBytes.size(), deadline, what, cancelled);
        HelloAck ack;
        err = HelloAck::decode(ackBytes.data(), ack);
        if (err.empty() && ack.refused) {
          std::string reason(ack.reasonBytes, '\0');
          recvAll(*link, reason.data(), reason.size(), deadline, what, cancelled);
          err = strCat("it refused the connection: ", excerpt(reason, HelloAck::kMaxReasonBytes));
        } else if (err.empty() && ack.rank != peer) {
          err = strCat("it answered as rank ", ack.rank);
        }
      }
      if (!err.empty()) {
        throw HandshakeMismatch(strCat("hetcomm: handshake with rank ", peer, " at ", addr.str(), " failed: ", err));
      }
      return link;
    } catch (const ConnectionRefusedError&) {
      throw ConnectionRefusedError(strCat("hetcomm: rank ", peer, " at ", addr.str(),
                                          " refused the connection: it is no longer listening (did it exit or crash?)"));
    } catch (const HandshakeMismatch&) {
      throw;
    } catch (const tls::TlsConnectionLost&) {
      // The acceptor gave up on our TLS handshake (as on a cleartext hello): retried below.
      if (Clock::now() + backoff >= deadline) throw;
      HC_LOG(kWarn, "rank ", rank_, ": TLS handshake with rank ", peer, " at ", addr.str(), " lost (attempt ", attempt,
             "); trying again");
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    } catch (const tls::TlsError& e) {
      // A refused certificate, or a peer not speaking TLS: trying again would fail again.
      throw tls::TlsError(strCat("rank ", rank_, " cannot connect to rank ", peer, ": ", e.what()));
    } catch (const CancelledError&) {
      throw;
    } catch (const CommError& e) {
      // The acceptor closed before answering (it gave up on our hello: a lossy link delayed it
      // past HETCOMM_HANDSHAKE_TIMEOUT_MS), the connection was reset, or a timeout: try again
      // while the deadline allows.
      if (Clock::now() + backoff >= deadline) throw;
      HC_LOG(kWarn, "rank ", rank_, ": handshake with rank ", peer, " at ", addr.str(), " failed (attempt ", attempt,
             "): ", e.what(), "; trying again");
      const Deadline until = Clock::now() + backoff;
      while (Clock::now() < until) {
        if (cancelled()) throw CancelledError(strCat("hetcomm: gave up ", what(), ": the process group is shutting down"));
        std::this_thread::sleep_for(std::chrono::milliseconds(kCancelPollMs));
      }
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }
}

Link& TcpMesh::collectiveLink(int peer, Deadline deadline) {
  HC_ENFORCE(peer >= 0 && peer < size_ && peer != rank_);
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_ || closed_) throw CommError("hetcomm: the group's connections were shut down after an error");
    if (collective_[peer]) return *collective_[peer];
    if (peer > rank_) {
      // The higher rank opens the connection; wait for our listener to accept it. A peer that is
      // slow to connect is asked now and then whether it still lives (as the point-to-point
      // engine asks a silent sender): a dead one fails the wait at once, not at the deadline.
      auto interval = kFirstLivenessProbe;
      while (true) {
        const Deadline until = std::min(deadline, Clock::now() + interval);
        cv_.wait_until(lock, until, [&] { return collective_[peer] != nullptr || aborted_ || closed_; });
        if (aborted_ || closed_) throw CommError("hetcomm: the group's connections were shut down after an error");
        if (collective_[peer]) return *collective_[peer];
        if (Clock::now() >= deadline) {
          throw TimeoutError(strCat("hetcomm: rank ", rank_, " timed out waiting for rank ", peer,
                                    " to connect (is it alive and in the same collective?)"));
        }
        lock.unlock();
        bool gone = false;
        try {
          gone = peerGone(peer, std::min(deadline, Clock::now() + kLivenessProbeTimeout));
        } catch (const StoreUnreachableError&) {
          // Cannot tell: keep waiting until the deadline.
        }
        lock.lock();
        if (gone && !collective_[peer]) {
          // Not a PeerClosedError: a peer that is gone without a word leaves no reason to wait for.
          throw CommError(strCat("hetcomm: rank ", rank_, " waited for rank ", peer, " to connect, but rank ", peer,
                                 " has exited or crashed: its listening address refuses connections"));
        }
        interval = std::min(interval * 2, kMaxLivenessProbeInterval);
      }
    }
  }
  // This rank opens the connection. One thread at a time: two callers at once (the worker and a
  // setup on the caller's thread) would open two, and whichever the peer took second it closes,
  // while replacing the first here would free a link the other caller still uses.
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return !connecting_[peer] || aborted_ || closed_; })) {
      throw TimeoutError(strCat("hetcomm: rank ", rank_, " timed out connecting to rank ", peer,
                                " (another thread of this rank was connecting to it)"));
    }
    if (aborted_ || closed_) throw CommError("hetcomm: the group's connections were shut down after an error");
    if (collective_[peer]) return *collective_[peer];
    connecting_[peer] = true;
  }
  std::unique_ptr<Link> link;
  try {
    link = connectAndGreet(peer, Channel::kCollective, deadline, {});
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    connecting_[peer] = false;
    cv_.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  connecting_[peer] = false;
  cv_.notify_all();
  if (aborted_ || closed_) throw CommError("hetcomm: the group's connections were shut down after an error");
  collective_[peer] = std::move(link);
  return *collective_[peer];
}

std::unique_ptr<Link> TcpMesh::connectP2P(int peer, Deadline deadline, const Cancelled& cancelled) {
  HC_ENFORCE(peer >= 0 && peer < size_ && peer != rank_);
  return connectAndGreet(peer, Channel::kP2P, deadline, cancelled);
}

bool TcpMesh::peerGone(int peer, Deadline deadline, const Cancelled& cancelled) {
  HC_ENFORCE(peer >= 0 && peer < size_ && peer != rank_);
  try {
    connectAndGreet(peer, Channel::kProbe, deadline, cancelled);
    return false;
  } catch (const ConnectionRefusedError&) {
    return true;
  } catch (const StoreUnreachableError&) {
    throw;  // the caller decides: a peer that has not connected yet never will
  } catch (const CommError&) {
    return false;  // no answer in time, the store is unreachable, ...: cannot tell
  }
}

void TcpMesh::abort() {
  stopConnects_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = true;
  for (auto& link : collective_) {
    if (link) link->shutdown();
  }
  cv_.notify_all();
}

void TcpMesh::close() {
  stopConnects_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    cv_.notify_all();
  }
  if (wakePipe_[1] >= 0) {
    char c = 1;
    (void)!::write(wakePipe_[1], &c, 1);
  }
  if (listenThread_.joinable()) listenThread_.join();
  std::vector<Greeter> greeters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    greeters.swap(tlsGreeters_);
  }
  for (Greeter& t : greeters) t.thread.join();  // each gives up within kCancelPollMs of close()
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& link : collective_) link.reset();
  listener_.close();
  for (int& fd : wakePipe_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

namespace {

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
  // rank publishes its site (tlsPolicy in process_group_hetcomm.cc, a store set in its
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
