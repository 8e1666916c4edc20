"""Adaptive batch partitioning: per-rank batch sizes proportional to speed, within memory caps.

Batches proportional to speed equalise the ranks' compute times; the update must then weight each
rank's mean gradient by its samples (`hetcomm.hooks`). Here:

* `split_batch` -- the pure, deterministic integer split (the rule is in its docstring).
* `probe_max_batch` -- a rank's memory cap, by doubling until out-of-memory, then bisection.
* `profile_speed` -- samples/s from a short start-up profile.
* `predicted_step_seconds`, `rebalanced_sizes` -- the pure decision rule of `Partitioner`.
* `Partitioner` -- online re-balancing; every rank takes the same decisions at the same step.

Why proportional, and the gradient weighting: docs/training.md#why-proportional-batches-and-why-weight-by-samples.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch
import torch.distributed as dist

__all__ = ["split_batch", "exchange_columns", "probe_max_batch", "profile_speed", "predicted_step_seconds",
           "rebalanced_sizes", "Partitioner"]

_PREFIX = "hetcomm partition"

# A rank whose measured compute time is 0 (a timer too coarse for a tiny step) would get an
# infinite speed; treat it as this many seconds per sample instead.
_MIN_SECONDS_PER_SAMPLE = 1e-12


# --------------------------------------------------------------------------------------------
# The integer split
# --------------------------------------------------------------------------------------------

def _check_count(value: int, what: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{_PREFIX}: {what} must be a non-negative integer, got {value!r}")
    return int(value)


def _check_speeds(speeds: Sequence[float]) -> list[Fraction]:
    if len(speeds) == 0:
        raise ValueError(f"{_PREFIX}: no speeds (zero ranks)")
    exact = []
    for r, s in enumerate(speeds):
        s = float(s)
        if not (s > 0 and math.isfinite(s)):  # also rejects NaN
            raise ValueError(f"{_PREFIX}: speed of rank {r} must be finite and > 0, got {s!r}")
        exact.append(Fraction(s))
    return exact


def _water_fill(total: int, speeds: Sequence[Fraction], lo: Sequence[int],
                hi: Sequence[int | None]) -> list[Fraction]:
    """The real-valued targets ``x_r = clip(lam * s_r, lo_r, hi_r)`` with ``sum(x) = total``.

    ``f(lam) = sum(x_r)`` is continuous, non-decreasing and piecewise linear with breakpoints
    ``lo_r / s_r`` and ``hi_r / s_r``. The largest breakpoint ``p`` with ``f(p) <= total`` exists
    (at the smallest breakpoint every rank sits at its minimum and ``sum(lo) <= total``), and
    ``f`` is linear just above ``p`` with slope ``sum(s_r)`` over the ranks not clamped there.
    Exact rational arithmetic: the same inputs give the same targets on every machine.
    """
    def fill(lam: Fraction) -> list[Fraction]:
        out = []
        for s, l, h in zip(speeds, lo, hi):
            x = max(lam * s, Fraction(l))
            out.append(x if h is None else min(x, Fraction(h)))
        return out

    points = sorted({Fraction(l) / s for s, l in zip(speeds, lo)}
                    | {Fraction(h) / s for s, h in zip(speeds, hi) if h is not None})
    # Largest i with f(points[i]) <= total (f is non-decreasing, so bisect on it).
    first, last = 0, len(points) - 1
    while first < last:
        mid = (first + last + 1) // 2
        if sum(fill(points[mid])) <= total:
            first = mid
        else:
            last = mid - 1
    p = points[first]
    at_p = fill(p)
    missing = total - sum(at_p)
    if missing == 0:
        return at_p
    # Free just above p: not held at a minimum that lies beyond p, not held at a cap <= p.
    slope = sum(s for s, l, h in zip(speeds, lo, hi)
                if Fraction(l) / s <= p and (h is None or Fraction(h) / s > p))
    return fill(p + missing / slope)


def split_batch(global_batch: int, speeds: Sequence[float], *, min_per_rank: int = 1,
                max_per_rank: Sequence[int | None] | None = None) -> list[int]:
    """Per-rank batch sizes proportional to ``speeds``, summing exactly to ``global_batch``.

    The rule, in two steps:

    1. Real targets (water-filling): ``x_r = clip(lam * s_r, min_per_rank, cap_r)`` with the one
       ``lam`` for which ``sum(x) = global_batch``. Without binding limits this is
       ``x_r = B * s_r / sum(s)``. It is what "give the overflow above a cap to the ranks with
       room, in proportion to their speeds, and repeat until stable" converges to; a rank held
       at its minimum takes its deficit from the others the same way. Computed exactly with
       rationals, so identical inputs give identical outputs on every rank and machine.
    2. Largest-remainder rounding: every rank gets ``floor(x_r)``; the ``k`` samples left over
       go one each to the ``k`` ranks with the largest fractional parts ``x_r - floor(x_r)``,
       ties to the lower rank index.

    Guarantees: ``sum == global_batch``; ``min_per_rank <= b_r <= cap_r``; ``|b_r - x_r| < 1``;
    among all integer vectors with that sum, the result minimises ``max_r |b_r - x_r|`` (and
    ``sum_r |b_r - x_r|``).

    Args:
        global_batch: B, the total number of samples per step.
        speeds: relative speed of each rank (samples/s or any positive scale), all finite > 0.
        min_per_rank: the smallest batch a rank may get (0 allows idle ranks).
        max_per_rank: per-rank caps (memory limits); ``None`` for the list or an entry: no cap.

    Raises:
        ValueError: no ranks, a speed that is not finite and positive, a cap below the minimum,
            ``global_batch < P * min_per_rank`` or ``global_batch`` above the sum of the caps.

    >>> split_batch(10, [1, 1, 1, 1])
    [3, 3, 2, 2]
    >>> split_batch(100, [4, 2, 1, 1], max_per_rank=[40, None, None, None])
    [40, 30, 15, 15]
    """
    exact_speeds = _check_speeds(speeds)
    P = len(exact_speeds)
    total = _check_count(global_batch, "global_batch")
    lo = _check_count(min_per_rank, "min_per_rank")
    if max_per_rank is None:
        caps: list[int | None] = [None] * P
    else:
        if len(max_per_rank) != P:
            raise ValueError(f"{_PREFIX}: {len(max_per_rank)} caps for {P} ranks")
        caps = [None if c is None else _check_count(c, f"cap of rank {r}")
                for r, c in enumerate(max_per_rank)]
    for r, c in enumerate(caps):
        if c is not None and c < lo:
            raise ValueError(f"{_PREFIX}: rank {r} has cap {c} below min_per_rank {lo}")
    if total < P * lo:
        raise ValueError(f"{_PREFIX}: global batch {total} cannot give {P} ranks "
                         f"at least {lo} samples each")
    if all(c is not None for c in caps) and total > sum(caps):
        raise ValueError(f"{_PREFIX}: global batch {total} exceeds the sum of the per-rank caps "
                         f"{sum(caps)} ({caps})")

    targets = _water_fill(total, exact_speeds, [lo] * P, caps)
    sizes = [math.floor(x) for x in targets]
    left = total - sum(sizes)
    # sum(x) = total, so the fractional parts add up to `left`; with each < 1, at least `left`
    # of them are positive, so no rank at a cap (an integer target) is rounded up.
    by_remainder = sorted(range(P), key=lambda r: (-(targets[r] - sizes[r]), r))
    for r in by_remainder[:left]:
        sizes[r] += 1
    return sizes


# --------------------------------------------------------------------------------------------
# Start-up measurements
# --------------------------------------------------------------------------------------------

def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def probe_max_batch(try_batch: Callable[[int], None], *, start: int = 1, limit: int) -> int:
    """The largest batch size in ``[start, limit]`` for which ``try_batch`` runs.

    Doubles from ``start`` until ``try_batch(b)`` raises `torch.OutOfMemoryError` (on CUDA builds
    ``torch.cuda.OutOfMemoryError`` is that class) or ``limit`` is reached, then bisects between
    the last size that ran and the first that did not. The CUDA caching allocator is emptied
    after every try so that a failed try does not make the next one fail. Assumes that memory
    use grows with the batch size. Any other exception propagates. On CPU there is no reliable
    out-of-memory signal: declare the cap instead.

    Raises:
        ValueError: ``start < 1`` or ``limit < start``.
        RuntimeError: ``try_batch(start)`` already runs out of memory.
    """
    start = _check_count(start, "start")
    limit = _check_count(limit, "limit")
    if start < 1 or limit < start:
        raise ValueError(f"{_PREFIX}: need 1 <= start <= limit, got start={start}, limit={limit}")

    def runs(batch: int) -> bool:
        try:
            try_batch(batch)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        # Outside the except block: the exception (and the frames holding its tensors) is gone.
        _release_cached_memory()
        return ok

    if not runs(start):
        raise RuntimeError(f"{_PREFIX}: probe_max_batch: batch size {start} (the start) already "
                           "runs out of memory")
    good, bad = start, None
    while good < limit:
        candidate = min(2 * good, limit)
        if not runs(candidate):
            bad = candidate
            break
        good = candidate
    if bad is None:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if runs(mid):
            good = mid
        else:
            bad = mid
    return good


def profile_speed(step: Callable[[int], None], batch_size: int, *, warmup: int = 1,
                  steps: int = 3) -> float:
    """Samples per second of ``step(batch_size)``: ``batch_size`` / median time of ``steps`` calls.

    ``warmup`` untimed calls go first (allocator, autotuning, lazy initialisation). The median
    ignores one-off stalls. When CUDA is in use the device is synchronised around each timed call,
    so asynchronous kernels are counted.
    """
    batch_size = _check_count(batch_size, "batch_size")
    warmup = _check_count(warmup, "warmup")
    steps = _check_count(steps, "steps")
    if batch_size < 1 or steps < 1:
        raise ValueError(f"{_PREFIX}: profile_speed needs batch_size >= 1 and steps >= 1")
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else (lambda: None)
    for _ in range(warmup):
        step(batch_size)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step(batch_size)
        sync()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return batch_size / max(median, _MIN_SECONDS_PER_SAMPLE)


# --------------------------------------------------------------------------------------------
# The decision rule
# --------------------------------------------------------------------------------------------

def predicted_step_seconds(sizes: Sequence[int], seconds_per_sample: Sequence[float]) -> float:
    """Compute time of one step: the slowest rank's ``b_r * t_r``."""
    if len(sizes) != len(seconds_per_sample):
        raise ValueError(f"{_PREFIX}: {len(sizes)} sizes for {len(seconds_per_sample)} ranks")
    return max(b * t for b, t in zip(sizes, seconds_per_sample))


def rebalanced_sizes(sizes: Sequence[int], seconds_per_sample: Sequence[float], *,
                     min_per_rank: int = 1,
                     max_per_rank: Sequence[int | None] | None = None,
                     threshold: float = 0.05) -> list[int] | None:
    """The new partition if it is predicted to be worth it, else None (hysteresis).

    Proposes ``split_batch(sum(sizes), 1 / t, ...)`` and accepts it only if the predicted step
    time improves by more than ``threshold``: ``(current - proposed) / current > threshold``.
    Small measurement noise therefore never moves samples back and forth.
    """
    if not threshold >= 0:
        raise ValueError(f"{_PREFIX}: threshold must be >= 0, got {threshold!r}")
    t = [max(float(x), _MIN_SECONDS_PER_SAMPLE) for x in seconds_per_sample]
    proposed = split_batch(sum(sizes), [1.0 / x for x in t], min_per_rank=min_per_rank,
                           max_per_rank=max_per_rank)
    current_s = predicted_step_seconds(sizes, t)
    proposed_s = predicted_step_seconds(proposed, t)
    if proposed == list(sizes) or current_s <= 0:
        return None
    if (current_s - proposed_s) / current_s > threshold:
        return proposed
    return None


# --------------------------------------------------------------------------------------------
# Online re-balancing
# --------------------------------------------------------------------------------------------

# Rows of the per-rank exchange (see Partitioner._exchange).
_WINDOW_COMPUTE, _WINDOW_SAMPLES, _TOTAL_COMPUTE, _TOTAL_IDLE, _TOTAL_SAMPLES = range(5)


class Partitioner:
    """Per-rank batch sizes, re-balanced online from measured compute times.

    Every rank builds one with the same arguments (except ``max_per_rank``, its own cap) and calls
    `record` once per step. Every ``interval`` steps the ranks exchange, in one collective, each
    rank's mean compute seconds per sample over the window; each rank then updates an EMA of every
    rank's seconds per sample ``t_r`` and applies `rebalanced_sizes`. All decisions are computed
    from the agreed values with the same code, so every rank holds the same partition at every
    step and there is never a disagreement to resolve.

    **`record` must be called the same number of times on every rank** (once per global step,
    including steps where a rank's batch is empty): it is a collective every ``interval`` calls,
    and a rank that calls it more or less often deadlocks the group or desynchronises the
    partition.

    Hysteresis: the partition changes only at an agreement (every ``interval`` steps) and only if
    the predicted step time ``max_r(b_r * t_r)`` improves by more than ``threshold`` (a fraction),
    so measurement noise does not move samples back and forth. ``version`` counts the changes.

    Measurements: ``compute_seconds`` must exclude time blocked on communication (the gradient
    all-reduce, waiting for slower ranks); otherwise a fast rank looks as slow as the slowest and
    nothing moves. Pass that time as ``idle_seconds``: it is only reported. The model assumes
    compute time proportional to the batch (``b_r * t_r``); a fixed per-step overhead makes small
    batches look slow per sample. Declared ``speeds`` set only the initial partition (they may be
    in any scale); the first agreement replaces them with measurements. A rank without any
    measurement yet (an empty batch so far) is assumed as slow as the slowest measured rank.

    Exchange: `dist.all_reduce` (SUM) of a float64 CPU tensor of shape (5, P) in which each rank
    fills only its own column and leaves zeros elsewhere. Every element is a sum of one value and
    zeros, so the result is exact and bit-identical on every rank whatever the reduction order.
    The group must support CPU tensors (gloo, hetcomm). Caps are exchanged the same way, once,
    in the constructor (also a collective).

    Stats: the exchange also carries each rank's totals, so `stats` (no communication) returns
    values agreed at the last exchange; `gather_stats` (a collective) exchanges them now.
    """

    def __init__(self, global_batch: int, *, group: dist.ProcessGroup | None = None,
                 speeds: Sequence[float] | None = None, max_per_rank: int | None = None,
                 min_per_rank: int = 1, ema: float = 0.3, threshold: float = 0.05,
                 interval: int = 5) -> None:
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            self._group = group
            self._rank = dist.get_rank(group)
            self._world_size = dist.get_world_size(group)
            if self._rank < 0:
                raise ValueError(f"{_PREFIX}: this process is not a member of the group")
        else:
            if group is not None:
                raise ValueError(f"{_PREFIX}: a group was given but torch.distributed is not "
                                 "initialised")
            self._group, self._rank, self._world_size = None, 0, 1
        P = self._world_size
        self._global_batch = _check_count(global_batch, "global_batch")
        self._min_per_rank = _check_count(min_per_rank, "min_per_rank")
        if not 0 < ema <= 1:
            raise ValueError(f"{_PREFIX}: ema must be in (0, 1], got {ema!r}")
        if not threshold >= 0:
            raise ValueError(f"{_PREFIX}: threshold must be >= 0, got {threshold!r}")
        self._interval = _check_count(interval, "interval")
        if self._interval < 1:
            raise ValueError(f"{_PREFIX}: interval must be >= 1")
        self._ema, self._threshold = float(ema), float(threshold)
        if speeds is None:
            speeds = [1.0] * P
        if len(speeds) != P:
            raise ValueError(f"{_PREFIX}: {len(speeds)} speeds for {P} ranks")
        own_cap = -1 if max_per_rank is None else _check_count(max_per_rank, "max_per_rank")
        # -1 encodes "no cap"; integers are exact in float64.
        self._caps: list[int | None] = [None if c < 0 else int(c)
                                        for c in self._exchange([float(own_cap)])[0]]
        self._sizes = split_batch(self._global_batch, speeds, min_per_rank=self._min_per_rank,
                                  max_per_rank=self._caps)
        self._version = 0
        self._seconds_per_sample: list[float | None] | None = None
        self._steps = 0
        self._window = [0.0, 0.0]                 # compute seconds, samples since the last exchange
        self._totals = [0.0, 0.0, 0.0]            # compute seconds, idle seconds, samples
        self._agreed_totals = [[0.0] * P for _ in range(3)]
        self._agreed_at_step = 0

    # ---- the partition -----------------------------------------------------------------------

    @property
    def sizes(self) -> list[int]:
        """Current per-rank batch sizes (the same list on every rank); sums to `global_batch`."""
        return list(self._sizes)

    @property
    def local_batch(self) -> int:
        return self._sizes[self._rank]

    @property
    def version(self) -> int:
        """Number of re-partitions so far (0 for the initial partition)."""
        return self._version

    @property
    def global_batch(self) -> int:
        return self._global_batch

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def caps(self) -> list[int | None]:
        """Every rank's cap (None: no cap), as exchanged at construction."""
        return list(self._caps)

    @property
    def seconds_per_sample(self) -> list[float | None] | None:
        """The agreed EMA of each rank's compute seconds per sample (None before the first)."""
        return None if self._seconds_per_sample is None else list(self._seconds_per_sample)

    # ---- measurements ------------------------------------------------------------------------

    def record(self, compute_seconds: float, idle_seconds: float = 0.0,
               samples: int | None = None) -> bool:
        """Records one step of this rank; every ``interval`` calls, agrees and maybe re-partitions.

        Args:
            compute_seconds: time computing this step (forward, backward, optimizer), excluding
                time blocked on communication.
            idle_seconds: time blocked at synchronisation (reported in the stats only).
            samples: samples this rank processed in the step; default `local_batch`. Pass
                ``len(batch)`` when they can differ (a DataLoader that prefetches, an epoch's
                last partial step).

        Returns:
            True when the partition changed (read `sizes` / `local_batch` again).
        """
        for value, what in ((compute_seconds, "compute_seconds"), (idle_seconds, "idle_seconds")):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{_PREFIX}: {what} must be finite and >= 0, got {value!r}")
        samples = self.local_batch if samples is None else _check_count(samples, "samples")
        self._window[0] += compute_seconds
        self._window[1] += samples
        self._totals[0] += compute_seconds
        self._totals[1] += idle_seconds
        self._totals[2] += samples
        self._steps += 1
        if self._steps % self._interval:
            return False
        rows = self._exchange(self._window + self._totals)
        self._window = [0.0, 0.0]
        self._agree_totals(rows)
        self._update_estimates(rows[_WINDOW_COMPUTE], rows[_WINDOW_SAMPLES])
        if all(t is None for t in self._seconds_per_sample):
            return False                      # no rank has processed a sample yet
        new_sizes = rebalanced_sizes(self._sizes, self._estimates_for_planning(),
                                     min_per_rank=self._min_per_rank, max_per_rank=self._caps,
                                     threshold=self._threshold)
        if new_sizes is None:
            return False
        self._sizes = new_sizes
        self._version += 1
        return True

    def _update_estimates(self, window_compute: Sequence[float],
                          window_samples: Sequence[float]) -> None:
        previous = self._seconds_per_sample or [None] * self._world_size
        updated: list[float | None] = []
        for old, seconds, samples in zip(previous, window_compute, window_samples):
            if samples <= 0:
                updated.append(old)           # nothing measured in this window
            elif old is None:
                updated.append(seconds / samples)
            else:
                updated.append((1.0 - self._ema) * old + self._ema * (seconds / samples))
        self._seconds_per_sample = updated

    def _estimates_for_planning(self) -> list[float]:
        known = [t for t in self._seconds_per_sample or [] if t is not None]
        slowest = max(known) if known else 1.0
        return [slowest if t is None else t for t in self._seconds_per_sample or []]

    # ---- stats -------------------------------------------------------------------------------

    def _agree_totals(self, rows: list[list[float]]) -> None:
        self._agreed_totals = [rows[_TOTAL_COMPUTE], rows[_TOTAL_IDLE], rows[_TOTAL_SAMPLES]]
        self._agreed_at_step = self._steps

    def stats(self) -> dict:
        """Per-rank totals as agreed at the last exchange (identical on every rank; no collective).

        Keys: ``compute_seconds``, ``idle_seconds``, ``samples`` (per-rank lists),
        ``samples_per_second`` (samples / compute seconds: each rank's compute speed, 0.0 before
        any compute time), ``sizes``, ``repartitions`` (= `version`) and ``as_of_step`` (how many
        steps the totals cover).
        """
        compute, idle, samples = self._agreed_totals
        return {
            "compute_seconds": list(compute),
            "idle_seconds": list(idle),
            "samples": [round(s) for s in samples],
            "samples_per_second": [s / c if c > 0 else 0.0 for s, c in zip(samples, compute)],
            "sizes": self.sizes,
            "repartitions": self._version,
            "as_of_step": self._agreed_at_step,
        }

    def gather_stats(self) -> dict:
        """`stats` brought up to date with one collective (call it on every rank, same step)."""
        self._agree_totals(self._exchange([0.0, 0.0] + self._totals))
        return self.stats()

    # ---- the collective ----------------------------------------------------------------------

    def _exchange(self, values: Sequence[float]) -> list[list[float]]:
        """``rows[i][r]`` = ``values[i]`` of rank r, identical on every rank (see class doc)."""
        if not self._distributed:
            return [[float(v)] for v in values]
        return exchange_columns(values, group=self._group)


def exchange_columns(values: Sequence[float], *, group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """Every rank's ``values``, agreed bit for bit: ``rows[i][r]`` is ``values[i]`` of rank r.

    A collective (every rank of ``group`` calls it with the same number of values): one SUM
    all-reduce of a float64 CPU table in which each rank fills only its own column. Each element
    is one value plus zeros, so the sum is exact and identical on every rank whatever the
    reduction order or algorithm, which is what lets every rank take the same decisions from it.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(len(values), world, dtype=torch.float64)
    table[:, rank] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    return table.tolist()
