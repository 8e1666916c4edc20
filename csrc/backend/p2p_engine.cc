#include "backend/p2p_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/logging.h"

namespace hetcomm {

P2PEngine::P2PEngine(int rank, int size, TcpMesh* mesh) : rank_(rank), size_(size), mesh_(mesh), peers_(size) {
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) throw CommError("hetcomm: pipe2 failed");
  thread_ = std::thread([this] { loop(); });
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
  if (stopping_ || !peers_[peer].outError.empty()) {
    std::string why = stopping_ ? "the process group is shutting down" : peers_[peer].outError;
    lock.unlock();
    op.done(std::make_exception_ptr(CommError(strCat("hetcomm send to rank ", peer, ": ", why))));
    return;
  }
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
  std::unique_lock<std::mutex> lock(mu_);
  Peer& p = peers_[peer];
  // Messages that already arrived stay claimable after the sender closed its connection.
  for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
    if (it->first != tag) continue;
    std::vector<char> payload = std::move(it->second);
    p.unexpected.erase(it);
    lock.unlock();
    if (payload.size() != bytes) {
      op.done(std::make_exception_ptr(CommError(strCat(
          "hetcomm recv on rank ", rank_, ": rank ", peer, " sent ", payload.size(), " bytes with tag ", tag,
          " but this receive expects ", bytes, " bytes"))));
    } else {
      if (bytes > 0) std::memcpy(data, payload.data(), bytes);
      op.done(nullptr);
    }
    return;
  }
  if (stopping_ || !p.inError.empty()) {
    std::string why = stopping_ ? "the process group is shutting down" : p.inError;
    lock.unlock();
    op.done(std::make_exception_ptr(CommError(strCat("hetcomm recv from rank ", peer, ": ", why))));
    return;
  }
  p.recvs.push_back(std::move(op));
  lock.unlock();
  wake();
}

void P2PEngine::addInbound(int peer, Socket socket) {
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[peer];
  if (p.in.valid()) throw CommError(strCat("duplicate point-to-point connection from rank ", peer));
  p.in = std::move(socket);
  wake();
}

void P2PEngine::stop(const std::string& reason) {
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Peer& p : peers_) {
      failAll(p.sends, reason, finished);
      failAll(p.recvs, reason, finished);
      if (p.incoming.matched) {
        finished.emplace_back(std::move(p.incoming.op.done), std::make_exception_ptr(CommError(reason)));
        p.incoming = Incoming();
      }
      p.out.close();
      p.in.close();
    }
  }
  for (auto& f : finished) f.first(f.second);
}

void P2PEngine::failAll(std::deque<Op>& ops, const std::string& why, Finished& finished) {
  for (Op& op : ops) finished.emplace_back(std::move(op.done), std::make_exception_ptr(CommError(why)));
  ops.clear();
}

void P2PEngine::connectPending(Finished& finished) {
  // Connecting blocks briefly (the peer's listener thread answers the handshake), so it is done
  // without the lock; only this thread ever touches `out`.
  for (int peer = 0; peer < size_; ++peer) {
    Deadline deadline;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Peer& p = peers_[peer];
      if (p.sends.empty() || p.out.valid() || !p.outError.empty()) continue;
      deadline = p.sends.front().deadline;
    }
    try {
      Socket s = mesh_->connectP2P(peer, deadline);
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer].out = std::move(s);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer].outError = e.what();
      failAll(peers_[peer].sends, strCat("hetcomm send from rank ", rank_, " to rank ", peer, ": ", e.what()), finished);
    }
  }
}

void P2PEngine::progressSends(int peer, Peer& p, Finished& finished) {
  while (!p.sends.empty() && p.out.valid()) {
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
    ssize_t n = left == 0 ? 0 : ::send(p.out.fd(), ptr, left, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n < 0) {
      p.outError = strCat("connection to rank ", peer, " failed: ", std::strerror(errno));
      p.out.close();
      failAll(p.sends, strCat("hetcomm send from rank ", rank_, ": ", p.outError), finished);
      return;
    }
    if (op.headerDone < op.header.size()) {
      op.headerDone += static_cast<size_t>(n);
    } else {
      op.dataDone += static_cast<size_t>(n);
    }
    if (op.headerDone == op.header.size() && op.dataDone == op.bytes) {
      finished.emplace_back(std::move(op.done), nullptr);
      p.sends.pop_front();
    }
  }
}

void P2PEngine::breakInbound(int peer, Peer& p, const std::string& why, Finished& finished) {
  p.inError = why;
  p.in.close();
  if (p.incoming.matched) {
    finished.emplace_back(std::move(p.incoming.op.done),
                          std::make_exception_ptr(CommError(strCat("hetcomm recv on rank ", rank_, ": ", why))));
  }
  p.incoming = Incoming();
  failAll(p.recvs, strCat("hetcomm recv on rank ", rank_, ": ", why), finished);
}

void P2PEngine::progressRecvs(int peer, Peer& p, Finished& finished) {
  while (p.in.valid()) {
    Incoming& in = p.incoming;
    const bool inHeader = in.headerDone < in.header.size();
    char* ptr;
    size_t left;
    if (inHeader) {
      ptr = reinterpret_cast<char*>(in.header.data()) + in.headerDone;
      left = in.header.size() - in.headerDone;
    } else {
      ptr = (in.matched ? in.op.data : in.unexpected.data()) + in.dataDone;
      left = in.parsed.bytes - in.dataDone;
    }
    if (left > 0) {
      ssize_t n = ::recv(p.in.fd(), ptr, left, 0);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      if (n == 0) {
        // Between messages this is a peer that finished (or died): only pending receives fail.
        return breakInbound(peer, p, strCat("rank ", peer, " closed the connection (did it fail or exit?)"), finished);
      }
      if (n < 0) return breakInbound(peer, p, strCat("connection from rank ", peer, " failed: ", std::strerror(errno)), finished);
      if (inHeader) {
        in.headerDone += static_cast<size_t>(n);
        if (in.headerDone < in.header.size()) continue;
        std::string err = P2PHeader::decode(in.header.data(), in.parsed);
        if (!err.empty()) return breakInbound(peer, p, strCat("garbage from rank ", peer, ": ", err), finished);
        auto match = std::find_if(p.recvs.begin(), p.recvs.end(), [&](const Op& op) { return op.tag == in.parsed.tag; });
        if (match != p.recvs.end()) {
          if (match->bytes != in.parsed.bytes) {
            Op op = std::move(*match);
            p.recvs.erase(match);
            finished.emplace_back(std::move(op.done), std::make_exception_ptr(CommError(strCat(
                "hetcomm recv on rank ", rank_, ": rank ", peer, " sent ", in.parsed.bytes, " bytes with tag ",
                in.parsed.tag, " but this receive expects ", op.bytes, " bytes"))));
            return breakInbound(peer, p, strCat("message size mismatch with rank ", peer, " (tag ", in.parsed.tag, ")"),
                                finished);
          }
          in.matched = true;
          in.op = std::move(*match);
          p.recvs.erase(match);
        } else {
          in.unexpected.resize(in.parsed.bytes);
        }
      } else {
        in.dataDone += static_cast<size_t>(n);
      }
    }
    if (in.headerDone == in.header.size() && in.dataDone == in.parsed.bytes) {
      if (in.matched) {
        finished.emplace_back(std::move(in.op.done), nullptr);
      } else {
        // A receive may have been posted while this message was arriving unclaimed.
        auto match = std::find_if(p.recvs.begin(), p.recvs.end(), [&](const Op& op) { return op.tag == in.parsed.tag; });
        if (match == p.recvs.end()) {
          p.unexpected.emplace_back(in.parsed.tag, std::move(in.unexpected));
        } else {
          Op op = std::move(*match);
          p.recvs.erase(match);
          if (op.bytes != in.parsed.bytes) {
            finished.emplace_back(std::move(op.done), std::make_exception_ptr(CommError(strCat(
                "hetcomm recv on rank ", rank_, ": rank ", peer, " sent ", in.parsed.bytes, " bytes with tag ",
                in.parsed.tag, " but this receive expects ", op.bytes, " bytes"))));
          } else {
            if (op.bytes > 0) std::memcpy(op.data, in.unexpected.data(), op.bytes);
            finished.emplace_back(std::move(op.done), nullptr);
          }
        }
      }
      in = Incoming();
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
      if (op.headerDone > 0) {  // half sent: the stream is unusable
        p.outError = w;
        p.out.close();
        failAll(p.sends, w, finished);
      } else {
        finished.emplace_back(std::move(op.done), std::make_exception_ptr(TimeoutError(w)));
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
      finished.emplace_back(std::move(it->done), std::make_exception_ptr(TimeoutError(why("recv", *it))));
      it = p.recvs.erase(it);
    } else {
      track(it->deadline);
      ++it;
    }
  }
}

void P2PEngine::loop() {
  while (true) {
    Finished finished;
    connectPending(finished);
    std::vector<pollfd> fds;
    int timeoutMs = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      const Deadline now = Clock::now();
      for (int peer = 0; peer < size_; ++peer) {
        Peer& p = peers_[peer];
        progressSends(peer, p, finished);
        progressRecvs(peer, p, finished);
        timeOut(peer, p, now, finished, timeoutMs);
        if (!p.sends.empty() && p.out.valid()) fds.push_back({p.out.fd(), POLLOUT, 0});
        // Always read: a message may arrive before the receive that claims it.
        if (p.in.valid()) fds.push_back({p.in.fd(), POLLIN, 0});
      }
    }
    for (auto& f : finished) f.first(f.second);
    if (!finished.empty()) continue;
    fds.push_back({wake_[0], POLLIN, 0});
    int rc = ::poll(fds.data(), fds.size(), timeoutMs < 0 ? -1 : std::max(timeoutMs, 1));
    if (rc > 0 && fds.back().revents != 0) {
      char buf[64];
      while (::read(wake_[0], buf, sizeof(buf)) > 0) {
      }
    }
  }
}

}  // namespace hetcomm
