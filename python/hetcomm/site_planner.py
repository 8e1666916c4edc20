"""Plans for clusters of several sites: the hierarchical schedule, its predicted time, the cut bound.

The engine's site-aware AllReduce (``csrc/algorithms/hierarchical.h``) takes a `SitePlan`:

* ``sites``: each site's ranks in the order of its ring;
* ``blocks``: the buffer is cut into blocks laid out back to back; ``blocks[b][s]`` is block b's
  owner in site s, and ``block_shares[b]`` its fraction of the buffer;
* ``site_shares``: every block is cut again into one piece per site; piece k
  (``site_shares[k]`` of the block) is reduced across sites by the block's owner in site k.

It runs, in one pipelined dataflow: a reduce-scatter inside each site (a rank's chunk is the
union of the blocks it owns there), then for every block a direct reduce-scatter and all-gather
between the block's owners (one per site, so sites of unequal sizes need no root), then an
all-gather inside each site.

Cost model (derived from the schedule; N bytes, all fractions normalised to sum 1)
=====================================================================================
Let ``o_r = sum of x_b over blocks r owns`` (its chunk in its site), ``x_b`` the block shares and
``w_k`` the site shares, and S the number of sites.

* Ring link a -> b inside site s (a site of m >= 2 ranks): the ring of ``ring_schedule.h`` over
  the site's chunks, so ``(2 - o_a - o_b) N`` (for m = 2 that is N whatever the shares).
* Link r -> q between sites s and t: r sends q piece t of every block they both own in the
  reduce-scatter and piece s in the all-gather: ``sum of x_b (w_t + w_s) N`` over those blocks;
  q -> r carries the same.
* Out of site s in all: ``(1 - w_s) N`` in the reduce-scatter (the pieces others reduce) and
  ``(S - 1) w_s N`` in the all-gather, i.e. ``(1 + (S - 2) w_s) N``; the same comes in. Two
  sites: N each way, the least any algorithm can move across a site's cut. A shared uplink
  (``LinkModel.uplinks``) carries the sum of the loads of the links that leave (enter) its group.
* Reduce at r: the site ring's ``(1 - o_pred(r)) N`` plus ``(S - 1) w_s o_r N`` from the others.

As for the ring (planner.py), the stages are pipelined segment by segment, so the time is the
busiest resource's load over its capacity::

    T_bw = max( ring links, cross-site links, uplinks, reducers: load / rate )

plus latency: ``2 (m_max - 1) + 2`` dependent messages (the site rings' steps and the two
cross-site steps) at ``alpha`` each, and pipeline fill: one segment over the path of a segment
through a site ring and across a site pair, ``seg * ((m_max - 1) * mean(1 / ring bw) +
mean(1 / cross-site bw))`` (the ring's own convention: half the path, since the all-gather's fill
overlaps the reduce-scatter's drain)::

    predict = N * T_bw + (2 (m_max - 1) + 2) alpha + fill

Worked example (the issue's cluster): sites {0, 2} and {1, 3}, 1000 Mbit/s inside (125 MB/s),
100 Mbit/s (12.5 MB/s) on each of the four cross-site pairs, N = 16 MB. Blocks (0,1), (0,3),
(2,1), (2,3) with x = 1/4 each: every cross-site link carries N/4 = 4 MB each way: 0.32 s; the
ring links inside a site carry N = 16 MB at 125 MB/s: 0.128 s. T = 0.32 s, which is the cut
bound: N over the 4 x 12.5 MB/s crossing the cut. The flat ring crosses the WAN on every link of
the ring order 0>1>2>3: 1.5 N over 12.5 MB/s = 1.92 s.

Choosing the plan (`best_site_plan`)
====================================
Given the sites (`hetcomm.sites`), each site's ring order is the planner's best ring for the site
alone (`planner.best_plan` on the restricted model). Site shares equalise the sites' cross-site
time when S >= 3: site s moves ``(1 + (S - 2) w_s) N`` through a cut of capacity ``C_s``, and
``w_s = ((2S - 2) C_s / sum C - 1) / (S - 2)`` (from ``(1 + (S - 2) w_s) / C_s = tau`` and
``sum w = 1``) makes those equal; a negative w_s becomes 0 and the rest is solved again over the
others (``(S - 2 + |A|) C_s / sum over A of C`` for the set A left). With two sites the cut's
load is N whatever w, and w = 1/2. Blocks are every combination
of one owner per site (up to `MAX_BLOCKS`; beyond, one block per rank of the largest site,
owners taken round robin) and their shares come from a linear program, HiGHS dual simplex as for
the ring::

    minimise T   subject to   load(link) <= T rate(link) for every resource above,
                              sum x = 1, x >= 0

(all loads are linear in x once w is fixed). Among optimal x a second LP picks the one that
minimises the largest cross-site link time, so that a shared uplink (where any split is optimal)
still spreads blocks over all cross-site pairs. Shares are snapped like the ring's
(``planner._snap_shares``).

Flat or hierarchical (`choose`)
===============================
Per message size, the predicted times of the flat ring plan and of the site plan decide; the
site plan is used from the smallest power of two at which it is predicted faster by more than
``min_gain`` (``SitePlan.min_bytes``), never by a fixed rule. One site: the flat ring.

The cut bound (`cut_bound_seconds`)
===================================
Every element of the result depends on every rank's input, so at least N bytes cross every cut
(S, complement) in each direction; a cut's capacity is at most the sum of its crossing links, and
traffic between uplink groups is at most the sum of the out-uplinks on the sending side and of
the in-uplinks on the receiving side. ``max over cuts of N / capacity`` is a lower bound on any
AllReduce; cuts are enumerated for P <= `MAX_CUT_RANKS`, else single ranks, sites and groups.
With S >= 3 sites the classic bound with sites as nodes is tighter: S site partials of an element
need S - 1 cross-site transfers to be combined and S - 1 to spread the result (for algorithms
that send values, not codes), so ``2 (S - 1) N / min(sum of the sites' out-cuts, sum of their
in-cuts)``; three
equal sites: 4/3 N through each site's cut, which the hierarchical schedule moves.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from hetcomm import planner
from hetcomm.planner import LinkModel

MAX_BLOCKS = 64          # every owner combination up to this many blocks
MAX_CUT_RANKS = 14       # cut_bound_seconds enumerates every cut up to this world size
CROSS_TIE_RTOL = 1e-6    # LP 2 keeps T within this of the optimum


@dataclass(frozen=True)
class SitePlan:
    """The engine's ``set_site_plan`` arguments (see the module docstring)."""

    sites: tuple[tuple[int, ...], ...]
    blocks: tuple[tuple[int, ...], ...]
    block_shares: tuple[float, ...]
    site_shares: tuple[float, ...]
    min_bytes: int = 0
    segment_bytes: int = 0
    #: the sites are the group's hosts and the steps inside each run through shared memory
    #: (`host_plan`); the intra-host links then carry nothing
    local_inner: bool = False

    def __post_init__(self) -> None:
        sites = tuple(tuple(int(r) for r in site) for site in self.sites)
        blocks = tuple(tuple(int(r) for r in owners) for owners in self.blocks)
        P = sum(len(s) for s in sites)
        if not sites or sorted(r for s in sites for r in s) != list(range(P)) or any(not s for s in sites):
            raise ValueError(f"hetcomm site plan: sites {sites} must partition the ranks 0..{P - 1}")
        site_of = {r: k for k, s in enumerate(sites) for r in s}
        if not blocks or len(blocks) != len(self.block_shares):
            raise ValueError(f"hetcomm site plan: {len(blocks)} blocks and {len(self.block_shares)} block shares")
        for b, owners in enumerate(blocks):
            if len(owners) != len(sites) or any(site_of.get(r) != k for k, r in enumerate(owners)):
                raise ValueError(f"hetcomm site plan: block {b}'s owners {owners} must be one rank of each site, "
                                 "in site order")
        if len(self.site_shares) != len(sites):
            raise ValueError(f"hetcomm site plan: {len(self.site_shares)} site shares for {len(sites)} sites")
        for what, shares in (("block", self.block_shares), ("site", self.site_shares)):
            if not all(math.isfinite(float(x)) and float(x) >= 0 for x in shares) or not sum(shares) > 0:
                raise ValueError(f"hetcomm site plan: {what} shares must be finite, >= 0 and not all zero")
        object.__setattr__(self, "sites", sites)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "block_shares", tuple(float(x) for x in self.block_shares))
        object.__setattr__(self, "site_shares", tuple(float(x) for x in self.site_shares))

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.sites)

    def site_of(self) -> list[int]:
        out = [0] * self.world_size
        for k, site in enumerate(self.sites):
            for r in site:
                out[r] = k
        return out

    def chunk_shares(self) -> list[float]:
        """Each rank's fraction of the buffer in its site's ring (its blocks' shares summed)."""
        total = math.fsum(self.block_shares)
        out = [0.0] * self.world_size
        for owners, x in zip(self.blocks, self.block_shares):
            for r in owners:
                out[r] += x / total
        return out

    def link_loads(self) -> dict[tuple[int, int], float]:
        """Bytes per byte of buffer on every directed link the schedule uses (module docstring)."""
        S = len(self.sites)
        xt, wt = math.fsum(self.block_shares), math.fsum(self.site_shares)
        x = [v / xt for v in self.block_shares]
        w = [v / wt for v in self.site_shares]
        o = self.chunk_shares()
        loads: dict[tuple[int, int], float] = {}
        for site in self.sites:
            m = len(site)
            for p in range(m if m > 1 and not self.local_inner else 0):
                a, b = site[p], site[(p + 1) % m]
                loads[(a, b)] = loads.get((a, b), 0.0) + 2.0 - o[a] - o[b]
        for owners, xb in zip(self.blocks, x):
            for s, t in itertools.permutations(range(S), 2):
                key = (owners[s], owners[t])
                loads[key] = loads.get(key, 0.0) + xb * (w[s] + w[t])
        return loads

    def reduce_loads(self) -> list[float]:
        """Bytes each rank reduces per byte of buffer."""
        S = len(self.sites)
        wt = math.fsum(self.site_shares)
        o = self.chunk_shares()
        out = [0.0] * self.world_size
        for k, site in enumerate(self.sites):
            m = len(site)
            for p, r in enumerate(site):
                # (With local_inner the host's reduce-scatter adds (m - 1) o_r in shared memory,
                # at memory speed, which no link rate describes: left out like its copies.)
                ring = 1.0 - o[site[(p - 1) % m]] if m > 1 and not self.local_inner else 0.0
                out[r] = ring + (S - 1) * self.site_shares[k] / wt * o[r]
        return out


def seconds_per_byte(loads: dict[tuple[int, int], float], reduce_loads: Sequence[float], model: LinkModel) -> float:
    """``T_bw / N`` for any schedule given its per-link and per-rank loads (bytes per byte)."""
    worst = 0.0
    for (a, b), v in loads.items():
        worst = max(worst, v / model.bw[a][b])
    worst = max(worst, planner.uplink_seconds_per_byte(loads, model))
    for r, v in enumerate(reduce_loads):
        if math.isfinite(model.reduce_bps[r]):
            worst = max(worst, v / model.reduce_bps[r])
    return worst


def site_plan_seconds_per_byte(plan: SitePlan, model: LinkModel) -> float:
    if plan.world_size != model.world_size:
        raise ValueError(f"hetcomm site plan: plan for {plan.world_size} ranks, model for {model.world_size}")
    return seconds_per_byte(plan.link_loads(), plan.reduce_loads(), model)


def _segment_bytes(plan: SitePlan, model: LinkModel, nbytes: int) -> float:
    if plan.segment_bytes > 0 and model.segment_bytes == 0:
        return float(plan.segment_bytes)
    return planner._segment_bytes(model, nbytes / model.world_size)


def predict_site_plan_seconds(plan: SitePlan, model: LinkModel, nbytes: int) -> float:
    """Predicted seconds for an AllReduce of ``nbytes`` with the site plan (module docstring)."""
    if nbytes <= 0:
        return 0.0
    m_max = max(len(s) for s in plan.sites)
    site_of = plan.site_of()
    ring_inv, cross_inv = [], []
    for (a, b) in plan.link_loads():
        (ring_inv if site_of[a] == site_of[b] else cross_inv).append(1.0 / model.bw[a][b])
    seg = _segment_bytes(plan, model, nbytes)
    fill = seg * ((m_max - 1) * (sum(ring_inv) / len(ring_inv) if ring_inv else 0.0)
                  + (sum(cross_inv) / len(cross_inv) if cross_inv else 0.0))
    return nbytes * site_plan_seconds_per_byte(plan, model) + (2 * (m_max - 1) + 2) * model.alpha + fill


# --------------------------------------------------------------------------------------------
# Choosing a site plan
# --------------------------------------------------------------------------------------------

def _site_capacity(model: LinkModel, members: Sequence[int]) -> float:
    """What can leave (and enter) a site at once: its crossing links, capped by a shared uplink."""
    inside = set(members)
    P = model.world_size
    out = sum(model.bw[a][b] for a in inside for b in range(P) if b not in inside)
    into = sum(model.bw[b][a] for a in inside for b in range(P) if b not in inside)
    for group, out_bps, in_bps in model.uplinks:
        if inside <= set(group):
            out, into = min(out, out_bps), min(into, in_bps)
    return min(out, into)


def site_shares_for(model: LinkModel, sites: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Site shares equalising the sites' cross-site times (module docstring); 1/S for S <= 2."""
    S = len(sites)
    if S <= 2:
        return (1.0 / S,) * S
    cap = [_site_capacity(model, s) for s in sites]
    active = list(range(S))
    w = [0.0] * S
    while True:
        total = sum(cap[k] for k in active)
        for k in range(S):
            w[k] = max(0.0, ((S - 2 + len(active)) * cap[k] / total - 1.0) / (S - 2)) if k in active else 0.0
        dropped = [k for k in active if w[k] <= 0.0]
        if not dropped or len(dropped) == len(active):
            break
        active = [k for k in active if k not in dropped]
    total = sum(w)
    if not total > 0:
        return (1.0 / S,) * S
    return planner._snap_shares([v / total for v in w])


def _candidate_blocks(sites: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    combos = 1
    for s in sites:
        combos *= len(s)
    if combos <= MAX_BLOCKS:
        return [tuple(c) for c in itertools.product(*sites)]
    n = max(len(s) for s in sites)
    return [tuple(s[i % len(s)] for s in sites) for i in range(n)]


def _site_order(model: LinkModel, members: Sequence[int]) -> tuple[int, ...]:
    if len(members) <= 2:
        return tuple(members)
    local = planner.best_plan(model.restricted(members))
    return tuple(members[i] for i in local.order)


def _solve_blocks(model: LinkModel, sites: Sequence[Sequence[int]], blocks: Sequence[tuple[int, ...]],
                  w: Sequence[float]) -> list[float]:
    """Block shares minimising T (LP 1), then the largest cross-site link time (LP 2)."""
    S, B, P = len(sites), len(blocks), model.world_size
    scale = max(max(row) for row in model.bw)
    bw = [[v / scale for v in row] for row in model.bw]
    # Loads as linear forms in x: (constant, coefficient vector).
    def form() -> tuple[float, np.ndarray]:
        return 0.0, np.zeros(B)
    owned = {r: np.zeros(B) for r in range(P)}
    for b, owners in enumerate(blocks):
        for r in owners:
            owned[r][b] = 1.0
    link: dict[tuple[int, int], list] = {}
    for site in sites:
        m = len(site)
        for p in range(m if m > 1 else 0):
            a, c = site[p], site[(p + 1) % m]
            const, coef = link.get((a, c), form())
            link[(a, c)] = [const + 2.0, coef - owned[a] - owned[c]]
    cross: set[tuple[int, int]] = set()
    for b, owners in enumerate(blocks):
        for s, t in itertools.permutations(range(S), 2):
            key = (owners[s], owners[t])
            const, coef = link.get(key, form())
            coef = coef.copy()
            coef[b] += w[s] + w[t]
            link[key] = [const, coef]
            cross.add(key)
    rows, rhs = [], []          # coef . x - cap * T <= -const
    cross_rows = []
    for (a, c), (const, coef) in sorted(link.items()):
        rows.append(np.append(coef, -bw[a][c]))
        rhs.append(-const)
        if (a, c) in cross:
            cross_rows.append((coef, bw[a][c]))
    for group, out_bps, in_bps in model.uplinks:
        members = set(group)
        for leaving, rate in ((True, out_bps), (False, in_bps)):
            if not math.isfinite(rate):
                continue
            const, coef = 0.0, np.zeros(B)
            for (a, c), (k, v) in link.items():
                if (a in members and c not in members) if leaving else (c in members and a not in members):
                    const, coef = const + k, coef + v
            rows.append(np.append(coef, -rate / scale))
            rhs.append(-const)
    site_of = {r: k for k, s in enumerate(sites) for r in s}
    for k, site in enumerate(sites):
        m = len(site)
        for p, r in enumerate(site):
            if not math.isfinite(model.reduce_bps[r]):
                continue
            const, coef = 0.0, (S - 1) * w[site_of[r]] * owned[r]
            if m > 1:
                const, coef = 1.0, coef - owned[site[(p - 1) % m]]
            rows.append(np.append(coef, -model.reduce_bps[r] / scale))
            rhs.append(-const)
    a_ub, b_ub = np.array(rows), np.array(rhs)
    a_eq = np.append(np.ones(B), 0.0)[None, :]
    c = np.zeros(B + 1)
    c[-1] = 1.0
    bounds = [(0.0, None)] * (B + 1)
    res = planner._run_lp(c, a_ub, b_ub, a_eq, np.array([1.0]), bounds, "the site plan's block shares")
    tau = float(res.x[-1])
    if not cross_rows:
        return [max(0.0, v) for v in res.x[:B]]
    # LP 2: keep T <= tau (1 + tol), minimise u >= load / rate over the cross-site links.
    rows2 = [np.append(r, 0.0) for r in a_ub]
    rows2.append(np.append(np.zeros(B), [1.0, 0.0]))
    rhs2 = list(b_ub) + [tau * (1 + CROSS_TIE_RTOL) + 1e-12]
    for coef, rate in cross_rows:
        rows2.append(np.append(coef, [0.0, -rate]))
        rhs2.append(0.0)
    c2 = np.zeros(B + 2)
    c2[-1] = 1.0
    res2 = planner._run_lp(c2, np.array(rows2), np.array(rhs2), np.append(np.ones(B), [0.0, 0.0])[None, :],
                           np.array([1.0]), [(0.0, None)] * (B + 2), "the site plan's cross-site balance")
    return [max(0.0, v) for v in res2.x[:B]]


def best_site_plan(model: LinkModel, site_labels: Sequence[int]) -> Optional[SitePlan]:
    """The site plan for ``site_labels`` (one per rank, e.g. `sites.Topology.sites`), or None for one site."""
    if len(site_labels) != model.world_size:
        raise ValueError(f"hetcomm site plan: {len(site_labels)} site labels for {model.world_size} ranks")
    groups: dict[int, list[int]] = {}
    for r, label in enumerate(site_labels):
        groups.setdefault(label, []).append(r)
    if len(groups) < 2:
        return None
    sites = [_site_order(model, members) for members in sorted(groups.values())]
    w = site_shares_for(model, sites)
    blocks = _candidate_blocks(sites)
    x = planner._snap_shares(_solve_blocks(model, sites, blocks, w))
    kept = [(b, xb) for b, xb in zip(blocks, x) if xb > 0]
    return SitePlan(tuple(sites), tuple(b for b, _ in kept), tuple(xb for _, xb in kept), w)


def _host_capacity(model: LinkModel, members: Sequence[int]) -> float:
    """A host's NIC, each way: its uplink when the model has one (a cut measured with all its flows
    at once), else the fastest single flow out of (into) it. Not the sum of its links: every
    rank of the host goes through the one NIC, and each pair was measured alone, at its full rate."""
    inside = set(members)
    for group, out_bps, in_bps in model.uplinks:
        if inside <= set(group):
            return min(out_bps, in_bps)
    P = model.world_size
    out = max(model.bw[a][b] for a in inside for b in range(P) if b not in inside)
    into = max(model.bw[b][a] for a in inside for b in range(P) if b not in inside)
    return min(out, into)


def _host_shares(model: LinkModel, hosts: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Pieces that equalise the hosts' NIC times: `site_shares_for`'s formula over host NICs."""
    H = len(hosts)
    if H <= 2:
        return (1.0 / H,) * H
    P = model.world_size
    nic = [_host_capacity(model, h) for h in hosts]
    # The same equalisation as for sites, on a model whose only limits are the host NICs.
    as_uplinks = LinkModel(tuple((1e30,) * P for _ in range(P)), uplinks=tuple((tuple(h), c, c) for h, c in zip(hosts, nic)))
    return site_shares_for(as_uplinks, hosts)


def host_plan(host_labels: Sequence[int], model: Optional[LinkModel] = None) -> Optional[SitePlan]:
    """Hosts as the inner level of the schedule: a `SitePlan` with ``local_inner`` whose sites are
    the hosts (``host_labels``: one per rank), or None unless there are several hosts and one of
    them holds several ranks.

    Each host's ranks split the buffer equally (the host's rank count sizes its ranks' chunks: a
    rank's chunk is the part it reduces in shared memory and carries across the NIC); the blocks
    are the intersections of the hosts' partitions, so every rank's blocks are one contiguous
    range in every host, as the engine needs, and a block pairs the ranks of the hosts whose
    chunks overlap on it: hosts of 3 and 1 ranks make three blocks, each with the lone rank as its
    second owner (no root). Host ``h`` reduces the piece ``w_h`` of every block; with a model the
    pieces equalise the hosts' NIC times (`site_shares_for`, from each host's cut: its NIC, as
    measured with all its flows at once), without one they are equal. Each host's NIC then
    carries ``(1 + (H - 2) w_h) N`` out and in: N for two hosts, ``2 (H - 1) / H N`` for equal
    shares, the least any schedule moves through it (design.md §9).
    """
    groups: dict[int, list[int]] = {}
    for r, label in enumerate(host_labels):
        groups.setdefault(label, []).append(r)
    hosts = sorted(groups.values())
    if len(hosts) < 2 or max(len(h) for h in hosts) < 2:
        return None
    if model is not None and model.world_size != len(host_labels):
        raise ValueError(f"hetcomm host plan: {len(host_labels)} host labels for a model of {model.world_size} ranks")
    w = _host_shares(model, hosts) if model is not None else (1.0 / len(hosts),) * len(hosts)
    cuts = sorted({Fraction(k, len(h)) for h in hosts for k in range(len(h) + 1)})
    blocks, shares = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        blocks.append(tuple(h[int(lo * len(h))] for h in hosts))
        shares.append(float(hi - lo))
    return SitePlan(tuple(tuple(h) for h in hosts), tuple(blocks), tuple(shares), tuple(w), local_inner=True)


# --------------------------------------------------------------------------------------------
# The cut bound
# --------------------------------------------------------------------------------------------

def cut_capacity(model: LinkModel, side: Sequence[bool]) -> float:
    """Bytes/s that can cross from the ranks with ``side[r]`` True to the others (an upper bound)."""
    P = model.world_size
    group_of = {}
    for k, (group, _, _) in enumerate(model.uplinks):
        for r in group:
            group_of[r] = k
    free, limited = 0.0, 0.0
    senders, receivers = set(), set()
    for a in range(P):
        if not side[a]:
            continue
        for b in range(P):
            if side[b]:
                continue
            ga, gb = group_of.get(a), group_of.get(b)
            if ga is None and gb is None or ga == gb:
                free += model.bw[a][b]
            else:
                limited += model.bw[a][b]
                if ga is not None:
                    senders.add(ga)
                if gb is not None:
                    receivers.add(gb)
    if limited > 0:
        # Links between groups: those leaving a group pass its out-uplink, those entering one its in-uplink.
        cap = limited
        out_groups = [model.uplinks[g][1] for g in senders]
        in_groups = [model.uplinks[g][2] for g in receivers]
        ungrouped_out = any(group_of.get(a) is None for a in range(P) if side[a])
        ungrouped_in = any(group_of.get(b) is None for b in range(P) if not side[b])
        if out_groups and not ungrouped_out:
            cap = min(cap, sum(out_groups))
        if in_groups and not ungrouped_in:
            cap = min(cap, sum(in_groups))
        limited = cap
    return free + limited


def cut_bound_seconds(model: LinkModel, nbytes: int, site_labels: Optional[Sequence[int]] = None) -> float:
    """``max over cuts of nbytes / capacity``, both directions (module docstring)."""
    P = model.world_size
    if P == 1 or nbytes <= 0:
        return 0.0
    cuts: list[tuple[bool, ...]] = []
    if P <= MAX_CUT_RANKS:
        for mask in range(1, 1 << (P - 1)):
            cuts.append(tuple(bool(mask >> r & 1) for r in range(P)))
    else:
        groups = [(r,) for r in range(P)] + [g for g, _, _ in model.uplinks]
        if site_labels is not None:
            groups += [tuple(r for r in range(P) if site_labels[r] == s) for s in sorted(set(site_labels))]
        for g in groups:
            if 0 < len(g) < P:
                cuts.append(tuple(r in g for r in range(P)))
    worst = 0.0
    for side in cuts:
        other = tuple(not v for v in side)
        cap = min(cut_capacity(model, side), cut_capacity(model, other))
        worst = max(worst, nbytes / cap)
    if site_labels is not None and len(set(site_labels)) > 2:
        # Sites as the nodes of the classic bound: combining S site partials of an element takes at
        # least S - 1 cross-site transfers and spreading the result S - 1 more, so 2 (S - 1) N
        # bytes leave sites in all, through the sum of the sites' cut capacities.
        # The sum runs over each direction on its own (bytes leave sites through their out-cuts and
        # arrive through their in-cuts); summing each site's slower direction would not be a bound.
        labels = sorted(set(site_labels))
        out_total = in_total = 0.0
        for s in labels:
            side = tuple(site_labels[r] == s for r in range(P))
            out_total += cut_capacity(model, side)
            in_total += cut_capacity(model, tuple(not v for v in side))
        worst = max(worst, 2 * (len(labels) - 1) * nbytes / min(out_total, in_total))
    return worst
