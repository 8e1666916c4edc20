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
  if (stopping_ || !peers_[peer].inError.empty()) {
    std::string why = stopping_ ? "the process group is shutting down" : peers_[peer].inError;
    lock.unlock();
    op.done(std::make_exception_ptr(CommError(strCat("hetcomm recv from rank ", peer, ": ", why))));
    return;
  }
  peers_[peer].recvs.push_back(std::move(op));
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

void P2PEngine::progressRecvs(int peer, Peer& p, Finished& finished) {
  while (!p.recvs.empty() && p.in.valid()) {
    Op& op = p.recvs.front();
    char* ptr;
    size_t left;
    if (op.headerDone < op.header.size()) {
      ptr = reinterpret_cast<char*>(op.header.data()) + op.headerDone;
      left = op.header.size() - op.headerDone;
    } else {
      ptr = op.data + op.dataDone;
      left = op.bytes - op.dataDone;
    }
    ssize_t n = left == 0 ? 0 : ::recv(p.in.fd(), ptr, left, 0);
    if (left != 0 && n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    std::string error;
    if (left != 0 && n == 0) error = strCat("rank ", peer, " closed the connection (did it fail or exit?)");
    if (n < 0) error = strCat("connection from rank ", peer, " failed: ", std::strerror(errno));
    if (error.empty() && op.headerDone < op.header.size()) {
      op.headerDone += static_cast<size_t>(n);
      if (op.headerDone == op.header.size()) {
        P2PHeader h;
        error = P2PHeader::decode(op.header.data(), h);
        if (error.empty() && (h.tag != op.tag || h.bytes != op.bytes)) {
          error = strCat("rank ", peer, " sent ", h.bytes, " bytes with tag ", h.tag, " but rank ", rank_,
                         " posted a receive of ", op.bytes, " bytes with tag ", op.tag,
                         " (sends and receives must match in order, size and tag)");
        }
      }
    } else if (error.empty()) {
      op.dataDone += static_cast<size_t>(n);
    }
    if (!error.empty()) {
      p.inError = error;
      p.in.close();
      failAll(p.recvs, strCat("hetcomm recv on rank ", rank_, ": ", error), finished);
      return;
    }
    if (op.headerDone == op.header.size() && op.dataDone == op.bytes) {
      finished.emplace_back(std::move(op.done), nullptr);
      p.recvs.pop_front();
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
        // Time out the operations at the head of each queue (the ones actually waiting).
        for (std::deque<Op>* q : {&p.sends, &p.recvs}) {
          if (q->empty()) continue;
          Op& op = q->front();
          if (op.deadline <= now) {
            const bool isSend = q == &p.sends;
            std::string why = strCat("hetcomm ", isSend ? "send" : "recv", ": rank ", rank_, " timed out after ",
                                     op.timeoutMs, " ms waiting for rank ", peer, " (tag ", op.tag, ", ", op.bytes,
                                     " bytes)");
            // A half-transferred message leaves the stream unusable.
            if (op.headerDone > 0) {
              (isSend ? p.outError : p.inError) = why;
              (isSend ? p.out : p.in).close();
              failAll(*q, why, finished);
            } else {
              finished.emplace_back(std::move(op.done), std::make_exception_ptr(TimeoutError(why)));
              q->pop_front();
            }
            continue;
          }
          timeoutMs = timeoutMs < 0 ? msUntil(op.deadline) : std::min(timeoutMs, msUntil(op.deadline));
        }
        if (!p.sends.empty() && p.out.valid()) fds.push_back({p.out.fd(), POLLOUT, 0});
        if (!p.recvs.empty() && p.in.valid()) fds.push_back({p.in.fd(), POLLIN, 0});
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
