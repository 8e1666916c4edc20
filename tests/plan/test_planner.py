"""Tests of the ring planner (python/hetcomm/plan/: cost, shares, order): pure, exact, no processes.

Units: bandwidths in bytes/s, ``mbit(x) = x * 1e6 / 8``; "MB" in design.md §2 is 10**6 bytes
(24 MB / 12.5 MB/s = 1.92 s only works out that way), so the worked example uses N = 16e6 bytes.
Times per byte are compared with relative tolerances: shares are snapped to a 2**-30 grid, which
moves a load by less than 2e-9 of N.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from hetcomm import planner
from hetcomm.plan import order as plan_order

from_nics = planner.LinkModel.from_nics
LinkModel = planner.LinkModel
Plan = planner.Plan

REL = 1e-6


def mbit(x: float) -> float:
    return x * 1e6 / 8


def sites_model(layout, intra=mbit(1000), inter=mbit(100)) -> LinkModel:
    P = len(layout)
    return LinkModel(bw=[[intra if layout[i] == layout[j] else inter for j in range(P)] for i in range(P)])


def crossings(order, layout) -> int:
    P = len(order)
    return sum(layout[order[p]] != layout[order[(p + 1) % P]] for p in range(P))


def orders_rank0_first(P):
    return [(0,) + rest for rest in itertools.permutations(range(1, P))]


def assert_satisfies_lp(order, shares, model, T_per_byte, rtol=1e-7):
    """Every constraint of LP 1 (docs/planner.md#shares-two-linear-programs), in bytes/s (N = 1 byte)."""
    P = len(order)
    assert all(s >= 0 for s in shares)
    assert math.fsum(shares) == pytest.approx(1.0, abs=1e-12)
    for p in range(P):
        a, b = order[p], order[(p + 1) % P]
        assert shares[a] + shares[b] + T_per_byte * model.bw[a][b] >= 2 - rtol, (a, b)
        if math.isfinite(model.reduce_bps[b]):
            assert shares[a] + T_per_byte * model.reduce_bps[b] >= 1 - rtol, ("reduce", b)


# --------------------------------------------------------------------------------------------
# design.md §2, worked example: NICs 800/800/800/100 Mbit/s, 16 MB fp32
# --------------------------------------------------------------------------------------------

WORKED = from_nics([mbit(800), mbit(800), mbit(800), mbit(100)])
N_WORKED = 16_000_000  # bytes: 4e6 fp32 elements


def test_worked_example_slow_rank_owns_everything():
    plan = planner.best_plan(WORKED)
    # Every order is the same ring up to relabelling fast ranks: identity by the tie rule.
    assert plan.order == (0, 1, 2, 3)
    assert plan.shares == (0.0, 0.0, 0.0, 1.0)   # exactly: snapping removes the LP's noise
    # The slow node's two links carry N each (a pipelined chain through it): 16 MB / 12.5 MB/s.
    assert plan.predicted_bw_seconds_per_byte * N_WORKED == pytest.approx(1.28, rel=1e-12)
    uniform = planner.uniform_plan(4, WORKED)
    # Uniform: every link carries 2N(P-1)/P = 24 MB, the slow ones at 12.5 MB/s.
    assert uniform.predicted_bw_seconds_per_byte * N_WORKED == pytest.approx(1.92, rel=1e-12)
    assert_satisfies_lp(plan.order, plan.shares, WORKED, plan.predicted_bw_seconds_per_byte)


def test_worked_example_lower_bound_for_any_algorithm_is_reached():
    # The slow node must receive and send N: 1.28 s is optimal for *any* algorithm, and the LP
    # optimum of every ring order reaches it.
    for order in orders_rank0_first(4):
        shares, T = planner.solve_shares(order, WORKED)
        assert T * N_WORKED == pytest.approx(1.28, rel=1e-12)
        assert shares[3] == 1.0


def test_worked_example_predicted_seconds_with_latency_terms():
    model = from_nics([mbit(800)] * 3 + [mbit(100)], alpha=0.0, segment_bytes=1_000_000)
    plan = planner.best_plan(model)
    # Fill: (P-1) segments * mean over ring links of 1/bw = 3 * 1e6 * (2/12.5e6 + 2/100e6) / 4.
    fill = 3 * 1e6 * (2 / 12.5e6 + 2 / 100e6) / 4
    assert fill == pytest.approx(0.135)
    assert planner.predict_allreduce_seconds(plan, model, N_WORKED) == pytest.approx(1.28 + fill, rel=1e-12)
    uniform = planner.uniform_plan(4)
    assert planner.predict_allreduce_seconds(uniform, model, N_WORKED) == pytest.approx(1.92 + fill, rel=1e-12)
    # Latency: 2(P-1) ring steps of alpha each.
    with_alpha = from_nics([mbit(800)] * 3 + [mbit(100)], alpha=1e-3, segment_bytes=1_000_000)
    assert planner.predict_allreduce_seconds(plan, with_alpha, N_WORKED) == pytest.approx(1.28 + fill + 6e-3, rel=1e-12)


def test_adaptive_segment_size_follows_the_engine():
    # seg = largest chunk / 4 clamped to [32 KiB, 1 MiB]; alpha 0; uniform links of 100 MB/s.
    model = from_nics([100e6] * 4, alpha=0.0)
    plan = planner.uniform_plan(4)
    per_byte = 1.5 / 100e6
    for nbytes, seg in [(64 * 1024 * 4, 32 * 1024),           # chunk 64 KiB -> 16 KiB -> 32 KiB
                        (4 * 1024 * 1024 * 4, 1024 * 1024),   # chunk 4 MiB -> 1 MiB
                        (1024 * 1024 * 4, 256 * 1024)]:       # chunk 1 MiB -> 256 KiB
        expected = nbytes * per_byte + 3 * seg / 100e6
        assert planner.predict_allreduce_seconds(plan, model, nbytes) == pytest.approx(expected, rel=1e-12)


def test_a_plans_segment_caps_the_adaptive_one():
    # The plan's segment_bytes bounds the adaptive size and never raises it (the engine's
    # CollectiveContext::segmentBytesFor); alpha 0, uniform links of 100 MB/s, 4 ranks.
    model = from_nics([100e6] * 4, alpha=0.0)
    per_byte = 1.5 / 100e6
    for cap, nbytes, seg in [(64 << 10, 16 << 20, 64 << 10),    # chunk 4 MiB -> 1 MiB, capped to 64 KiB
                             (512 << 10, 2 << 20, 128 << 10),   # chunk 512 KiB -> 128 KiB, under the cap
                             (1 << 20, 1 << 18, 32 << 10)]:     # chunk 64 KiB -> 16 KiB -> 32 KiB
        plan = dataclasses.replace(planner.uniform_plan(4), segment_bytes=cap)
        expected = nbytes * per_byte + 3 * seg / 100e6
        assert planner.predict_allreduce_seconds(plan, model, nbytes) == pytest.approx(expected, rel=1e-12)
    # HETCOMM_SEGMENT_BYTES (the model's segment_bytes) wins over the cap.
    forced = from_nics([100e6] * 4, alpha=0.0, segment_bytes=1 << 20)
    plan = dataclasses.replace(planner.uniform_plan(4), segment_bytes=64 << 10)
    assert planner.predict_allreduce_seconds(plan, forced, 16 << 20) == pytest.approx(
        (16 << 20) * per_byte + 3 * (1 << 20) / 100e6, rel=1e-12)


def test_small_messages_use_the_recursive_doubling_prediction():
    # steps: log2(P) for a power of two; floor(log2 P) + 2 (fold in, fold out) otherwise.
    for P, steps in [(2, 1), (3, 3), (4, 2), (5, 4), (8, 3)]:
        model = from_nics([mbit(800)] * (P - 1) + [mbit(100)], alpha=1e-4)
        for plan in (planner.uniform_plan(P), planner.best_plan(model)):
            got = planner.predict_allreduce_seconds(plan, model, 32 * 1024)
            assert got == pytest.approx(steps * (1e-4 + 32 * 1024 / mbit(100)), rel=1e-12)
    assert planner.predict_allreduce_seconds(planner.uniform_plan(4), WORKED, 0) == 0.0
    single = LinkModel(bw=[[0.0]])
    assert planner.predict_allreduce_seconds(planner.uniform_plan(1), single, 1 << 20) == 0.0


def test_format_plan_is_one_line():
    line = planner.format_plan(planner.best_plan(WORKED), WORKED)
    assert "\n" not in line
    assert "ring 0>1>2>3" in line and "r3=100.0%" in line and "0.0125 GB/s" in line
    assert "uniform ring 0.008333 GB/s" in line


# --------------------------------------------------------------------------------------------
# Uniform links
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_uniform_links_give_exactly_uniform_shares_and_identity(P):
    for reduce_bps in (None, [3e8] * P):
        model = from_nics([1e8] * P, reduce_bps=reduce_bps)
        plan = planner.best_plan(model)
        assert plan.order == tuple(range(P))
        assert plan.shares == (1.0 / P,) * P   # exactly; even P also admits alternating optima
        assert plan.is_uniform
        if P > 1:
            assert plan.predicted_bw_seconds_per_byte == pytest.approx(2 * (P - 1) / P / 1e8, rel=1e-12)
        assert planner.make_plan(model, nbytes=64 << 20) == planner.uniform_plan(P, model)


def test_uniform_plan():
    assert planner.uniform_plan(3) == Plan((0, 1, 2), (1 / 3, 1 / 3, 1 / 3), None)
    assert planner.uniform_plan(4, WORKED).predicted_bw_seconds_per_byte == pytest.approx(1.5 / mbit(100))
    with pytest.raises(ValueError, match="model has 4 ranks"):
        planner.uniform_plan(3, WORKED)


# --------------------------------------------------------------------------------------------
# Two slow NICs (S = 100 Mbit = 12.5e6 B/s, fast ones 8S)
# --------------------------------------------------------------------------------------------
# Hand solution: T* = 1.5 N / S for any P >= 4 and any placement of the two slow ranks.
# * Slow ranks adjacent (a -> s1 -> s2 -> b): the loads of a->s1 and s2->b add up to
#   4 - o_a - o_s1 - o_s2 - o_b >= 3, so one of them is >= 1.5 N on a link of bandwidth S.
#   Reached by o_a = o_s2 = x, o_s1 = o_b = 1/2 - x: all three slow links carry exactly 1.5 N.
# * Slow ranks apart (a -> s1 -> b, c -> s2 -> d): the four slow links carry
#   8 - o_a - 2 o_s1 - o_b - o_c - 2 o_s2 - o_d >= 8 - 2 = 6, so one is >= 1.5 N.
#   Reached by o_s1 = o_s2 = 1/2 (every slow link carries 2 - 1/2 = 1.5).
# * Fast links carry at most 2N at 8S: 0.25 N / S, never binding.
# Uniform shares give 2(P-1)/P N / S: also 1.5 at P = 4 (weighting gains nothing there), 5/3 at
# P = 6 (the plan is 10% faster).

S = mbit(100)
F = mbit(800)


@pytest.mark.parametrize("nics", [(F, S, F, S), (F, F, S, S), (S, F, F, S)])
def test_two_slow_nics_of_four_gain_nothing(nics):
    model = from_nics(nics)
    for order in orders_rank0_first(4):
        shares, T = planner.solve_shares(order, model)
        assert T * S == pytest.approx(1.5, rel=REL)
        assert_satisfies_lp(order, shares, model, T)
    plan = planner.best_plan(model)
    assert plan == planner.uniform_plan(4, model)
    assert planner.make_plan(model, nbytes=N_WORKED) == planner.uniform_plan(4, model)


@pytest.mark.parametrize("nics, owners", [
    ((F, F, F, F, S, S), None),            # adjacent in the identity ring
    ((F, F, F, S, F, S), (3, 5)),          # apart: each slow rank owns half
])
def test_two_slow_nics_of_six(nics, owners):
    model = from_nics(nics)
    plan = planner.best_plan(model)
    assert plan.order == tuple(range(6))   # every order reaches 1.5: the identity wins the tie
    assert plan.predicted_bw_seconds_per_byte * S == pytest.approx(1.5, rel=REL)
    assert planner.uniform_plan(6, model).predicted_bw_seconds_per_byte * S == pytest.approx(5 / 3, rel=1e-12)
    assert_satisfies_lp(plan.order, plan.shares, model, plan.predicted_bw_seconds_per_byte)
    if owners is not None:
        assert [plan.shares[r] for r in owners] == pytest.approx([0.5, 0.5], abs=1e-12)
    assert planner.make_plan(model, nbytes=N_WORKED) == plan


# --------------------------------------------------------------------------------------------
# Two sites joined by a slow link (intra 1000 Mbit, inter 100 Mbit = l)
# --------------------------------------------------------------------------------------------
# Links whose endpoints are disjoint have loads summing to 2k - (their endpoints' shares) >=
# 2k - 1, so k vertex-disjoint slow links force T >= (2 - 1/k) N / l. Two sites in a ring
# crossing the gap c times contain c/2 .. c disjoint slow links.
# * 2 + 2 ranks: every ring has exactly 2 disjoint crossings (c = 2: two; c = 4: alternate
#   ones) -> T = 1.5 N/l for every order, which uniform shares already reach.
# * 3 + 3 ranks: c = 2 -> 1.5 N/l (o_X + o_Y = 1/2 on both crossings); c = 4 and c = 6 contain
#   3 disjoint crossings -> 5/3 N/l (uniform's value too).

def test_sites_two_plus_two_order_does_not_matter():
    for layout in [(0, 0, 1, 1), (0, 1, 0, 1)]:
        model = sites_model(layout)
        by_crossings = {}
        for order in orders_rank0_first(4):
            _, T = planner.solve_shares(order, model)
            by_crossings.setdefault(crossings(order, layout), []).append(T * mbit(100))
        assert sorted(by_crossings) == [2, 4]
        assert all(t == pytest.approx(1.5, rel=REL) for ts in by_crossings.values() for t in ts)
        assert planner.best_plan(model) == planner.uniform_plan(4, model)


def test_sites_identity_already_crosses_twice():
    layout = (0, 0, 0, 1, 1, 1)
    model = sites_model(layout)
    plan = planner.best_plan(model)
    assert plan.order == tuple(range(6)) and crossings(plan.order, layout) == 2
    assert plan.predicted_bw_seconds_per_byte * mbit(100) == pytest.approx(1.5, rel=REL)


def test_sites_interleaved_ranks_get_an_order_crossing_twice():
    layout = (0, 1, 0, 1, 0, 1)          # identity crosses the slow link 6 times
    model = sites_model(layout)
    T_of = {}
    for order in orders_rank0_first(6):
        _, T = planner.solve_shares(order, model)
        T_of[order] = T * mbit(100)
        expected = 1.5 if crossings(order, layout) == 2 else 5 / 3
        assert T_of[order] == pytest.approx(expected, rel=REL), order
    plan = planner.best_plan(model)
    assert crossings(plan.order, layout) == 2
    # Ties among the 2-crossing orders go to the lexicographically smallest.
    assert plan.order == min(o for o in T_of if crossings(o, layout) == 2) == (0, 1, 3, 5, 2, 4)
    assert plan.predicted_bw_seconds_per_byte * mbit(100) == pytest.approx(1.5, rel=REL)
    identity = planner.solve_shares(tuple(range(6)), model)[1]
    assert plan.predicted_bw_seconds_per_byte < identity * (1 - 0.09)
    assert_satisfies_lp(plan.order, plan.shares, model, plan.predicted_bw_seconds_per_byte)
    assert planner.make_plan(model, nbytes=N_WORKED) == plan


def test_local_search_above_eight_ranks_finds_two_crossings():
    layout = (0, 1) * 5                  # P = 10: local search, identity crosses 10 times
    model = sites_model(layout)
    plan = planner.best_plan(model)
    assert crossings(plan.order, layout) == 2
    assert plan.predicted_bw_seconds_per_byte * mbit(100) == pytest.approx(1.5, rel=REL)
    assert plan == planner.best_plan(sites_model(layout))


# --------------------------------------------------------------------------------------------
# Brute force: a grid over shares for every order, P <= 4
# --------------------------------------------------------------------------------------------

def _grid(P: int, steps: int) -> np.ndarray:
    """All share vectors with entries in {0, 1/steps, ..., 1} summing to 1."""
    pts = [c for c in itertools.product(range(steps + 1), repeat=P - 1) if sum(c) <= steps]
    arr = np.array(pts, dtype=float)
    return np.column_stack([arr, steps - arr.sum(axis=1)]) / steps


def _brute_T(order, model, grid) -> float:
    P = len(order)
    worst = np.zeros(len(grid))
    for p in range(P):
        a, b = order[p], order[(p + 1) % P]
        worst = np.maximum(worst, (2 - grid[:, a] - grid[:, b]) / model.bw[a][b])
        if math.isfinite(model.reduce_bps[b]):
            worst = np.maximum(worst, (1 - grid[:, a]) / model.reduce_bps[b])
    return float(worst.min())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("P", [2, 3, 4])
def test_against_brute_force(P, seed):
    rng = np.random.default_rng(1000 * P + seed)
    bw = rng.uniform(1e7, 1e9, size=(P, P))
    reduce_bps = rng.uniform(2e7, 2e9, size=P) if seed % 2 else None
    model = LinkModel(bw=bw.tolist(), reduce_bps=None if reduce_bps is None else reduce_bps.tolist())
    grid = _grid(P, 50)                   # step 0.02
    best_brute = math.inf
    for order in orders_rank0_first(P):
        shares, T = planner.solve_shares(order, model)
        brute = _brute_T(order, model, grid)
        best_brute = min(best_brute, brute)
        assert T <= brute * (1 + 1e-8), order
        assert T >= brute * 0.8          # the grid is coarse, not that coarse
        ring_bw = [model.bw[order[p]][order[(p + 1) % P]] for p in range(P)]
        assert T >= 2 * (P - 1) / sum(ring_bw) * (1 - 1e-9)      # sum of the link constraints
        assert T >= 1 / min(ring_bw) * (1 - 1e-9)                 # o_A + o_B <= 1 on each link
        assert T == pytest.approx(planner.ring_seconds_per_byte(order, shares, model), rel=1e-15)
        assert_satisfies_lp(order, shares, model, T)
    plan = planner.best_plan(model)
    assert plan.predicted_bw_seconds_per_byte <= best_brute * (1 + 1e-8)
    assert plan.predicted_bw_seconds_per_byte == pytest.approx(
        min(planner.solve_shares(o, model)[1] for o in orders_rank0_first(P)), rel=REL)


def _random_model(rng, P: int, kind: str) -> LinkModel:
    """Link matrices of three kinds: fully random, two sites joined by a 10x slower link, and
    one slow NIC; every link with +-10% noise, some reducers finite."""
    site = rng.integers(0, 2, size=P)
    bw = np.zeros((P, P))
    for i in range(P):
        for j in range(P):
            if i == j:
                continue
            if kind == "random":
                bw[i, j] = rng.uniform(1e6, 1e9)
            elif kind == "sites":
                bw[i, j] = (1e8 if site[i] == site[j] else 1e7) * rng.uniform(0.9, 1.1)
            else:
                bw[i, j] = (1e7 if P - 1 in (i, j) else 1e8) * rng.uniform(0.9, 1.1)
    reduce_bps = [math.inf if rng.random() < 0.5 else rng.uniform(5e7, 2e9) for _ in range(P)]
    return LinkModel(bw=bw.tolist(), reduce_bps=reduce_bps)


@pytest.mark.parametrize("kind", ["random", "sites", "slow_nic"])
@pytest.mark.parametrize("P", [3, 5, 6])
def test_order_search_bound_is_valid_and_the_search_is_exact(P, kind):
    """The search prunes orders by a lower bound of LP 1: it must never exceed an order's LP
    optimum, and the order found must be the one checking every order finds."""
    rng = np.random.default_rng(P * 100 + len(kind))
    for _ in range(3):
        model = _random_model(rng, P, kind)
        search = plan_order.RingSearch(model)
        orders = list(orders_rank0_first(P))
        taus = [search.tau(o) for o in orders]
        bounds = search.lower_bounds(orders)
        assert all(lb <= t * (1 + 1e-9) for lb, t in zip(bounds, taus))
        planner.best_plan.cache_clear()
        assert planner.best_plan(model).order == plan_order._pick_order(list(zip(orders, taus)), P)


def test_two_sites_of_four_ranks_solve_few_lps(monkeypatch):
    """8 ranks, two sites, noisy links: every ring crosses the slow link at least twice, and the
    bound of two disjoint crossings (3 / (b1 + b2)) is what LP 1 reaches, so only the rings
    through the best pair of crossings need an LP (without it: 4897 LPs of 5040, seconds)."""
    calls = []
    real = plan_order.min_tau
    monkeypatch.setattr(plan_order, "min_tau", lambda data: calls.append(1) or real(data))
    rng = np.random.default_rng(3)
    site = [0, 1, 0, 1, 0, 1, 0, 1]   # interleaved: the identity ring crosses eight times
    bw = [[0.0 if i == j else (1e8 if site[i] == site[j] else 1e7) * rng.uniform(0.9, 1.1) for j in range(8)]
          for i in range(8)]
    model = LinkModel(bw=bw, reduce_bps=[2e9] * 8)
    planner.best_plan.cache_clear()
    order = planner.best_plan(model).order
    crossings = sum(site[order[p]] != site[order[(p + 1) % 8]] for p in range(8))
    assert crossings == 2, order
    assert len(calls) < 100, f"{len(calls)} LPs"


# --------------------------------------------------------------------------------------------
# Slow reducer
# --------------------------------------------------------------------------------------------
# P = 3, all links B, rank 1 reduces at B/4, identity ring 0 -> 1 -> 2 -> 0. Rank 1 reduces all
# but its predecessor's chunk: (1 - o_0) N / (B/4) <= T. With s = o_1 + o_2 = 1 - o_0 the link
# 1 -> 2 carries 2 - s and the reducer needs 4 s: balanced at s = 0.4, T* = 1.6 N / B, and the
# other links carry 2 - 0.6 - o <= 1.4 < 1.6. Uniform: 4 (2/3) = 8/3 N / B (reduce-bound).

def test_slow_reducer_makes_its_predecessor_own_more():
    B = 1e8
    model = LinkModel(bw=[[B] * 3] * 3, reduce_bps=[math.inf, B / 4, math.inf])
    shares, T = planner.solve_shares((0, 1, 2), model)
    assert T * B == pytest.approx(1.6, rel=REL)
    assert shares[0] == pytest.approx(0.6, abs=1e-8)        # the predecessor of rank 1
    assert shares[1] + shares[2] == pytest.approx(0.4, abs=1e-8)
    assert shares[0] > max(shares[1], shares[2])
    assert_satisfies_lp((0, 1, 2), shares, model, T)
    assert planner.uniform_plan(3, model).predicted_bw_seconds_per_byte * B == pytest.approx(8 / 3)
    # The reverse ring makes rank 2 the predecessor; best_plan keeps the identity on the tie.
    rev_shares, rev_T = planner.solve_shares((0, 2, 1), model)
    assert rev_T == pytest.approx(T, rel=REL) and rev_shares[2] == pytest.approx(0.6, abs=1e-8)
    plan = planner.best_plan(model)
    pred = plan.order[(plan.order.index(1) - 1) % 3]
    assert plan.shares[pred] == max(plan.shares)


# --------------------------------------------------------------------------------------------
# Plan.counts: the engine's sharesToCounts
# --------------------------------------------------------------------------------------------

def largest_remainder(total, shares):
    """The apportionment sharesToCounts approximates in floating point, in exact arithmetic:
    every share gets the floor of its exact quota, and what is left goes one element each to the
    largest fractional parts, ties to the lower position (Hamilton's method). Returns the counts
    and the fractional parts (for telling a near-tie, where floating point may break the tie
    the other way, from a wrong answer)."""
    fr = [Fraction(x) for x in shares]
    quotas = [total * f / sum(fr) for f in fr]
    counts = [q.numerator // q.denominator for q in quotas]
    rest = [q - c for q, c in zip(quotas, counts)]
    for i in sorted(range(len(shares)), key=lambda i: (-rest[i], i))[:total - sum(counts)]:
        counts[i] += 1
    return counts, rest


def test_counts_hand_cases():
    assert Plan((0, 1), (0.5, 0.5)).counts(10) == [5, 5]
    assert Plan((0, 1, 2), (1 / 3, 1 / 3, 1 / 3)).counts(10) == [4, 3, 3]
    assert Plan((0, 1, 2, 3), (0.0, 0.0, 0.0, 1.0)).counts(7) == [0, 0, 0, 7]
    assert Plan((0, 1, 2), (0.5, 0.0, 0.5)).counts(3) == [2, 0, 1]
    # Shares are taken in ring-position order: the tie goes to the lower *position* (rank 1).
    assert Plan((1, 0), (0.5, 0.5)).counts(3) == [1, 2]
    assert Plan((0, 1, 2), (1 / 3, 1 / 3, 1 / 3)).counts(0) == [0, 0, 0]
    assert Plan((0, 1, 2, 3), (0.25,) * 4).counts(2) == [1, 1, 0, 0]
    assert planner.shares_to_counts(10, [1, 1, 1]) == [4, 3, 3]   # unnormalised shares too


def test_counts_random_against_reference():
    rng = np.random.default_rng(7)
    for trial in range(400):
        P = int(rng.integers(1, 9))
        shares = rng.random(P)
        shares[rng.random(P) < 0.3] = 0.0
        if trial % 7 == 0:
            shares = np.zeros(P)
            shares[int(rng.integers(P))] = 1.0
        if shares.sum() == 0:
            shares[0] = 1.0
        order = tuple(int(x) for x in rng.permutation(P))
        plan = Plan(order, tuple(shares.tolist()))
        numel = int(rng.choice([0, 1, P - 1 if P > 1 else 1, 10, 997, 10**6 + 3]))
        counts = plan.counts(numel)
        assert sum(counts) == numel
        assert all(c == 0 for c, s in zip(counts, plan.shares) if s == 0)
        expected, rest = largest_remainder(numel, [plan.shares[r] for r in order])
        got = [counts[r] for r in order]
        if got != expected:
            # Only a near-tie may come out the other way (the engine's quotas are floats).
            moved = [pos for pos in range(P) if got[pos] != expected[pos]]
            assert max(rest[p] for p in moved) - min(rest[p] for p in moved) < 1e-9, (numel, shares, got, expected)


# --------------------------------------------------------------------------------------------
# Determinism, make_plan, validation
# --------------------------------------------------------------------------------------------

def test_same_inputs_same_plan():
    for model_args in [([mbit(800)] * 3 + [mbit(100)], None), ([1e8, 3e8, 5e7, 2e8, 9e7], [4e8, 1e8, 5e8, 2e8, 3e8])]:
        a = planner.best_plan(from_nics(*model_args))
        b = planner.best_plan(from_nics(list(model_args[0]), model_args[1]))
        assert a == b
        assert math.fsum(a.shares) == pytest.approx(1.0, abs=1e-12)
    rng = np.random.default_rng(3)
    bw = rng.uniform(1e7, 1e9, size=(5, 5))
    assert planner.best_plan(LinkModel(bw=bw.tolist())) == planner.best_plan(LinkModel(bw=tuple(map(tuple, bw))))
    plan = planner.best_plan(LinkModel(bw=bw.tolist()))
    assert math.fsum(plan.shares) == 1.0   # the 2**-30 grid: dyadic shares, exact sum


def test_make_plan_keeps_uniform_where_weighting_gains_nothing():
    uniform = planner.uniform_plan(4, WORKED)
    assert planner.make_plan(WORKED, nbytes=8) == uniform              # recursive doubling
    assert planner.make_plan(WORKED, nbytes=32 * 1024) == uniform
    weighted = planner.make_plan(WORKED, nbytes=N_WORKED)
    assert weighted == planner.best_plan(WORKED) and not weighted.is_uniform
    assert planner.make_plan(WORKED) == weighted                       # large-message limit
    # 1.28 vs 1.92 s is a 33% gain: a 40% threshold keeps uniform.
    assert planner.make_plan(WORKED, nbytes=N_WORKED, min_gain=0.40) == uniform
    # A 3% slower NIC: the best plan is 1.5% faster in bandwidth time (0.8% with the latency
    # terms at 16 MB), below the 3% threshold.
    nearly = from_nics([100e6, 100e6, 100e6, 97e6])
    assert planner.make_plan(nearly, nbytes=N_WORKED) == planner.uniform_plan(4, nearly)
    single = LinkModel(bw=[[0.0]])
    assert planner.make_plan(single, nbytes=N_WORKED) == planner.uniform_plan(1, single)


@pytest.mark.parametrize("bad, match", [
    (0.0, "link 2 -> 3 must be positive"),
    (-5.0, "link 2 -> 3 must be positive"),
    (float("nan"), "link 2 -> 3 is NaN"),
    (float("inf"), "link 2 -> 3 must be finite"),
])
def test_bad_bandwidth_raises_naming_the_link(bad, match):
    bw = [[1e8] * 4 for _ in range(4)]
    bw[2][3] = bad
    with pytest.raises(ValueError, match=match):
        LinkModel(bw=bw)


def test_other_bad_inputs_raise():
    with pytest.raises(ValueError, match="NIC bandwidth of rank 1"):
        from_nics([1e8, float("nan")])
    with pytest.raises(ValueError, match="reduce throughput of rank 0 is NaN"):
        from_nics([1e8, 1e8], reduce_bps=[float("nan"), 1e8])
    with pytest.raises(ValueError, match="reduce throughput of rank 1 must be positive"):
        from_nics([1e8, 1e8], reduce_bps=[1e8, 0.0])
    with pytest.raises(ValueError, match="3x3"):
        LinkModel(bw=[[1.0, 1.0, 1.0], [1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="alpha"):
        from_nics([1e8, 1e8], alpha=-1.0)
    with pytest.raises(ValueError, match="not a permutation"):
        planner.solve_shares((0, 1, 1, 2), WORKED)
    with pytest.raises(ValueError, match="not a permutation"):
        Plan((0, 2), (0.5, 0.5))
    with pytest.raises(ValueError, match="share of rank 1"):
        Plan((0, 1), (0.5, float("nan")))
    with pytest.raises(ValueError, match="all be zero"):
        Plan((0, 1), (0.0, 0.0))
    with pytest.raises(ValueError, match="2 shares for a model of 4 ranks"):
        planner.predict_allreduce_seconds(Plan((0, 1), (0.5, 0.5)), WORKED, 1 << 20)
    with pytest.raises(ValueError, match="min_gain"):
        planner.make_plan(WORKED, min_gain=float("nan"))


def test_solver_failure_raises_and_never_falls_back(monkeypatch):
    class Failed:
        status, message, x = 2, "The problem is infeasible.", None

    monkeypatch.setattr("scipy.optimize.linprog", lambda *a, **k: Failed())
    planner.best_plan.cache_clear()  # best plans are memoised: an earlier test may have made this one
    with pytest.raises(planner.PlanningError, match="HiGHS failed on the minimum-time LP.*infeasible"):
        planner.best_plan(WORKED)
    with pytest.raises(planner.PlanningError):
        planner.solve_shares((0, 1, 2, 3), WORKED)
    with pytest.raises(planner.PlanningError):
        planner.make_plan(WORKED, nbytes=N_WORKED)
