#pragma once
// Collective algorithms on raw host buffers. Each runs on the group's worker thread (or, small and
// within one host, on the caller's), one at a time, in the same order on every rank, and either
// completes or throws CommError/TimeoutError.
#include <cstdint>
#include <memory>
#include <vector>

#include "algorithms/context.h"
#include "algorithms/hierarchical.h"
#include "kernels/dtype.h"

namespace hetcomm {

// Ring order and per-rank shares of the ring AllReduce (shares[r] is rank r's share of the
// buffer; fractions, any non-negative vector with a positive sum).
struct RingPlan {
  std::vector<int> order;
  std::vector<double> shares;
  // Allreduces smaller than this use uniform shares in rank order: below the crossover the
  // weighted plan's longer critical path costs more than its balance saves (the planner decides).
  uint64_t minBytes = 0;
  // The largest pipeline segment of this plan's allreduces (0: none; the adaptive size applies
  // below it). The planner sets it from the slowest ring link: a segment crossing a slow link is
  // pipeline fill that nothing overlaps. A cap, not a size: a segment above the adaptive quarter
  // of a chunk leaves too few segments per chunk to fill the pipeline (16 hosts x 2 ranks, 16 MB,
  // equal 1000 Mbit NICs: 512 KB segments ran 0.83x the adaptive 128 KB).
  uint64_t segmentBytes = 0;
  // The site-aware schedule (hierarchical.h) for allreduces of at least sites->minBytes bytes;
  // null: the ring always.
  std::shared_ptr<const SitePlan> sites;

  static RingPlan uniform(int size);
  // Throws CommError unless order is a permutation of 0..size-1 and shares are valid.
  void validate(int size) const;
  // The plan an allreduce of `bytes` uses: this one with its site plan at or above
  // sites->minBytes; else without it, and uniform below minBytes.
  RingPlan forBytes(size_t bytes) const;
  // A fingerprint carried in the headers so that ranks holding different plans fail loudly.
  uint64_t fingerprint() const;
};

enum class AllreduceAlgo : uint8_t { kRing = 1, kRecursiveDoubling = 2 };

// The algorithm allreduce picks for a message (same on every rank for the same size).
AllreduceAlgo chooseAllreduceAlgo(size_t bytes, int size);

// In place: buf holds count elements in, the reduction out. AVG divides fp16/bf16 contributions
// before the sum and other types after it (avgScalesInputs in kernels/reduce.h).
void allreduce(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op, const RingPlan& plan);
// Pipelined chain from root.
void broadcast(CollectiveContext& ctx, char* buf, size_t bytes, int root);
// out holds every rank's block back to back (block r is blockBytes[r] long); this rank's block
// must already be in place. Ring all-gather.
void allgatherv(CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes, const RingPlan& plan);
// work holds counts[0] + ... + counts[P-1] elements; afterwards rank r's block (at the prefix
// offset of counts) holds the reduction of that block. Ring reduce-scatter; AVG as allreduce.
void reduceScatterv(CollectiveContext& ctx, char* work, const std::vector<size_t>& counts, DType dtype, RedOp op,
                    const RingPlan& plan);
// Root receives blockBytes from every rank into out (block r at r * blockBytes); own block in place.
void gather(CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root);
// Root sends block r of in (at r * blockBytes) to rank r; every rank receives into out.
void scatter(CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root);
// Pairwise exchange; offsets/sizes in bytes per peer.
void alltoallv(CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
               const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
               const std::vector<size_t>& recvBytes);
void barrier(CollectiveContext& ctx);

}  // namespace hetcomm
