#include "algorithms/ring_schedule.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/error.h"

namespace hetcomm {

std::vector<size_t> sharesToCounts(size_t total, const std::vector<double>& shares) {
  HC_ENFORCE(!shares.empty());
  double sum = 0;
  for (double s : shares) {
    if (!(s >= 0) || !std::isfinite(s)) throw CommError("hetcomm: plan shares must be finite and non-negative");
    sum += s;
  }
  if (!(sum > 0)) throw CommError("hetcomm: plan shares sum to zero");
  std::vector<size_t> counts(shares.size());
  std::vector<std::pair<double, size_t>> remainders;
  size_t assigned = 0;
  for (size_t i = 0; i < shares.size(); ++i) {
    const double exact = static_cast<double>(total) * (shares[i] / sum);
    counts[i] = std::min(static_cast<size_t>(std::floor(exact)), total - assigned);
    assigned += counts[i];
    remainders.emplace_back(exact - std::floor(exact), i);
  }
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; assigned < total; k = (k + 1) % remainders.size()) {
    // Never hand elements to a zero share: a rank declared to own nothing owns nothing.
    if (shares[remainders[k].second] > 0) {
      ++counts[remainders[k].second];
      ++assigned;
    }
  }
  return counts;
}

std::vector<size_t> prefixOffsets(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size(), 0);
  for (size_t c = 1; c < counts.size(); ++c) offsets[c] = offsets[c - 1] + counts[c - 1];
  return offsets;
}

std::vector<ByteRange> computeSegments(size_t firstElement, size_t count, size_t elementSize, size_t segmentBytes) {
  std::vector<ByteRange> out;
  if (count == 0) return out;
  const size_t perSegment = std::max<size_t>(1, segmentBytes / elementSize);
  const size_t nseg = (count + perSegment - 1) / perSegment;
  const size_t base = count / nseg, extra = count % nseg;
  size_t at = firstElement;
  for (size_t s = 0; s < nseg; ++s) {
    const size_t n = base + (s < extra ? 1 : 0);
    out.push_back({at * elementSize, n * elementSize});
    at += n;
  }
  return out;
}

namespace {

int wrap(int x, int P) { return ((x % P) + P) % P; }

}  // namespace

RingSchedule buildRingSchedule(int pos, int P, const std::vector<size_t>& chunkOffsets,
                               const std::vector<size_t>& counts, size_t elementSize, size_t segmentBytes,
                               RingPhases phases) {
  HC_ENFORCE(P >= 2 && pos >= 0 && pos < P);
  HC_ENFORCE(static_cast<int>(counts.size()) == P && chunkOffsets.size() == counts.size());
  auto segs = [&](int chunk) { return computeSegments(chunkOffsets[chunk], counts[chunk], elementSize, segmentBytes); };
  const bool rs = static_cast<uint8_t>(phases) & static_cast<uint8_t>(RingPhases::kReduceScatter);
  const bool ag = static_cast<uint8_t>(phases) & static_cast<uint8_t>(RingPhases::kAllGather);

  // Receive sequence R_pos (see the header): reduce-scatter chunks pos-2 .. pos-P, then
  // all-gather chunks pos-1 .. pos-(P-1).
  std::vector<std::vector<ByteRange>> recvChunks;
  std::vector<uint8_t> recvChunkReduces;
  if (rs) {
    for (int k = 2; k <= P; ++k) {
      recvChunks.push_back(segs(wrap(pos - k, P)));
      recvChunkReduces.push_back(1);
    }
  }
  if (ag) {
    for (int k = 1; k <= P - 1; ++k) {
      recvChunks.push_back(segs(wrap(pos - k, P)));
      recvChunkReduces.push_back(0);
    }
  }
  RingSchedule out;
  // Lead: the chunk this position starts with, its own data (reduce-scatter: chunk pos-1; the
  // all-gather alone: the chunk it owns, pos).
  out.sends = segs(rs ? wrap(pos - 1, P) : pos);
  out.sendLead = out.sends.size();
  for (size_t c = 0; c < recvChunks.size(); ++c) {
    for (const ByteRange& r : recvChunks[c]) {
      out.recvs.push_back(r);
      out.recvReduces.push_back(recvChunkReduces[c]);
    }
    if (c + 1 < recvChunks.size()) out.sends.insert(out.sends.end(), recvChunks[c].begin(), recvChunks[c].end());
  }
  return out;
}

RingSchedule buildChainSchedule(int pos, int P, size_t bytes, size_t segmentBytes) {
  HC_ENFORCE(P >= 2 && pos >= 0 && pos < P);
  RingSchedule out;
  std::vector<ByteRange> all = computeSegments(0, bytes, 1, segmentBytes);
  if (pos == 0) {
    out.sends = all;
    out.sendLead = all.size();
    return out;
  }
  out.recvs = all;
  out.recvReduces.assign(all.size(), 0);
  if (pos != P - 1) out.sends = all;  // forward each segment once it has arrived
  return out;
}

}  // namespace hetcomm
