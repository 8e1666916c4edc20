#include "transport/p2p_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "common/env.h"
#include "common/error.h"
#include "common/logging.h"
#include "common/threads.h"
#include "transport/shm/ring_link.h"

namespace hetcomm {
namespace {

// Bytes of unclaimed messages kept per peer (see the header comment).
HETCOMM_PARAM(paramP2PUnexpectedBytes, "HETCOMM_P2P_UNEXPECTED_BYTES", int64_t{256} << 20)

// A receive from a peer that has not connected probes it after kFirstProbe, then ever less often.
constexpr std::chrono::milliseconds kFirstProbe{1000};
constexpr std::chrono::milliseconds kMaxProbeInterval{8000};
constexpr std::chrono::milliseconds kProbeTimeout{2000};

std::exception_ptr commError(const std::string& what) { return std::make_exception_ptr(CommError(what)); }

}  // namespace

P2PEngine::P2PEngine(int rank, int size, TcpMesh* mesh, TrafficCounters* traffic)
    : rank_(rank),
      size_(size),
      mesh_(mesh),
      traffic_(traffic),
      unexpectedBudget_(static_cast<size_t>(std::max<int64_t>(0, paramP2PUnexpectedBytes()))),
      ringBytes_(ringBytesSetting()),  // on every rank, before anything: a bad value fails every rank's creation
      peers_(size) {
  if (ringBytes_ > 0) removeStaleRings();
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) throw CommError("hetcomm: pipe2 failed");
  thread_ = startThread("point-to-point engine", [this] { loop(); },
                        [this](const std::string& what) { failFromThread(what); });
}

P2PEngine::~P2PEngine() {
  stop("the process group was destroyed");
  for (int& fd : wake_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void P2PEngine::wake() {
  char c = 1;
  (void)!::write(wake_[1], &c, 1);
}

void P2PEngine::setFailureHandler(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mu_);
  onFailure_ = std::move(handler);
}

bool P2PEngine::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!anyRecvs_.empty()) return false;
  for (const Peer& p : peers_) {
    if (!p.sends.empty() || !p.recvs.empty() || p.incoming.matched) return false;
  }
  return true;
}

std::string P2PEngine::refusal(const char* kind, int peer) const {
  const std::string who = peer == kAnySource ? std::string("any rank") : strCat("rank ", peer);
  if (!failure_.empty()) {
    return strCat("hetcomm ", kind, " on rank ", rank_, " (", who, "): the process group is unusable after an earlier failure: ",
                  failure_);
  }
  if (stopping_) return strCat("hetcomm ", kind, " on rank ", rank_, " (", who, "): the process group is shutting down");
  return "";
}

void P2PEngine::runCallbacks(Finished& finished) {
  std::function<void(const std::string&)> report;
  std::string first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failureReported_ && failure_.empty() && !stopping_ && onFailure_) {
      for (const Finishing& f : finished) {
        if (!f.error) continue;
        try {
          std::rethrow_exception(f.error);
        } catch (const std::exception& e) {
          first = e.what();
        } catch (...) {
          first = "a point-to-point operation failed";
        }
        failureReported_ = true;
        report = onFailure_;
        break;
      }
    }
  }
  // The group fails first, so that the callbacks below complete works whose group is failed already.
  if (report) {
    try {
      report(first);
    }
    HETCOMM_RETHROW_FORCED_UNWIND
    catch (...) {
      HC_LOG(kError, "the point-to-point engine's failure handler threw");
    }
  }
  for (Finishing& f : finished) {
    try {
      f.done(f.error, f.peer, f.at == Clock::time_point{} ? Clock::now() : f.at);
    }
    HETCOMM_RETHROW_FORCED_UNWIND
    catch (const std::exception& e) {
      HC_LOG(kError, "a point-to-point completion callback threw: ", e.what());
    } catch (...) {
      HC_LOG(kError, "a point-to-point completion callback threw a non-standard exception");
    }
  }
  finished.clear();
}

void P2PEngine::postSend(int peer, int64_t tag, const char* data, size_t bytes, Deadline deadline, int64_t timeoutMs,
                         Done done) {
  Op op;
  op.data = const_cast<char*>(data);
  op.bytes = bytes;
  op.tag = tag;
  op.deadline = deadline;
  op.timeoutMs = timeoutMs;
  op.done = std::move(done);
  P2PHeader h;
  h.tag = tag;
  h.bytes = bytes;
  op.header = h.encode();
  std::unique_lock<std::mutex> lock(mu_);
  std::string refused = refusal("send", peer);
  if (refused.empty() && !peers_[peer].outError.empty()) {
    refused = strCat("hetcomm send to rank ", peer, ": ", peers_[peer].outError);
  }
  if (!refused.empty()) {
    lock.unlock();
    Finished f{{std::move(op.done), commError(refused), peer}};
    runCallbacks(f);
    return;
  }
  op.posted = nextPosted_++;
  peers_[peer].sends.push_back(std::move(op));
  lock.unlock();
  wake();
}

void P2PEngine::postRecv(int peer, int64_t tag, char* data, size_t bytes, Deadline deadline, int64_t timeoutMs,
                         Done done) {
  Op op;
  op.data = data;
  op.bytes = bytes;
  op.tag = tag;
  op.deadline = deadline;
  op.timeoutMs = timeoutMs;
  op.done = std::move(done);
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Messages that already arrived stay claimable after the sender closed its connection. From
    // any source: the one that arrived first, whichever peer sent it.
    int from = -1;
    std::deque<Peer::Unclaimed>::iterator it;
    const std::string refused = refusal("recv", peer);
    for (int q = 0; q < size_ && refused.empty(); ++q) {
      if (peer != kAnySource && q != peer) continue;
      Peer& p = peers_[q];
      auto m = std::find_if(p.unexpected.begin(), p.unexpected.end(), [&](const auto& u) { return u.tag == tag; });
      if (m == p.unexpected.end() || (from >= 0 && it->arrived < m->arrived)) continue;
      from = q;
      it = m;
    }
    if (from >= 0) {
      Peer& p = peers_[from];
      std::vector<char> payload = std::move(it->payload);
      const Clock::time_point at = it->at;  // before the erase, which invalidates `it`
      p.unexpected.erase(it);
      p.unexpectedBytes -= payload.size();
      if (payload.size() != bytes) {
        finished.push_back({std::move(op.done),
                            commError(strCat("hetcomm recv on rank ", rank_, ": rank ", from, " sent ", payload.size(),
                                             " bytes with tag ", tag, " but this receive expects ", bytes, " bytes")),
                            from});
      } else {
        if (bytes > 0) std::memcpy(data, payload.data(), bytes);
        finished.push_back({std::move(op.done), nullptr, from, at});
      }
    }
    if (finished.empty()) {
      const std::string broken = peer == kAnySource ? "" : peers_[peer].inError;
      if (!refused.empty()) {
        finished.push_back({std::move(op.done), commError(refused), peer});
      } else if (!broken.empty()) {
        finished.push_back({std::move(op.done), commError(strCat("hetcomm recv from rank ", peer, ": ", broken)), peer});
      } else {
        op.posted = nextPosted_++;
        if (peer == kAnySource) {
          anyRecvs_.push_back(std::move(op));
        } else {
          Peer& p = peers_[peer];
          if (p.recvs.empty() && !p.in) {
            p.probeInterval = kFirstProbe;
            p.nextProbe = Clock::now() + kFirstProbe;
          }
          p.recvs.push_back(std::move(op));
        }
      }
    }
  }
  if (!finished.empty()) {
    runCallbacks(finished);
    wake();  // a claimed message may have made room for one waiting in the socket
    return;
  }
  wake();
}

void P2PEngine::addInbound(int peer, std::unique_ptr<Link> link) {
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[peer];
  if (p.in) throw CommError(strCat("duplicate point-to-point connection from rank ", peer));
  if (!failure_.empty()) link->shutdown();  // failed: the peer learns it at once
  p.in = std::move(link);
  wake();
}

void P2PEngine::setSharedMemoryPeers(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  sharesMemory_.assign(size_, false);
  for (int r : ranks) {
    if (r >= 0 && r < size_ && r != rank_) sharesMemory_[r] = true;
  }
}

std::array<int64_t, 3> P2PEngine::linkKinds() {
  std::lock_guard<std::mutex> lock(mu_);
  std::array<int64_t, 3> out{};
  for (const Peer& p : peers_) {
    for (const Link* l : {p.out.get(), p.in.get()}) {
      if (l != nullptr) ++out[static_cast<size_t>(l->kind())];
    }
  }
  return out;
}

void P2PEngine::stop(const std::string& reason) {
  const bool onEngineThread = std::this_thread::get_id() == thread_.get_id();
  std::unique_lock<std::mutex> stopLock(stopMu_, std::defer_lock);
  if (!onEngineThread) stopLock.lock();  // the engine thread must never wait for a stop() that joins it
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cancelHelpers_ = true;
  wake();
  if (onEngineThread || stopped_) return;
  if (thread_.joinable()) thread_.join();
  std::vector<Helper> helpers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    helpers.swap(helpers_);
  }
  for (Helper& h : helpers) h.thread.join();  // they give up within kCancelPollMs
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int peer = 0; peer < size_; ++peer) {
      Peer& p = peers_[peer];
      failAll(p.sends, peer, reason, finished);
      failAll(p.recvs, peer, reason, finished);
      if (p.incoming.matched) finished.push_back({std::move(p.incoming.op.done), commError(reason), peer});
      p.incoming = Incoming();
      p.out.reset();
      p.in.reset();
    }
    failAll(anyRecvs_, kAnySource, reason, finished);
  }
  runCallbacks(finished);
  stopped_ = true;
}

void P2PEngine::failFromThread(const std::string& what) {
  // A thread of the engine died: the group fails (through its handler, which calls fail()).
  std::function<void(const std::string&)> report;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failureReported_ && failure_.empty() && !stopping_) report = onFailure_;
    failureReported_ = true;
  }
  if (report) report(what);
  fail(what);
}

void P2PEngine::fail(const std::string& cause) {
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty() || stopping_) return;  // stop() fails what is pending itself
    failure_ = cause;
    for (int peer = 0; peer < size_; ++peer) {
      Peer& p = peers_[peer];
      failAll(p.sends, peer, refusal("send", peer), finished);
      failAll(p.recvs, peer, refusal("recv", peer), finished);
      if (p.incoming.matched) finished.push_back({std::move(p.incoming.op.done), commError(refusal("recv", peer)), peer});
      p.incoming = Incoming();
      // Shut down, not closed: the engine thread may be polling these descriptors right now. The
      // peers see the connections end, and their operations with this rank fail at once.
      if (p.out) p.out->shutdown();
      if (p.in) p.in->shutdown();
      if (p.outError.empty()) p.outError = cause;
      if (p.inError.empty()) p.inError = cause;
    }
    failAll(anyRecvs_, kAnySource, refusal("recv", kAnySource), finished);
  }
  cancelHelpers_ = true;
  runCallbacks(finished);
  wake();
}

void P2PEngine::failAll(std::deque<Op>& ops, int peer, const std::string& why, Finished& finished) {
  for (Op& op : ops) finished.push_back({std::move(op.done), commError(why), peer});
  ops.clear();
}

void P2PEngine::startHelper(std::function<void()> body) {
  auto finished = std::make_shared<std::atomic<bool>>(false);
  helpers_.push_back({startThread("point-to-point helper",
                                  [this, body, finished] {
                                    // Marked finished even when the body throws, so that it is joined.
                                    struct Done {
                                      P2PEngine* engine;
                                      std::atomic<bool>& flag;
                                      ~Done() {
                                        flag.store(true);
                                        engine->wake();
                                      }
                                    } done{this, *finished};
                                    body();
                                  },
                                  [this](const std::string& what) { failFromThread(what); }),
                      finished});
}

void P2PEngine::joinFinishedHelpers() {
  std::vector<Helper> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto split = std::partition(helpers_.begin(), helpers_.end(), [](const Helper& h) { return !h.finished->load(); });
    std::move(split, helpers_.end(), std::back_inserter(done));
    helpers_.erase(split, helpers_.end());
  }
  for (Helper& h : done) h.thread.join();  // finished: returns at once
}

// Connecting waits for the peer's listener to answer the handshake (and, for a peer that is
// slow to come up, for its address in the store): on a helper thread, so that no other peer's
// traffic waits for it.
void P2PEngine::connectPending() {
  for (int peer = 0; peer < size_; ++peer) {
    Peer& p = peers_[peer];
    if (p.sends.empty() || p.out || p.connecting || !p.outError.empty()) continue;
    p.connecting = true;
    const Deadline deadline = p.sends.front().deadline;
    const size_t ringBytes = peer < static_cast<int>(sharesMemory_.size()) && sharesMemory_[peer] ? ringBytes_ : 0;
    startHelper([this, peer, deadline, ringBytes] {
      std::unique_ptr<Link> s;
      std::string error;
      try {
        const Cancelled cancelled = [this] { return cancelHelpers_.load(); };
        s = mesh_->connectP2P(peer, deadline, cancelled);
        if (ringBytes > 0) s = offerRing(std::move(s), ringBytes, deadline, cancelled);
      } catch (const std::exception& e) {
        error = e.what();
      }
      Finished failed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Peer& p = peers_[peer];
        p.connecting = false;
        if (error.empty()) {
          if (!failure_.empty()) s->shutdown();  // failed while connecting
          p.out = std::move(s);
        } else {
          p.outError = error;
          failAll(p.sends, peer, strCat("hetcomm send from rank ", rank_, " to rank ", peer, ": ", error), failed);
        }
      }
      runCallbacks(failed);
    });
  }
}

// A receive waiting on a peer that has not even connected cannot tell a slow sender from a dead
// one by itself: ask the peer's listener (a refused connection means the peer is gone).
void P2PEngine::probeSilentPeers(Deadline now, int& pollTimeoutMs) {
  for (int peer = 0; peer < size_; ++peer) {
    Peer& p = peers_[peer];
    if (p.recvs.empty() || p.in || !p.inError.empty() || p.probing) continue;
    if (now < p.nextProbe) {
      const int ms = std::max(1, msUntil(p.nextProbe));
      pollTimeoutMs = pollTimeoutMs < 0 ? ms : std::min(pollTimeoutMs, ms);
      continue;
    }
    p.probing = true;
    startHelper([this, peer] {
      bool gone = false;
      std::string why;
      try {
        gone = mesh_->peerGone(peer, Clock::now() + kProbeTimeout, [this] { return cancelHelpers_.load(); });
        if (gone) why = strCat("rank ", peer, " has exited or crashed: its listening address refuses connections");
      } catch (const StoreUnreachableError& e) {
        // The peer has not connected, and it needs the store to find this rank: it never will.
        gone = true;
        why = strCat("rank ", peer, " has not connected, and the store it would find this rank through is "
                     "unreachable: ", e.what());
      }
      Finished failed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Peer& p = peers_[peer];
        p.probing = false;
        p.probeInterval = std::min(kMaxProbeInterval, std::max(kFirstProbe, p.probeInterval * 2));
        p.nextProbe = Clock::now() + p.probeInterval;
        if (gone && !p.in && p.inError.empty()) {
          p.inError = why;
          failAll(p.recvs, peer, strCat("hetcomm recv on rank ", rank_, ": ", p.inError), failed);
        }
      }
      runCallbacks(failed);
    });
  }
}

void P2PEngine::progressSends(int peer, Peer& p, Finished& finished) {
  while (!p.sends.empty() && p.out) {
    Op& op = p.sends.front();
    const char* ptr;
    size_t left;
    if (op.headerDone < op.header.size()) {
      ptr = reinterpret_cast<const char*>(op.header.data()) + op.headerDone;
      left = op.header.size() - op.headerDone;
    } else {
      ptr = op.data + op.dataDone;
      left = op.bytes - op.dataDone;
    }
    ssize_t n = left == 0 ? 0 : p.out->send(ptr, left);
    op.attempted = true;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n < 0) {
      p.outError = strCat("connection to rank ", peer, " failed: ", std::strerror(errno));
      p.out.reset();
      failAll(p.sends, peer, strCat("hetcomm send from rank ", rank_, ": ", p.outError), finished);
      return;
    }
    if (traffic_ != nullptr) traffic_->addSent(peer, static_cast<uint64_t>(n));
    if (op.headerDone < op.header.size()) {
      op.headerDone += static_cast<size_t>(n);
    } else {
      op.dataDone += static_cast<size_t>(n);
    }
    if (op.headerDone == op.header.size() && op.dataDone == op.bytes) {
      if (traffic_ != nullptr) traffic_->addP2PSent();
      finished.push_back({std::move(op.done), nullptr, peer, Clock::now()});
      p.sends.pop_front();
    }
  }
}

void P2PEngine::timeOut(int peer, Peer& p, Deadline now, Finished& finished, int& pollTimeoutMs) {
  auto why = [&](const char* kind, const Op& op) {
    return strCat("hetcomm ", kind, ": rank ", rank_, " timed out after ", op.timeoutMs, " ms waiting for rank ", peer,
                  " (tag ", op.tag, ", ", op.bytes, " bytes)");
  };
  auto track = [&](Deadline d) {
    const int ms = msUntil(d);
    pollTimeoutMs = pollTimeoutMs < 0 ? ms : std::min(pollTimeoutMs, ms);
  };
  // Sends go in order: only the head can be waiting on the network.
  if (!p.sends.empty()) {
    Op& op = p.sends.front();
    if (op.deadline <= now) {
      const std::string w = why("send", op);
      // Half sent, the stream is unusable. On TLS a write that would block has already encrypted a
      // record of the message, which the next write would send: that counts as started too.
      if (op.headerDone > 0 || (op.attempted && p.out && p.out->kind() == Link::Kind::kTls)) {
        p.outError = w;
        p.out.reset();
        failAll(p.sends, peer, w, finished);
      } else {
        finished.push_back({std::move(op.done), std::make_exception_ptr(TimeoutError(w)), peer});
        p.sends.pop_front();
      }
    } else {
      track(op.deadline);
    }
  }
  if (p.incoming.matched) {
    if (p.incoming.op.deadline <= now) return breakInbound(peer, p, why("recv", p.incoming.op), finished);
    track(p.incoming.op.deadline);
  }
  for (auto it = p.recvs.begin(); it != p.recvs.end();) {
    if (it->deadline <= now) {
      finished.push_back({std::move(it->done), std::make_exception_ptr(TimeoutError(why("recv", *it) + whyStuck(p))), peer});
      it = p.recvs.erase(it);
    } else {
      track(it->deadline);
      ++it;
    }
  }
}

void P2PEngine::loop() {
  while (true) {
    joinFinishedHelpers();
    Finished finished;
    std::vector<LinkWait> waits;
    int timeoutMs = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      const Deadline now = Clock::now();
      connectPending();
      probeSilentPeers(now, timeoutMs);
      firstPeer_ = (firstPeer_ + 1) % size_;
      for (int k = 0; k < size_; ++k) {
        const int peer = (firstPeer_ + k) % size_;
        Peer& p = peers_[peer];
        progressSends(peer, p, finished);
        progressRecvs(peer, p, finished);
        timeOut(peer, p, now, finished, timeoutMs);
        if (!p.sends.empty() && p.out) waits.push_back({p.out.get(), /*send=*/true, /*recv=*/false});
        // Always read (a message may arrive before the receive that claims it), unless the
        // message in the socket waits for room.
        if (p.in && !p.incoming.waitsForRoom) waits.push_back({p.in.get(), /*send=*/false, /*recv=*/true});
      }
      for (auto it = anyRecvs_.begin(); it != anyRecvs_.end();) {
        if (it->deadline <= now) {
          finished.push_back({std::move(it->done),
                              std::make_exception_ptr(TimeoutError(strCat(
                                  "hetcomm recv: rank ", rank_, " timed out after ", it->timeoutMs,
                                  " ms waiting for a message with tag ", it->tag, " from any rank (", it->bytes, " bytes)"))),
                              kAnySource});
          it = anyRecvs_.erase(it);
        } else {
          const int ms = msUntil(it->deadline);
          timeoutMs = timeoutMs < 0 ? ms : std::min(timeoutMs, ms);
          ++it;
        }
      }
    }
    const bool progressed = !finished.empty();
    runCallbacks(finished);
    if (progressed) continue;
    // The links are the engine's own (only this thread does I/O on them or frees them), so they
    // outlive the wait without the lock.
    bool woken = false;
    const auto timeout = timeoutMs < 0 ? std::chrono::milliseconds(-1) : std::chrono::milliseconds(std::max(timeoutMs, 1));
    const int rc = waitLinks(waits.data(), waits.size(), timeout, wake_[0], &woken);
    if (rc < 0) {
      HC_LOG(kError, "rank ", rank_, ": the point-to-point engine's poll failed: ", std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (woken) {
      char buf[64];
      while (::read(wake_[0], buf, sizeof(buf)) > 0) {
      }
    }
  }
}

}  // namespace hetcomm
