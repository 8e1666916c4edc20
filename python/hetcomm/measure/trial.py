"""The last guard against probe noise: a plan fitted to measured rates is kept only if it runs
faster than the same schedule with equal shares, timed on the group itself at its creation.

Why a trial: on a loaded machine the probe's readings of identical links scatter by 2-5x, and no
statistic of those readings told noise from a real difference every time (8 hosts of 4 ranks on
2 cores, every NIC 1000 Mbit/s: a link's repeats 1.3-9x apart, hosts read 18-116 MB/s; host
shares fitted to that ran at 0.66-0.97x equal shares). A slow link, by contrast, shows in the
time of the collective it slows. So: the plan chosen from the measured model, and the one chosen
from the equal model (`hetcomm.measure.ProbeResult.equal_model`: the same levels, every class of
link at one rate), each run ``TRIAL_PAIRS`` times, interleaved, after an untimed run each, on one
allreduce sized to take about ``TRIAL_SECONDS`` (0.1 s) under the measured plan's prediction and large
enough for its weighted shares to apply; the measured plan stays only when its median time beats
the equal one's by ``TRIAL_MARGIN`` and it was faster in most pairs. Every rank runs the same trials with the size rank 0 chose,
and the times are agreed (the slowest rank's), so every rank decides alike.

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
MIN_TRIAL_BYTES = 1 << 20
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


def trial_bytes(plan: planner.Plan, model: planner.LinkModel) -> int:
    """The power of two in [MIN_TRIAL_BYTES, MAX_TRIAL_BYTES] that ``plan`` is predicted to reduce
    in about TRIAL_SECONDS (at least large enough that bandwidth, not latency, decides), raised to
    the size from which its weighted part applies (its site plan's, else its ring's); 0 when that
    lies above MAX_TRIAL_BYTES (no trial: the plan differs from equal shares only for larger
    messages)."""
    n = MIN_TRIAL_BYTES
    while n < MAX_TRIAL_BYTES and planner.predict_allreduce_seconds(plan, model, 2 * n) <= TRIAL_SECONDS:
        n *= 2
    # From its min_bytes on the site (or host) plan takes every allreduce, whatever the ring's own
    # crossover (seen: a ring weighted only from 64 MB beside a host plan from 0 B; taking the
    # larger of the two skipped the trial and kept host shares fitted to noise).
    needed = plan.sites.min_bytes if plan.sites is not None else plan.min_bytes
    while n < needed:
        n *= 2
    return n if n <= MAX_TRIAL_BYTES else 0


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
    mine, theirs = statistics.median(ours), statistics.median(others)
    wins = mine < theirs * (1.0 - TRIAL_MARGIN) and 2 * sum(a < b for a, b in zip(ours, others)) > len(ours)
    install(backend, equal)
    line = (f"hetcomm plan trial: {nbytes >> 10} KB allreduce, measured shares {mine * 1e3:.2f} ms, equal shares "
            f"{theirs * 1e3:.2f} ms (median of {TRIAL_PAIRS}): "
            f"{'measured shares kept' if wins else 'equal shares kept (not faster by ' + format(TRIAL_MARGIN, '.0%') + ' in most pairs)'}"
            f"; the trial took {time.perf_counter() - start:.2f} s")
    return wins, line
