"""Ring plans for heterogeneous links: which ring order, and how much of the buffer each rank owns.

The ring AllReduce of hetcomm takes a *plan*: ``order`` (ring position p holds rank ``order[p]``,
which sends to ``order[p+1]``, indices mod P) and ``shares`` (``shares[r]`` is the fraction of the
buffer that rank r owns, i.e. fully reduces during the reduce-scatter). This module chooses the
plan from a cost model. Its functions are pure (Python, numpy, scipy; no torch) and
deterministic, so every rank can compute the same plan from the same inputs; the only thing it
takes from the extension is the engine's settings (message sizes that change the algorithm and
the segment size), read once from ``hetcomm._C.engine_settings()`` so that the model never
disagrees with the engine it models.

Cost model
==========
Inputs (`LinkModel`): P ranks, directed link bandwidths ``bw[i][j]`` (bytes/s, i -> j, the
diagonal unused), per-rank reduce throughput ``reduce_bps[i]`` (bytes/s reduced into the local
buffer; ``inf`` = free) and a per-message latency ``alpha`` (s).

Link load. With the schedule of ``csrc/algorithms/ring_schedule.h``, the reduce-scatter sends
every chunk around the ring once, starting at its owner's successor, so link A -> B carries every
chunk except A's own; the all-gather starts each chunk at its owner, so A -> B carries every chunk
except B's own. With shares ``o`` (fractions, ``sum(o) = 1``) and N bytes::

    load(A -> B) = (1 - o_A) N + (1 - o_B) N = (2 - o_A - o_B) N

Uniform shares give the textbook ``2 N (P-1)/P`` per link.

Bandwidth time. Segments are pipelined (a rank forwards a segment as soon as it has received and
reduced it), so links work concurrently and the collective lasts as long as its busiest link::

    T_bw = max over ring links A -> B of (2 - o_A - o_B) N / bw(A -> B)

Summing the P link constraints ``(2 - o_A - o_B) N <= T bw(A -> B)`` gives the lower bound
``T >= 2 (P-1) N / sum(ring bw)``; each single link gives ``T >= N / bw`` because
``o_A + o_B <= 1``.

Reduce time. Rank A adds every reduce-scatter chunk it receives, i.e. all chunks except its
predecessor's: ``(1 - o_pred(A)) N`` bytes. Reducing overlaps with the transfers, so it is one
more concurrent resource::

    T_reduce = max over ranks A of (1 - o_pred(A)) N / reduce_bps[A]

A slow reducer is relieved by giving its *predecessor* a larger share.

Predicted AllReduce time (`predict_allreduce_seconds`), for messages above
``small_allreduce_bytes`` (the engine's ``HETCOMM_SMALL_ALLREDUCE_BYTES``, 32 KiB)::

    N * max(T_bw, T_reduce)/N  +  2 (P-1) alpha  +  (P-1) seg * mean over ring links of 1/bw

The second term is the 2(P-1) dependent ring steps (reduce-scatter then all-gather), one
message latency each. The third is pipeline fill and drain: one segment crossing P-1 hops, each
at the ring's mean per-hop time. ``seg`` is the engine's segment size: ``HETCOMM_SEGMENT_BYTES``
when set (``LinkModel.segment_bytes``), else a quarter of the largest chunk clamped to
[32 KiB, 1 MiB] (``CollectiveContext::segmentBytesFor``). Both latency terms are nearly the same
for every plan of a given P, so they hardly affect which plan wins; they matter for comparing
predictions with measurements. (Walking the dataflow of the worked example below with 1 MiB
segments: the chain plan pays about one segment on a slow link plus four fast hops, 0.12 s; the
uniform plan keeps its slow links busy from the start and pays less; the term says 0.14 s for
both, where "P-1 hops at the slowest link" would say 0.25 s.)

Worked example (design.md §2): P = 4, full-duplex NICs of 800/800/800/100 Mbit/s
(100, 100, 100, 12.5 MB/s; ``bw[i][j] = min(nic_i, nic_j)``), N = 16 MB (4e6 fp32). Uniform
shares put 1.5 N = 24 MB on the two links of the slow rank: 24 / 12.5 = 1.92 s. The LP gives the
slow rank everything (o = 0, 0, 0, 1): its two links carry N each (16 / 12.5 = 1.28 s) and the
fast links 2N at 100 MB/s (0.32 s). 1.28 s is optimal for any algorithm, since the slow rank
must receive and send N at least once.

Small messages (``N <= small_allreduce_bytes``) use recursive doubling in the engine, which
ignores the plan. Its prediction is ``steps * (alpha + N / min(bw) + N / min(reduce_bps))`` with
``steps = log2(p2) + (2 if P != p2 else 0)``, p2 the largest power of two <= P (the engine folds
the extra ranks in before and out after). ``min`` over *all* links is a conservative stand-in for
"the slowest pair that exchanges in some step".

Best shares for an order (`solve_shares`)
=========================================
Normalise N = 1 (the optimum is a fraction vector independent of N) and solve the LP::

    minimise    T
    subject to  o_A + o_B + T bw(A -> B) >= 2     for each ring link A -> B
                o_pred(A) + T reduce_bps[A] >= 1  for each rank A with finite reduce_bps
                sum(o) = 1,  o >= 0

Bandwidths are divided by the largest one before solving, so coefficients are O(1) and T is in
units of (1 / largest bandwidth) per byte. The LP is solved with HiGHS' dual simplex
(``scipy.optimize.linprog(method="highs-ds")``): a vertex solution, deterministic for identical
inputs. Any solver status other than success raises `PlanningError`; there is no fallback.

The optimum is often not unique (uniform links and an even P admit alternating shares). Among
plans whose T is within a relative ``SHARE_TIE_RTOL`` (1e-10) of the optimum T*, a second LP
picks the one closest to uniform::

    minimise    sum |o_i - 1/P|        (linearised with d_i >= +-(o_i - 1/P))
    subject to  the constraints above with T fixed at T* (1 + SHARE_TIE_RTOL)

so uniform links give exactly uniform shares, and weighting appears only where it buys time.
Where the optimum is unique, the slack lets LP 2 move shares by about SHARE_TIE_RTOL towards
uniform, which the snapping below removes again; so the tolerance is kept tiny. It is still well
above the solver's error on O(1)-scaled data (dual simplex solves its final basis to machine
precision, and LP 1's solution is feasible for LP 2 under the same feasibility tolerance), and
far below anything measurable. Where the L1 objective itself ties
(e.g. moving share between two ranks that are both below 1/P), HiGHS returns one vertex,
deterministically.

Shares are then snapped so that LP noise cannot leak into the plan: if every share is within
``SHARE_QUANTUM`` of 1/P, all become exactly ``1/P`` (the engine's uniform plan); otherwise they
are apportioned on the grid ``SHARE_QUANTUM = 2**-30`` (~9.3e-10) with the engine's own largest-
remainder rule, so they are dyadic, exactly representable, and sum to exactly 1.0 in floating
point. The rounding moves a load by at most 2**-29 of N: relative to a link load (always >= N)
below 2e-9; relative to a binding reduce load ``(1 - o_pred) N``, which is at least
``reduce_bps / bw`` of N, below ``2e-9 * bw / reduce_bps``.
``predicted_bw_seconds_per_byte`` is recomputed from the returned shares, never taken from the LP.

Ring order (`best_plan`)
========================
Links are directed, so a ring and its reverse are different candidates. Fixing rank 0 at
position 0 removes rotations (they are the same ring). For ``P <= MAX_EXHAUSTIVE_RANKS`` (8) all
(P-1)! orders are candidates; three cheap devices keep this fast without changing the answer:

* orders whose ring data (the cyclic sequence of link bandwidths and reducer speeds, up to
  rotation) are identical have the same optimum, so the LP is solved once per distinct sequence
  (uniform links: one LP in all);
* each order has a lower bound (`_RingSearch.lower_bounds`, computed for all orders at once):
  the sum of all link constraints ``2(P-1)/sum(ring bw)``, the sum of the k finite reducers'
  ``(k-1)/sum(R)``, and the best *packing* of links that share no rank and reducer constraints
  on other shares, ``(2 links + reducers - 1) / (their bw + their R)`` (their shares are
  distinct, so they add up to at most 1); one link gives ``1/bw``, and two disjoint crossings
  of a slow link give ``3/(b1 + b2)``, which is exactly what two sites joined by a WAN cost;
  if the identity order comes within ``ORDER_TIE_RTOL`` of the smallest bound, it ties with
  the best and wins at once (one slow NIC: every order ties);
* otherwise orders are visited by increasing bound and the search stops once the bound exceeds
  the best T found by more than ``ORDER_TIE_RTOL``.

An LP costs about 1-2 ms through ``linprog``. At P = 8 with noisy measured links
(``benchmarks/plan_time.py``) choosing a plan takes 0.03-0.2 s on a 2-core development machine;
without the packing bound two sites needed 4897 LPs of 5040 orders (6 s).

Orders whose T is within a relative ``ORDER_TIE_RTOL`` (1e-6) of the best are ties: the identity
order wins if it is among them, else the lexicographically smallest. For ``P > 8`` a
deterministic local search: start from the better of the identity and a greedy widest-next-link
tour, then apply segment reversals (2-opt) and position swaps, first improvement in a fixed scan
order, accepting a move only when T improves by more than ``ORDER_TIE_RTOL``.

Keep uniform where weighting gains nothing (`make_plan`)
========================================================
A weighted plan costs nothing at run time but is one more thing that can differ between ranks
and surprise a reader. `make_plan` returns the identity order with uniform shares unless the best
plan's predicted time for the given message size beats the uniform plan's by more than
``min_gain`` (default 3%); messages of at most ``small_allreduce_bytes`` always get the uniform
plan, since recursive doubling ignores the plan anyway.

Determinism across ranks
========================
No randomness, no iteration over unordered containers, fixed scan orders, and ties broken by
explicit rules. HiGHS is deterministic for identical inputs, so ranks that run the same code
(same numpy/scipy) on identical ``LinkModel`` values get bit-identical plans. The snapping above
further removes LP noise below ~1e-9. Inputs measured independently on each rank are *not*
identical: agree on the model first (e.g. rank 0 measures and broadcasts it, or computes the plan
and broadcasts that). As a last line of defence the engine puts a fingerprint of the plan in every
ring header, so ranks holding different plans fail loudly instead of computing garbage.

Using a plan::

    plan = make_plan(LinkModel.from_nics([100e6, 100e6, 100e6, 12.5e6]), nbytes=64 << 20)
    hetcomm.backend_of().set_plan(list(plan.order), list(plan.shares))
"""
from __future__ import annotations

import functools
import itertools
import math
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import numpy as np
from scipy.optimize import linprog

__all__ = [
    "LinkModel",
    "Plan",
    "PlanningError",
    "solve_shares",
    "best_plan",
    "uniform_plan",
    "make_plan",
    "predict_allreduce_seconds",
    "ring_seconds_per_byte",
    "shares_to_counts",
    "format_plan",
]

from hetcomm._C import engine_settings as _engine_settings

if TYPE_CHECKING:  # the site plan and topology only annotate Plan here; site_planner imports this module
    from hetcomm.site_planner import SitePlan
    from hetcomm.sites import Topology

# The engine's own settings, as this process's engine uses them (HETCOMM_SMALL_ALLREDUCE_BYTES and
# HETCOMM_SEGMENT_BYTES applied): models default to them, so predictions and the crossover size
# follow whatever the engine will do.
_ENGINE = _engine_settings()
SMALL_ALLREDUCE_BYTES = int(_ENGINE["small_allreduce_bytes"])
SEGMENT_BYTES = int(_ENGINE["segment_bytes"])            # 0: adaptive
MIN_SEGMENT_BYTES = int(_ENGINE["min_segment_bytes"])    # CollectiveContext::segmentBytesFor clamps
MAX_SEGMENT_BYTES = int(_ENGINE["max_segment_bytes"])
DEFAULT_ALPHA_SECONDS = 50e-6          # one TCP message on a LAN, order of magnitude
MAX_EXHAUSTIVE_RANKS = 8               # (P-1)! orders: 5040 at P = 8
SHARE_TIE_RTOL = 1e-10                 # "as good as the optimum" when choosing among shares
ORDER_TIE_RTOL = 1e-6                  # "as good as the best" when choosing among ring orders
SHARE_QUANTUM = 2.0 ** -30             # shares are snapped to this grid (dyadic, exact sums)
DEFAULT_MIN_GAIN = 0.03                # make_plan keeps uniform unless it saves more than this
_LOCAL_SEARCH_MAX_PASSES = 100


class PlanningError(RuntimeError):
    """The LP solver did not return an optimal solution (never silently replaced by a guess)."""


def _check_rate(value: float, what: str, allow_inf: bool) -> float:
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"hetcomm planner: {what} is NaN")
    if v <= 0:
        raise ValueError(f"hetcomm planner: {what} must be positive, got {v!r}")
    if math.isinf(v) and not allow_inf:
        raise ValueError(f"hetcomm planner: {what} must be finite, got {v!r}")
    return v


@dataclass(frozen=True)
class LinkModel:
    """What the planner knows about the cluster; all rates in bytes per second.

    ``bw[i][j]``: bandwidth of the directed link i -> j; every off-diagonal entry must be finite
    and positive (the diagonal is ignored and stored as 0). ``reduce_bps[i]``: how fast rank i
    adds received data into its buffer (``inf``: never the bottleneck; default all ``inf``).
    ``alpha``: seconds per message (one ring step). ``uplinks``: links that several ranks share,
    as ``(ranks, out_bps, in_bps)`` triples: all traffic from a rank of ``ranks`` to a rank
    outside them shares ``out_bps``, all traffic into them from outside shares ``in_bps`` (``inf``:
    unshared in that direction); a site behind one WAN uplink is the example. Groups must be
    disjoint. ``segment_bytes``: the engine's
    ``HETCOMM_SEGMENT_BYTES`` (0: adaptive, as the engine). ``small_allreduce_bytes``: the
    engine's ``HETCOMM_SMALL_ALLREDUCE_BYTES``. Invalid values raise ValueError naming them.
    Stored as tuples, so a model is immutable, hashable and compares by value.
    """

    bw: tuple[tuple[float, ...], ...]
    reduce_bps: Optional[tuple[float, ...]] = None
    alpha: float = DEFAULT_ALPHA_SECONDS
    segment_bytes: int = SEGMENT_BYTES
    small_allreduce_bytes: int = SMALL_ALLREDUCE_BYTES
    uplinks: tuple[tuple[tuple[int, ...], float, float], ...] = ()

    def __post_init__(self) -> None:
        rows = [list(row) for row in self.bw]
        P = len(rows)
        if P < 1:
            raise ValueError("hetcomm planner: the bandwidth matrix is empty")
        for i, row in enumerate(rows):
            if len(row) != P:
                raise ValueError(f"hetcomm planner: the bandwidth matrix must be {P}x{P}; row {i} has "
                                 f"{len(row)} entries")
        bw = tuple(
            tuple(0.0 if i == j else _check_rate(rows[i][j], f"bandwidth of link {i} -> {j}", allow_inf=False)
                  for j in range(P))
            for i in range(P))
        if self.reduce_bps is None:
            reduce_bps = (math.inf,) * P
        else:
            reduce_bps = tuple(self.reduce_bps)
            if len(reduce_bps) != P:
                raise ValueError(f"hetcomm planner: reduce_bps has {len(reduce_bps)} entries for {P} ranks")
            reduce_bps = tuple(_check_rate(r, f"reduce throughput of rank {i}", allow_inf=True)
                               for i, r in enumerate(reduce_bps))
        alpha = float(self.alpha)
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"hetcomm planner: alpha must be finite and >= 0 seconds, got {self.alpha!r}")
        for name in ("segment_bytes", "small_allreduce_bytes"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                raise ValueError(f"hetcomm planner: {name} must be a non-negative integer, got {value!r}")
        uplinks, seen = [], set()
        for k, entry in enumerate(self.uplinks):
            try:
                ranks, out_bps, in_bps = entry
                ranks = tuple(sorted(int(r) for r in ranks))
            except (TypeError, ValueError):
                raise ValueError(f"hetcomm planner: uplink {k} must be (ranks, out_bps, in_bps), got {entry!r}") from None
            if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < P for r in ranks) or seen & set(ranks):
                raise ValueError(f"hetcomm planner: uplink {k} ranks {ranks} must be distinct ranks of 0..{P - 1}, "
                                 "in no other uplink")
            seen |= set(ranks)
            uplinks.append((ranks, _check_rate(out_bps, f"uplink {k} out rate", allow_inf=True),
                            _check_rate(in_bps, f"uplink {k} in rate", allow_inf=True)))
        object.__setattr__(self, "uplinks", tuple(uplinks))
        object.__setattr__(self, "bw", bw)
        object.__setattr__(self, "reduce_bps", reduce_bps)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "segment_bytes", int(self.segment_bytes))
        object.__setattr__(self, "small_allreduce_bytes", int(self.small_allreduce_bytes))

    @property
    def world_size(self) -> int:
        return len(self.bw)

    def restricted(self, ranks: Sequence[int]) -> "LinkModel":
        """The model of the group made of ``ranks`` (indices into this model), in that order:
        rank k of the result is ``ranks[k]`` here."""
        ranks = [int(r) for r in ranks]
        if not ranks or sorted(set(ranks)) != sorted(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"hetcomm planner: {ranks} are not distinct ranks of a {self.world_size}-rank model")
        index = {r: k for k, r in enumerate(ranks)}
        uplinks = tuple((tuple(index[r] for r in group if r in index), out_bps, in_bps)
                        for group, out_bps, in_bps in self.uplinks if any(r in index for r in group))
        return LinkModel(bw=tuple(tuple(self.bw[i][j] for j in ranks) for i in ranks),
                         reduce_bps=tuple(self.reduce_bps[i] for i in ranks), alpha=self.alpha,
                         segment_bytes=self.segment_bytes, small_allreduce_bytes=self.small_allreduce_bytes,
                         uplinks=uplinks)

    @staticmethod
    def from_nics(nic_bps: Sequence[float], reduce_bps: Optional[Sequence[float]] = None,
                  alpha: float = DEFAULT_ALPHA_SECONDS, **engine: int) -> "LinkModel":
        """One full-duplex NIC per rank: ``bw[i][j] = min(nic[i], nic[j])``.

        In a ring every rank sends to one peer and receives from one, so a transfer i -> j is
        limited by i's egress and j's ingress and by nothing else. A schedule that talks to
        several peers at once (the hierarchical one) shares the NIC among them: each NIC is also
        an uplink of its rank. ``engine``: ``segment_bytes``, ``small_allreduce_bytes``.
        """
        nics = [_check_rate(v, f"NIC bandwidth of rank {i}", allow_inf=False) for i, v in enumerate(nic_bps)]
        P = len(nics)
        bw = tuple(tuple(0.0 if i == j else min(nics[i], nics[j]) for j in range(P)) for i in range(P))
        return LinkModel(bw=bw, reduce_bps=None if reduce_bps is None else tuple(reduce_bps), alpha=alpha,
                         uplinks=tuple(((i,), nics[i], nics[i]) for i in range(P)), **engine)

    def with_rank_uplinks(self) -> "LinkModel":
        """This model with each rank's traffic capped by its fastest link in each direction, for
        models measured one pair at a time (which cannot show what concurrent flows share): a
        rank talking to several peers at once is assumed to get no more than its best single
        link. Unchanged if it already has uplinks."""
        if self.uplinks:
            return self
        P = self.world_size
        ups = tuple(((i,), max(self.bw[i][j] for j in range(P) if j != i),
                     max(self.bw[j][i] for j in range(P) if j != i)) for i in range(P)) if P > 1 else ()
        return dataclasses.replace(self, uplinks=ups)


@dataclass(frozen=True)
class Plan:
    """A ring order and per-rank shares, as the engine's ``set_plan(order, shares)`` takes them.

    ``order[p]``: the rank at ring position p (it sends to ``order[p+1]``). ``shares[r]``: rank r's
    fraction of the buffer. ``predicted_bw_seconds_per_byte``: ``max(T_bw, T_reduce) / N`` under the
    model the plan was made for (``None`` for a plan built without one); its inverse is the
    predicted algorithm bandwidth for large messages. ``min_bytes``: smaller allreduces use
    uniform shares instead.
    """

    order: tuple[int, ...]
    shares: tuple[float, ...]
    predicted_bw_seconds_per_byte: Optional[float] = None
    # Allreduces smaller than this keep uniform shares in the engine (the weighted plan only pays
    # above the crossover size; see `crossover_bytes`).
    min_bytes: int = 0
    # The engine's pipeline segment size for this plan (0: its adaptive default).
    segment_bytes: int = 0
    # The site-aware schedule for allreduces of at least sites.min_bytes (site_planner.SitePlan),
    # and the topology it was made for (sites.Topology); None: the ring at every size.
    sites: Optional["SitePlan"] = None
    topology: Optional["Topology"] = None

    def __post_init__(self) -> None:
        order = tuple(int(r) for r in self.order)
        shares = tuple(float(s) for s in self.shares)
        P = len(order)
        if sorted(order) != list(range(P)) or P == 0:
            raise ValueError(f"hetcomm planner: plan order {order} is not a permutation of 0..{P - 1}")
        if len(shares) != P:
            raise ValueError(f"hetcomm planner: a plan for {P} ranks needs {P} shares, got {len(shares)}")
        for r, s in enumerate(shares):
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"hetcomm planner: share of rank {r} must be finite and >= 0, got {s!r}")
        if not sum(shares) > 0:
            raise ValueError("hetcomm planner: plan shares must not all be zero")
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "shares", shares)

    @property
    def world_size(self) -> int:
        return len(self.order)

    @property
    def is_uniform(self) -> bool:
        """True for the engine's default plan: identity order, equal shares."""
        return (self.order == tuple(range(self.world_size)) and len(set(self.shares)) == 1
                and self.sites is None)

    def predict_seconds(self, nbytes: int, model: LinkModel) -> float:
        """`predict_allreduce_seconds` of this plan."""
        return predict_allreduce_seconds(self, model, nbytes)

    def counts(self, numel: int) -> list[int]:
        """Elements owned by each rank (indexed by rank) for a buffer of ``numel`` elements.

        Bit-for-bit what the engine computes: ``sharesToCounts`` applied to the shares in
        ring-position order (floor, then the remainder by largest fractional part, ties to the
        lower *position*, never to a zero share), mapped back to ranks. Sums to ``numel``.
        """
        by_position = shares_to_counts(numel, [self.shares[r] for r in self.order])
        out = [0] * self.world_size
        for pos, rank in enumerate(self.order):
            out[rank] = by_position[pos]
        return out


def shares_to_counts(total: int, shares: Sequence[float]) -> list[int]:
    """Python twin of ``sharesToCounts`` (csrc/algorithms/ring_schedule.cc), same float operations.

    ``exact_i = total * (s_i / sum(s))``; each gets ``floor(exact_i)`` (capped so the running sum
    never exceeds ``total``); the rest goes one element at a time in order of decreasing
    fractional part (stable: ties to the lower index), cycling, skipping zero shares.
    """
    if int(total) != total or total < 0:
        raise ValueError(f"hetcomm planner: element count must be a non-negative integer, got {total!r}")
    total = int(total)
    if not shares:
        raise ValueError("hetcomm planner: no shares")
    ssum = 0.0
    for s in shares:
        if not (s >= 0 and math.isfinite(s)):
            raise ValueError("hetcomm planner: shares must be finite and non-negative")
        ssum += s
    if not ssum > 0:
        raise ValueError("hetcomm planner: shares sum to zero")
    counts = [0] * len(shares)
    remainders: list[tuple[float, int]] = []
    assigned = 0
    for i, s in enumerate(shares):
        exact = float(total) * (s / ssum)
        fl = math.floor(exact)
        counts[i] = min(int(fl), total - assigned)
        assigned += counts[i]
        remainders.append((exact - fl, i))
    remainders.sort(key=lambda item: -item[0])  # stable, like std::stable_sort with '>'
    k = 0
    while assigned < total:
        idx = remainders[k][1]
        if shares[idx] > 0:
            counts[idx] += 1
            assigned += 1
        k = (k + 1) % len(remainders)
    return counts


# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------

def _check_plan_fits(order: Sequence[int], shares: Sequence[float], model: LinkModel) -> None:
    P = model.world_size
    if len(shares) != P:
        raise ValueError(f"hetcomm planner: {len(shares)} shares for a model of {P} ranks")
    if sorted(order) != list(range(P)):
        raise ValueError(f"hetcomm planner: order {tuple(order)} is not a permutation of the {P} ranks of the model")


def ring_seconds_per_byte(order: Sequence[int], shares: Sequence[float], model: LinkModel) -> float:
    """``max(T_bw, T_reduce) / N`` for the ring ``order`` with ``shares`` (normalised to sum 1).

    ``max`` over ring links A -> B of ``(2 - o_A - o_B) / bw(A -> B)`` and over ranks A with
    finite reduce throughput of ``(1 - o_pred(A)) / reduce_bps[A]``; 0 for a single rank.
    """
    _check_plan_fits(order, shares, model)
    P = model.world_size
    if P == 1:
        return 0.0
    total = math.fsum(shares)
    if not total > 0:
        raise ValueError("hetcomm planner: shares sum to zero")
    o = [s / total for s in shares]
    worst = 0.0
    loads = {}
    for p in range(P):
        a, b = order[p], order[(p + 1) % P]
        loads[(a, b)] = 2.0 - o[a] - o[b]
        worst = max(worst, loads[(a, b)] / model.bw[a][b])
        if math.isfinite(model.reduce_bps[b]):
            worst = max(worst, (1.0 - o[a]) / model.reduce_bps[b])  # b reduces all but a's chunk
    return max(worst, uplink_seconds_per_byte(loads, model))


def uplink_seconds_per_byte(loads: dict, model: LinkModel) -> float:
    """The busiest shared uplink's time per byte of buffer: over ``model.uplinks``, the summed
    loads (bytes per byte, by directed link ``(a, b)``) of the links leaving (entering) the group,
    over its out (in) rate; 0 without uplinks."""
    worst = 0.0
    for group, out_bps, in_bps in model.uplinks:
        members = set(group)
        out = math.fsum(v for (a, b), v in loads.items() if a in members and b not in members)
        into = math.fsum(v for (a, b), v in loads.items() if b in members and a not in members)
        worst = max(worst, out / out_bps, into / in_bps)
    return worst


def _segment_bytes(model: LinkModel, largest_chunk_bytes: float) -> float:
    if model.segment_bytes > 0:
        return float(model.segment_bytes)
    return float(min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, int(largest_chunk_bytes) // 4)))


def _recursive_doubling_steps(P: int) -> int:
    p2 = 1 << (P.bit_length() - 1)
    return (p2.bit_length() - 1) + (2 if p2 != P else 0)


def predict_allreduce_seconds(plan: Plan, model: LinkModel, nbytes: int) -> float:
    """Predicted seconds for an AllReduce of ``nbytes`` bytes under ``plan`` (module docstring).

    Ring (``nbytes > small_allreduce_bytes``)::

        nbytes * ring_seconds_per_byte + 2 (P-1) alpha + (P-1) seg * mean(1 / ring bw)

    Recursive doubling (smaller messages; the plan is ignored)::

        steps * (alpha + nbytes / min(bw) + nbytes / min(reduce_bps))

    0 for a single rank or an empty message.
    """
    _check_plan_fits(plan.order, plan.shares, model)
    if int(nbytes) != nbytes or nbytes < 0:
        raise ValueError(f"hetcomm planner: nbytes must be a non-negative integer, got {nbytes!r}")
    P = model.world_size
    if P == 1 or nbytes == 0:
        return 0.0
    off_diagonal = [model.bw[i][j] for i in range(P) for j in range(P) if i != j]
    if nbytes <= model.small_allreduce_bytes:
        per_step = model.alpha + nbytes / min(off_diagonal) + nbytes / min(model.reduce_bps)
        return _recursive_doubling_steps(P) * per_step
    if plan.sites is not None and nbytes >= plan.sites.min_bytes:
        from hetcomm.site_planner import predict_site_plan_seconds
        return predict_site_plan_seconds(plan.sites, model, nbytes)
    per_byte = ring_seconds_per_byte(plan.order, plan.shares, model)
    largest_chunk = nbytes * max(plan.shares) / math.fsum(plan.shares)
    mean_hop_seconds_per_byte = math.fsum(1.0 / model.bw[plan.order[p]][plan.order[(p + 1) % P]]
                                          for p in range(P)) / P
    fill = (P - 1) * _segment_bytes(model, largest_chunk) * mean_hop_seconds_per_byte
    return nbytes * per_byte + 2 * (P - 1) * model.alpha + fill


# --------------------------------------------------------------------------------------------
# The LPs (ring-position space: variable y_p is the share of rank order[p])
# --------------------------------------------------------------------------------------------

def _run_lp(c: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray, b_eq: np.ndarray,
            bounds: list[tuple[float, Optional[float]]], what: str):
    # Dual simplex: a vertex solution, deterministic for identical inputs.
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs-ds")
    if res.status != 0 or res.x is None or not np.all(np.isfinite(res.x)):
        raise PlanningError(f"hetcomm planner: HiGHS failed on {what}: status {res.status}, {res.message}")
    return res


def _min_tau(b: Sequence[float], r: Sequence[float]) -> float:
    """LP 1: the least normalised T for ring data b (link p -> p+1) and r (reducer at p)."""
    P = len(b)
    rows, rhs = [], []
    for p in range(P):
        row = np.zeros(P + 1)
        row[p] -= 1.0
        row[(p + 1) % P] -= 1.0
        row[P] = -b[p]
        rows.append(row)
        rhs.append(-2.0)
    for p in range(P):
        if math.isfinite(r[p]):
            row = np.zeros(P + 1)
            row[(p - 1) % P] = -1.0
            row[P] = -r[p]
            rows.append(row)
            rhs.append(-1.0)
    c = np.zeros(P + 1)
    c[P] = 1.0
    a_eq = np.ones((1, P + 1))
    a_eq[0, P] = 0.0
    res = _run_lp(c, np.array(rows), np.array(rhs), a_eq, np.array([1.0]),
                  [(0.0, 1.0)] * P + [(0.0, None)], "the minimum-time LP")
    return float(res.x[P])


def _closest_to_uniform(b: Sequence[float], r: Sequence[float], tau_cap: float) -> list[float]:
    """LP 2: shares (by position) minimising sum |y - 1/P| among those with T <= tau_cap."""
    P = len(b)
    u = 1.0 / P
    rows, rhs = [], []

    def add(coeffs: dict[int, float], bound: float) -> None:
        row = np.zeros(2 * P)
        for k, v in coeffs.items():
            row[k] += v
        rows.append(row)
        rhs.append(bound)

    for p in range(P):
        add({p: -1.0, (p + 1) % P: -1.0}, -(2.0 - tau_cap * b[p]))
        if math.isfinite(r[p]):
            add({(p - 1) % P: -1.0}, -(1.0 - tau_cap * r[p]))
    for i in range(P):
        add({i: 1.0, P + i: -1.0}, u)     # d_i >= y_i - 1/P
        add({i: -1.0, P + i: -1.0}, -u)   # d_i >= 1/P - y_i
    c = np.concatenate([np.zeros(P), np.ones(P)])
    a_eq = np.concatenate([np.ones(P), np.zeros(P)])[None, :]
    res = _run_lp(c, np.array(rows), np.array(rhs), a_eq, np.array([1.0]),
                  [(0.0, 1.0)] * P + [(0.0, None)] * P, "the closest-to-uniform LP")
    return [float(v) for v in res.x[:P]]


def _snap_shares(raw: Sequence[float]) -> tuple[float, ...]:
    """Removes solver noise: exactly 1/P when (nearly) uniform, else the 2**-30 grid, sum exactly 1."""
    P = len(raw)
    clipped = [max(0.0, float(v)) for v in raw]
    if max(abs(v - 1.0 / P) for v in clipped) <= SHARE_QUANTUM:
        return (1.0 / P,) * P
    units = shares_to_counts(int(1 / SHARE_QUANTUM), clipped)
    return tuple(k * SHARE_QUANTUM for k in units)


class _RingSearch:
    """Normalised model data and a cache of LP-1 optima keyed by the ring's data up to rotation."""

    def __init__(self, model: LinkModel) -> None:
        self.P = model.world_size
        self.ref = max(model.bw[i][j] for i in range(self.P) for j in range(self.P) if i != j)
        self.b = [[x / self.ref for x in row] for row in model.bw]
        self.r = [x / self.ref for x in model.reduce_bps]
        finite_r = [x for x in self.r if math.isfinite(x)]
        self._reduce_bound = (len(finite_r) - 1) / math.fsum(finite_r) if len(finite_r) > 1 else 0.0
        self._cache: dict[tuple, float] = {}

    def ring_data(self, order: Sequence[int]) -> tuple[list[float], list[float]]:
        P = self.P
        return ([self.b[order[p]][order[(p + 1) % P]] for p in range(P)],
                [self.r[order[p]] for p in range(P)])

    def lower_bounds(self, orders: Sequence[Sequence[int]]) -> np.ndarray:
        """A lower bound of LP 1 for each of ``orders`` (valid, cheap, tight for sites joined by
        slow links, not tight in general), vectorised over the orders.

        Every share is at most their sum, 1. Sum of all link constraints: ``2(P-1) <= T sum(b)``.
        Sum of the k finite reducers' constraints: ``k - 1 <= T sum(r)``. And a *packing*: take
        ring links that share no rank, and reducer constraints whose share variable (the
        predecessor's) is in none of those links and is not used twice; the shares they bound are
        distinct, so their left-hand sides add up to at most 1::

            sum over the links (2 - T b) + sum over the reducers (1 - T r) <= 1
            T >= (2 links + reducers - 1) / (sum of their b + sum of their r)

        One link gives ``T >= 1/b``; two disjoint links of a ring that crosses a slow link twice
        give ``3 / (b1 + b2)``, which LP 1 meets. The best packing comes from a dynamic program
        over ring positions (the cheapest rate sum for each count, with and without the link
        that closes the ring).
        """
        P = self.P
        idx = np.asarray(orders, dtype=np.int64)                          # (n, P)
        b_all = np.asarray(self.b, dtype=np.float64)
        r_all = np.asarray(self.r, dtype=np.float64)
        b = b_all[idx, np.roll(idx, -1, axis=1)]                          # link p -> p+1
        w = r_all[np.roll(idx, -1, axis=1)]                               # share at p bounded by reducer p+1
        best = np.maximum(2.0 * (P - 1) / b.sum(axis=1), self._reduce_bound)
        for closing in (False, True):
            # f[:, k]: the least rate sum of a packing of count k (2 a link, 1 a reducer) within
            # the positions seen so far; with the closing link P-1 -> 0, positions P-1 and 0 are
            # taken by it.
            n, K = idx.shape[0], 2 * P + 1
            f = np.full((n, K), np.inf)
            first, last = (1, P - 1) if closing else (0, P)
            if closing:
                f[:, 2] = b[:, P - 1]
            else:
                f[:, 0] = 0.0
            rows = {first: f}
            for v in range(first, last):
                cur = rows.pop(v)
                nxt = rows.get(v + 1, np.full((n, K), np.inf))
                np.minimum(nxt, cur, out=nxt)                             # position v unused
                np.minimum(nxt[:, 1:], cur[:, :-1] + w[:, v:v + 1], out=nxt[:, 1:])
                rows[v + 1] = nxt
                if v + 1 < last:                                          # link v -> v+1
                    two = rows.get(v + 2, np.full((n, K), np.inf))
                    np.minimum(two[:, 2:], cur[:, :-2] + b[:, v:v + 1], out=two[:, 2:])
                    rows[v + 2] = two
            f = rows[last]
            counts = np.arange(K, dtype=np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(np.isfinite(f) & (counts >= 2), (counts - 1.0) / f, 0.0)
            best = np.maximum(best, ratio.max(axis=1))
        return best

    def tau(self, order: Sequence[int]) -> float:
        b, r = self.ring_data(order)
        seq = list(zip(b, r))
        key = min(tuple(seq[k:] + seq[:k]) for k in range(self.P))
        if key not in self._cache:
            kb = [x for x, _ in key]
            kr = [y for _, y in key]
            self._cache[key] = _min_tau(kb, kr)
        return self._cache[key]


def _validate_order(order: Sequence[int], P: int) -> tuple[int, ...]:
    out = tuple(int(x) for x in order)
    if sorted(out) != list(range(P)):
        raise ValueError(f"hetcomm planner: order {tuple(order)} is not a permutation of 0..{P - 1}")
    return out


def solve_shares(order: Sequence[int], model: LinkModel) -> tuple[tuple[float, ...], float]:
    """Best shares (indexed by rank) for ring ``order`` and their ``max(T_bw, T_reduce) / N``.

    LP 1 finds the least time T*; LP 2 picks, among shares within ``SHARE_TIE_RTOL`` of T*, the
    ones closest to uniform; the result is snapped (module docstring). The returned time is
    recomputed from the returned shares. Raises PlanningError if HiGHS fails.
    """
    P = model.world_size
    order = _validate_order(order, P)
    if P == 1:
        return (1.0,), 0.0
    search = _RingSearch(model)
    b, r = search.ring_data(order)
    tau_star = _min_tau(b, r)
    by_position = _closest_to_uniform(b, r, tau_star * (1.0 + SHARE_TIE_RTOL))
    by_rank = [0.0] * P
    for pos, rank in enumerate(order):
        by_rank[rank] = by_position[pos]
    shares = _snap_shares(by_rank)
    return shares, ring_seconds_per_byte(order, shares, model)


def _pick_order(candidates: Iterable[tuple[tuple[int, ...], float]], P: int) -> tuple[int, ...]:
    """Among (order, tau) pairs: ties within ORDER_TIE_RTOL of the best; identity first, then lex."""
    cands = list(candidates)
    best = min(t for _, t in cands)
    tied = [o for o, t in cands if t <= best * (1.0 + ORDER_TIE_RTOL)]
    identity = tuple(range(P))
    return identity if identity in tied else min(tied)


def _exhaustive_order(search: _RingSearch) -> tuple[int, ...]:
    P = search.P
    orders = [(0,) + rest for rest in itertools.permutations(range(1, P))]  # lexicographic
    bounded = sorted(zip(search.lower_bounds(orders).tolist(), range(len(orders))))
    # The best T is at least the smallest bound: if the identity is that close to it, it is tied
    # with the best and wins; this settles symmetric models (one slow NIC: every order ties)
    # without enumerating.
    identity = orders[0]
    if search.tau(identity) <= bounded[0][0] * (1.0 + ORDER_TIE_RTOL):
        return identity
    evaluated: list[tuple[tuple[int, ...], float]] = []
    best = math.inf
    for lb, i in bounded:
        # The bound is a valid lower bound of T, so no later order can tie with the best.
        if lb > best * (1.0 + ORDER_TIE_RTOL):
            break
        t = search.tau(orders[i])
        evaluated.append((orders[i], t))
        best = min(best, t)
    return _pick_order(evaluated, P)


def _greedy_order(search: _RingSearch) -> tuple[int, ...]:
    """From rank 0, always to the unvisited rank with the widest link from here (ties: lowest)."""
    P = search.P
    order = [0]
    left = list(range(1, P))
    while left:
        cur = order[-1]
        nxt = max(left, key=lambda j: (search.b[cur][j], -j))
        order.append(nxt)
        left.remove(nxt)
    return tuple(order)


def _local_search_order(search: _RingSearch) -> tuple[int, ...]:
    P = search.P
    identity = tuple(range(P))
    greedy = _greedy_order(search)
    cur = _pick_order([(identity, search.tau(identity)), (greedy, search.tau(greedy))], P)
    cur_t = search.tau(cur)

    def moves(o: tuple[int, ...]):
        for i in range(1, P - 1):
            for j in range(i + 1, P):
                yield o[:i] + o[i:j + 1][::-1] + o[j + 1:]   # 2-opt: reverse positions i..j
        for i in range(1, P - 1):
            for j in range(i + 1, P):
                s = list(o)
                s[i], s[j] = s[j], s[i]
                yield tuple(s)

    for _ in range(_LOCAL_SEARCH_MAX_PASSES):
        for cand in moves(cur):
            t = search.tau(cand)
            if t < cur_t * (1.0 - ORDER_TIE_RTOL):
                cur, cur_t = cand, t
                break
        else:
            break
    return cur


@functools.lru_cache(maxsize=32)
def best_plan(model: LinkModel) -> Plan:
    """The best ring order and its shares (exhaustive for P <= 8, local search above).

    Memoised (models and plans are immutable): choosing a plan asks for the best plan of one
    model once per candidate message size (`crossover_bytes`), and the search can take a second
    for 8 ranks whose links are all nearly equal.
    """
    P = model.world_size
    if P == 1:
        return Plan((0,), (1.0,), 0.0)
    search = _RingSearch(model)
    order = _exhaustive_order(search) if P <= MAX_EXHAUSTIVE_RANKS else _local_search_order(search)
    shares, per_byte = solve_shares(order, model)
    return Plan(order, shares, per_byte)


def uniform_plan(world_size: int, model: Optional[LinkModel] = None) -> Plan:
    """The engine's default plan: identity order, shares exactly 1/P (evaluated if a model is given)."""
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"hetcomm planner: world size must be a positive integer, got {world_size!r}")
    P = int(world_size)
    order, shares = tuple(range(P)), (1.0 / P,) * P
    if model is None:
        return Plan(order, shares, None)
    if model.world_size != P:
        raise ValueError(f"hetcomm planner: model has {model.world_size} ranks, plan {P}")
    return Plan(order, shares, ring_seconds_per_byte(order, shares, model))


def make_plan(model: LinkModel, nbytes: Optional[int] = None, min_gain: float = DEFAULT_MIN_GAIN) -> Plan:
    """The plan to use: the best plan if it beats uniform by more than ``min_gain``, else uniform.

    ``nbytes``: the message size to judge by (``None``: the large-message limit, i.e. bandwidth
    time only). Messages of at most ``small_allreduce_bytes`` always get the uniform plan.
    """
    if not (math.isfinite(min_gain) and 0 <= min_gain < 1):
        raise ValueError(f"hetcomm planner: min_gain must be in [0, 1), got {min_gain!r}")
    P = model.world_size
    uniform = uniform_plan(P, model)
    if P == 1 or (nbytes is not None and nbytes <= model.small_allreduce_bytes):
        return uniform
    best = best_plan(model)
    if nbytes is None:
        t_best, t_uniform = best.predicted_bw_seconds_per_byte, uniform.predicted_bw_seconds_per_byte
    else:
        t_best = predict_allreduce_seconds(best, model, nbytes)
        t_uniform = predict_allreduce_seconds(uniform, model, nbytes)
    return best if t_best < t_uniform * (1.0 - min_gain) else uniform


def crossover_bytes(model: LinkModel, min_gain: float = DEFAULT_MIN_GAIN, max_log2: int = 40) -> Optional[int]:
    """The smallest power-of-two message size at which `make_plan` picks the weighted plan.

    ``None`` when it never does (uniform links, or no gain beyond ``min_gain``).
    """
    if make_plan(model, None, min_gain).is_uniform:
        return None
    start = max(1, model.small_allreduce_bytes + 1).bit_length()
    for k in range(start, max_log2 + 1):
        if not make_plan(model, 1 << k, min_gain).is_uniform:
            return 1 << k
    return None


def format_plan(plan: Plan, model: Optional[LinkModel] = None) -> str:
    """One line for a debug log: ring order, shares in %, predicted large-message algbw."""
    ring = ">".join(str(r) for r in plan.order)
    total = math.fsum(plan.shares)
    shares = " ".join(f"r{r}={100.0 * s / total:.1f}%" for r, s in enumerate(plan.shares))
    line = f"hetcomm plan: ring {ring} | shares {shares}"
    if plan.min_bytes:
        line += f" | for allreduces >= {plan.min_bytes} B"
    if plan.segment_bytes:
        line += f" | segments {plan.segment_bytes // 1024} KB"
    if model is not None and model.world_size > 1:
        per_byte = ring_seconds_per_byte(plan.order, plan.shares, model)
        uniform = ring_seconds_per_byte(tuple(range(model.world_size)), (1.0,) * model.world_size, model)
        line += (f" | predicted {1e-9 / per_byte:.4g} GB/s algbw"
                 f" (uniform ring {1e-9 / uniform:.4g} GB/s)")
    elif plan.predicted_bw_seconds_per_byte:
        line += f" | predicted {1e-9 / plan.predicted_bw_seconds_per_byte:.4g} GB/s algbw"
    if plan.sites is not None:
        sp = plan.sites
        total = math.fsum(sp.block_shares)
        blocks = " ".join(f"({','.join(map(str, b))})={100.0 * x / total:.1f}%" for b, x in zip(sp.blocks, sp.block_shares))
        level = "hosts (shared memory inside)" if sp.local_inner else "sites"
        line += (f"\nhetcomm plan: hierarchical for allreduces >= {sp.min_bytes} B | {level} "
                 + " ".join("{" + ">".join(map(str, s)) + "}" for s in sp.sites)
                 + f" | blocks {blocks} | {level.split()[0][:-1]} shares "
                 + " ".join(f"{100.0 * w:.1f}%" for w in sp.site_shares))
        if sp.segment_bytes:
            line += f" | segments {sp.segment_bytes // 1024} KB"
        if model is not None:
            from hetcomm.site_planner import site_plan_seconds_per_byte
            line += f" | predicted {1e-9 / site_plan_seconds_per_byte(sp, model):.4g} GB/s algbw"
    return line
