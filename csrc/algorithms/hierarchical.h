#pragma once
// Site-aware (hierarchical) AllReduce: reduce-scatter inside each site, reduce-scatter and
// all-gather of every shard directly between the shard's owners in the other sites, all-gather
// inside each site, all in one dataflow (flow_pipeline.h) so the three stages overlap segment by
// segment.
//
// Layout. The buffer is cut into *blocks* laid out back to back (block b gets blockShares[b] of
// it, by sharesToCounts). Every block has one owner in every site (blockOwners[b][s] is a rank of
// site s). Inside site s a rank's chunk is the union of the blocks it owns there, so a rank owning
// several blocks holds a chunk of several ranges, and sites of different sizes (3 + 1, 2 + 1 + 1)
// need no root: each block pairs the owners it names. Each block is cut again into S *pieces*,
// piece k getting siteShares[k] of the block: piece k is reduced across sites by the block's owner
// in site k.
//
// Schedule of rank r in site s (position p of m in the site's ring), per segment:
//   1. site reduce-scatter: the ring of ring_schedule.h over the site's chunks (nothing if m = 1);
//   2. cross-site reduce-scatter: for each block r owns, send piece t to the block's owner in
//      site t (once the site reduce-scatter has finished that segment here), and add the pieces
//      s that the other owners send, in increasing site order (so the sum is the same bits on
//      every run);
//   3. cross-site all-gather: send the finished piece s to every other owner of the block; receive
//      the finished pieces t in place;
//   4. site all-gather: the ring again, starting with r's chunk once each of its segments is final.
//
// Traffic, with N the buffer's bytes, x_b = blockShares (normalised) and w_k = siteShares:
//   link r -> q across sites (r in s, q in t):   sum over blocks owned by both of x_b (w_t + w_s) N
//   out of site s in all:                        (1 + (S - 2) w_s) N   (N for two sites)
//   ring link inside site s:                     (2 - o_a - o_b) N with o the owners' block sums.
// With two sites each site sends N across the WAN, the least any algorithm can (design.md §8).
//
// Three levels (plan.hosts given: ranks in hosts, hosts in sites). Block b has a holder in every
// host (holders[b][h]) and an owner in every site (blockOwners[b][s], the holder in one host of
// the site). Per rank:
//   1. host reduce-scatter through shared memory: each holder gets its blocks summed over its host;
//   2. site reduce: every holder of b that is not b's owner in its site sends b to the owner, which
//      adds the other hosts' sums to its own host's in increasing host order;
//   3-4. across sites, between the owners, as steps 2-3 above;
//   5. site gather: the owner sends the final b to the site's other holders of b;
//   6. host all-gather through shared memory.
// A host's NIC carries (1 - y_h) N + (k - 1) y_h N out for the site steps (y_h: the fraction of
// the buffer its ranks own in the site, k the site's hosts) plus its y_h share of the site's WAN
// traffic, so every host of a site fills the site's uplink together, and no block crosses the WAN
// more often than with one rank per site. A host plan is the special case of one host per site.
//
// Safety of the in-place writes follows the ring's argument: a final value reaching r proves
// that r's earlier partial of the same bytes was consumed (it is part of that value).
#include <cstdint>
#include <vector>

#include "algorithms/context.h"
#include "kernels/dtype.h"

namespace hetcomm {

struct SitePlan {
  std::vector<std::vector<int>> sites;        // each site's ranks in its ring order
  std::vector<std::vector<int>> blockOwners;  // [block][site] -> a rank of that site
  std::vector<double> blockShares;            // fraction of the buffer per block
  std::vector<double> siteShares;             // fraction of each block reduced by each site's owner
  // Allreduces of at least this many bytes use this schedule; smaller ones the ring plan.
  uint64_t minBytes = 0;
  uint64_t segmentBytes = 0;                  // the largest segment (as RingPlan's); 0: no cap
  // Sites are the group's hosts, and their ranks share memory (ctx.local): the steps inside a
  // site run through shared memory instead of the TCP ring, one after the other (see
  // allreduceHierarchical). Then each site lists its host's ranks ascending, and every rank's
  // blocks are contiguous, in the order of the site's ranks, so that a rank's chunk is one range.
  bool localInner = false;
  // Three levels (see above): each host's ranks ascending, every host inside one site, and
  // holders[block][host] the rank of that host holding the block after the host's reduce-scatter
  // (each rank's blocks contiguous, in the order of its host's ranks). Empty: two levels.
  std::vector<std::vector<int>> hosts;
  std::vector<std::vector<int>> holders;

  // Throws CommError unless the sites partition 0..size-1, every block names one rank of each
  // site, and the shares are finite, non-negative and not all zero; with hosts, unless the hosts
  // partition the ranks inside the sites, every block names one holder of each host (contiguous
  // per rank) and every owner holds its block.
  void validate(int size) const;
  uint64_t fingerprint() const;
};

// In place: buf holds count elements in, the reduction out. Host memory. AVG reduces as SUM and
// divides nothing: allreduce divides around it (avgScalesInputs in kernels/reduce.h).
//
// With plan.localInner (hosts as the inner level): a reduce-scatter over the host's shared memory
// leaves each rank its chunk (its blocks) summed over the host; then steps 2-3 above between the
// blocks' owners over TCP; then an all-gather over shared memory. Each host's NIC carries
// (1 + (H - 2) w_h) N out and in, N for two hosts, whatever the number of ranks per host: no root.
void allreduceHierarchical(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                           const SitePlan& plan);

}  // namespace hetcomm
