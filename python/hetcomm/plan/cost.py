"""The cost model: predicted times of the engine's schedules, and lower bounds for any schedule.

Any schedule puts a *load* on every link it uses (bytes per byte of buffer); segments are
pipelined, so a collective lasts as long as its busiest resource (link, shared link or reducer),
plus latency and pipeline fill. Here:

* `predict_allreduce_seconds` (ring and recursive doubling), `predict_site_plan_seconds`;
* `cut_capacity` and `cut_bound_seconds`: at least N bytes cross every cut of the ranks each way,
  so ``max over cuts of N / capacity`` bounds any AllReduce.

Derivations and the worked example: docs/planner.md#the-cost-model, docs/planner.md#the-cut-bound.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np

from hetcomm.plan.model import LinkModel, engine_setting
from hetcomm.plan.schedules import Plan, SitePlan, ring_loads

MAX_CUT_RANKS = 14       # cut_bound_seconds enumerates every cut up to this world size

Loads = tuple[np.ndarray, np.ndarray, np.ndarray]


def _check_plan_fits(order: Sequence[int], shares: Sequence[float], model: LinkModel) -> None:
    P = model.world_size
    if len(shares) != P:
        raise ValueError(f"hetcomm planner: {len(shares)} shares for a model of {P} ranks")
    if sorted(order) != list(range(P)):
        raise ValueError(f"hetcomm planner: order {tuple(order)} is not a permutation of the {P} ranks of the model")


def _as_arrays(loads: Union[dict, Loads]) -> Loads:
    if isinstance(loads, dict):
        keys = list(loads)
        return (np.array([a for a, _ in keys], dtype=np.int64), np.array([b for _, b in keys], dtype=np.int64),
                np.array([loads[k] for k in keys], dtype=np.float64))
    return loads


def group_loads(loads: Union[dict, Loads], model: LinkModel) -> tuple[np.ndarray, np.ndarray]:
    """For every shared-link group (``model.uplinks`` order), the summed loads of the links that
    leave it and of those that enter it."""
    src, dst, load = _as_arrays(loads)
    if not model.uplinks or len(load) == 0:
        return np.zeros(len(model.uplinks)), np.zeros(len(model.uplinks))
    M = model.membership
    P = model.world_size
    # leaving g = sent by a member - sent by a member to a member; entering likewise.
    sent = M @ np.bincount(src, weights=load, minlength=P)
    received = M @ np.bincount(dst, weights=load, minlength=P)
    both = np.asarray(M[:, src].multiply(M[:, dst]) @ load).ravel()
    return sent - both, received - both


def uplink_seconds_per_byte(loads: Union[dict, Loads], model: LinkModel) -> float:
    """The busiest shared link's time per byte of buffer: over ``model.uplinks``, the summed loads
    of the links leaving (entering) the group over its out (in) rate; 0 without uplinks."""
    if not model.uplinks:
        return 0.0
    out, into = group_loads(loads, model)
    rates = np.asarray([(o, i) for _, o, i in model.uplinks], dtype=np.float64)
    return float(max((out / rates[:, 0]).max(), (into / rates[:, 1]).max()))


def seconds_per_byte(loads: Union[dict, Loads], reduce_loads: Sequence[float], model: LinkModel) -> float:
    """``T_bw / N`` for any schedule given its per-link and per-rank loads (bytes per byte)."""
    src, dst, load = _as_arrays(loads)
    worst = float((load / model.bw[src, dst]).max()) if len(load) else 0.0
    worst = max(worst, uplink_seconds_per_byte((src, dst, load), model))
    reduce = np.asarray(reduce_loads, dtype=np.float64)
    finite = np.isfinite(model.reduce_array)
    if finite.any():
        worst = max(worst, float((reduce[finite] / model.reduce_array[finite]).max()))
    return worst


def ring_seconds_per_byte(order: Sequence[int], shares: Sequence[float], model: LinkModel) -> float:
    """``max(T_bw, T_reduce) / N`` for the ring ``order`` with ``shares`` (normalised to sum 1).

    ``max`` over ring links A -> B of ``(2 - o_A - o_B) / bw(A -> B)``, over ranks A with
    finite reduce throughput of ``(1 - o_pred(A)) / reduce_bps[A]`` and over shared links; 0 for
    a single rank.
    """
    _check_plan_fits(order, shares, model)
    if model.world_size == 1:
        return 0.0
    if not math.fsum(shares) > 0:
        raise ValueError("hetcomm planner: shares sum to zero")
    src, dst, load = ring_loads(order, shares)
    o = np.asarray(shares, dtype=np.float64) / math.fsum(shares)
    reduce = np.zeros(model.world_size)
    reduce[dst] = 1.0 - o[src]                     # b reduces all but its predecessor a's chunk
    return seconds_per_byte((src, dst, load), reduce, model)


def site_plan_seconds_per_byte(plan: SitePlan, model: LinkModel) -> float:
    if plan.world_size != model.world_size:
        raise ValueError(f"hetcomm site plan: plan for {plan.world_size} ranks, model for {model.world_size}")
    return seconds_per_byte(plan.load_arrays(), plan.reduce_loads(), model)


def segment_bytes(model: LinkModel, largest_chunk_bytes: float, cap: int = 0) -> float:
    """The engine's segment size for a ring whose largest chunk has this many bytes: the forced
    one (HETCOMM_SEGMENT_BYTES), else the adaptive one, at most ``cap`` (a plan's segment_bytes)
    when that is set (CollectiveContext::segmentBytesFor)."""
    if model.segment_bytes > 0:
        return float(model.segment_bytes)
    adaptive = min(engine_setting("max_segment_bytes"),
                   max(engine_setting("min_segment_bytes"), int(largest_chunk_bytes) // 4))
    return float(min(cap, adaptive) if cap > 0 else adaptive)


def recursive_doubling_steps(P: int) -> int:
    p2 = 1 << (P.bit_length() - 1)
    return (p2.bit_length() - 1) + (2 if p2 != P else 0)


def predict_site_plan_seconds(plan: SitePlan, model: LinkModel, nbytes: int) -> float:
    """Predicted seconds for an AllReduce of ``nbytes`` with the site plan (`hetcomm.plan.hierarchy`)::

        predict = N * T_bw + sum over pieces of ((2 (m_max - 1) + 2) alpha + fill)

    with ``fill = seg * ((m_max - 1) * mean(1 / ring bw) + mean(1 / cross-site bw))``: one segment
    over the path of a segment through a site ring and across a site pair (the ring's own
    convention: half the path, since the all-gather's fill overlaps the reduce-scatter's drain).
    The engine runs the message in pieces of HETCOMM_SITE_PIECE_BYTES (32 MB), one after the
    other, each with its own latency, fill and adaptive segment (a quarter of the piece's chunk).
    """
    if nbytes <= 0:
        return 0.0
    # Steps inside a site: the ring's m - 1, one exchange between hosts with three levels.
    m_max = 2 if plan.hosts else max(len(s) for s in plan.sites)
    site_of = np.asarray(plan.site_of())
    src, dst, _ = plan.load_arrays()
    inv = 1.0 / model.bw[src, dst]
    inside = site_of[src] == site_of[dst]
    ring_mean = float(inv[inside].mean()) if inside.any() else 0.0
    cross_mean = float(inv[~inside].mean()) if (~inside).any() else 0.0

    def per_piece(piece_bytes: int) -> float:
        seg = segment_bytes(model, piece_bytes / model.world_size, plan.segment_bytes)
        return (2 * (m_max - 1) + 2) * model.alpha + seg * ((m_max - 1) * ring_mean + cross_mean)

    # the engine's cut (sitePieceCount): at least 4 KB, whole cache lines
    piece = max(4096, engine_setting("site_piece_bytes")) // 64 * 64
    full, rest = divmod(int(nbytes), piece)
    fixed = full * per_piece(piece) + (per_piece(rest) if rest else 0.0)
    return nbytes * site_plan_seconds_per_byte(plan, model) + fixed


def predict_allreduce_seconds(plan: Plan, model: LinkModel, nbytes: int) -> float:
    """Predicted seconds for an AllReduce of ``nbytes`` bytes under ``plan``.

    Derivation: docs/planner.md#the-cost-model.

    Ring (``nbytes > small_allreduce_bytes``)::

        nbytes * ring_seconds_per_byte + 2 (P-1) alpha + (P-1) seg * mean(1 / ring bw)

    Recursive doubling (smaller messages; the plan is ignored)::

        steps * (alpha + nbytes / min(bw) + nbytes / min(reduce_bps))

    The site plan from ``plan.sites.min_bytes`` on (`predict_site_plan_seconds`). 0 for a single
    rank or an empty message.
    """
    _check_plan_fits(plan.order, plan.shares, model)
    if int(nbytes) != nbytes or nbytes < 0:
        raise ValueError(f"hetcomm planner: nbytes must be a non-negative integer, got {nbytes!r}")
    P = model.world_size
    if P == 1 or nbytes == 0:
        return 0.0
    if nbytes <= model.small_allreduce_bytes:
        per_step = model.alpha + nbytes / model.min_link + nbytes / min(model.reduce_bps)
        return recursive_doubling_steps(P) * per_step
    if plan.sites is not None and nbytes >= plan.sites.min_bytes:
        return predict_site_plan_seconds(plan.sites, model, nbytes)
    per_byte = ring_seconds_per_byte(plan.order, plan.shares, model)
    largest_chunk = nbytes * max(plan.shares) / math.fsum(plan.shares)
    order = np.asarray(plan.order)
    mean_hop_seconds_per_byte = float((1.0 / model.bw[order, np.roll(order, -1)]).mean())
    fill = (P - 1) * segment_bytes(model, largest_chunk, plan.segment_bytes) * mean_hop_seconds_per_byte
    return nbytes * per_byte + 2 * (P - 1) * model.alpha + fill


# --------------------------------------------------------------------------------------------
# The cut bound
# --------------------------------------------------------------------------------------------

def _one_side(model: LinkModel, bw: np.ndarray, sending: np.ndarray, rate_index: int) -> float:
    """One side's bound on what crosses a cut (`cut_capacity`'s recursion): ``sending`` ranks send
    to the others over ``bw`` (the model's rates, or their transpose for the receiving side, with
    ``rate_index`` 1 for out-rates, 2 for in-rates)."""
    P = model.world_size
    senders, receivers = np.flatnonzero(sending), np.flatnonzero(~sending)
    flows = bw[np.ix_(senders, receivers)]
    links_total = np.zeros(P)
    links_total[senders] = flows.sum(axis=1)
    at_sender = np.full(P, -1)
    at_sender[senders] = np.arange(len(senders))
    at_receiver = np.full(P, -1)
    at_receiver[receivers] = np.arange(len(receivers))
    # A group of one rank caps that rank's row at its rate (leave = inside-free = total): done for
    # all such groups at once. The others form a tree: a group's parent is the smallest larger
    # group holding it; groups come largest first, so it is known when the group is reached.
    cap = np.full(P, np.inf)
    multi = []
    for k, (g, *rates) in enumerate(model.uplinks):
        if len(g) == 1:
            cap[g[0]] = min(cap[g[0]], rates[rate_index - 1])
        else:
            multi.append(k)
    row_total = np.minimum(links_total, cap)          # what each rank can send, its NIC applied
    groups = [np.asarray(model.uplinks[k][0], dtype=np.int64) for k in multi]
    rates = [model.uplinks[k][rate_index] for k in multi]
    G = len(groups)
    parent, owner = [G] * G, np.full(P, G)            # G: the root (every rank)
    for k, g in enumerate(groups):
        parent[k] = int(owner[g[0]])
        owner[g] = k
    # Per node (G slots and the root), summed over its children: T (all they can send to
    # receivers anywhere), I (what stays inside each child), L (what leaves each child), and the
    # links from senders to receivers inside each child.
    child_total, child_inside, child_leave, child_within = (np.zeros(G + 1) for _ in range(4))
    np.add.at(child_total, owner[senders], row_total[senders])    # a sending rank: all its links
    np.add.at(child_leave, owner[senders], row_total[senders])
    for k in range(G - 1, -1, -1):                   # smallest first: children before parents
        g = groups[k]
        s, r = at_sender[g], at_receiver[g]
        s, r = s[s >= 0], r[r >= 0]
        internal = float(flows[np.ix_(s, r)].sum()) if len(s) and len(r) else 0.0
        links_out = float(links_total[g].sum()) - internal
        between = internal - child_within[k]
        leave = min(rates[k], links_out, child_leave[k])
        inside = min(child_total[k], child_inside[k] + min(child_leave[k], between))
        total = min(child_total[k], child_inside[k] + min(child_leave[k], between + leave))
        up = parent[k]
        child_total[up] += total
        child_inside[up] += inside
        child_leave[up] += leave
        child_within[up] += internal
    between = float(flows.sum()) - child_within[G]
    return float(min(child_total[G], child_inside[G] + min(child_leave[G], between)))


def cut_capacity(model: LinkModel, side: Sequence[bool]) -> float:
    """Bytes/s that can cross from the ranks with ``side[r]`` True to the others (an upper bound).

    Derivation. Let A send and B receive. The shared-link groups form a tree (they are laminar);
    the children of a group are its largest subgroups and its ranks in no subgroup. For a node G
    bound three flows from A∩G: ``L(G)`` to B outside G, ``I(G)`` to B inside G, ``T(G)`` to all
    of B. A rank a of A is a leaf with ``L = T =`` the sum of its links to B and ``I = 0``. Then,
    with sums over the children C of G:

    * ``L(G) = min(out-rate of G, links from A∩G to B outside G, sum L(C))``: that flow passes G's
      uplink, uses those links, and leaves the child it starts in;
    * flow that leaves a child either stays in G (at most the links between different children)
      or leaves G (at most L(G)), and flow that does not leave its child is at most I(C); every
      child sends at most T(C). So ``I(G) = min(sum T(C), sum I(C) + min(sum L(C), between))``
      and ``T(G) = min(sum T(C), sum I(C) + min(sum L(C), between + L(G)))``.

    The set of all ranks is the root, with no rate of its own and nothing outside; the capacity
    is ``T(root)``.
    The same recursion from the receiving side (in-rates, links reversed) gives a second bound,
    and the capacity is the smaller. Without shared links this is the sum of the crossing links.
    """
    mask = np.asarray(side, dtype=bool)
    P = model.world_size
    if mask.shape != (P,):
        raise ValueError(f"hetcomm planner: a cut of {P} ranks needs {P} sides, got {mask.shape}")
    return min(_one_side(model, model.bw, mask, 1), _one_side(model, model.bw.T, ~mask, 2))


def site_cuts(model: LinkModel, site_labels: Sequence[int]) -> list[tuple[float, float]]:
    """Per site (labels numbered 0..S-1), the capacity of its cut out of and into it."""
    labels = np.asarray(site_labels)
    return [(cut_capacity(model, labels == s), cut_capacity(model, labels != s)) for s in range(int(labels.max()) + 1)]


def cut_bound_seconds(model: LinkModel, nbytes: int, site_labels: Optional[Sequence[int]] = None) -> float:
    """``max over cuts of nbytes / capacity``, both directions.

    Derivation: docs/planner.md#the-cut-bound.
    """
    P = model.world_size
    if P == 1 or nbytes <= 0:
        return 0.0
    cuts: list[np.ndarray] = []
    if P <= MAX_CUT_RANKS:
        masks = np.arange(1, 1 << (P - 1))
        cuts = [(masks[k] >> np.arange(P)) & 1 == 1 for k in range(len(masks))]
    else:
        groups = [(r,) for r in range(P)] + [g for g, _, _ in model.uplinks]
        if site_labels is not None:
            groups += [tuple(r for r in range(P) if site_labels[r] == s) for s in sorted(set(site_labels))]
        for g in dict.fromkeys(groups):
            if 0 < len(g) < P:
                m = np.zeros(P, dtype=bool)
                m[list(g)] = True
                cuts.append(m)
    worst = 0.0
    for side in cuts:
        cap = min(cut_capacity(model, side), cut_capacity(model, ~side))
        worst = max(worst, nbytes / cap)
    if site_labels is not None and len(set(site_labels)) > 2:
        worst = max(worst, nbytes * sites_bound_seconds_per_byte(model, site_labels))
    return worst


def sites_bound_seconds_per_byte(model: LinkModel, site_labels: Sequence[int]) -> float:
    """The part of the cut bound that comes from the sites alone, per byte: every site's cut in
    its slower direction, and with S >= 3 sites the sites as nodes of the classic bound.

    Sites as the nodes of the classic bound: combining S site partials of an element takes at
    least S - 1 cross-site transfers and spreading the result S - 1 more, so 2 (S - 1) N bytes
    leave sites in all, through the sum of the sites' cut capacities. The sum runs over each
    direction on its own (bytes leave sites through their out-cuts and arrive through their
    in-cuts); summing each site's slower direction would not be a bound."""
    labels = sorted(set(site_labels))
    if len(labels) < 2:
        return 0.0
    index = np.asarray([labels.index(s) for s in site_labels])
    per_site = site_cuts(model, index)
    worst = max(1.0 / min(o, i) for o, i in per_site)
    if len(labels) > 2:
        out_total = sum(o for o, _ in per_site)
        in_total = sum(i for _, i in per_site)
        worst = max(worst, 2 * (len(labels) - 1) / min(out_total, in_total))
    return worst
