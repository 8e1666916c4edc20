"""Hierarchical schedules over levels: sites (`best_site_plan`), hosts (`host_plan`), and hosts
inside sites (`three_level_plan`).

Both return a `hetcomm.plan.schedules.SitePlan` for the engine's site-aware AllReduce
(``csrc/algorithms/hierarchical.h``): a reduce-scatter inside each site, then every block reduced
and gathered directly between its owners (one per site, so sites of unequal sizes need no root),
then an all-gather inside each site. `best_site_plan` picks each site's ring, the site shares that
equalise the sites' cross-site times, and the block shares (an LP); `host_plan` makes the hosts
the sites, with shared memory inside each (``local_inner``).

The cost model (with a worked example), the site shares, the block LP and the host plan:
docs/hosts-and-sites.md#the-site-schedules-cost-model,
docs/hosts-and-sites.md#choosing-the-site-plan,
docs/hosts-and-sites.md#hosts-as-the-inner-level-the-host-plan.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

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


def _equalising_shares(capacities: Sequence[float], slope: Optional[float] = None) -> tuple[float, ...]:
    """Shares equalising ``(1 + a w_s) / C_s`` with ``a = slope`` (default S - 2, the site shares);
    equal shares when ``a <= 0``.

    Derivation: docs/hosts-and-sites.md#choosing-the-site-plan.
    """
    S = len(capacities)
    a = float(S - 2 if slope is None else slope)
    if a <= 0 or S < 2:
        return (1.0 / S,) * S
    cap = list(capacities)
    active = list(range(S))
    w = [0.0] * S
    while True:
        total = sum(cap[k] for k in active)
        for k in range(S):
            w[k] = max(0.0, ((a + len(active)) * cap[k] / total - 1.0) / a) if k in active else 0.0
        dropped = [k for k in active if w[k] <= 0.0]
        if not dropped or len(dropped) == len(active):
            break
        active = [k for k in active if k not in dropped]
    total = sum(w)
    if not total > 0:
        return (1.0 / S,) * S
    return snap_shares([v / total for v in w])


def site_shares_for(model: LinkModel, sites: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Site shares equalising the sites' cross-site times; 1/S for S <= 2.

    Derivation: docs/hosts-and-sites.md#choosing-the-site-plan.
    """
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
    import scipy.sparse as sparse  # here, not at import: only the planning rank needs SciPy
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


def _host_blocks(hosts: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[float]]:
    """Blocks of a host plan: each host's ranks split the buffer equally, in rank order; the
    blocks are the common refinement, each naming its holder in every host."""
    cuts = sorted({Fraction(k, len(h)) for h in hosts for k in range(len(h) + 1)})
    blocks, shares = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        blocks.append(tuple(h[int(lo * len(h))] for h in hosts))
        shares.append(float(hi - lo))
    return blocks, shares


def host_plan(host_labels: Sequence[int], model: Optional[LinkModel] = None, min_gain: float = 0.0) -> Optional[SitePlan]:
    """Hosts as the inner level of the schedule: a `SitePlan` with ``local_inner`` whose sites
    are the hosts (``host_labels``: one per rank), or None unless there are several hosts and one
    of them holds several ranks. Host shares from the hosts' NICs in ``model`` replace equal
    shares only when predicted faster by ``min_gain`` (noise in measured NICs must not cost speed).

    Derivation: docs/hosts-and-sites.md#hosts-as-the-inner-level-the-host-plan.
    """
    hosts = ranks_by_label(host_labels)
    if len(hosts) < 2 or max(len(h) for h in hosts) < 2:
        return None
    if model is not None and model.world_size != len(host_labels):
        raise ValueError(f"hetcomm host plan: {len(host_labels)} host labels for a model of {model.world_size} ranks")
    blocks, shares = _host_blocks(hosts)
    groups = tuple(tuple(h) for h in hosts)
    equal = SitePlan(groups, tuple(blocks), tuple(shares), (1.0 / len(hosts),) * len(hosts), local_inner=True)
    if model is None:
        return equal
    w = _equalising_shares([_host_capacity(model, h) for h in hosts])
    return _unless_no_gain(SitePlan(groups, tuple(blocks), tuple(shares), tuple(w), local_inner=True), equal, model,
                           min_gain)


def _unless_no_gain(weighted: SitePlan, equal: SitePlan, model: LinkModel, min_gain: float) -> SitePlan:
    """``weighted`` if predicted faster than ``equal`` by ``min_gain``, else ``equal``."""
    from hetcomm.plan.cost import site_plan_seconds_per_byte

    if weighted == equal:
        return equal
    if site_plan_seconds_per_byte(weighted, model) < site_plan_seconds_per_byte(equal, model) * (1.0 - min_gain):
        return weighted
    return equal


MAX_STRIPES = 64


def _three_level_layout(sites: Sequence[Sequence[int]], hosts: Sequence[Sequence[int]],
                        host_shares: Sequence[Sequence[float]]):
    """Blocks, holders, owners and block shares of a three-level plan.

    Each host splits the buffer equally among its ranks, in rank order (its holders). The buffer
    is cut into R equal stripes (R the least common multiple of the hosts' rank counts, or the
    largest of them past MAX_STRIPES), and inside every stripe each site's hosts own consecutive
    parts by ``host_shares`` (one list per site, over its hosts in ``hosts`` order): so every rank
    of a host owns part of what its host owns, and the site's traffic leaves from all of them."""
    R = 1
    for h in hosts:
        R = R * len(h) // math.gcd(R, len(h))
    if R > MAX_STRIPES:
        R = max(len(h) for h in hosts)
    site_hosts = [[k for k, h in enumerate(hosts) if h[0] in set(site)] for site in sites]
    cuts = {0.0, 1.0}
    for h in hosts:
        cuts.update(j / len(h) for j in range(len(h)))
    for stripe in range(R):
        for members, y in zip(site_hosts, host_shares):
            at = stripe / R
            for v in y:
                at += v / R
                cuts.add(min(at, (stripe + 1) / R))
    points = sorted(cuts)
    points = [v for i, v in enumerate(points) if i == 0 or v - points[i - 1] > 1e-12]
    blocks, holders, shares = [], [], []
    for lo, hi in zip(points, points[1:]):
        mid = (lo + hi) / 2
        held = tuple(h[min(len(h) - 1, int(mid * len(h)))] for h in hosts)
        stripe = min(R - 1, int(mid * R))
        pos = mid * R - stripe
        owners = []
        for members, y in zip(site_hosts, host_shares):
            acc, pick = 0.0, members[-1]
            for k, v in zip(members, y):
                acc += v
                if pos < acc:
                    pick = k
                    break
            owners.append(held[pick])
        blocks.append(tuple(owners))
        holders.append(held)
        shares.append(hi - lo)
    return blocks, holders, shares


def three_level_plan(site_labels: Sequence[int], host_labels: Sequence[int], model: Optional[LinkModel] = None,
                     min_gain: float = 0.0) -> Optional[SitePlan]:
    """Ranks in hosts, hosts in sites: a `SitePlan` with ``hosts`` (csrc/algorithms/hierarchical.h),
    or None unless there are several sites, the hosts lie inside them and some site holds several
    hosts.

    Each site's owner share of a block is spread over its hosts by ``y``, equalising the hosts'
    NIC times ``(1 + (k_s - 2 + c_s) y_h) / C_h`` (k_s hosts in the site, c_s = 1 + (S - 2) w_s
    the site's cross-site bytes per byte it owns); site shares ``w`` as in `best_site_plan`.
    Host shares from ``model`` replace equal ones only when predicted faster by ``min_gain``.

    Derivation: docs/hosts-and-sites.md#three-levels-hosts-inside-sites.
    """
    if len(site_labels) != len(host_labels):
        raise ValueError(f"hetcomm three-level plan: {len(site_labels)} site labels, {len(host_labels)} host labels")
    sites = ranks_by_label(site_labels)
    hosts = ranks_by_label(host_labels)
    if len(sites) < 2 or len(hosts) <= len(sites):
        return None
    site_of = {r: k for k, site in enumerate(sites) for r in site}
    if any(len({site_of[r] for r in h}) != 1 for h in hosts):
        return None
    if model is not None and model.world_size != len(site_labels):
        raise ValueError(f"hetcomm three-level plan: {len(site_labels)} labels for a model of {model.world_size} ranks")
    site_hosts = [[h for h in hosts if site_of[h[0]] == k] for k in range(len(sites))]
    S = len(sites)

    def plan(w: Sequence[float], y: Sequence[Sequence[float]]) -> SitePlan:
        blocks, holders, shares = _three_level_layout(sites, hosts, y)
        return SitePlan(tuple(tuple(s) for s in sites), tuple(blocks), tuple(shares), tuple(w),
                        hosts=tuple(tuple(h) for h in hosts), holders=tuple(holders))

    equal_y = [(1.0 / len(m),) * len(m) for m in site_hosts]
    if model is None:
        return plan((1.0 / S,) * S, equal_y)
    # Site shares as the site plan takes them; only the host shares are held to the margin.
    w = site_shares_for(model, sites)
    y = []
    for k, members in enumerate(site_hosts):
        c = 1.0 + (S - 2) * w[k]
        y.append(_equalising_shares([_host_capacity(model, h) for h in members], len(members) - 2 + c))
    return _unless_no_gain(plan(w, y), plan(w, equal_y), model, min_gain)
