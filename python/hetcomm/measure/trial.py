"""The last guard against probe noise: a plan fitted to measured rates is kept only if it runs
faster than the same schedule with equal shares, timed on the group itself at its creation.

Why a trial: on a loaded machine the probe's readings of identical links scatter by 2-5x, and no
statistic of those readings told noise from a real difference every time (8 hosts of 4 ranks on
2 cores, every NIC 1000 Mbit/s: a link's repeats 1.3-9x apart, hosts read 18-116 MB/s; host
shares fitted to that ran at 0.66-0.97x equal shares). A slow link, by contrast, shows in the
time of the collective it slows. So: the plan chosen from the measured model, and the one chosen
from the equal model (`hetcomm.measure.ProbeResult.equal_model`: the same levels, every class of
link at one rate), each run ``TRIAL_PAIRS`` times, interleaved, after an untimed run each, on one
allreduce sized to take about ``TRIAL_SECONDS`` (0.1 s) under the measured plan's prediction, at a
size where the two plans run different schedules (`trial_bytes`); the measured plan stays only
when its median time beats the equal one's by ``TRIAL_MARGIN`` and it was faster in most pairs
(`keeps_measured`). Every rank runs the same trials with the size rank 0 chose, and the times are
agreed (the slowest rank's), so every rank decides alike.

A collective over the group, run by `hetcomm.topology.apply_model` when the plan came from
measured rates and its shares differ from its equal counterpart's. docs/planner.md#the-trial-at-creation.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from hetcomm import plan as planner

TRIAL_PAIRS = 3
# Large enough that bandwidth, not per-step latency, sets the time: on 8 hosts of 4 ranks a plan
# that ran 1.39x slower than equal shares at 16 MB and 1.32x at 4 MB was only 1.06x at 1 MB, within
# the noise, and a trial at 1 MB kept it in 2 of 5 creations.
TRIAL_SECONDS = 0.1
# Kept only when faster by this in the median and in most pairs: on 8 hosts of 4 ranks sharing 2
# cores, a plan 5% faster in a trial's median ran 0.86x equal shares right after (the ranks' share
# of the cores, not the links, moves such small differences). Not "every pair": one slow pair
# then threw away a plan 1.34x faster in the median (one slow NIC of four).
TRIAL_MARGIN = 0.10
# The time above sets the size; this floor only keeps it above the engine's small-message paths
# (recursive doubling up to 32 KB, crossovers from 64 KB). It is low because on slow links a
# larger floor made the trial the cost of group creation: 32 ranks with host NICs of 100 and one
# of 25 Mbit/s took 15.6 s to create with a 1 MB floor (13 allreduces of 0.3-0.6 s predicted),
# 2.4 s before the trial; the plans' predicted ratio is the same at 256 KB (1.71x) as at 1 MB (1.74x).
MIN_TRIAL_BYTES = 256 << 10
MAX_TRIAL_BYTES = 16 << 20


def same_shares(a: planner.Plan, b: planner.Plan) -> bool:
    """Whether two plans move the same bytes between the same ranks: ring order and shares, and
    the site plan's layout and shares; the sizes from which each part applies and the pipeline
    segments are left out (they follow the measured rates without changing who carries what)."""
    if a.order != b.order or a.shares != b.shares or (a.sites is None) != (b.sites is None):
        return False
    if a.sites is None:
        return True
    x, y = a.sites, b.sites
    return (x.sites, x.blocks, x.block_shares, x.site_shares, x.local_inner, x.hosts, x.holders) == \
           (y.sites, y.blocks, y.block_shares, y.site_shares, y.local_inner, y.hosts, y.holders)


def _runs_at(plan: planner.Plan, nbytes: int, small_allreduce_bytes: int) -> tuple:
    """What the engine runs for an allreduce of ``nbytes`` under ``plan`` (`RingPlan::forBytes`),
    segments left out: recursive doubling up to HETCOMM_SMALL_ALLREDUCE_BYTES, then the site (or
    host) plan from its min_bytes, else the weighted ring from the plan's min_bytes, else the
    uniform ring in rank order."""
    if nbytes <= small_allreduce_bytes:
        return ("recursive doubling",)
    x = plan.sites
    if x is not None and nbytes >= x.min_bytes:
        return ("sites", x.sites, x.blocks, x.block_shares, x.site_shares, x.local_inner, x.hosts, x.holders)
    if nbytes >= plan.min_bytes:
        return ("ring", tuple(plan.order), tuple(plan.shares))
    P = len(plan.order)
    return ("ring", tuple(range(P)), (1.0 / P,) * P)


def trial_bytes(measured: planner.Plan, equal: planner.Plan, model: planner.LinkModel) -> int:
    """The largest power of two in [MIN_TRIAL_BYTES, MAX_TRIAL_BYTES] that ``measured`` is
    predicted to reduce in at most about TRIAL_SECONDS (between half of it and all of it, so that
    bandwidth, not latency, decides), raised to the first size at which the two plans run
    different schedules (`_runs_at`: each plan's weighted parts
    apply from their own sizes); 0 when they differ only above MAX_TRIAL_BYTES (no trial)."""
    n = MIN_TRIAL_BYTES
    while n < MAX_TRIAL_BYTES and planner.predict_allreduce_seconds(measured, model, 2 * n) <= TRIAL_SECONDS:
        n *= 2
    # Seen: a ring weighted only from 64 MB beside a host plan from 0 B, and a ring weighted from
    # 1 MB beside a site plan from 64 MB: each part is tried where it runs.
    small = model.small_allreduce_bytes
    while n <= MAX_TRIAL_BYTES and _runs_at(measured, n, small) == _runs_at(equal, n, small):
        n *= 2
    return n if n <= MAX_TRIAL_BYTES else 0


def keeps_measured(measured_times: list[float], equal_times: list[float]) -> bool:
    """The trial's rule on the agreed times of each pair: the measured plan stays when its median
    is at least TRIAL_MARGIN faster than the equal plan's and it was faster in most pairs."""
    faster = sum(a < b for a, b in zip(measured_times, equal_times))
    return (statistics.median(measured_times) < statistics.median(equal_times) * (1.0 - TRIAL_MARGIN)
            and 2 * faster > len(measured_times))


def _timed_allreduce(backend, t: torch.Tensor) -> float:
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.SUM
    start = time.perf_counter()
    backend.allreduce([t], opts).wait()
    return time.perf_counter() - start


def measured_plan_wins(backend, measured: planner.Plan, equal: planner.Plan, nbytes: int,
                       install: Callable[[object, planner.Plan], None]) -> tuple[bool, str]:
    """Runs the trial on allreduces of ``nbytes`` (`trial_bytes`, the same on every rank;
    ``install(backend, plan)`` sets a plan on this rank) and leaves ``equal`` installed; returns
    whether ``measured`` won, and a line that says what was timed. A failure raises naming the
    trial."""
    try:
        return _trial(backend, measured, equal, nbytes, install)
    except Exception as e:
        install(backend, measured)  # the plan every rank had before the trial, whichever ran last
        raise RuntimeError(f"hetcomm: the plan trial at group creation ({nbytes >> 10} KB allreduces) failed: {e}") from e


def _trial(backend, measured: planner.Plan, equal: planner.Plan, nbytes: int,
           install: Callable[[object, planner.Plan], None]) -> tuple[bool, str]:
    start = time.perf_counter()
    t = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = torch.zeros(2 * TRIAL_PAIRS, dtype=torch.float64)
    for k in range(TRIAL_PAIRS):
        # Alternate which goes first, so that neither always follows the other's traffic.
        pair = (measured, equal) if k % 2 == 0 else (equal, measured)
        for plan in pair:
            install(backend, plan)
            # Untimed first: the links it loads more than the other plan did start cold (a TCP
            # window that shrank while they carried little made one plan's time depend on which
            # ran before it: 300 against 400 ms for the same plan).
            _timed_allreduce(backend, t)
            slot = 2 * k + (0 if plan is measured else 1)
            times[slot] = _timed_allreduce(backend, t)
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MAX
    backend.allreduce([times], opts).wait()
    ours, others = times[0::2].tolist(), times[1::2].tolist()
    wins = keeps_measured(ours, others)
    install(backend, equal)
    faster = sum(a < b for a, b in zip(ours, others))
    line = (f"hetcomm plan trial: {nbytes >> 10} KB allreduce, measured shares {statistics.median(ours) * 1e3:.2f} ms, "
            f"equal shares {statistics.median(others) * 1e3:.2f} ms (median of {TRIAL_PAIRS}; measured faster in "
            f"{faster} of {TRIAL_PAIRS}): {'measured' if wins else 'equal'} shares kept "
            f"(the rule: {TRIAL_MARGIN:.0%} faster in the median and in most pairs)"
            f"; the trial took {time.perf_counter() - start:.2f} s")
    return wins, line
