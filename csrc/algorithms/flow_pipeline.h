#pragma once
// A dataflow pipeline over several links at once: what a schedule needs when a rank talks to more
// than one peer concurrently (the hierarchical allreduce: a ring inside the site and direct
// exchanges with one or more ranks of every other site, all in flight together).
//
// A *flow* is one direction of one connection: the items this rank sends to a peer, in order, or
// the items it receives from a peer, in order. An *item* is a byte range of the buffer. Every item
// may name items (of any flow) that must be *done* before it starts:
//
//   send item      done once its last byte is handed to the kernel; starts (reads the buffer) only
//                  when its dependencies are done;
//   receive item   done once its last byte has arrived and, for a reducing item, has been combined
//                  into the buffer; it is not even read off the socket before its dependencies are
//                  done (TCP flow control holds the sender back meanwhile).
//
// Items of one flow run in order, so the sender's sequence for a peer must be exactly the peer's
// receive sequence from it: both sides build them from the same plan. A flow starts with the
// collective's header, whose "bytes" field is the flow's total, so two ranks that built different
// schedules fail with a clear error instead of misreading each other's bytes.
//
// The schedule must be acyclic (dependencies point to items that can complete without this one);
// a schedule that stalls with nothing in flight is a bug and raises instead of hanging.
#include <cstdint>
#include <vector>

#include "algorithms/context.h"
#include "kernels/dtype.h"

namespace hetcomm {

struct FlowItem {
  char* ptr = nullptr;
  size_t bytes = 0;
  bool reduce = false;             // receive only: combine into ptr instead of overwriting it
  std::vector<uint32_t> deps;      // indices into FlowGraph::items
};

struct Flow {
  int peer = -1;
  bool send = true;
  std::vector<uint32_t> items;     // indices into FlowGraph::items, in wire order
  // The header's step field for this flow; -1: the graph's. The all-to-all sets the exchange
  // step of its lockstep (device) form, so that CPU and CUDA ranks still read each other.
  int64_t step = -1;
};

struct FlowGraph {
  std::vector<FlowItem> items;
  std::vector<Flow> flows;         // at most one send and one receive flow per peer
  DType dtype = DType::kUInt8;
  RedOp op = RedOp::kSum;
  // Carried in every flow's header and checked: whatever, besides the flows' totals, both sides
  // must agree on for their sequences to match (the hierarchical schedule: its segment size).
  uint32_t step = 0;

  // Adds an item and returns its index.
  uint32_t add(char* ptr, size_t bytes, bool reduce, std::vector<uint32_t> deps);
  // The flow to (send) or from (receive) peer, created on first use.
  Flow& flow(int peer, bool send);
};

// Runs every flow of the graph to completion, or throws (CommError, PeerClosedError,
// TimeoutError) naming the peer and what was in flight.
void runFlows(const CollectiveContext& ctx, const FlowGraph& graph);

}  // namespace hetcomm
