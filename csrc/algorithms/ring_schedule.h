#pragma once
// Ring schedule: which byte ranges a rank sends to its successor and receives from its
// predecessor, in which order, and which send waits for which receive.
//
// Derivation (P ranks at ring positions 0..P-1; position i sends to i+1 and receives from i-1,
// indices mod P; the buffer is split into P chunks, chunk c of o_c elements, and position c
// *owns* chunk c: it ends the reduce-scatter holding chunk c fully reduced).
//
//   Reduce-scatter. Chunk c starts at position c+1, which sends its own copy; every position on
//   the way adds its copy and forwards; after P-1 hops it reaches position c, which adds its own
//   and holds the total. So position i sends chunks i-1, i-2, ..., i+1 (P-1 chunks) and receives
//   chunks i-2, i-3, ..., i, reducing each into its buffer.
//   All-gather. Chunk c leaves its owner c and travels c+1, ..., c-1, written in place. Position i
//   sends chunks i, i-1, ..., i+2 and receives i-1, i-2, ..., i+1.
//
//   The link i -> i+1 therefore carries every chunk but o_i in the reduce-scatter and every chunk
//   but o_{i+1} in the all-gather: load = 2N - o_i - o_{i+1}, which uniform shares make the
//   classic 2N(P-1)/P. Shares are free: any vector with sum N (zeros included) is correct.
//
// Pipelining. Written as streams, position i's receive sequence R_i is exactly its
// predecessor's send sequence S_{i-1}, and S_i = [chunk i-1] ++ (R_i without its last chunk):
// every chunk position i forwards is one it has just received (and reduced, in the
// reduce-scatter). Splitting each chunk into segments turns that into a dataflow rule: send j
// (j >= lead, where lead = segments of chunk i-1) may go once receive j - lead is done. Nothing
// waits on a step boundary, so several segments are in flight on every link and sending,
// receiving and reducing overlap. The same rule describes the reduce-scatter alone, the
// all-gather alone and a pipelined chain broadcast; only the sequences change.
//
// In-place safety. Receiving the all-gather copy of chunk c overwrites bytes this rank sent
// earlier in the reduce-scatter. That is safe without extra synchronisation: the final value of
// a segment exists only after the partial sums of that segment, including this rank's, have
// travelled the ring, so its arrival proves our earlier send of those bytes was consumed.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace hetcomm {

struct ByteRange {
  size_t offset = 0;
  size_t bytes = 0;
  bool operator==(const ByteRange& o) const { return offset == o.offset && bytes == o.bytes; }
};

struct RingSchedule {
  std::vector<ByteRange> sends;     // to the successor, in order
  std::vector<ByteRange> recvs;     // from the predecessor, in order
  std::vector<uint8_t> recvReduces; // per receive: 1 = reduce into the buffer, 0 = write in place
  size_t sendLead = 0;              // sends[j], j >= sendLead, waits for recvs[j - sendLead]
};

enum class RingPhases : uint8_t { kReduceScatter = 1, kAllGather = 2, kAllReduce = 3 };

// Integer element counts from fractions: floor of each share, then the remainder handed out by
// largest fractional part (ties to the lower index). Sums to exactly `total`; deterministic.
std::vector<size_t> sharesToCounts(size_t total, const std::vector<double>& shares);

// Element offsets of chunks laid out back to back: offsets[c] = sum of counts[0..c).
std::vector<size_t> prefixOffsets(const std::vector<size_t>& counts);

// Splits `count` elements into segments of at most `segmentBytes` (at least one element each),
// as evenly as possible; zero elements give no segment.
std::vector<ByteRange> computeSegments(size_t firstElement, size_t count, size_t elementSize, size_t segmentBytes);

// Schedule for ring position `pos` of `P`, chunk c covering counts[c] elements at
// chunkOffsets[c] (elements) of the buffer.
RingSchedule buildRingSchedule(int pos, int P, const std::vector<size_t>& chunkOffsets,
                               const std::vector<size_t>& counts, size_t elementSize, size_t segmentBytes,
                               RingPhases phases);

// Pipelined chain broadcast along ring positions 0 (the root) .. P-1.
RingSchedule buildChainSchedule(int pos, int P, size_t bytes, size_t segmentBytes);

}  // namespace hetcomm
