// The connecting side of TcpMesh and its life cycle (tcp_mesh.h); the accepting side, the
// listener and its greetings: tcp_mesh_accept.cc.
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
    : rank_(rank), size_(size), secret_(secret), lookup_(std::move(lookup)), collective_(size), pacing_(size, 0), connecting_(size, false) {
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

int TcpMesh::setPacing(const std::vector<uint64_t>& bytesPerSecond) {
  HC_ENFORCE(bytesPerSecond.size() == static_cast<size_t>(size_), "one pacing rate per rank");
  std::lock_guard<std::mutex> lock(mu_);
  pacing_ = bytesPerSecond;
  int refused = 0;
  for (int peer = 0; peer < size_; ++peer) {
    if (collective_[peer] && !collective_[peer]->pace(pacing_[peer])) ++refused;
  }
  return refused;
}

std::vector<int64_t> TcpMesh::pacing() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out(size_, -1);
  for (int peer = 0; peer < size_; ++peer) {
    if (collective_[peer]) out[peer] = static_cast<int64_t>(collective_[peer]->pacing());
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
  if (pacing_[peer] != 0) link->pace(pacing_[peer]);
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

}  // namespace hetcomm
