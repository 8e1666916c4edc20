#include "algorithms/hierarchical.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "algorithms/flow_pipeline.h"
#include "algorithms/local_group.h"
#include "algorithms/ring_schedule.h"
#include "common/error.h"
#include "common/fingerprint.h"

namespace hetcomm {

namespace {

// Hosts (each a list of ranks, ascending) partition 0..size-1, and holders[b][h], a rank of host h,
// never goes back to an earlier rank of the host from block to block: each rank's blocks are one
// range, in the order of the host's ranks, as the host's reduce-scatter lays them out.
void checkHostLayout(const std::vector<std::vector<int>>& hosts, const std::vector<std::vector<int>>& holders,
                     int size, const char* what) {
  std::vector<int> hostOf(size, -1);
  for (size_t h = 0; h < hosts.size(); ++h) {
    if (hosts[h].empty() || !std::is_sorted(hosts[h].begin(), hosts[h].end())) {
      throw CommError(strCat("hetcomm: a ", what, " plan lists each host's ranks ascending (host ", h, " does not)"));
    }
    for (int r : hosts[h]) {
      if (r < 0 || r >= size || hostOf[r] != -1) {
        throw CommError(strCat("hetcomm: the ", what, " plan's hosts must partition the ranks 0..", size - 1, " (rank ",
                               r, ")"));
      }
      hostOf[r] = static_cast<int>(h);
    }
  }
  for (int r = 0; r < size; ++r) {
    if (hostOf[r] < 0) throw CommError(strCat("hetcomm: rank ", r, " is in no host of the ", what, " plan"));
  }
  for (size_t b = 0; b < holders.size(); ++b) {
    if (holders[b].size() != hosts.size()) {
      throw CommError(strCat("hetcomm: block ", b, " of the ", what, " plan names ", holders[b].size(),
                             " holders for ", hosts.size(), " hosts"));
    }
    for (size_t h = 0; h < hosts.size(); ++h) {
      const int r = holders[b][h];
      if (r < 0 || r >= size || hostOf[r] != static_cast<int>(h)) {
        throw CommError(strCat("hetcomm: block ", b, "'s holder in host ", h, " is rank ", r, ", not a rank of that host"));
      }
      if (b > 0 && r < holders[b - 1][h]) {
        throw CommError(strCat("hetcomm: in a ", what, " plan each rank's blocks are contiguous and in rank order (block ",
                               b, " goes back to rank ", r, " in host ", h, ")"));
      }
    }
  }
}

void checkShares(const std::vector<double>& shares, const char* what) {
  double sum = 0;
  for (double s : shares) {
    if (!(s >= 0) || !std::isfinite(s)) throw CommError(strCat("hetcomm: site plan ", what, " must be finite and >= 0"));
    sum += s;
  }
  if (!(sum > 0)) throw CommError(strCat("hetcomm: site plan ", what, " must not all be zero"));
}

}  // namespace

void SitePlan::validate(int size) const {
  if (sites.empty()) throw CommError("hetcomm: a site plan needs at least one site");
  std::vector<int> siteOf(size, -1);
  for (size_t s = 0; s < sites.size(); ++s) {
    if (sites[s].empty()) throw CommError(strCat("hetcomm: site ", s, " of the site plan has no ranks"));
    for (int r : sites[s]) {
      if (r < 0 || r >= size || siteOf[r] != -1) {
        throw CommError(strCat("hetcomm: the site plan's sites must partition the ranks 0..", size - 1,
                               " (rank ", r, " is out of range or in two sites)"));
      }
      siteOf[r] = static_cast<int>(s);
    }
  }
  for (int r = 0; r < size; ++r) {
    if (siteOf[r] < 0) throw CommError(strCat("hetcomm: rank ", r, " is in no site of the site plan"));
  }
  if (blockOwners.empty() || blockOwners.size() != blockShares.size()) {
    throw CommError(strCat("hetcomm: a site plan needs at least one block and one share per block (", blockOwners.size(),
                           " blocks, ", blockShares.size(), " shares)"));
  }
  for (size_t b = 0; b < blockOwners.size(); ++b) {
    if (blockOwners[b].size() != sites.size()) {
      throw CommError(strCat("hetcomm: block ", b, " of the site plan names ", blockOwners[b].size(), " owners for ",
                             sites.size(), " sites"));
    }
    for (size_t s = 0; s < sites.size(); ++s) {
      const int r = blockOwners[b][s];
      if (r < 0 || r >= size || siteOf[r] != static_cast<int>(s)) {
        throw CommError(strCat("hetcomm: block ", b, "'s owner in site ", s, " is rank ", r, ", not a rank of that site"));
      }
    }
  }
  if (siteShares.size() != sites.size()) {
    throw CommError(strCat("hetcomm: a site plan needs one site share per site (", siteShares.size(), " for ",
                           sites.size(), ")"));
  }
  checkShares(blockShares, "block shares");
  checkShares(siteShares, "site shares");
  if (localInner && !hosts.empty()) throw CommError("hetcomm: a site plan has either local_inner or hosts, not both");
  if (localInner) checkHostLayout(sites, blockOwners, size, "host");
  if (!hosts.empty()) {
    if (holders.size() != blockOwners.size()) {
      throw CommError(strCat("hetcomm: a three-level plan needs one holder list per block (", holders.size(), " for ",
                             blockOwners.size(), " blocks)"));
    }
    checkHostLayout(hosts, holders, size, "three-level");
    std::vector<int> hostOf(size, -1);
    for (size_t h = 0; h < hosts.size(); ++h) {
      for (int r : hosts[h]) hostOf[r] = static_cast<int>(h);
      for (int r : hosts[h]) {
        if (siteOf[r] != siteOf[hosts[h][0]]) {
          throw CommError(strCat("hetcomm: host ", h, " of the three-level plan spans two sites (ranks ", hosts[h][0],
                                 " and ", r, ")"));
        }
      }
    }
    for (size_t b = 0; b < blockOwners.size(); ++b) {
      for (size_t s = 0; s < sites.size(); ++s) {
        const int owner = blockOwners[b][s];
        if (holders[b][hostOf[owner]] != owner) {
          throw CommError(strCat("hetcomm: block ", b, "'s owner in site ", s, " (rank ", owner,
                                 ") does not hold it in its host"));
        }
      }
    }
  } else if (!holders.empty()) {
    throw CommError("hetcomm: a site plan has holders only with hosts");
  }
}

uint64_t SitePlan::fingerprint() const {
  Fingerprint f;
  f.mix(sites.size());
  for (const auto& site : sites) {
    f.mix(site.size());
    for (int r : site) f.mix(static_cast<uint64_t>(r));
  }
  for (const auto& owners : blockOwners) {
    for (int r : owners) f.mix(static_cast<uint64_t>(r));
  }
  for (double s : blockShares) f.mixDouble(s);
  for (double s : siteShares) f.mixDouble(s);
  f.mix(minBytes);
  f.mix(segmentBytes);
  f.mix(localInner ? 1 : 0);
  f.mix(hosts.size());
  for (const auto& host : hosts) {
    f.mix(host.size());
    for (int r : host) f.mix(static_cast<uint64_t>(r));
  }
  for (const auto& held : holders) {
    for (int r : held) f.mix(static_cast<uint64_t>(r));
  }
  return f.value();
}

namespace {

constexpr uint32_t kNone = UINT32_MAX;

std::vector<uint32_t> depsOf(uint32_t item) { return item == kNone ? std::vector<uint32_t>{} : std::vector<uint32_t>{item}; }

// The segments ("atoms") of the buffer: block b's piece k is cut by computeSegments; atoms[b][k]
// lists them. Every rank computes the same cuts.
struct Layout {
  std::vector<std::vector<std::vector<ByteRange>>> atoms;
  std::vector<std::vector<uint32_t>> firstId;  // [b][k]: the id of atoms[b][k][0]
  uint32_t total = 0;
};

Layout layoutOf(const SitePlan& plan, size_t count, size_t es, size_t segmentBytes) {
  Layout out;
  const size_t S = plan.sites.size();
  const std::vector<size_t> blockCounts = sharesToCounts(count, plan.blockShares);
  size_t at = 0;
  for (size_t b = 0; b < blockCounts.size(); ++b) {
    const std::vector<size_t> pieceCounts = sharesToCounts(blockCounts[b], plan.siteShares);
    out.atoms.emplace_back();
    out.firstId.emplace_back();
    for (size_t k = 0; k < S; ++k) {
      out.firstId[b].push_back(out.total);
      out.atoms[b].push_back(computeSegments(at, pieceCounts[k], es, segmentBytes));
      out.total += static_cast<uint32_t>(out.atoms[b][k].size());
      at += pieceCounts[k];
    }
  }
  return out;
}

}  // namespace

void allreduceHierarchical(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                           const SitePlan& plan) {
  HC_ENFORCE(ctx.device == nullptr || ((plan.localInner || !plan.hosts.empty()) && ctx.local != nullptr &&
                                        ctx.local->levelFor(ctx.device) != nullptr),
             "the hierarchical allreduce runs on host memory unless the host's inner level takes the device's");
  const int S = static_cast<int>(plan.sites.size());
  const size_t es = elementSize(dtype);
  const int me = ctx.rank;
  int s = -1, p = -1;
  for (int t = 0; t < S && s < 0; ++t) {
    auto it = std::find(plan.sites[t].begin(), plan.sites[t].end(), me);
    if (it != plan.sites[t].end()) {
      s = t;
      p = static_cast<int>(it - plan.sites[t].begin());
    }
  }
  HC_ENFORCE(s >= 0, "rank missing from a validated site plan");
  const std::vector<int>& site = plan.sites[s];
  const int m = static_cast<int>(site.size());
  // The plan's segment caps the adaptive one (RingPlan::segmentBytes); a forced one wins.
  const size_t segmentBytes = ctx.withSegmentCap(plan.segmentBytes).segmentBytesFor(count * es / ctx.size);
  const Layout L = layoutOf(plan, count, es, segmentBytes);
  const size_t B = plan.blockOwners.size();

  // Hosts as the inner level: the host's reduce-scatter through shared memory first, so that
  // this rank's chunk (its blocks, one range) holds the host's sum before the flows below start.
  // With two levels (localInner) the sites are the hosts and the owners the holders.
  const bool three = !plan.hosts.empty();
  const bool inner = plan.localInner || three;
  const std::vector<std::vector<int>>& hosts = three ? plan.hosts : plan.sites;
  const std::vector<std::vector<int>>& holders = three ? plan.holders : plan.blockOwners;
  int h = three ? -1 : s;
  for (size_t t = 0; three && t < hosts.size() && h < 0; ++t) {
    if (std::find(hosts[t].begin(), hosts[t].end(), me) != hosts[t].end()) h = static_cast<int>(t);
  }
  HC_ENFORCE(h >= 0, "rank missing from a validated three-level plan");
  const std::vector<int>& host = hosts[h];
  std::vector<size_t> localCounts;
  InnerLevel* level = nullptr;
  if (inner) {
    if (host.size() > 1 && (ctx.local == nullptr || ctx.local->ranks != host)) {
      throw CommError(strCat(ctx.prefix(), ": the plan's host of this rank (", host.size(),
                             " ranks) is not the set of ranks of its host's inner level"));
    }
    const std::vector<size_t> blockCounts = sharesToCounts(count, plan.blockShares);
    localCounts.assign(host.size(), 0);
    for (size_t b = 0; b < B; ++b) {
      localCounts[std::find(host.begin(), host.end(), holders[b][h]) - host.begin()] += blockCounts[b];
    }
    if (host.size() > 1) {
      level = ctx.local->levelFor(ctx.device);
      level->reduceScatterv(ctx, buf, localCounts, dtype, op, 0.0);
    }
  }
  // Device memory (a level that keeps the host's steps on the device): only this rank's chunk, the
  // blocks it holds, crosses to host memory for the steps between hosts, and comes back for the
  // host's all-gather. The flows below touch nothing else (every block a rank sends or receives
  // is one it holds: owners hold their blocks).
  CollectiveContext onHost = ctx;
  onHost.device = nullptr;
  char* base = buf;             // where the flows find byte 0 of the buffer
  size_t chunkFrom = 0, chunkBytes = count * es;
  if (ctx.device != nullptr) {
    const size_t me = std::find(host.begin(), host.end(), ctx.rank) - host.begin();
    for (size_t l = 0; l < me; ++l) chunkFrom += localCounts[l] * es;
    chunkBytes = localCounts[me] * es;
    char* staged = ctx.device->hostBuffer(std::max<size_t>(1, chunkBytes));
    ctx.device->copyToHost(staged, buf + chunkFrom, chunkBytes);
    ctx.device->waitFor(ctx.device->mark());
    base = staged;
  }

  FlowGraph g;
  g.dtype = dtype;
  g.op = op;
  // The interleaved chunk order below depends on the segment size: ranks must agree on it (a rank
  // with another HETCOMM_SEGMENT_BYTES would otherwise add misaligned bytes silently).
  g.step = static_cast<uint32_t>(std::min<size_t>(segmentBytes, UINT32_MAX));
  auto atomPtr = [&](const ByteRange& r) {
    HC_ENFORCE(r.offset >= chunkFrom && r.offset + r.bytes <= chunkFrom + chunkBytes,
               "a flow of the hierarchical allreduce outside this rank's chunk");
    return base + (r.offset - chunkFrom);
  };
  // Per atom (by id): the item after which this rank's copy holds the site's partial sum (own
  // chunk), the final value, and the ring's receive items.
  std::vector<uint32_t> siteDone(L.total, kNone), finalDone(L.total, kNone), rsRecv(L.total, kNone),
      agRecv(L.total, kNone);
  // The atoms (id, range) of ring position c's chunk, interleaved across its pieces: first
  // segment of every piece, then the second of every piece, ... In buffer order, the site ring
  // would finish the owner's last block only at the end of the reduce-scatter, so the cross-site
  // flows of that block would start late (measured: 1.30x the cut bound instead of 1.1x on two
  // sites of two); interleaved, every cross-site flow has its first segment after one ring step.
  auto atomsOf = [&](const std::function<bool(size_t)>& takes) {
    std::vector<std::pair<uint32_t, ByteRange>> out;
    std::vector<std::pair<size_t, int>> pieces;
    size_t longest = 0;
    for (size_t b = 0; b < B; ++b) {
      if (!takes(b)) continue;
      for (int k = 0; k < S; ++k) {
        pieces.emplace_back(b, k);
        longest = std::max(longest, L.atoms[b][k].size());
      }
    }
    for (size_t i = 0; i < longest; ++i) {
      for (const auto& [b, k] : pieces) {
        if (i < L.atoms[b][k].size()) out.emplace_back(L.firstId[b][k] + i, L.atoms[b][k][i]);
      }
    }
    return out;
  };
  auto chunk = [&](int c) {
    const int owner = site[((c % m) + m) % m];
    return atomsOf([&](size_t b) { return plan.blockOwners[b][s] == owner; });
  };
  // The hosts of this rank's site, ascending (three levels).
  std::vector<int> siteHosts;
  for (size_t t = 0; three && t < hosts.size(); ++t) {
    if (std::find(site.begin(), site.end(), hosts[t][0]) != site.end()) siteHosts.push_back(static_cast<int>(t));
  }

  // 1. Site reduce-scatter (ring_schedule.h's sequences over chunks of several ranges).
  if (m > 1 && !inner) {
    const int succ = site[(p + 1) % m], pred = site[(p + m - 1) % m];
    for (int k = 2; k <= m; ++k) {
      for (const auto& [id, r] : chunk(p - k)) rsRecv[id] = g.add(atomPtr(r), r.bytes, true, {});
    }
    for (const auto& [id, r] : chunk(p - 1)) {
      const uint32_t item = g.add(atomPtr(r), r.bytes, false, {});
      g.flow(succ, true).items.push_back(item);
    }
    for (int k = 2; k <= m - 1; ++k) {
      for (const auto& [id, r] : chunk(p - k)) {
        const uint32_t item = g.add(atomPtr(r), r.bytes, false, {rsRecv[id]});
        g.flow(succ, true).items.push_back(item);
      }
    }
    Flow& in = g.flow(pred, false);
    for (int k = 2; k <= m; ++k) {
      for (const auto& [id, r] : chunk(p - k)) in.items.push_back(rsRecv[id]);
    }
  }
  for (const auto& [id, r] : chunk(p)) siteDone[id] = rsRecv[id];  // kNone (no dependency) when m == 1

  // 1b. Site reduce (three levels): this rank's blocks that another host owns in the site go to
  // their owner; the blocks it owns come from the site's other hosts, added in host order.
  if (three) {
    for (int q : site) {
      if (q == me) continue;
      for (const auto& [id, r] : atomsOf([&](size_t b) { return holders[b][h] == me && plan.blockOwners[b][s] == q; })) {
        g.flow(q, true).items.push_back(g.add(atomPtr(r), r.bytes, false, {}));
      }
    }
    for (int t : siteHosts) {
      if (t == h) continue;
      for (int q : hosts[t]) {
        for (const auto& [id, r] : atomsOf([&](size_t b) { return plan.blockOwners[b][s] == me && holders[b][t] == q; })) {
          siteDone[id] = g.add(atomPtr(r), r.bytes, true, depsOf(siteDone[id]));
          g.flow(q, false).items.push_back(siteDone[id]);
        }
      }
    }
  }

  // 2-3. Across sites, for the blocks this rank owns: reduce-scatter then all-gather, per peer.
  // Reduce-scatter first for every site (in increasing order: the order of the sum), so that each
  // peer's flow carries its reduce-scatter items before its all-gather items.
  std::vector<uint32_t> partial(siteDone);  // piece s: the item after which the sum so far is in place
  for (int t = 0; t < S; ++t) {
    if (t == s) continue;
    for (size_t b = 0; b < B; ++b) {
      if (plan.blockOwners[b][s] != me) continue;
      const int q = plan.blockOwners[b][t];
      for (size_t i = 0; i < L.atoms[b][t].size(); ++i) {
        const uint32_t id = L.firstId[b][t] + i;
        const ByteRange& r = L.atoms[b][t][i];
        const uint32_t item = g.add(atomPtr(r), r.bytes, false, depsOf(siteDone[id]));
        g.flow(q, true).items.push_back(item);
      }
      for (size_t i = 0; i < L.atoms[b][s].size(); ++i) {
        const uint32_t id = L.firstId[b][s] + i;
        const ByteRange& r = L.atoms[b][s][i];
        const uint32_t item = g.add(atomPtr(r), r.bytes, true, depsOf(partial[id]));
        g.flow(q, false).items.push_back(item);
        partial[id] = item;
      }
    }
  }
  for (size_t b = 0; b < B; ++b) {
    if (plan.blockOwners[b][s] != me) continue;
    for (size_t i = 0; i < L.atoms[b][s].size(); ++i) finalDone[L.firstId[b][s] + i] = partial[L.firstId[b][s] + i];
  }
  for (int t = 0; t < S; ++t) {
    if (t == s) continue;
    for (size_t b = 0; b < B; ++b) {
      if (plan.blockOwners[b][s] != me) continue;
      const int q = plan.blockOwners[b][t];
      for (size_t i = 0; i < L.atoms[b][s].size(); ++i) {
        const uint32_t id = L.firstId[b][s] + i;
        const ByteRange& r = L.atoms[b][s][i];
        g.flow(q, true).items.push_back(g.add(atomPtr(r), r.bytes, false, depsOf(finalDone[id])));
      }
      for (size_t i = 0; i < L.atoms[b][t].size(); ++i) {
        const uint32_t id = L.firstId[b][t] + i;
        const ByteRange& r = L.atoms[b][t][i];
        finalDone[id] = g.add(atomPtr(r), r.bytes, false, {});
        g.flow(q, false).items.push_back(finalDone[id]);
      }
    }
  }

  // 4b. Site gather (three levels): the final blocks this rank owns to their holders in the site's
  // other hosts; this rank's other blocks from their owners.
  if (three) {
    for (int t : siteHosts) {
      if (t == h) continue;
      for (int q : hosts[t]) {
        for (const auto& [id, r] : atomsOf([&](size_t b) { return plan.blockOwners[b][s] == me && holders[b][t] == q; })) {
          g.flow(q, true).items.push_back(g.add(atomPtr(r), r.bytes, false, depsOf(finalDone[id])));
        }
      }
    }
    for (int q : site) {
      if (q == me) continue;
      for (const auto& [id, r] : atomsOf([&](size_t b) { return holders[b][h] == me && plan.blockOwners[b][s] == q; })) {
        g.flow(q, false).items.push_back(g.add(atomPtr(r), r.bytes, false, {}));
      }
    }
  }

  // 4. Site all-gather: this rank's chunk once final, then forwarding what arrives.
  if (m > 1 && !inner) {
    const int succ = site[(p + 1) % m], pred = site[(p + m - 1) % m];
    for (int k = 1; k <= m - 1; ++k) {
      for (const auto& [id, r] : chunk(p - k)) agRecv[id] = g.add(atomPtr(r), r.bytes, false, {});
    }
    for (const auto& [id, r] : chunk(p)) {
      const uint32_t item = g.add(atomPtr(r), r.bytes, false, depsOf(finalDone[id]));
      g.flow(succ, true).items.push_back(item);
    }
    for (int k = 1; k <= m - 2; ++k) {
      for (const auto& [id, r] : chunk(p - k)) {
        const uint32_t item = g.add(atomPtr(r), r.bytes, false, {agRecv[id]});
        g.flow(succ, true).items.push_back(item);
      }
    }
    for (int k = 1; k <= m - 1; ++k) {
      for (const auto& [id, r] : chunk(p - k)) g.flow(pred, false).items.push_back(agRecv[id]);
    }
  }
  // Flows with nothing to move (zero shares, tiny buffers) are left out on both sides alike.
  g.flows.erase(std::remove_if(g.flows.begin(), g.flows.end(), [](const Flow& f) { return f.items.empty(); }),
                g.flows.end());
  runFlows(onHost, g);
  ctx.path = onHost.path;
  if (ctx.device != nullptr) ctx.device->copyToDevice(buf + chunkFrom, base, chunkBytes);
  if (level != nullptr) {
    std::vector<size_t> blockBytes(localCounts);
    for (size_t& n : blockBytes) n *= es;
    level->allgatherv(ctx, buf, blockBytes);
  }
  if (inner) ctx.path = CollectivePath::kHierarchical;
}

}  // namespace hetcomm
