#pragma once
// The one data-moving loop of the collectives: send a sequence of byte ranges to one peer while
// receiving a sequence from another (possibly the same) peer, on non-blocking links (link.h)
// driven by waitLinks(), so that sending, receiving and reducing overlap on a single thread that
// sleeps when it cannot progress. Dependencies follow the ring rule (see ring_schedule.h): sends[j], j >= lead,
// waits until recvs[j - lead] has been received (and reduced).
//
// With ctx.device set, the transfers' pointers are device memory and runPipeline stages them
// (staged_pipeline.cc): each send is copied to a pinned host slot before it goes on the wire,
// each receive lands in a slot and is copied (or reduced) into device memory, segment by segment,
// so that the device copies, the network and the reductions overlap.
#include <vector>

#include "algorithms/context.h"
#include "kernels/dtype.h"

namespace hetcomm {

struct Transfer {
  char* ptr = nullptr;
  size_t bytes = 0;
  bool reduce = false;  // receive only: combine into ptr instead of overwriting it
};

struct PipelineSpec {
  int sendPeer = -1;  // -1: send nothing (not even a header)
  int recvPeer = -1;  // -1: receive nothing
  std::vector<Transfer> sends;
  size_t sendLead = 0;
  std::vector<Transfer> recvs;
  DType dtype = DType::kUInt8;
  RedOp op = RedOp::kSum;
  uint32_t step = 0;  // identifies the message within the collective (checked in the header)
  // Header "bytes" field to send / to expect; UINT64_MAX means the collective's total.
  uint64_t sendBytesField = UINT64_MAX;
  uint64_t expectBytesField = UINT64_MAX;
};

void runPipeline(const CollectiveContext& ctx, const PipelineSpec& spec);
// runPipeline for device memory (ctx.device != nullptr); called by runPipeline.
void runStagedPipeline(const CollectiveContext& ctx, const PipelineSpec& spec);

// Convenience: send `sendBytes` from sendBuf to sendPeer while receiving `recvBytes` into recvBuf
// from recvPeer (either peer may be -1). Headers carry the per-message sizes, so a size mismatch
// between the two sides is reported, not misread.
void exchange(const CollectiveContext& ctx, int sendPeer, const void* sendBuf, size_t sendBytes, int recvPeer,
              void* recvBuf, size_t recvBytes, uint32_t step);

}  // namespace hetcomm
