// The receiving half of the point-to-point engine (p2p_engine.h): reading frames off a peer's
// inbound link, matching them to receives or keeping them unclaimed, and taking a shared-memory
// ring offered as a link's first frame (shm/ring_link.h).
#include <errno.h>

#include <cstring>

#include "common/error.h"
#include "transport/p2p_engine.h"
#include "transport/shm/ring_link.h"

namespace hetcomm {
namespace {

std::exception_ptr recvError(const std::string& what) { return std::make_exception_ptr(CommError(what)); }

}  // namespace

bool P2PEngine::claimReceive(int peer, int64_t tag, Op& out) {
  Peer& p = peers_[peer];
  auto own = std::find_if(p.recvs.begin(), p.recvs.end(), [&](const Op& op) { return op.tag == tag; });
  auto any = std::find_if(anyRecvs_.begin(), anyRecvs_.end(), [&](const Op& op) { return op.tag == tag; });
  const bool haveOwn = own != p.recvs.end(), haveAny = any != anyRecvs_.end();
  if (!haveOwn && !haveAny) return false;
  if (haveOwn && (!haveAny || own->posted < any->posted)) {
    out = std::move(*own);
    p.recvs.erase(own);
  } else {
    out = std::move(*any);
    anyRecvs_.erase(any);
  }
  return true;
}

void P2PEngine::breakInbound(int peer, Peer& p, const std::string& why, Finished& finished) {
  p.inError = why;
  p.in.reset();
  if (p.incoming.matched) {
    finished.push_back({std::move(p.incoming.op.done), recvError(strCat("hetcomm recv on rank ", rank_, ": ", why)), peer});
  }
  p.incoming = Incoming();
  failAll(p.recvs, peer, strCat("hetcomm recv on rank ", rank_, ": ", why), finished);
}

void P2PEngine::deliver(int peer, Peer& p, Finished& finished) {
  const Clock::time_point at = Clock::now();  // its last byte was just read
  Incoming& in = p.incoming;
  if (in.matched) {
    finished.push_back({std::move(in.op.done), nullptr, peer, at});
    return;
  }
  // A receive may have been posted while this message was arriving unclaimed.
  Op op;
  if (!claimReceive(peer, in.parsed.tag, op)) {
    p.unexpectedBytes += in.unexpected.size();
    p.unexpected.push_back({in.parsed.tag, in.arrived, std::move(in.unexpected), at});
    return;
  }
  if (op.bytes != in.parsed.bytes) {
    finished.push_back({std::move(op.done),
                        recvError(strCat("hetcomm recv on rank ", rank_, ": rank ", peer, " sent ", in.parsed.bytes,
                                         " bytes with tag ", in.parsed.tag, " but this receive expects ", op.bytes, " bytes")),
                        peer});
  } else {
    if (op.bytes > 0) std::memcpy(op.data, in.unexpected.data(), op.bytes);
    finished.push_back({std::move(op.done), nullptr, peer, at});
  }
}

void P2PEngine::progressRecvs(int peer, Peer& p, Finished& finished) {
  while (p.in) {
    Incoming& in = p.incoming;
    const bool inHeader = in.headerDone < in.header.size();
    if (!inHeader && !in.matched && in.unexpected.size() != in.parsed.bytes) {
      // Header read, payload not placed yet: a receive that claims it, or room to keep it.
      Op op;
      if (claimReceive(peer, in.parsed.tag, op)) {
        if (op.bytes != in.parsed.bytes) {
          finished.push_back({std::move(op.done),
                              recvError(strCat("hetcomm recv on rank ", rank_, ": rank ", peer, " sent ",
                                               in.parsed.bytes, " bytes with tag ", in.parsed.tag,
                                               " but this receive expects ", op.bytes, " bytes")),
                              peer});
          return breakInbound(peer, p, strCat("message size mismatch with rank ", peer, " (tag ", in.parsed.tag, ")"),
                              finished);
        }
        in.matched = true;
        in.waitsForRoom = false;
        in.op = std::move(op);
      } else if (in.parsed.bytes == 0 || (in.parsed.bytes <= unexpectedBudget_ &&
                                          p.unexpectedBytes <= unexpectedBudget_ - in.parsed.bytes)) {
        // (Compared so that no sum can wrap: the size comes off the wire, 2^64 - 8 included.)
        try {
          in.unexpected.resize(in.parsed.bytes);
        } catch (const std::exception&) {  // bad_alloc, or length_error for what no vector can hold
          return breakInbound(peer, p, strCat("cannot buffer the ", in.parsed.bytes, "-byte message with tag ",
                                              in.parsed.tag, " from rank ", peer, ": out of memory"), finished);
        }
        in.waitsForRoom = false;
      } else {
        in.waitsForRoom = true;  // stays in the socket until a receive claims it or room frees up
        return;
      }
    }
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
      ssize_t n = p.in->recv(ptr, left);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      if (n == 0) {
        // Between messages this is a peer that finished (or died): only pending receives fail.
        return breakInbound(peer, p, strCat("rank ", peer, " closed the connection (did it fail or exit?)"), finished);
      }
      if (n < 0) return breakInbound(peer, p, strCat("connection from rank ", peer, " failed: ", std::strerror(errno)), finished);
      // A header is counted as it arrives, like the payload, once the link has carried a frame (the
      // first header may be a ring offer, which the sender does not count either).
      if (traffic_ != nullptr && (!inHeader || p.inStarted)) traffic_->addReceived(peer, static_cast<uint64_t>(n));
      if (inHeader) {
        in.headerDone += static_cast<size_t>(n);
        if (in.headerDone < in.header.size()) continue;
        if (!p.inStarted && ShmOffer::looksLikeOffer(in.header.data())) {
          answerOffer(peer, p, finished);
          continue;
        }
        if (traffic_ != nullptr && !p.inStarted) traffic_->addReceived(peer, in.header.size());
        p.inStarted = true;
        std::string err = P2PHeader::decode(in.header.data(), in.parsed);
        if (!err.empty()) return breakInbound(peer, p, strCat("garbage from rank ", peer, ": ", err), finished);
        in.arrived = nextArrival_++;
        continue;  // the payload's destination is chosen at the top of the loop
      }
      in.dataDone += static_cast<size_t>(n);
    }
    if (in.headerDone == in.header.size() && in.dataDone == in.parsed.bytes) {
      if (traffic_ != nullptr) traffic_->addP2PReceived();
      deliver(peer, p, finished);
      in = Incoming();
      // Receives from any source take messages in the order they arrive: one message per peer
      // and pass, so that a chatty peer whose socket is never empty cannot take them all.
      if (!anyRecvs_.empty()) return;
    }
  }
}

void P2PEngine::answerOffer(int peer, Peer& p, Finished& finished) {
  ShmOffer offer;
  const std::string err = ShmOffer::decode(p.incoming.header.data(), offer);
  p.incoming = Incoming();
  p.inStarted = true;
  if (!err.empty()) return breakInbound(peer, p, strCat("garbage from rank ", peer, ": ", err), finished);
  try {
    // Taken whatever this rank knows of the sender's host yet (it may not have finished finding
    // its hosts): opening the segment, this user's own and of the offered size, is the proof that
    // the two share memory. Refused with the rings off, and on a link that is not plain TCP.
    if (ringBytes_ > 0 && p.in->kind() == Link::Kind::kTcp) {
      p.in = acceptRing(std::move(p.in), offer);
    } else {
      refuseRing(*p.in);
    }
  } catch (const std::exception& e) {
    return breakInbound(peer, p, strCat("connection from rank ", peer, " failed: ", e.what()), finished);
  }
}

std::string P2PEngine::whyStuck(const Peer& p) const {
  const Incoming& in = p.incoming;
  if (!in.waitsForRoom) return "";
  return strCat("; it is behind an unclaimed ", in.parsed.bytes, "-byte message with tag ", in.parsed.tag,
                " that does not fit the ", unexpectedBudget_, " bytes kept for unclaimed messages from one peer "
                "(HETCOMM_P2P_UNEXPECTED_BYTES): post that receive first, or raise the limit");
}

}  // namespace hetcomm
