"""Ring order: which rank follows which, and the best ring plan (`best_plan`, `make_plan`).

Every candidate order is scored by LP 1 of `hetcomm.plan.shares`. Up to ``MAX_EXHAUSTIVE_RANKS``
(8) ranks every order is a candidate, pruned by lower bounds (`RingSearch`); beyond, the
candidates are drawn from the levels of the cluster (`structured_orders`, `level_units`: hosts
together, sites in every cyclic order, greedy tours) and the best gets a bounded refinement.
`make_plan` keeps the identity order with uniform shares unless weighting gains more than
``min_gain``. The search is deterministic: ties are broken by explicit rules, so ranks with
identical inputs get bit-identical plans.

The search, its bounds and the determinism rules: docs/planner.md#ring-order.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Iterable, Optional, Sequence

import numpy as np

from hetcomm.labels import ranks_by_label
from hetcomm.plan import levels as levels_mod
from hetcomm.plan.cost import predict_allreduce_seconds, ring_seconds_per_byte
from hetcomm.plan.levels import Topology
from hetcomm.plan.model import LinkModel
from hetcomm.plan.schedules import Plan
from hetcomm.plan.shares import min_tau, ring_data, solve_shares, validate_order

MAX_EXHAUSTIVE_RANKS = 8               # (P-1)! orders: 5040 at P = 8
MAX_EXHAUSTIVE_HOSTS = 6               # host units: 120 orders, each an LP over all their ranks,
MAX_EXHAUSTIVE_HOST_RANKS = 64         # as long as those are few
ORDER_TIE_RTOL = 1e-6                  # "as good as the best" when choosing among ring orders
DEFAULT_MIN_GAIN = 0.03                # make_plan keeps uniform unless it saves more than this
MAX_SITE_PERMUTATIONS = 24             # every cyclic order of up to 5 sites
REFINE_TRIES = 12                      # LPs spent refining the best structured order
MAX_LOCAL_SEARCH_RANKS = 16            # rings of hosts up to here get a full local search of their ranks
_CANONICAL_ROTATION_RANKS = 16         # up to here the LP cache keys rings up to rotation
_PACKING_BOUND_RANKS = 64              # above, lower_bounds skips the packing (its one-link case stays)


class RingSearch:
    """Normalised model data and a cache of LP-1 optima keyed by the ring's data."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self.P = model.world_size
        self.ref = model.max_link
        # Links capped by the shared link of a single rank at either end (a NIC: the only ring
        # link that crosses it), as `ring_data` folds them in.
        bw = model.bw.copy()
        for group, out_bps, in_bps in model.uplinks:
            if len(group) == 1:
                r = group[0]
                bw[r, :] = np.minimum(bw[r, :], out_bps)
                bw[:, r] = np.minimum(bw[:, r], in_bps)
        self.b = bw / self.ref
        self.r = model.reduce_array / self.ref
        # Shared links of several ranks: (members, out rate, in rate), normalised.
        self.groups = [(np.isin(np.arange(self.P), g), o / self.ref, i / self.ref)
                       for g, o, i in model.uplinks if len(g) > 1]
        finite_r = self.r[np.isfinite(self.r)]
        self._reduce_bound = (len(finite_r) - 1) / math.fsum(finite_r) if len(finite_r) > 1 else 0.0
        self._cache: dict[tuple, float] = {}
        self.lps = 0

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

        A shared link of several ranks that k >= 1 ring links cross carries their loads: each
        is 2 less its ends' shares, and a rank's share counts once for every one of those links it
        ends, at most c times, so the loads add up to at least ``2k - c`` (the shares add up to 1):
        ``T >= (2k - c) / rate``. Summing every crossed shared link's constraint the same way
        (a link that leaves one group and enters another counts twice) bounds T by the sum of
        their rates: two sites behind uplinks, crossed once each way, give ``1.5 / rate``.
        """
        P = self.P
        idx = np.asarray(orders, dtype=np.int64)                          # (n, P)
        b = self.b[idx, np.roll(idx, -1, axis=1)]                         # link p -> p+1
        w = self.r[np.roll(idx, -1, axis=1)]                              # share at p bounded by reducer p+1
        best = np.maximum(2.0 * (P - 1) / b.sum(axis=1), self._reduce_bound)
        if self.groups:
            best = np.maximum(best, self._cap_bounds(idx))
        if P > _PACKING_BOUND_RANKS:
            # The packing's dynamic program costs O(P^2) an order: its one-link case only.
            return np.maximum(best, 1.0 / b.min(axis=1))
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

    def _cap_bounds(self, idx: np.ndarray) -> np.ndarray:
        """Bounds from the shared links of several ranks (see `lower_bounds`), per order."""
        n = idx.shape[0]
        multiplicity = np.zeros(idx.shape)
        rates = np.zeros(n)
        best = np.zeros(n)
        for member, out_rate, in_rate in self.groups:
            inside, after = member[idx], member[np.roll(idx, -1, axis=1)]
            for crossing, rate in ((inside & ~after, out_rate), (~inside & after, in_rate)):
                if not np.isfinite(rate):
                    continue
                k = crossing.sum(axis=1)
                touching = (crossing + np.roll(crossing, 1, axis=1)).max(axis=1)
                best = np.maximum(best, np.where(k > 0, (2.0 * k - touching) / rate, 0.0))
                multiplicity += crossing
                rates += np.where(k > 0, rate, 0.0)
        touching = (multiplicity + np.roll(multiplicity, 1, axis=1)).max(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            union = np.where(rates > 0, (2.0 * multiplicity.sum(axis=1) - touching) / rates, 0.0)
        return np.maximum(best, union)

    def tau(self, order: Sequence[int]) -> float:
        data = ring_data(self.model, order, self.ref)
        if data.caps:
            # Which links share a cap is part of the ring's data: key by the order itself.
            key = (tuple(_rotate_to_zero(order)),)
        elif self.P <= _CANONICAL_ROTATION_RANKS:
            seq = list(zip(data.b.tolist(), data.r.tolist()))
            key = min(tuple(seq[k:] + seq[:k]) for k in range(self.P))
        else:
            start = list(order).index(0)
            key = (tuple(np.roll(data.b, -start).tolist()), tuple(np.roll(data.r, -start).tolist()))
        if key not in self._cache:
            self.lps += 1
            self._cache[key] = min_tau(data)
        return self._cache[key]


def _pick_order(candidates: Iterable[tuple[tuple[int, ...], float]], P: int,
                preferred: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """Among (order, tau) pairs: ties within ORDER_TIE_RTOL of the best; ``preferred`` (default
    the identity) first, then the lexicographically smallest."""
    cands = list(candidates)
    best = min(t for _, t in cands)
    tied = [o for o, t in cands if t <= best * (1.0 + ORDER_TIE_RTOL)]
    preferred = tuple(range(P)) if preferred is None else preferred
    return preferred if preferred in tied else min(tied)


def _scored_by_bound(search: RingSearch, orders: Sequence[tuple[int, ...]],
                     bounded: Sequence[tuple[float, int]]) -> list[tuple[tuple[int, ...], float]]:
    """(order, tau) for ``orders`` taken by increasing lower bound (``bounded``: sorted (bound,
    index) pairs), until a bound exceeds the best tau found: a bound is a valid lower bound of
    tau, so no later order can win or tie (within ORDER_TIE_RTOL)."""
    scored: list[tuple[tuple[int, ...], float]] = []
    best = math.inf
    for lb, i in bounded:
        if lb > best * (1.0 + ORDER_TIE_RTOL):
            break
        t = search.tau(orders[i])
        scored.append((orders[i], t))
        best = min(best, t)
    return scored


def exhaustive_order(search: RingSearch, units: Optional[Sequence[Sequence[int]]] = None) -> tuple[int, ...]:
    """The best ring over every order of ``units`` (groups of ranks kept together in their order;
    default every rank alone), the first unit first."""
    P = search.P
    units = [[r] for r in range(P)] if units is None else [list(u) for u in units]
    orders = [tuple(r for k in (0,) + rest for r in units[k]) for rest in itertools.permutations(range(1, len(units)))]
    bounded = sorted(zip(search.lower_bounds(orders).tolist(), range(len(orders))))
    # The best T is at least the smallest bound: if the natural order (units by lowest rank, the
    # identity for ranks) is that close to it, it is tied with the best and wins; this settles
    # symmetric models (one slow NIC: every order ties) without enumerating.
    natural = orders[0]
    if search.tau(natural) <= bounded[0][0] * (1.0 + ORDER_TIE_RTOL):
        return natural
    return _pick_order(_scored_by_bound(search, orders, bounded), P, natural)


def level_units(P: int, topology: Optional[Topology]) -> list[list[int]]:
    """The units a ring search orders: the hosts (their ranks together, ascending) when the
    topology has hosts of several ranks, else single ranks; units by lowest rank."""
    if topology is None or topology.num_hosts == P:
        return [[r] for r in range(P)]
    return ranks_by_label(topology.hosts)


def _greedy_tour(rates: np.ndarray, start: int = 0) -> list[int]:
    """From ``start``, always to the unvisited node with the widest link from here (ties: lowest)."""
    n = rates.shape[0]
    order = [start]
    left = np.ones(n, dtype=bool)
    left[start] = False
    for _ in range(n - 1):
        row = np.where(left, rates[order[-1]], -np.inf)
        nxt = int(np.argmax(row))                  # first maximum: the lowest index
        order.append(nxt)
        left[nxt] = False
    return order


def _mean_rates(bw: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """The mean link rate from each group to each other group (diagonal 0)."""
    n = len(groups)
    P = bw.shape[0]
    onehot = np.zeros((n, P))
    for k, g in enumerate(groups):
        onehot[k, g] = 1.0 / len(g)
    out = onehot @ bw @ onehot.T
    np.fill_diagonal(out, 0.0)
    return out


def _rotate_to_zero(order: Sequence[int]) -> tuple[int, ...]:
    k = list(order).index(0)
    return tuple(order[k:]) + tuple(order[:k])


def structured_orders(model: LinkModel, topology: Optional[Topology] = None) -> list[tuple[int, ...]]:
    """The candidate orders, rank 0 first, without repeats.

    Which, and why: docs/planner.md#more-ranks-orders-drawn-from-the-levels.
    """
    P = model.world_size
    if topology is not None and topology.world_size != P:
        raise ValueError(f"hetcomm planner: topology of {topology.world_size} ranks for a model of {P}")
    site_labels = topology.sites if topology is not None else levels_mod.detect_sites(model.bw)
    host_labels = topology.hosts if topology is not None else tuple(range(P))
    candidates = [tuple(range(P)), tuple(_greedy_tour(model.bw))]
    sites = ranks_by_label(site_labels)
    hosts_of_site = [ranks_by_label([host_labels[r] for r in site]) for site in sites]
    # hosts_of_site[s]: lists of indices into sites[s]; turn them into ranks.
    hosts_of_site = [[[site[i] for i in host] for host in hosts] for site, hosts in zip(sites, hosts_of_site)]
    S = len(sites)
    if math.factorial(max(S - 1, 0)) <= MAX_SITE_PERMUTATIONS:
        site_orders = [(0,) + rest for rest in itertools.permutations(range(1, S))]
    else:
        site_orders = [tuple(range(S)), tuple(_greedy_tour(_mean_rates(model.bw, sites)))]
    host_variants = [hosts_of_site]
    greedy_hosts = []
    for hosts in hosts_of_site:
        if len(hosts) > 2:
            tour = _greedy_tour(_mean_rates(model.bw, hosts))
            greedy_hosts.append([hosts[i] for i in tour])
        else:
            greedy_hosts.append(hosts)
    if greedy_hosts != hosts_of_site:
        host_variants.append(greedy_hosts)
    for site_order in site_orders:
        for variant in host_variants:
            candidates.append(tuple(r for s in site_order for host in variant[s] for r in host))
    return list(dict.fromkeys(_rotate_to_zero(c) for c in candidates))


def _refine(search: RingSearch, order: tuple[int, ...], tau: float) -> tuple[tuple[int, ...], float]:
    """Bounded improvement of ``order`` at its binding link.

    The rule: docs/planner.md#more-ranks-orders-drawn-from-the-levels.
    """
    P = search.P
    if P < 4:
        return order, tau
    tries = 0
    while tries < REFINE_TRIES:
        b = ring_data(search.model, order, search.ref).b
        # The narrowest ring link is the usual bottleneck (the LP's shares are not at hand here):
        # move its head next to the ranks it has the widest links with, or reverse up to them.
        p = int(np.argmin(b))
        head = order[(p + 1) % P]
        tail = order[p]
        partners = [int(q) for q in np.argsort(-search.b[head], kind="stable") if q != head][:3]
        improved = False
        for q in partners:
            if tries >= REFINE_TRIES:
                break
            rest = [r for r in order if r != head]
            at = rest.index(q)
            moves = [rest[:at + 1] + [head] + rest[at + 1:], rest[:at] + [head] + rest[at:]]
            i, j = sorted((order.index(tail) + 1, order.index(q)))
            if j - i >= 1:
                moves.append(list(order[:i]) + list(order[i:j + 1])[::-1] + list(order[j + 1:]))
            for move in moves:
                cand = _rotate_to_zero(move)
                if cand == order or float(search.lower_bounds([cand])[0]) >= tau * (1.0 - ORDER_TIE_RTOL):
                    continue
                tries += 1
                t = search.tau(cand)
                if t < tau * (1.0 - ORDER_TIE_RTOL):
                    order, tau, improved = cand, t, True
                    break
            if improved:
                break
        if not improved:
            break
    return order, tau


def _neighbours(order: tuple[int, ...]):
    """Every move of one rank to another place, every reversal, every swap (rank 0 stays first)."""
    P = len(order)
    for i in range(1, P):
        rest = order[:i] + order[i + 1:]
        for j in range(1, P):
            if j != i:
                yield rest[:j] + (order[i],) + rest[j:]
    for i in range(1, P - 1):
        for j in range(i + 1, P):
            yield order[:i] + order[i:j + 1][::-1] + order[j + 1:]
            s = list(order)
            s[i], s[j] = s[j], s[i]
            yield tuple(s)


def local_search(search: RingSearch, order: tuple[int, ...], max_lps: int = 400) -> tuple[int, ...]:
    """First-improvement local search over `_neighbours`, at most ``max_lps`` LPs (small rings)."""
    tau = search.tau(order)
    start = search.lps
    improved = True
    while improved and search.lps - start < max_lps:
        improved = False
        for cand in dict.fromkeys(_neighbours(order)):
            if search.lps - start >= max_lps:
                break
            if float(search.lower_bounds([cand])[0]) >= tau * (1.0 - ORDER_TIE_RTOL):
                continue
            t = search.tau(cand)
            if t < tau * (1.0 - ORDER_TIE_RTOL):
                order, tau, improved = cand, t, True
                break
    return order


def structured_order(search: RingSearch, topology: Optional[Topology] = None) -> tuple[int, ...]:
    """The best of `structured_orders` after `_refine`; LPs bounded whatever P."""
    candidates = structured_orders(search.model, topology)
    bounds = search.lower_bounds(candidates).tolist()
    scored = _scored_by_bound(search, candidates, sorted(zip(bounds, range(len(candidates)))))
    order = _pick_order(scored, search.P)
    tau = dict(scored)[order]
    # An order that meets its own lower bound cannot be improved: no refinement (uniform sites).
    if tau <= float(search.lower_bounds([order])[0]) * (1.0 + ORDER_TIE_RTOL):
        return order
    refined, t = _refine(search, order, tau)
    return refined if t < tau * (1.0 - ORDER_TIE_RTOL) else order


@functools.lru_cache(maxsize=32)
def best_plan(model: LinkModel, topology: Optional[Topology] = None, exhaustive: Optional[bool] = None) -> Plan:
    """The best ring order and its shares: every order of the level's units (`level_units`) when
    there are at most 8 ranks or 6 hosts of at most 64 ranks in all (each order an LP over all
    the ranks: 5040 LPs of 8 ranks, 120 of up to 64), else `structured_order`.
    ``exhaustive``: True tries every order of the *ranks*, False forces `structured_order`;
    ``topology`` gives the levels (else sites are detected and every rank is its own host).

    Memoised (models and plans are immutable): choosing a plan asks for the best plan of one
    model once per candidate message size (`crossover_bytes`).
    """
    P = model.world_size
    if P == 1:
        return Plan((0,), (1.0,), 0.0)
    search = RingSearch(model)
    units = level_units(P, topology)
    if exhaustive is True:
        order = exhaustive_order(search)
    elif exhaustive is False or len(units) > (MAX_EXHAUSTIVE_RANKS if len(units) == P else MAX_EXHAUSTIVE_HOSTS) \
            or P > MAX_EXHAUSTIVE_HOST_RANKS:
        order = structured_order(search, topology)
    else:
        order = exhaustive_order(search, units)
        if len(units) < P <= MAX_LOCAL_SEARCH_RANKS:
            # Keeping a host's ranks together can miss a ring that splits a fast host around a
            # slow one: every move of one rank, reversal and swap, first improvement kept.
            order = local_search(search, order)
    shares, per_byte = solve_shares(order, model, tau_star=search.tau(order))
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


def make_plan(model: LinkModel, nbytes: Optional[int] = None, min_gain: float = DEFAULT_MIN_GAIN,
              topology: Optional[Topology] = None) -> Plan:
    """The plan to use: the best plan if it beats uniform by more than ``min_gain``, else uniform.

    ``nbytes``: the message size to judge by (``None``: the large-message limit, i.e. bandwidth
    time only). Messages of at most ``small_allreduce_bytes`` always get the uniform plan.
    """
    if not (math.isfinite(min_gain) and 0 <= min_gain < 1):
        raise ValueError(f"hetcomm planner: min_gain must be in [0, 1), got {min_gain!r}")
    P = model.world_size
    uniform = _uniform_evaluated(model)
    if P == 1 or (nbytes is not None and nbytes <= model.small_allreduce_bytes):
        return uniform
    best = best_plan(model, topology)
    if nbytes is None:
        t_best, t_uniform = best.predicted_bw_seconds_per_byte, uniform.predicted_bw_seconds_per_byte
    else:
        t_best = predict_allreduce_seconds(best, model, nbytes)
        t_uniform = predict_allreduce_seconds(uniform, model, nbytes)
    return best if t_best < t_uniform * (1.0 - min_gain) else uniform


@functools.lru_cache(maxsize=32)
def _uniform_evaluated(model: LinkModel) -> Plan:
    return uniform_plan(model.world_size, model)


def crossover_bytes(model: LinkModel, min_gain: float = DEFAULT_MIN_GAIN, max_log2: int = 40,
                    topology: Optional[Topology] = None) -> Optional[int]:
    """The smallest power-of-two message size at which `make_plan` picks the weighted plan.

    ``None`` when it never does (uniform links, or no gain beyond ``min_gain``).
    """
    if make_plan(model, None, min_gain, topology).is_uniform:
        return None
    start = max(1, model.small_allreduce_bytes + 1).bit_length()
    for k in range(start, max_log2 + 1):
        if not make_plan(model, 1 << k, min_gain, topology).is_uniform:
            return 1 << k
    return None


__all__ = ["RingSearch", "exhaustive_order", "structured_orders", "structured_order", "best_plan", "uniform_plan",
           "make_plan", "crossover_bytes", "validate_order", "MAX_EXHAUSTIVE_RANKS", "ORDER_TIE_RTOL",
           "DEFAULT_MIN_GAIN"]
