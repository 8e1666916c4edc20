#include "algorithms/pipeline.h"

#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "algorithms/pipeline_io.h"
#include "common/env.h"
#include "common/error.h"
#include "kernels/reduce.h"

namespace hetcomm {

const char* collectiveName(uint8_t kind) {
  switch (static_cast<CollectiveKind>(kind)) {
    case CollectiveKind::kAllreduce: return "allreduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllgather: return "allgather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kAlltoall: return "alltoall";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "unknown-collective";
}

std::string CollectiveContext::prefix() const {
  return strCat("hetcomm ", collectiveName(header.opcode), " #", header.seq, ": rank ", rank);
}

size_t CollectiveContext::segmentBytesFor(size_t chunkBytes) const {
  if (segmentBytes > 0) return segmentBytes;
  // About 4 segments per chunk keeps every link busy while the pipeline fills and drains; the
  // bounds trade wake-ups per byte (small segments cost a poll() and a context switch each, which
  // hurts most when ranks share cores) against fill latency (large ones).
  const size_t adaptive = std::min<size_t>(kMaxSegmentBytes, std::max<size_t>(kMinSegmentBytes, chunkBytes / 4));
  return segmentCap > 0 ? std::min(segmentCap, adaptive) : adaptive;
}

namespace pipeline_io {

std::string describeMismatch(const CollectiveHeader& want, const CollectiveHeader& got) {
  std::string d;
  auto add = [&](const std::string& s) { d += (d.empty() ? "" : ", ") + s; };
  if (got.opcode != want.opcode) add(strCat("it runs ", collectiveName(got.opcode), " where this rank runs ", collectiveName(want.opcode)));
  if (got.seq != want.seq) add(strCat("its collective #", got.seq, " meets this rank's #", want.seq));
  if (got.dtype != want.dtype) {
    add(strCat("dtype ", dtypeName(static_cast<DType>(got.dtype)), " vs ", dtypeName(static_cast<DType>(want.dtype))));
  }
  if (got.redop != want.redop) {
    auto op = [](uint8_t v) { return v == 0xff ? "none" : redOpName(static_cast<RedOp>(v)); };
    add(strCat("op ", op(got.redop), " vs ", op(want.redop)));
  }
  if (got.bytes != want.bytes) add(strCat(got.bytes, " bytes vs ", want.bytes, " bytes"));
  if (got.algo != want.algo) add(strCat("algorithm ", int(got.algo), " vs ", int(want.algo), " (message sizes differ)"));
  if (got.aux != want.aux) {
    add(strCat("the tensors' sizes or dtypes, the root or the ring plan differ (fingerprint ", got.aux, " vs ",
               want.aux, ")"));
  }
  if (got.step != want.step) {
    add(strCat("step ", got.step, " vs ", want.step, " (the site plan's: segment sizes, HETCOMM_SEGMENT_BYTES)"));
  }
  return d;
}

namespace {

[[noreturn]] void throwIo(const CollectiveContext& ctx, int peer, const char* doing, int err) {
  throw PeerClosedError(strCat(ctx.prefix(), " lost its connection to rank ", peer, " while ", doing, ": ",
                         err == 0 ? "closed by the peer (did it fail or exit?)" : std::strerror(err)),
                        peer);
}

}  // namespace

CollectiveHeader outgoingHeader(const CollectiveContext& ctx, const PipelineSpec& spec) {
  CollectiveHeader h = ctx.header;
  h.step = spec.step;
  if (spec.sendBytesField != UINT64_MAX) h.bytes = spec.sendBytesField;
  return h;
}

CollectiveHeader expectedHeader(const CollectiveContext& ctx, const PipelineSpec& spec) {
  CollectiveHeader h = ctx.header;
  h.step = spec.step;
  if (spec.expectBytesField != UINT64_MAX) h.bytes = spec.expectBytesField;
  return h;
}

void checkHeader(const CollectiveContext& ctx, const PipelineSpec& spec, const uint8_t* bytes,
                 const CollectiveHeader& want) {
  CollectiveHeader got;
  std::string err = CollectiveHeader::decode(bytes, got);
  if (!err.empty()) throw CommError(strCat(ctx.prefix(), " received garbage from rank ", spec.recvPeer, ": ", err));
  if (!(got == want)) {
    throw CommError(strCat(ctx.prefix(), " and rank ", spec.recvPeer,
                           " disagree about the collective (tensor shapes, dtypes, ops or call order differ "
                           "across ranks): ",
                           describeMismatch(want, got)));
  }
}

size_t sendSome(const CollectiveContext& ctx, Link& link, int peer, const char* data, size_t len) {
  while (true) {
    ssize_t n = link.send(data, len);
    if (n > 0) {
      if (ctx.traffic != nullptr) ctx.traffic->addSent(peer, static_cast<uint64_t>(n));
      return static_cast<size_t>(n);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    throwIo(ctx, peer, "sending", n < 0 ? errno : 0);
  }
}

size_t recvSome(const CollectiveContext& ctx, Link& link, int peer, char* data, size_t len) {
  while (true) {
    ssize_t n = link.recv(data, len);
    if (n > 0) {
      if (ctx.traffic != nullptr) ctx.traffic->addReceived(peer, static_cast<uint64_t>(n));
      return static_cast<size_t>(n);
    }
    if (n == 0) throwIo(ctx, peer, "receiving", 0);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    throwIo(ctx, peer, "receiving", errno);
  }
}

int linksToWaitFor(LinkWait* waits, Link* sendLink, bool wantOut, Link* recvLink, bool wantIn) {
  int n = 0;
  if (wantOut) waits[n++] = {sendLink, /*send=*/true, /*recv=*/false};
  if (wantIn) {
    if (n == 1 && sendLink == recvLink) {
      waits[0].recv = true;
    } else {
      waits[n++] = {recvLink, /*send=*/false, /*recv=*/true};
    }
  }
  return n;
}

bool waitReady(const CollectiveContext& ctx, LinkWait* waits, int n, int64_t maxWaitUs) {
  const auto now = Clock::now();
  if (now >= ctx.deadline) return false;
  auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(ctx.deadline - now);
  if (maxWaitUs >= 0) wait = std::min<std::chrono::nanoseconds>(wait, std::chrono::microseconds(maxWaitUs));
  const int rc = waitLinks(waits, static_cast<size_t>(n), wait);
  if (rc < 0) throw CommError(strCat(ctx.prefix(), ": poll failed: ", std::strerror(errno)));
  // Readiness, a hang-up or an error: the next send()/recv() reports which (EOF, EPIPE, ...).
  return rc != 0 || Clock::now() < ctx.deadline;
}

void throwTimeout(const CollectiveContext& ctx, const PipelineSpec& spec, int waitingFor, size_t received,
                  size_t toReceive, size_t sent, size_t toSend) {
  std::string progress;
  if (spec.recvPeer >= 0) progress = strCat("received ", received, " of ", toReceive, " segments from rank ", spec.recvPeer);
  if (spec.sendPeer >= 0) {
    progress += strCat(progress.empty() ? "" : ", ", "sent ", sent, " of ", toSend, " segments to rank ", spec.sendPeer);
  }
  throw TimeoutError(strCat(ctx.prefix(), " timed out after ", ctx.timeoutMs, " ms waiting for rank ", waitingFor,
                            " (", progress, ")"));
}

}  // namespace pipeline_io

using namespace pipeline_io;

void runPipeline(const CollectiveContext& ctx, const PipelineSpec& spec) {
  if (ctx.device != nullptr) {
    runStagedPipeline(ctx, spec);
    return;
  }
  const bool doSend = spec.sendPeer >= 0, doRecv = spec.recvPeer >= 0;
  HC_ENFORCE(doSend || spec.sends.empty());
  HC_ENFORCE(doRecv || spec.recvs.empty());
  Link* const sendLink = doSend ? &ctx.linkOf(spec.sendPeer) : nullptr;
  Link* const recvLink = doRecv ? &ctx.linkOf(spec.recvPeer) : nullptr;

  const auto outBytes = outgoingHeader(ctx, spec).encode();
  const CollectiveHeader want = expectedHeader(ctx, spec);
  std::array<uint8_t, kHeaderBytes> inBytes{};

  size_t scratchBytes = 0;
  for (const Transfer& t : spec.recvs) {
    if (t.reduce) scratchBytes = std::max(scratchBytes, t.bytes);
  }
  std::vector<char> scratch(scratchBytes);
  const size_t es = elementSize(spec.dtype);

  size_t hdrOut = doSend ? 0 : kHeaderBytes, hdrIn = doRecv ? 0 : kHeaderBytes;
  size_t si = 0, sOff = 0, ri = 0, rOff = 0;
  const size_t nsend = spec.sends.size(), nrecv = spec.recvs.size();

  while (true) {
    const bool sendDone = hdrOut == kHeaderBytes && si == nsend;
    const bool recvDone = hdrIn == kHeaderBytes && ri == nrecv;
    if (sendDone && recvDone) return;
    bool progressed = false, sendBlocked = false;

    // Send as much as the socket takes and the dependencies allow.
    while (true) {
      const char* p;
      size_t left;
      if (hdrOut < kHeaderBytes) {
        p = reinterpret_cast<const char*>(outBytes.data()) + hdrOut;
        left = kHeaderBytes - hdrOut;
      } else if (si < nsend && (si < spec.sendLead || si - spec.sendLead < ri)) {
        p = spec.sends[si].ptr + sOff;
        left = spec.sends[si].bytes - sOff;
      } else {
        break;
      }
      const size_t n = sendSome(ctx, *sendLink, spec.sendPeer, p, left);
      if (n == 0) {
        sendBlocked = true;
        break;
      }
      progressed = true;
      if (hdrOut < kHeaderBytes) {
        hdrOut += n;
      } else if ((sOff += n) == spec.sends[si].bytes) {
        ++si;
        sOff = 0;
      }
    }

    // Receive until the socket is drained or one item completes (then give sends a turn).
    while (hdrIn < kHeaderBytes || ri < nrecv) {
      char* p;
      size_t left;
      if (hdrIn < kHeaderBytes) {
        p = reinterpret_cast<char*>(inBytes.data()) + hdrIn;
        left = kHeaderBytes - hdrIn;
      } else {
        const Transfer& t = spec.recvs[ri];
        p = (t.reduce ? scratch.data() : t.ptr) + rOff;
        left = t.bytes - rOff;
      }
      const size_t n = recvSome(ctx, *recvLink, spec.recvPeer, p, left);
      if (n == 0) break;
      progressed = true;
      if (hdrIn < kHeaderBytes) {
        if ((hdrIn += n) == kHeaderBytes) checkHeader(ctx, spec, inBytes.data(), want);
        continue;
      }
      const Transfer& t = spec.recvs[ri];
      if ((rOff += n) == t.bytes) {
        if (t.reduce) reduceInto(t.ptr, scratch.data(), t.bytes / es, spec.dtype, spec.op);
        ++ri;
        rOff = 0;
        break;
      }
    }
    if (progressed) continue;

    LinkWait waits[2];
    const bool wantIn = !(hdrIn == kHeaderBytes && ri == nrecv);
    const int nwaits = linksToWaitFor(waits, sendLink, sendBlocked, recvLink, wantIn);
    HC_ENFORCE(nwaits > 0, "pipeline stalled with nothing to wait for");
    if (!waitReady(ctx, waits, nwaits, -1)) {
      throwTimeout(ctx, spec, wantIn ? spec.recvPeer : spec.sendPeer, ri, nrecv, si, nsend);
    }
  }
}

void exchange(const CollectiveContext& ctx, int sendPeer, const void* sendBuf, size_t sendBytes, int recvPeer,
              void* recvBuf, size_t recvBytes, uint32_t step) {
  PipelineSpec spec;
  spec.sendPeer = sendPeer;
  spec.recvPeer = recvPeer;
  spec.step = step;
  if (sendPeer >= 0) {
    spec.sendBytesField = sendBytes;
    if (sendBytes > 0) spec.sends.push_back({const_cast<char*>(static_cast<const char*>(sendBuf)), sendBytes, false});
    spec.sendLead = spec.sends.size();
  }
  if (recvPeer >= 0) {
    spec.expectBytesField = recvBytes;
    if (recvBytes > 0) spec.recvs.push_back({static_cast<char*>(recvBuf), recvBytes, false});
  }
  runPipeline(ctx, spec);
}

}  // namespace hetcomm
