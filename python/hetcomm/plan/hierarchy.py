"""Hierarchical schedules over levels: sites (`best_site_plan`) and hosts (`host_plan`).

The engine's site-aware AllReduce (``csrc/algorithms/hierarchical.h``) takes a
`hetcomm.plan.schedules.SitePlan` and runs, in one pipelined dataflow: a reduce-scatter inside
each site (a rank's chunk is the union of the blocks it owns there), then for every block a
direct reduce-scatter and all-gather between the block's owners (one per site, so sites of
unequal sizes need no root), then an all-gather inside each site. With ``local_inner`` the sites
are the hosts of the group and the steps inside each run through shared memory.

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
  sites: N each way, the least any algorithm can move across a site's cut. A shared link
  (``LinkModel.uplinks``: a site's WAN uplink, a host's NIC) carries the sum of the loads of the
  links that leave (enter) its group.
* Reduce at r: the site ring's ``(1 - o_pred(r)) N`` plus ``(S - 1) w_s o_r N`` from the others.

As for the ring, the stages are pipelined segment by segment, so the time is the busiest
resource's load over its capacity, plus latency: ``2 (m_max - 1) + 2`` dependent messages and one
segment's fill (`hetcomm.plan.cost.predict_site_plan_seconds`).

Worked example: sites {0, 2} and {1, 3}, 1000 Mbit/s inside (125 MB/s), 100 Mbit/s (12.5 MB/s)
on each of the four cross-site pairs, N = 16 MB. Blocks (0,1), (0,3), (2,1), (2,3) with x = 1/4
each: every cross-site link carries N/4 = 4 MB each way: 0.32 s; the ring links inside a site
carry N = 16 MB at 125 MB/s: 0.128 s. T = 0.32 s, which is the cut bound: N over the 4 x 12.5
MB/s crossing the cut. The flat ring crosses the WAN on every link of the ring order 0>1>2>3:
1.5 N over 12.5 MB/s = 1.92 s.

Choosing the site plan (`best_site_plan`)
=========================================
Each site's ring order is the ring planner's best ring for the site alone (`order.best_plan` on
the restricted model, with the site's hosts as its levels: structured above 8 ranks). Site shares
equalise the sites' cross-site time when S >= 3: site s moves ``(1 + (S - 2) w_s) N`` through a
cut of capacity ``C_s``, and ``w_s = ((2S - 2) C_s / sum C - 1) / (S - 2)`` (from ``(1 + (S - 2)
w_s) / C_s = tau`` and ``sum w = 1``) makes those equal; a negative w_s becomes 0 and the rest is
solved again over the others (``(S - 2 + |A|) C_s / sum over A of C`` for the set A left). With
two sites the cut's load is N whatever w, and w = 1/2. Blocks are every combination of one owner
per site (up to `MAX_BLOCKS`; beyond, one block per rank of the largest site, owners taken round
robin) and their shares come from a linear program, HiGHS dual simplex as for the ring::

    minimise T   subject to   load(link) <= T rate(link) for every resource above,
                              sum x = 1, x >= 0

(all loads are linear in x once w is fixed; the constraint matrix is sparse, one row a link, so
sites of hundreds of ranks solve in well under a second). Among optimal x a second LP picks the
one that minimises the largest cross-site link time, so that a shared uplink (where any split is
optimal) still spreads blocks over all cross-site pairs. Shares are snapped like the ring's.

Hosts as the inner level (`host_plan`)
======================================
A `SitePlan` with ``local_inner`` whose sites are the hosts: each host's ranks split the buffer
equally (a rank's chunk is the part it reduces in shared memory and carries across the NIC); the
blocks are the intersections of the hosts' partitions, so every rank's blocks are one contiguous
range in every host, as the engine needs, and a block pairs the ranks of the hosts whose chunks
overlap on it: hosts of 3 and 1 ranks make three blocks, each with the lone rank as its second
owner (no root). Host h reduces the piece ``w_h`` of every block; with a model the pieces
equalise the hosts' NIC times (the site formula above over the hosts' NICs), without one they are
equal. Each host's NIC then carries ``(1 + (H - 2) w_h) N`` out and in: N for two hosts,
``2 (H - 1) / H N`` for equal shares, the least any schedule moves through it (design.md §9).
"""
from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sparse

from hetcomm.labels import ranks_by_label
from hetcomm.plan.cost import cut_capacity
from hetcomm.plan.levels import Topology
from hetcomm.plan.model import LinkModel
from hetcomm.plan.order import best_plan
from hetcomm.plan.schedules import SitePlan
from hetcomm.plan.shares import run_lp, snap_shares

MAX_BLOCKS = 64          # every owner combination up to this many blocks
CROSS_TIE_RTOL = 1e-6    # LP 2 keeps T within this of the optimum


def _site_capacity(model: LinkModel, members: Sequence[int]) -> float:
    """What can leave (and enter) a site at once: its cut, in its slower direction."""
    side = np.zeros(model.world_size, dtype=bool)
    side[list(members)] = True
    return min(cut_capacity(model, side), cut_capacity(model, ~side))


def _equalising_shares(capacities: Sequence[float]) -> tuple[float, ...]:
    """Site shares equalising ``(1 + (S - 2) w_s) / C_s`` (module docstring); 1/S for S <= 2."""
    S = len(capacities)
    if S <= 2:
        return (1.0 / S,) * S
    cap = list(capacities)
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
    return snap_shares([v / total for v in w])


def site_shares_for(model: LinkModel, sites: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Site shares equalising the sites' cross-site times (module docstring); 1/S for S <= 2."""
    if len(sites) <= 2:
        return _equalising_shares([1.0] * len(sites))
    return _equalising_shares([_site_capacity(model, s) for s in sites])


def _candidate_blocks(sites: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    combos = 1
    for s in sites:
        combos *= len(s)
    if combos <= MAX_BLOCKS:
        return [tuple(c) for c in itertools.product(*sites)]
    n = max(len(s) for s in sites)
    return [tuple(s[i % len(s)] for s in sites) for i in range(n)]


def _site_order(model: LinkModel, members: Sequence[int], hosts: Optional[Sequence[int]]) -> tuple[int, ...]:
    if len(members) <= 2:
        return tuple(members)
    topology = Topology(sites=(0,) * len(members), hosts=tuple(hosts[r] for r in members)) if hosts else None
    local = best_plan(model.restricted(members), topology)
    return tuple(members[i] for i in local.order)


def _solve_blocks(model: LinkModel, sites: Sequence[Sequence[int]], blocks: Sequence[tuple[int, ...]],
                  w: Sequence[float]) -> list[float]:
    """Block shares minimising T (LP 1), then the largest cross-site link time (LP 2).

    Every resource's load is ``const + coef . x``; rows are kept as a sparse matrix over the
    blocks: ring links (sorted by link), then the shared links leaving and entering each group,
    then the reducers."""
    S, B, P = len(sites), len(blocks), model.world_size
    scale = model.max_link
    owners = np.asarray(blocks, dtype=np.int64)                       # (B, S)
    owned = sparse.csr_matrix((np.ones(B * S), (owners.ravel(), np.repeat(np.arange(B), S))), shape=(P, B))
    # Ring links inside the sites: const 2, coef -(owned[a] + owned[c]).
    ring_src = np.concatenate([np.asarray(s) for s in sites if len(s) > 1] or [np.zeros(0, np.int64)]).astype(np.int64)
    ring_dst = np.concatenate([np.roll(np.asarray(s), -1) for s in sites if len(s) > 1] or [np.zeros(0, np.int64)]).astype(np.int64)
    # Cross-site links: block b adds w_s + w_t to the link between its owners in s and t.
    pairs = [(s, t) for s, t in itertools.permutations(range(S), 2)]
    cross_src = np.concatenate([owners[:, s] for s, _ in pairs])
    cross_dst = np.concatenate([owners[:, t] for _, t in pairs])
    cross_val = np.concatenate([np.full(B, w[s] + w[t]) for s, t in pairs])
    cross_blk = np.tile(np.arange(B), len(pairs))
    keys = np.unique(np.concatenate([ring_src * P + ring_dst, cross_src * P + cross_dst]))
    link_src, link_dst = keys // P, keys % P
    row_of = {int(k): i for i, k in enumerate(keys)}
    L = len(keys)
    ring_rows = np.asarray([row_of[int(k)] for k in ring_src * P + ring_dst], dtype=np.int64)
    cross_rows = np.asarray([row_of[int(k)] for k in cross_src * P + cross_dst], dtype=np.int64)
    const = np.zeros(L)
    np.add.at(const, ring_rows, 2.0)
    ring_coef = sparse.csr_matrix((np.ones(len(ring_rows)), (ring_rows, np.arange(len(ring_rows)))),
                                  shape=(L, len(ring_rows))) @ (-(owned[ring_src] + owned[ring_dst]))
    coef = (ring_coef + sparse.csr_matrix((cross_val, (cross_rows, cross_blk)), shape=(L, B))).tocsr()
    is_cross = np.zeros(L, dtype=bool)
    is_cross[cross_rows] = True
    rows, rhs, rates = [coef], [-const], [model.bw[link_src, link_dst] / scale]
    if model.uplinks:
        # Per group, the links leaving it then those entering it (groups in the model's order).
        M = model.membership
        inside = M[:, link_src].multiply(M[:, link_dst])
        crossing = sparse.vstack([M[:, link_src] - inside, M[:, link_dst] - inside], format="csr")
        G = len(model.uplinks)
        group_rates = np.asarray([[o, i] for _, o, i in model.uplinks]).ravel()        # out, in per group
        pick = np.stack([np.arange(G), G + np.arange(G)], axis=1).ravel()               # row of (g, out), (g, in)
        keep = np.isfinite(group_rates)
        crossing = crossing[pick[keep]]
        rows.append(crossing @ coef)
        rhs.append(-(crossing @ const))
        rates.append(group_rates[keep] / scale)
    # Reducers: rank r adds (S - 1) w_s of its blocks from the other sites, and in a site ring of
    # m > 1 ranks everything but its predecessor's chunk: const 1, coef -owned[pred(r)].
    member, pred, weight, ring = [], [], [], []
    for k, site in enumerate(sites):
        m = len(site)
        for p, r in enumerate(site):
            if np.isfinite(model.reduce_bps[r]):
                member.append(r)
                pred.append(site[(p - 1) % m])
                weight.append((S - 1) * w[k])
                ring.append(m > 1)
    if member:
        n = len(member)
        ring = np.asarray(ring)
        pick = sparse.csr_matrix((np.asarray(weight), (np.arange(n), member)), shape=(n, P))
        minus = sparse.csr_matrix((-np.ones(int(ring.sum())), (np.flatnonzero(ring), np.asarray(pred)[ring])),
                                  shape=(n, P))
        rows.append((pick + minus) @ owned)
        rhs.append(-ring.astype(np.float64))
        rates.append(np.asarray([model.reduce_bps[r] for r in member]) / scale)
    a_loads = sparse.vstack(rows, format="csr")
    caps = np.concatenate(rates)
    a_ub = sparse.hstack([a_loads, sparse.csr_matrix(-caps[:, None])], format="csr")   # coef . x - cap T <= -const
    b_ub = np.concatenate(rhs)
    a_eq = sparse.csr_matrix(np.append(np.ones(B), 0.0)[None, :])
    c = np.zeros(B + 1)
    c[-1] = 1.0
    res = run_lp(c, a_ub, b_ub, a_eq, np.array([1.0]), [(0.0, None)] * (B + 1), "the site plan's block shares")
    tau = float(res.x[-1])
    if not is_cross.any():
        return [max(0.0, v) for v in res.x[:B]]
    # LP 2: keep T <= tau (1 + tol), minimise u >= load / rate over the cross-site links.
    cross_coef = coef[is_cross]
    cross_rate = (model.bw[link_src, link_dst] / scale)[is_cross]
    a2 = sparse.vstack([
        sparse.hstack([a_ub, sparse.csr_matrix((a_ub.shape[0], 1))]),
        sparse.csr_matrix(([1.0], ([0], [B])), shape=(1, B + 2)),
        sparse.hstack([cross_coef, sparse.csr_matrix((cross_coef.shape[0], 1)), sparse.csr_matrix(-cross_rate[:, None])]),
    ], format="csr")
    b2 = np.concatenate([b_ub, [tau * (1 + CROSS_TIE_RTOL) + 1e-12], -const[is_cross]])
    c2 = np.zeros(B + 2)
    c2[-1] = 1.0
    res2 = run_lp(c2, a2, b2, sparse.csr_matrix(np.append(np.ones(B), [0.0, 0.0])[None, :]), np.array([1.0]),
                  [(0.0, None)] * (B + 2), "the site plan's cross-site balance")
    return [max(0.0, v) for v in res2.x[:B]]


def best_site_plan(model: LinkModel, site_labels: Sequence[int],
                   host_labels: Optional[Sequence[int]] = None) -> Optional[SitePlan]:
    """The site plan for ``site_labels`` (one per rank, e.g. `Topology.sites`), or None for one
    site. ``host_labels``: the hosts, which keep their ranks together in each site's ring."""
    if len(site_labels) != model.world_size:
        raise ValueError(f"hetcomm site plan: {len(site_labels)} site labels for {model.world_size} ranks")
    groups = ranks_by_label(site_labels)
    if len(groups) < 2:
        return None
    sites = [_site_order(model, ranks, host_labels) for ranks in groups]
    w = site_shares_for(model, sites)
    blocks = _candidate_blocks(sites)
    x = snap_shares(_solve_blocks(model, sites, blocks, w))
    kept = [(b, xb) for b, xb in zip(blocks, x) if xb > 0]
    return SitePlan(tuple(sites), tuple(b for b, _ in kept), tuple(xb for _, xb in kept), w)


def _host_capacity(model: LinkModel, members: Sequence[int]) -> float:
    """A host's NIC, each way: the smallest shared link holding the host when the model has one (a
    cut measured with all its flows at once), else the fastest single flow out of (into) it. Not
    the sum of its links: every rank of the host goes through the one NIC, and each pair was
    measured alone, at its full rate."""
    inside = set(members)
    holding = [(len(g), o, i) for g, o, i in model.uplinks if inside <= set(g)]
    if holding:
        _, out_bps, in_bps = min(holding)
        return min(out_bps, in_bps)
    side = np.zeros(model.world_size, dtype=bool)
    side[list(members)] = True
    out = model.bw[np.ix_(side, ~side)].max()
    into = model.bw[np.ix_(~side, side)].max()
    return float(min(out, into))


def host_plan(host_labels: Sequence[int], model: Optional[LinkModel] = None) -> Optional[SitePlan]:
    """Hosts as the inner level of the schedule (module docstring): a `SitePlan` with
    ``local_inner`` whose sites are the hosts (``host_labels``: one per rank), or None unless
    there are several hosts and one of them holds several ranks."""
    hosts = ranks_by_label(host_labels)
    if len(hosts) < 2 or max(len(h) for h in hosts) < 2:
        return None
    if model is not None and model.world_size != len(host_labels):
        raise ValueError(f"hetcomm host plan: {len(host_labels)} host labels for a model of {model.world_size} ranks")
    if model is not None:
        w = _equalising_shares([_host_capacity(model, h) for h in hosts])
    else:
        w = (1.0 / len(hosts),) * len(hosts)
    cuts = sorted({Fraction(k, len(h)) for h in hosts for k in range(len(h) + 1)})
    blocks, shares = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        blocks.append(tuple(h[int(lo * len(h))] for h in hosts))
        shares.append(float(hi - lo))
    return SitePlan(tuple(tuple(h) for h in hosts), tuple(blocks), tuple(shares), tuple(w), local_inner=True)
