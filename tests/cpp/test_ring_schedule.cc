// Ring schedule (csrc/algorithms/ring_schedule): share -> count conversion, segmentation, and an
// in-process simulation of the ring's dataflow built from every position's schedule.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "algorithms/context.h"
#include "algorithms/ring_schedule.h"
#include "check.h"
#include "common/error.h"

using namespace hetcomm;

namespace {

std::string str(const ByteRange& r) { return strCat("[", r.offset, ", +", r.bytes, ")"); }
std::string str(const std::vector<size_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += strCat(i ? "," : "", v[i]);
  return s + "]";
}
size_t sum(const std::vector<size_t>& v) {
  size_t s = 0;
  for (size_t x : v) s += x;
  return s;
}
size_t totalBytes(const std::vector<ByteRange>& v) {
  size_t s = 0;
  for (const ByteRange& r : v) s += r.bytes;
  return s;
}
int wrap(int x, int P) { return ((x % P) + P) % P; }

}  // namespace

// ---------------------------------------------------------------------------------- sharesToCounts

TEST_CASE(shares_to_counts_hand_cases) {
  CHECK_EQ(str(sharesToCounts(10, {0.5, 0.5})), "[5,5]");
  CHECK_EQ(str(sharesToCounts(10, {1, 1, 1})), "[4,3,3]");  // remainder to the lowest index on ties
  CHECK_EQ(str(sharesToCounts(10, {1})), "[10]");
  CHECK_EQ(str(sharesToCounts(7, {0, 1, 0})), "[0,7,0]");
  CHECK_EQ(str(sharesToCounts(0, {1, 2})), "[0,0]");
  CHECK_EQ(str(sharesToCounts(5, {1, 1, 1, 1, 1, 1, 1, 1})), "[1,1,1,1,1,0,0,0]");
  CHECK_EQ(str(sharesToCounts(3, {0.2, 0.3, 0.5})), "[1,1,1]");  // floors 0,0,1; fractions .6 .9 .5
  CHECK_EQ(str(sharesToCounts(100, {3, 1})), "[75,25]");
  CHECK_EQ(str(sharesToCounts(2, {0, 1e-300, 0, 1e-300})), "[0,1,0,1]");
}

TEST_CASE(shares_to_counts_rejects_bad_shares) {
  CHECK_THROWS_AS(sharesToCounts(10, {}), std::logic_error);
  CHECK_THROWS_AS(sharesToCounts(10, {0, 0}), CommError);
  CHECK_THROWS_AS(sharesToCounts(10, {1, -0.5}), CommError);
  CHECK_THROWS_AS(sharesToCounts(10, {1, NAN}), CommError);
  CHECK_THROWS_AS(sharesToCounts(10, {1, INFINITY}), CommError);
}

TEST_CASE(shares_to_counts_random) {
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t P = 1 + rng() % 9;
    std::vector<double> shares(P);
    const int kind = trial % 4;
    for (double& s : shares) s = unit(rng) < 0.3 ? 0.0 : unit(rng);
    if (kind == 1) {  // one owner of everything
      std::fill(shares.begin(), shares.end(), 0.0);
      shares[rng() % P] = 1.0;
    }
    const double scale = kind == 2 ? std::ldexp(1.0, static_cast<int>(rng() % 1200) - 600) : 1.0;
    for (double& s : shares) s *= scale;
    if (std::all_of(shares.begin(), shares.end(), [](double s) { return s == 0; })) shares[rng() % P] = scale;
    const size_t N = kind == 3 ? (size_t(1) << 40) + rng() % 1000 : rng() % 100000;

    const std::vector<size_t> counts = sharesToCounts(N, shares);
    REQUIRE(counts.size() == P);
    CHECK_MSG(sum(counts) == N, "N=", N, " counts=", str(counts));
    CHECK(sharesToCounts(N, shares) == counts);  // deterministic
    long double total = 0;
    for (double s : shares) total += s;
    for (size_t i = 0; i < P; ++i) {
      if (shares[i] == 0) CHECK_MSG(counts[i] == 0, "zero share got ", counts[i], " N=", N);
      // Largest remainder: each count is the floor or the ceiling of its exact value.
      const long double exact = static_cast<long double>(N) * shares[i] / total;
      CHECK_MSG(std::fabs(static_cast<long double>(counts[i]) - exact) < 1.0L + 1e-6L * exact, "i=", i,
                " count=", counts[i], " exact=", static_cast<double>(exact));
    }
  }
}

TEST_CASE(prefix_offsets) {
  CHECK_EQ(str(prefixOffsets({3, 0, 5, 1})), "[0,3,3,8]");
  CHECK_EQ(str(prefixOffsets({})), "[]");
  CHECK_EQ(str(prefixOffsets({0})), "[0]");
}

// --------------------------------------------------------------------------------- segmentBytesFor

TEST_CASE(a_plans_segment_caps_the_adaptive_size) {
  CollectiveContext ctx;
  CHECK_EQ(ctx.segmentBytesFor(4 << 20), size_t(1) << 20);     // a quarter, at most 1 MiB
  CHECK_EQ(ctx.segmentBytesFor(512 << 10), size_t(128) << 10);
  CHECK_EQ(ctx.segmentBytesFor(1 << 10), size_t(32) << 10);     // at least 32 KiB
  const CollectiveContext capped = ctx.withSegmentCap(256 << 10);
  CHECK_EQ(capped.segmentBytesFor(4 << 20), size_t(256) << 10);   // capped
  CHECK_EQ(capped.segmentBytesFor(512 << 10), size_t(128) << 10); // never raised to the cap
  CHECK_EQ(ctx.segmentBytesFor(4 << 20), size_t(1) << 20);        // the original keeps no cap
  ctx.segmentBytes = 2 << 20;                                      // HETCOMM_SEGMENT_BYTES wins
  CHECK_EQ(ctx.withSegmentCap(256 << 10).segmentBytesFor(512 << 10), size_t(2) << 20);
}

// --------------------------------------------------------------------------------- computeSegments

TEST_CASE(compute_segments_cover_exactly) {
  std::mt19937_64 rng(5);
  CHECK(computeSegments(17, 0, 4, 64).empty());
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t es = size_t(1) << (rng() % 4);
    const size_t first = rng() % 1000, count = rng() % 3000;
    const size_t segBytes = trial % 5 == 0 ? rng() % 4 : 1 + rng() % 2000;  // sometimes < one element (or 0)
    const std::vector<ByteRange> segs = computeSegments(first, count, es, segBytes);
    const size_t perSeg = std::max<size_t>(1, segBytes / es);
    CHECK_EQ(segs.size(), (count + perSeg - 1) / perSeg);
    size_t at = first * es, smallest = std::numeric_limits<size_t>::max(), largest = 0;
    for (const ByteRange& r : segs) {
      CHECK_MSG(r.offset == at, "gap or overlap at ", str(r), " expected offset ", at);
      CHECK(r.bytes > 0 && r.bytes % es == 0);
      CHECK_MSG(r.bytes <= std::max(segBytes, es), str(r), " exceeds segment size ", segBytes);
      smallest = std::min(smallest, r.bytes);
      largest = std::max(largest, r.bytes);
      at += r.bytes;
    }
    CHECK_EQ(at, (first + count) * es);
    if (!segs.empty()) CHECK_MSG(largest - smallest <= es, "uneven: ", smallest, " .. ", largest);  // as even as possible
  }
}

// ------------------------------------------------------------------------------- ring simulation

namespace {

enum class ReadAt { kSend, kReceive };  // when a message's bytes are read from the sender's buffer

// Runs the dataflow of `sched` (one schedule per ring position; position i sends to i+1) on
// byte buffers `bufs`. Messages go through FIFO queues of at most `capacity` entries; actions are
// picked at random among those enabled, which models arbitrary relative speeds. Reduction adds
// little-endian uint32 words. ReadAt::kReceive reads the payload from the sender's buffer only when
// the receiver takes it (a zero-copy send that is still in flight), which checks the header's
// in-place safety argument. Returns "" or what went wrong (mismatch, deadlock).
std::string simulate(const std::vector<RingSchedule>& sched, std::vector<std::vector<uint8_t>>& bufs, ReadAt readAt,
                     size_t capacity, std::mt19937_64& rng) {
  const int P = static_cast<int>(sched.size());
  struct Message {
    ByteRange range;
    std::vector<uint8_t> payload;
  };
  std::vector<std::deque<Message>> link(P);  // link[i]: i -> i+1
  std::vector<size_t> ns(P, 0), nr(P, 0);
  for (;;) {
    std::vector<std::pair<int, bool>> enabled;  // (position, is send)
    for (int i = 0; i < P; ++i) {
      const RingSchedule& s = sched[i];
      const size_t j = ns[i];
      if (j < s.sends.size() && link[i].size() < capacity && (j < s.sendLead || nr[i] > j - s.sendLead)) {
        enabled.push_back({i, true});
      }
      if (nr[i] < s.recvs.size() && !link[wrap(i - 1, P)].empty()) enabled.push_back({i, false});
    }
    if (enabled.empty()) break;
    const auto [i, isSend] = enabled[rng() % enabled.size()];
    const RingSchedule& s = sched[i];
    if (isSend) {
      const ByteRange r = s.sends[ns[i]++];
      if (r.offset + r.bytes > bufs[i].size()) return strCat("position ", i, " sends out of bounds ", str(r));
      Message m{r, {}};
      if (readAt == ReadAt::kSend) m.payload.assign(bufs[i].begin() + r.offset, bufs[i].begin() + r.offset + r.bytes);
      link[i].push_back(std::move(m));
    } else {
      const int from = wrap(i - 1, P);
      Message m = std::move(link[from].front());
      link[from].pop_front();
      const size_t k = nr[i]++;
      const ByteRange want = s.recvs[k];
      if (!(m.range == want)) {
        return strCat("position ", i, " receive ", k, " expects ", str(want), " but ", from, " sent ", str(m.range));
      }
      if (readAt == ReadAt::kReceive) {
        m.payload.assign(bufs[from].begin() + m.range.offset, bufs[from].begin() + m.range.offset + m.range.bytes);
      }
      uint8_t* dst = bufs[i].data() + want.offset;
      if (s.recvReduces[k]) {
        if (want.offset % 4 || want.bytes % 4) return strCat("reduce of a range not made of whole words ", str(want));
        for (size_t w = 0; w < want.bytes; w += 4) {
          uint32_t a, b;
          std::memcpy(&a, dst + w, 4);
          std::memcpy(&b, m.payload.data() + w, 4);
          a += b;
          std::memcpy(dst + w, &a, 4);
        }
      } else {
        std::memcpy(dst, m.payload.data(), want.bytes);
      }
    }
  }
  for (int i = 0; i < P; ++i) {
    if (ns[i] != sched[i].sends.size() || nr[i] != sched[i].recvs.size()) {
      return strCat("deadlock: position ", i, " stuck at send ", ns[i], "/", sched[i].sends.size(), ", receive ",
                    nr[i], "/", sched[i].recvs.size());
    }
    if (!link[i].empty()) return strCat("link ", i, " -> ", wrap(i + 1, P), " has unreceived messages");
  }
  return "";
}

// Structural properties shared by every ring and chain schedule.
void checkStructure(const std::vector<RingSchedule>& sched, size_t bufferBytes, const std::string& what) {
  const int P = static_cast<int>(sched.size());
  for (int i = 0; i < P; ++i) {
    const RingSchedule& s = sched[i];
    CHECK_MSG(s.recvReduces.size() == s.recvs.size(), what, " pos ", i);
    // Position i receives exactly what its predecessor sends, in the same order.
    CHECK_MSG(s.recvs == sched[wrap(i - 1, P)].sends, what, " pos ", i, ": recvs differ from the sends of ", wrap(i - 1, P));
    // S_i = [lead] ++ (R_i minus its last chunk): send j >= lead forwards receive j - lead.
    CHECK_MSG(s.sendLead <= s.sends.size(), what, " pos ", i);
    for (size_t j = s.sendLead; j < s.sends.size(); ++j) {
      if (j - s.sendLead >= s.recvs.size() || !(s.sends[j] == s.recvs[j - s.sendLead])) {
        CHECK_MSG(false, what, " pos ", i, ": send ", j, " is not receive ", j - s.sendLead);
        break;
      }
    }
    for (const ByteRange& r : s.sends) CHECK_MSG(r.bytes > 0 && r.offset + r.bytes <= bufferBytes, what, " ", str(r));
  }
}

struct RingCase {
  int P;
  std::vector<size_t> counts;
  size_t segBytes;
};

std::vector<RingCase> ringCases(std::mt19937_64& rng) {
  std::vector<RingCase> out;
  const size_t segChoices[] = {1, 4, 8, 12, 20, 64, 1 << 20};
  for (int P = 2; P <= 6; ++P) {
    for (int t = 0; t < 30; ++t) {
      std::vector<size_t> counts(P);
      const int kind = t % 6;
      for (size_t& c : counts) c = rng() % 3 == 0 ? 0 : rng() % 40;                   // random, zeros
      if (kind == 1) {                                                               // one owner
        std::fill(counts.begin(), counts.end(), 0);
        counts[rng() % P] = 1 + rng() % 50;
      }
      if (kind == 2) std::fill(counts.begin(), counts.end(), 1 + t % 7);             // uniform
      if (kind == 3) std::fill(counts.begin(), counts.end(), 0), counts[rng() % P] = 1;  // N = 1
      if (kind == 4) std::fill(counts.begin(), counts.end(), 0);                     // N = 0
      out.push_back({P, counts, segChoices[rng() % 7]});
    }
  }
  return out;
}

std::vector<std::vector<uint8_t>> randomBuffers(int P, size_t bytes, std::mt19937_64& rng) {
  std::vector<std::vector<uint8_t>> bufs(P, std::vector<uint8_t>(bytes));
  for (auto& b : bufs)
    for (auto& x : b) x = static_cast<uint8_t>(rng());
  return bufs;
}

uint32_t word(const std::vector<uint8_t>& b, size_t e) {
  uint32_t w;
  std::memcpy(&w, b.data() + 4 * e, 4);
  return w;
}

// Builds every position's schedule for one case and phase set, checks its structure and link
// loads, simulates it under several interleavings and checks the result.
void runRingCase(const RingCase& rc, RingPhases phases, std::mt19937_64& rng) {
  const int P = rc.P;
  const size_t es = 4, N = sum(rc.counts);
  const std::vector<size_t> offsets = prefixOffsets(rc.counts);
  const std::string what = strCat("P=", P, " counts=", str(rc.counts), " seg=", rc.segBytes, " phases=",
                                  static_cast<int>(phases));
  std::vector<RingSchedule> sched;
  for (int i = 0; i < P; ++i) sched.push_back(buildRingSchedule(i, P, offsets, rc.counts, es, rc.segBytes, phases));
  checkStructure(sched, N * es, what);

  const bool rs = phases != RingPhases::kAllGather, ag = phases != RingPhases::kReduceScatter;
  for (int i = 0; i < P; ++i) {
    const int next = wrap(i + 1, P), prev = wrap(i - 1, P);
    // Per-link load: the reduce-scatter sends every chunk but o_i, the all-gather every chunk but o_{i+1}.
    const size_t want = ((rs ? N - rc.counts[i] : 0) + (ag ? N - rc.counts[next] : 0)) * es;
    CHECK_MSG(totalBytes(sched[i].sends) == want, what, " pos ", i, " sends ", totalBytes(sched[i].sends),
              " bytes, want ", want);
    size_t reduced = 0, written = 0;
    for (size_t k = 0; k < sched[i].recvs.size(); ++k) (sched[i].recvReduces[k] ? reduced : written) += sched[i].recvs[k].bytes;
    CHECK_MSG(reduced == (rs ? N - rc.counts[prev] : 0) * es, what, " pos ", i, " reduces ", reduced, " bytes");
    CHECK_MSG(written == (ag ? N - rc.counts[i] : 0) * es, what, " pos ", i, " writes ", written, " bytes");
  }

  std::vector<int> owner(N);
  for (int c = 0; c < P; ++c)
    for (size_t e = offsets[c]; e < offsets[c] + rc.counts[c]; ++e) owner[e] = c;
  for (ReadAt readAt : {ReadAt::kSend, ReadAt::kReceive}) {
    for (size_t capacity : {size_t(1), size_t(3), std::numeric_limits<size_t>::max()}) {
      const std::vector<std::vector<uint8_t>> init = randomBuffers(P, N * es, rng);
      std::vector<std::vector<uint8_t>> bufs = init;
      const std::string err = simulate(sched, bufs, readAt, capacity, rng);
      CHECK_MSG(err.empty(), what, " capacity=", capacity, " readAtReceive=", readAt == ReadAt::kReceive, ": ", err);
      if (!err.empty()) return;
      int bad = 0;
      for (size_t e = 0; e < N && bad < 3; ++e) {
        uint32_t total = 0;
        for (int i = 0; i < P; ++i) total += word(init[i], e);
        for (int i = 0; i < P; ++i) {
          uint32_t want;
          if (phases == RingPhases::kAllReduce) want = total;
          else if (phases == RingPhases::kAllGather) want = word(init[owner[e]], e);
          else if (i == owner[e]) want = total;  // reduce-scatter: only the owner's chunk is defined
          else continue;
          if (word(bufs[i], e) != want && bad++ < 3) {
            CHECK_MSG(false, what, " capacity=", capacity, " readAtReceive=", readAt == ReadAt::kReceive, ": pos ",
                      i, " element ", e, " = ", word(bufs[i], e), ", want ", want);
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE(ring_allreduce_simulation) {
  std::mt19937_64 rng(1);
  for (const RingCase& rc : ringCases(rng)) runRingCase(rc, RingPhases::kAllReduce, rng);
}

TEST_CASE(ring_reduce_scatter_simulation) {
  std::mt19937_64 rng(2);
  for (const RingCase& rc : ringCases(rng)) runRingCase(rc, RingPhases::kReduceScatter, rng);
}

TEST_CASE(ring_allgather_simulation) {
  std::mt19937_64 rng(3);
  for (const RingCase& rc : ringCases(rng)) runRingCase(rc, RingPhases::kAllGather, rng);
}

TEST_CASE(chain_broadcast_simulation) {
  std::mt19937_64 rng(4);
  for (int P = 2; P <= 6; ++P) {
    for (size_t bytes : {size_t(0), size_t(1), size_t(7), size_t(100), size_t(4099)}) {
      for (size_t segBytes : {size_t(1), size_t(3), size_t(64), size_t(1) << 20}) {
        const std::string what = strCat("chain P=", P, " bytes=", bytes, " seg=", segBytes);
        std::vector<RingSchedule> sched;
        for (int i = 0; i < P; ++i) sched.push_back(buildChainSchedule(i, P, bytes, segBytes));
        checkStructure(sched, bytes, what);
        for (int i = 0; i < P; ++i) {
          CHECK_MSG(totalBytes(sched[i].sends) == (i == P - 1 ? 0 : bytes), what, " pos ", i);
          CHECK_MSG(totalBytes(sched[i].recvs) == (i == 0 ? 0 : bytes), what, " pos ", i);
          for (uint8_t r : sched[i].recvReduces) CHECK_MSG(r == 0, what, " chain receives never reduce");
        }
        for (ReadAt readAt : {ReadAt::kSend, ReadAt::kReceive}) {
          for (size_t capacity : {size_t(1), std::numeric_limits<size_t>::max()}) {
            const std::vector<std::vector<uint8_t>> init = randomBuffers(P, bytes, rng);
            std::vector<std::vector<uint8_t>> bufs = init;
            const std::string err = simulate(sched, bufs, readAt, capacity, rng);
            CHECK_MSG(err.empty(), what, ": ", err);
            for (int i = 0; i < P; ++i) CHECK_MSG(bufs[i] == init[0], what, " capacity=", capacity, ": pos ", i, " differs from the root");
          }
        }
      }
    }
  }
}

// The simulator itself must catch broken schedules, or the tests above prove nothing.
TEST_CASE(simulator_detects_deadlock_and_mismatch) {
  std::mt19937_64 rng(9);
  const std::vector<size_t> counts = {5, 3, 4};
  const std::vector<size_t> offsets = prefixOffsets(counts);
  std::vector<RingSchedule> sched;
  for (int i = 0; i < 3; ++i) sched.push_back(buildRingSchedule(i, 3, offsets, counts, 4, 8, RingPhases::kAllReduce));
  {
    std::vector<RingSchedule> broken = sched;
    for (RingSchedule& s : broken) s.sendLead = 0;  // everyone waits to receive before sending
    auto bufs = randomBuffers(3, 12 * 4, rng);
    const std::string err = simulate(broken, bufs, ReadAt::kSend, 1, rng);
    CHECK_MSG(err.find("deadlock") != std::string::npos, "got '", err, "'");
  }
  {
    std::vector<RingSchedule> broken = sched;
    std::swap(broken[1].recvs[0], broken[1].recvs[1]);
    auto bufs = randomBuffers(3, 12 * 4, rng);
    const std::string err = simulate(broken, bufs, ReadAt::kSend, 1, rng);
    CHECK_MSG(err.find("expects") != std::string::npos, "got '", err, "'");
  }
  {  // a schedule that finishes but leaves a message unreceived
    std::vector<RingSchedule> broken = sched;
    broken[2].recvs.pop_back();
    broken[2].recvReduces.pop_back();
    auto bufs = randomBuffers(3, 12 * 4, rng);
    CHECK(!simulate(broken, bufs, ReadAt::kSend, std::numeric_limits<size_t>::max(), rng).empty());
  }
}

TEST_CASE(ring_schedule_rejects_bad_arguments) {
  const std::vector<size_t> counts = {2, 2}, offsets = prefixOffsets(counts);
  CHECK_THROWS_AS(buildRingSchedule(0, 1, {0}, {4}, 4, 64, RingPhases::kAllReduce), std::logic_error);
  CHECK_THROWS_AS(buildRingSchedule(2, 2, offsets, counts, 4, 64, RingPhases::kAllReduce), std::logic_error);
  CHECK_THROWS_AS(buildRingSchedule(-1, 2, offsets, counts, 4, 64, RingPhases::kAllReduce), std::logic_error);
  CHECK_THROWS_AS(buildRingSchedule(0, 3, offsets, counts, 4, 64, RingPhases::kAllReduce), std::logic_error);
  CHECK_THROWS_AS(buildChainSchedule(0, 1, 10, 4), std::logic_error);
}
