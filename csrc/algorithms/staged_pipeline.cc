// The pipeline of pipeline.h for transfers in device memory.
//
// Every transfer is cut into pieces of at most one staging slot. A send piece goes through
//
//     enqueue device->host copy into a send slot   (once its dependency is met and a slot is free)
//     wait until that copy is done                 (a ticket; never blocks the loop)
//     write the slot to the socket
//
// and a receive piece through
//
//     wait until the next receive slot is free     (the queue's last read of it is done)
//     read it from the socket into the slot
//     enqueue host->device copy, or reduction, from the slot into the device buffer
//
// with the slots of each direction used round robin, so several pieces are in flight in each
// stage at once: device copies, network and reductions overlap.
//
// Dependencies. pipeline.h's rule "sends[j], j >= lead, waits for recvs[j - lead]" is kept at
// transfer granularity: a piece of send transfer j is enqueued once every piece of receive
// transfer j - lead has been *enqueued* (not completed). The queue runs in order, so the copy that
// reads the forwarded bytes runs after the reduction that produced them: the dependency costs no
// host round trip.
//
// In place. In the ring's all-gather a receive overwrites bytes this rank sent in the
// reduce-scatter (ring_schedule.h explains why the host pipeline may). Here the overwrite is
// enqueued after the segment arrived, which is after this rank's copy of the old bytes had to
// complete for them to go on the wire: the order on the queue is the order the host path has.

#include <algorithm>
#include <deque>

#include "algorithms/device_ops.h"
#include "algorithms/pipeline.h"
#include "algorithms/pipeline_io.h"
#include "common/env.h"
#include "common/error.h"

namespace hetcomm {
namespace {

using namespace pipeline_io;


struct Piece {
  char* ptr = nullptr;  // device memory
  size_t bytes = 0;
  bool reduce = false;
};

// Pieces of at most maxBytes (a multiple of every element size); piecesEnd[t] is one past the
// last piece of transfer t (transfers of zero bytes have none).
void cut(const std::vector<Transfer>& transfers, size_t maxBytes, std::vector<Piece>& pieces,
         std::vector<size_t>& piecesEnd) {
  for (const Transfer& t : transfers) {
    for (size_t off = 0; off < t.bytes; off += maxBytes) {
      pieces.push_back({t.ptr + off, std::min(maxBytes, t.bytes - off), t.reduce});
    }
    piecesEnd.push_back(pieces.size());
  }
}

}  // namespace

void runStagedPipeline(const CollectiveContext& ctx, const PipelineSpec& spec) {
  DeviceOps& dev = *ctx.device;
  const bool doSend = spec.sendPeer >= 0, doRecv = spec.recvPeer >= 0;
  HC_ENFORCE(doSend || spec.sends.empty());
  HC_ENFORCE(doRecv || spec.recvs.empty());
  StagingSlots& slots = dev.slots();
  const int nSendSlots = slots.count() / 2, nRecvSlots = slots.count() - nSendSlots;
  HC_ENFORCE(nSendSlots >= 1 && nRecvSlots >= 1 && slots.slotBytes % 16 == 0, "bad staging slots");
  const size_t es = elementSize(spec.dtype);

  std::vector<Piece> sendPieces, recvPieces;
  std::vector<size_t> sendEnd, recvEnd;
  cut(spec.sends, slots.slotBytes, sendPieces, sendEnd);
  cut(spec.recvs, slots.slotBytes, recvPieces, recvEnd);
  const size_t nsend = sendPieces.size(), nrecv = recvPieces.size();
  // Send piece i belongs to transfer sendTransfer[i].
  std::vector<size_t> sendTransfer(nsend);
  for (size_t t = 0, i = 0; t < sendEnd.size(); ++t) {
    for (; i < sendEnd[t]; ++i) sendTransfer[i] = t;
  }

  Link* const sendLink = doSend ? &ctx.linkOf(spec.sendPeer) : nullptr;
  Link* const recvLink = doRecv ? &ctx.linkOf(spec.recvPeer) : nullptr;
  const auto outBytes = outgoingHeader(ctx, spec).encode();
  const CollectiveHeader want = expectedHeader(ctx, spec);
  std::array<uint8_t, kHeaderBytes> inBytes{};
  size_t hdrOut = doSend ? 0 : kHeaderBytes, hdrIn = doRecv ? 0 : kHeaderBytes;

  auto sendSlot = [&](size_t piece) { return slots.slot(static_cast<int>(piece % nSendSlots)); };
  auto recvSlotIndex = [&](size_t piece) { return nSendSlots + static_cast<int>(piece % nRecvSlots); };

  // Sends: pieces [sent, staged) have their device->host copy enqueued; stagedAt holds their
  // tickets, oldest first. Piece `sent` is on the wire up to sendOff.
  size_t staged = 0, sent = 0, sendOff = 0;
  std::deque<DeviceOps::Ticket> stagedAt;
  // Receives: piece `received` arrives into its slot up to recvOff; recvSlotFree caches that the
  // slot's last device read is done. Receive transfers [0, recvTransfersQueued) are fully enqueued.
  size_t received = 0, recvOff = 0, recvTransfersQueued = 0;
  bool recvSlotFree = false;

  auto dependencyMet = [&](size_t piece) {
    const size_t t = sendTransfer[piece];
    return t < spec.sendLead || t - spec.sendLead < recvTransfersQueued;
  };

  while (true) {
    if (hdrOut == kHeaderBytes && sent == nsend && hdrIn == kHeaderBytes && received == nrecv) return;
    bool progressed = false;

    // Stage sends while slots are free and the data they read is (queued to be) final.
    while (staged < nsend && staged - sent < static_cast<size_t>(nSendSlots) && dependencyMet(staged)) {
      const Piece& p = sendPieces[staged];
      dev.copyToHost(sendSlot(staged), p.ptr, p.bytes);
      stagedAt.push_back(dev.mark());
      ++staged;
      progressed = true;
    }

    // Put staged bytes on the wire.
    bool sendBlocked = false, sendWaitsForDevice = false;
    while (true) {
      const char* data;
      size_t left;
      if (hdrOut < kHeaderBytes) {
        data = reinterpret_cast<const char*>(outBytes.data()) + hdrOut;
        left = kHeaderBytes - hdrOut;
      } else if (sent < staged) {
        if (sendOff == 0 && !dev.reached(stagedAt.front())) {
          sendWaitsForDevice = true;
          break;
        }
        data = sendSlot(sent) + sendOff;
        left = sendPieces[sent].bytes - sendOff;
      } else {
        break;
      }
      const size_t n = sendSome(ctx, *sendLink, spec.sendPeer, data, left);
      if (n == 0) {
        sendBlocked = true;
        break;
      }
      progressed = true;
      if (hdrOut < kHeaderBytes) {
        hdrOut += n;
      } else if ((sendOff += n) == sendPieces[sent].bytes) {
        stagedAt.pop_front();
        ++sent;
        sendOff = 0;
      }
    }

    // Receive into free slots; hand each complete piece to the device queue.
    bool recvWaitsForDevice = false;
    while (hdrIn < kHeaderBytes || received < nrecv) {
      char* data;
      size_t left;
      if (hdrIn < kHeaderBytes) {
        data = reinterpret_cast<char*>(inBytes.data()) + hdrIn;
        left = kHeaderBytes - hdrIn;
      } else {
        const int slot = recvSlotIndex(received);
        if (!recvSlotFree && !(recvSlotFree = dev.reached(slots.queueReadsUntil[slot]))) {
          recvWaitsForDevice = true;
          break;
        }
        data = slots.slot(slot) + recvOff;
        left = recvPieces[received].bytes - recvOff;
      }
      const size_t n = recvSome(ctx, *recvLink, spec.recvPeer, data, left);
      if (n == 0) break;
      progressed = true;
      if (hdrIn < kHeaderBytes) {
        if ((hdrIn += n) == kHeaderBytes) checkHeader(ctx, spec, inBytes.data(), want);
        continue;
      }
      const Piece& p = recvPieces[received];
      if ((recvOff += n) < p.bytes) continue;
      const int slot = recvSlotIndex(received);
      if (received + 1 == nrecv) dev.testDelay();
      if (p.reduce) {
        dev.reduceFromHost(p.ptr, slots.slot(slot), p.bytes / es, spec.dtype, spec.op);
      } else {
        dev.copyToDevice(p.ptr, slots.slot(slot), p.bytes);
      }
      slots.queueReadsUntil[slot] = dev.mark();
      ++received;
      recvOff = 0;
      recvSlotFree = false;
      while (recvTransfersQueued < recvEnd.size() && recvEnd[recvTransfersQueued] <= received) ++recvTransfersQueued;
      break;  // a piece is queued: give the sends (which may depend on it) a turn
    }
    if (progressed) continue;

    LinkWait waits[2];
    const bool wantIn = hdrIn < kHeaderBytes || (received < nrecv && !recvWaitsForDevice);
    const int nwaits = linksToWaitFor(waits, sendLink, sendBlocked, recvLink, wantIn);
    const bool waitsForDevice = sendWaitsForDevice || recvWaitsForDevice;
    HC_ENFORCE(nwaits > 0 || waitsForDevice, "staged pipeline stalled with nothing to wait for");
    // Nothing on a link wakes us when device work finishes: while only that is pending, poll.
    if (!waitReady(ctx, waits, nwaits, waitsForDevice ? std::max<int64_t>(0, paramDevicePollUs()) : -1)) {
      throwTimeout(ctx, spec, wantIn || recvWaitsForDevice ? spec.recvPeer : spec.sendPeer, received, nrecv, sent,
                   nsend);
    }
  }
}

}  // namespace hetcomm
