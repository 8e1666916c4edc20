"""Best shares for a given ring order: two small linear programs, and snapping their noise away.

LP 1 finds the least time T of the ring with its best shares (the cost model of
`hetcomm.plan.cost`, whole, shared links included); among the plans within ``SHARE_TIE_RTOL`` of
T, LP 2 picks the one closest to uniform, so weighting appears only where it buys time. Both are
solved with HiGHS' dual simplex; any solver status other than success raises `PlanningError`
(there is no fallback). The shares are then snapped to 1/P or to the dyadic grid
``SHARE_QUANTUM``, so LP noise never reaches the plan and they sum to exactly 1.0.

The LPs, the tolerances and the snapping's error: docs/planner.md#shares-two-linear-programs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hetcomm.plan.cost import ring_seconds_per_byte
from hetcomm.plan.model import LinkModel
from hetcomm.plan.schedules import shares_to_counts

SHARE_TIE_RTOL = 1e-10                 # "as good as the optimum" when choosing among shares
SHARE_QUANTUM = 2.0 ** -30             # shares are snapped to this grid (dyadic, exact sums)


class PlanningError(RuntimeError):
    """The LP solver did not return an optimal solution (never silently replaced by a guess)."""


def run_lp(c: np.ndarray, a_ub, b_ub: np.ndarray, a_eq, b_eq: np.ndarray,
           bounds: list[tuple[float, Optional[float]]], what: str):
    """HiGHS dual simplex (a vertex solution, deterministic for identical inputs); raises
    `PlanningError` unless it solved the LP. (scipy.optimize is imported here: only the rank that
    plans needs it, and it is the slowest of the planner's imports.)"""
    from scipy.optimize import linprog

    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs-ds")
    if res.status != 0 or res.x is None or not np.all(np.isfinite(res.x)):
        raise PlanningError(f"hetcomm planner: HiGHS failed on {what}: status {res.status}, {res.message}")
    return res


@dataclass(frozen=True)
class RingData:
    """One ring order's LP data, by ring position, rates divided by the model's fastest link:
    ``b[p]`` link p -> p+1 (capped by a shared link of a single rank at either end, which only
    that link crosses), ``r[p]`` the reducer at p, and ``caps``: per shared link of several ranks
    that the ring crosses, ``(positions, rate)``: the links at those positions cross it (leave or
    enter its group), so their loads together stay within ``T * rate``."""

    b: np.ndarray
    r: np.ndarray
    caps: tuple[tuple[tuple[int, ...], float], ...] = ()

    def key(self) -> tuple:
        return (tuple(self.b.tolist()), tuple(self.r.tolist()), self.caps)


def ring_data(model: LinkModel, order: Sequence[int], scale: Optional[float] = None) -> RingData:
    """The `RingData` of ``order`` (``scale``: divide rates by this, default the fastest link)."""
    ref = model.max_link if scale is None else scale
    idx = np.asarray(order, dtype=np.int64)
    nxt = np.roll(idx, -1)
    b = model.bw[idx, nxt]
    caps = []
    for group, out_bps, in_bps in model.uplinks:
        member = np.zeros(model.world_size, dtype=bool)
        member[list(group)] = True
        leaving = member[idx] & ~member[nxt]
        entering = ~member[idx] & member[nxt]
        if len(group) == 1:            # one link each way crosses it: a cap on that link
            b = np.where(leaving, np.minimum(b, out_bps), b)
            b = np.where(entering, np.minimum(b, in_bps), b)
            continue
        for crossing, rate in ((leaving, out_bps), (entering, in_bps)):
            if np.isfinite(rate) and crossing.any():
                caps.append((tuple(int(p) for p in np.flatnonzero(crossing)), float(rate) / ref))
    return RingData(b / ref, model.reduce_array[idx] / ref, tuple(caps))


def _ring_rows(data: RingData, width: int):
    """LP 1's rows ``-y_p - y_{p+1} - b_p T <= -2`` (every link), then ``-y_{p-1} - r_p T <= -1``
    (finite r_p), then per cap ``sum over its links of (-y_p - y_{p+1}) - rate T <= -2 (links)``,
    as a sparse matrix of ``width`` columns, T in column P."""
    import scipy.sparse as sparse  # here, not at import: only the planning rank needs SciPy
    b, r = data.b, data.r
    P = len(b)
    pos = np.arange(P)
    finite = np.flatnonzero(np.isfinite(r))
    rows = [pos, pos, P + np.arange(len(finite))]
    cols = [pos, (pos + 1) % P, (finite - 1) % P]
    vals = [-np.ones(P), -np.ones(P), -np.ones(len(finite))]
    rhs = [np.full(P, -2.0), np.full(len(finite), -1.0)]
    rows += [pos, P + np.arange(len(finite))]
    cols += [np.full(P, P), np.full(len(finite), P)]
    vals += [-b, -r[finite]]
    first = P + len(finite)
    for k, (positions, rate) in enumerate(data.caps):
        at = np.asarray(positions)
        row = np.full(len(at), first + k)
        rows += [row, row, [first + k]]
        cols += [at, (at + 1) % P, [P]]
        vals += [-np.ones(len(at)), -np.ones(len(at)), [-rate]]
    rhs.append(np.asarray([-2.0 * len(positions) for positions, _ in data.caps]))
    n_rows = first + len(data.caps)
    matrix = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                               shape=(n_rows, width))
    return matrix, np.concatenate(rhs)


def min_tau(data: RingData) -> float:
    """LP 1: the least normalised T for a ring's data."""
    import scipy.sparse as sparse  # here, not at import: only the planning rank needs SciPy
    P = len(data.b)
    a_ub, b_ub = _ring_rows(data, P + 1)
    c = np.zeros(P + 1)
    c[P] = 1.0
    a_eq = sparse.csr_matrix(np.append(np.ones(P), 0.0)[None, :])
    res = run_lp(c, a_ub, b_ub, a_eq, np.array([1.0]), [(0.0, 1.0)] * P + [(0.0, None)], "the minimum-time LP")
    return float(res.x[P])


def closest_to_uniform(data: RingData, tau_cap: float) -> list[float]:
    """LP 2: shares (by position) minimising sum |y - 1/P| among those with T <= tau_cap.

    Rows in the order a dense build would give them (per position its link, then its reducer;
    then the caps; per share its two deviation rows), so that HiGHS walks to the same vertex where
    the L1 objective ties."""
    import scipy.sparse as sparse  # here, not at import: only the planning rank needs SciPy
    b, r = data.b, data.r
    P = len(b)
    u = 1.0 / P
    pos = np.arange(P)
    finite = np.isfinite(r)
    # Row of position p's link constraint, and of its reducer constraint (if finite).
    link_row = pos + np.concatenate([[0], np.cumsum(finite)[:-1]])
    reduce_row = (link_row + 1)[finite]
    n_ring = P + int(finite.sum())
    cap_rows, cap_cols, cap_rhs = [], [], []
    for k, (positions, rate) in enumerate(data.caps):
        at = np.asarray(positions)
        cap_rows += [np.full(2 * len(at), n_ring + k)]
        cap_cols += [np.concatenate([at, (at + 1) % P])]
        cap_rhs.append(-(2.0 * len(at) - tau_cap * rate))
    n_caps = len(data.caps)
    dev_row = n_ring + n_caps + 2 * pos
    rows = np.concatenate([link_row, link_row, reduce_row, *cap_rows, dev_row, dev_row, dev_row + 1, dev_row + 1])
    cols = np.concatenate([pos, (pos + 1) % P, (pos[finite] - 1) % P, *cap_cols, pos, P + pos, pos, P + pos])
    n_cap_entries = sum(len(c) for c in cap_cols)
    vals = np.concatenate([-np.ones(2 * P), -np.ones(int(finite.sum())), -np.ones(n_cap_entries), np.ones(P),
                           -np.ones(P), -np.ones(P), -np.ones(P)])
    a_ub = sparse.csr_matrix((vals, (rows, cols)), shape=(n_ring + n_caps + 2 * P, 2 * P))
    b_ub = np.empty(n_ring + n_caps + 2 * P)
    b_ub[link_row] = -(2.0 - tau_cap * b)
    b_ub[reduce_row] = -(1.0 - tau_cap * r[finite])
    b_ub[n_ring:n_ring + n_caps] = cap_rhs
    b_ub[dev_row] = u                 # d_i >= y_i - 1/P
    b_ub[dev_row + 1] = -u            # d_i >= 1/P - y_i
    c = np.concatenate([np.zeros(P), np.ones(P)])
    a_eq = sparse.csr_matrix(np.concatenate([np.ones(P), np.zeros(P)])[None, :])
    res = run_lp(c, a_ub, b_ub, a_eq, np.array([1.0]), [(0.0, 1.0)] * P + [(0.0, None)] * P,
                 "the closest-to-uniform LP")
    return [float(v) for v in res.x[:P]]


def snap_shares(raw: Sequence[float]) -> tuple[float, ...]:
    """Removes solver noise: exactly 1/P when (nearly) uniform, else the 2**-30 grid, sum exactly 1."""
    P = len(raw)
    clipped = [max(0.0, float(v)) for v in raw]
    if max(abs(v - 1.0 / P) for v in clipped) <= SHARE_QUANTUM:
        return (1.0 / P,) * P
    units = shares_to_counts(int(1 / SHARE_QUANTUM), clipped)
    return tuple(k * SHARE_QUANTUM for k in units)


def validate_order(order: Sequence[int], P: int) -> tuple[int, ...]:
    out = tuple(int(x) for x in order)
    if sorted(out) != list(range(P)):
        raise ValueError(f"hetcomm planner: order {tuple(order)} is not a permutation of 0..{P - 1}")
    return out


def solve_shares(order: Sequence[int], model: LinkModel,
                 tau_star: Optional[float] = None) -> tuple[tuple[float, ...], float]:
    """Best shares (indexed by rank) for ring ``order`` and their ``max(T_bw, T_reduce) / N``.

    LP 1 finds the least time T* (or takes ``tau_star``, LP 1's value for this order, when the
    caller has it); LP 2 picks, among shares within ``SHARE_TIE_RTOL`` of T*, the ones closest to
    uniform; the result is snapped (docs/planner.md#shares-two-linear-programs). The returned
    time is recomputed from the returned shares. Raises PlanningError if HiGHS fails.
    """
    P = model.world_size
    order = validate_order(order, P)
    if P == 1:
        return (1.0,), 0.0
    data = ring_data(model, order)
    if tau_star is None:
        tau_star = min_tau(data)
    by_position = closest_to_uniform(data, tau_star * (1.0 + SHARE_TIE_RTOL))
    by_rank = [0.0] * P
    for pos, rank in enumerate(order):
        by_rank[rank] = by_position[pos]
    shares = snap_shares(by_rank)
    return shares, ring_seconds_per_byte(order, shares, model)
