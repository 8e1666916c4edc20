"""DiLoCo's synchronisation schedule with overlap: the fragments a pseudo-gradient is reduced in,
and when the replica moves onto an update that lands in the background.

`Overlap` is a part of `DiLoCo` (a mixin over its state); the derivation of the move:
docs/diloco.md#overlap-the-derivation.
"""
from __future__ import annotations

import concurrent.futures
import numbers
import warnings
from collections.abc import Sequence

import torch

from hetcomm.train import flat as _flat
from hetcomm.train.diloco.table import _SAMPLES, budget_seconds, last_round_seconds

_PREFIX = "hetcomm DiLoCo"
# With overlap and `time`, rounds stretched to at least this many times H steps by the
# synchronisation in flight are reported once (`Overlap._warn_if_link_bound`).
LINK_BOUND_WARNING = 1.25
# Seconds a rank waits for its own job in flight to end once its worker agreed that a job failed
# (`own_error`): the ranks of a worker learn of a failure together, inside the job, so a rank's
# own job may be a moment from raising its error when the training thread hears of it.
OWN_ERROR_SECONDS = 5.0


def own_error(futures: list) -> None:
    """Raises the error of the first of ``futures`` (this rank's jobs in flight) that failed,
    waiting up to `OWN_ERROR_SECONDS` for one to fail; returns if none did."""
    if futures:
        concurrent.futures.wait(futures, timeout=OWN_ERROR_SECONDS,
                                return_when=concurrent.futures.FIRST_EXCEPTION)
    for future in futures:
        if future.done() and future.exception() is not None:
            future.result()


def check_overlap_options(overlap: bool, overlap_steps, early_weight, fragments) -> tuple[int | None, float]:
    """DiLoCo's options of the overlap checked: (τ = ``overlap_steps`` or None, β = ``early_weight``
    with its default), else a ValueError naming the option."""
    if overlap_steps is not None and (isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int)
                                      or overlap_steps < 1 or not overlap):
        raise ValueError(f"{_PREFIX}: overlap_steps must be an int >= 1, with overlap=True (got "
                         f"{overlap_steps!r}, overlap={overlap!r})")
    if early_weight is not None and (isinstance(early_weight, bool) or not isinstance(early_weight, numbers.Real)
                                     or not 0.0 <= float(early_weight) <= 1.0 or not overlap):
        raise ValueError(f"{_PREFIX}: early_weight must be a number in [0, 1], with overlap=True (got "
                         f"{early_weight!r}, overlap={overlap!r})")
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1 or (fragments > 1
                                                                                         and not overlap):
        raise ValueError(f"{_PREFIX}: fragments must be an int >= 1, > 1 only with overlap=True (got "
                         f"{fragments!r}, overlap={overlap!r})")
    return overlap_steps, 0.25 if early_weight is None else float(early_weight)


def fragment_bounds(sizes: Sequence[int], fragments: int) -> list[tuple[int, int, int, int]]:
    """Up to ``fragments`` runs of consecutive tensors of about equal total size, none empty, as
    (first tensor, end tensor, first element, end element); fewer when fewer tensors hold
    elements. Empty tensors go with a neighbour."""
    n = len(sizes)
    cum = [0]
    for size in sizes:
        cum.append(cum[-1] + size)
    total = cum[-1]
    cuts = [0]
    for k in range(1, min(fragments, sum(1 for x in sizes if x > 0))):
        # the tensor boundary nearest k/F of the elements that leaves both sides non-empty
        options = [c for c in range(cuts[-1] + 1, n) if cum[cuts[-1]] < cum[c] < total]
        if not options:
            break
        cuts.append(min(options, key=lambda c: abs(cum[c] - total * k / fragments)))
    cuts.append(n)
    return [(i, j, cum[i], cum[j]) for i, j in zip(cuts, cuts[1:])]


class Overlap:
    """The moves of `DiLoCo` onto the late update of the round boundary (``overlap=True``): its
    fragments, ``_boundary`` (all of them, or with staggered fragments the first; the others:
    `hetcomm.train.diloco.stream`)."""

    def _shorten_last_round(self, round_index: int, table: list[list[float]]) -> None:
        """With ``time`` and overlap, once the previous round's (``round_index``) background
        synchronisation has agreed on its ``table``: if that agreement will stop the run
        (`_stop_decision`, at this round's end, from the same agreed values) and a sample budget is
        set, this round's deadline moves to where that budget is predicted to be reached
        (`last_round_seconds` of computing, less what this rank has computed so far, from now) if
        that is sooner: a long round at a slow link would otherwise overshoot it by up to a whole
        round. It still lasts until the synchronisation in flight has landed: ending sooner would
        only idle until then (the run ends at the same time either way), so the steps train
        instead. Round and time budgets keep the round whole; ``fixed`` and ``speed`` keep their
        step counts.

        A measurement round (no deadline: it would end when the synchronisation lands) gets that
        deadline too: the stop was decided from a prediction that this round trains what the
        previous one did, and a synchronisation that lands early (a slow link's first one, a
        loaded machine's) would otherwise end the run that many samples short (7,296 of 12,000
        trained, once, on a loaded machine).

        A planned round that does not end the run still ends where the budget is predicted to be
        reached, if that is sooner: a round planned from a synchronisation that a loaded CPU
        slowed down ran 990 steps, ten times a run's --samples, otherwise. (The run then stops
        after the next round, which this cuts to its first step after the landing.) The cap is in
        seconds of the clock, so time that is not computing (waits for a landing fragment) ends
        such a round a little short of the prediction; the last round makes up for it."""
        policy = self._policy
        # The rounds before it (the history gets round_index itself when its reduction ends).
        samples = sum(sum(rec["samples"]) for rec in self._history[:round_index - 1]) + sum(table[_SAMPLES])
        if self._stop_decision(table, ahead=True, settled=round_index, samples=samples) is None:
            seconds = budget_seconds(table, samples)
            cut = None if seconds is None else self._clock() + max(0.0, seconds - self._r_compute)
            if cut is not None and policy.deadline is not None and cut < policy.deadline:
                policy.deadline = cut
                self._until_landed = True       # (as below: its steps train rather than idle)
            return
        seconds = last_round_seconds(table, samples)
        if seconds is not None:
            cut = self._clock() + max(0.0, seconds - self._r_compute)
            policy.deadline = cut if policy.deadline is None else min(policy.deadline, cut)
            # Yet not before the synchronisation in flight has landed: the round would only wait
            # for it (1 s of a 17 s run at 20 Mbit/s, int4), and its steps train instead.
            self._until_landed = True

    def _maybe_rebase(self) -> None:
        """Moves the replica onto θ^k once round k's late update is in (see the module doc):
        p ← θ^k + β (p − θ̂_r^k), keeping a share β of the steps taken since its start; fragment by fragment
        as they land (a worker's ranks agree on how many)."""
        total = len(self._boundary)
        if self._rebase_after is None:
            # done: every fragment landed, or the synchronisation failed (-1: raised below on
            # every rank of the worker at once, before any move onto a partial update)
            done = self._pending.done()
            landed = (-1 if self._pending.exception() is not None else total) if done else self._landed
            if self._workers.size > 1:                 # a worker's replicas move at the same step
                landed = int(self._workers.least(landed))
            if landed < 0:
                own_error([self._pending])             # this rank's own failure: its error, not "another's"
                raise RuntimeError(f"{_PREFIX}: another rank of this worker failed its synchronisation "
                                   "(its error names the cause)")
            if landed < total:
                if landed > self._moved:
                    self._move_onto_global(landed)
                return
        elif self._r_steps < self._rebase_after:
            return
        start = self._clock()
        try:
            self._wait_lifted(self._pending)
        finally:
            end = self._clock()
            if end - start > 1e-4:
                self._totals["idle"] += end - start
                self._timeline.append(("idle", start, end))
        self._agree_landed([self._pending])            # raises here if the synchronisation failed
        self._move_onto_global(total)
        self._rebased = True

    def _agree_landed(self, futures: list) -> None:
        """After waiting for ``futures`` (jobs of the background thread): raises on every rank of
        the worker if one of them failed on any (its own error where it failed), before any rank
        moves its replica, whose new values the worker's ranks exchange (sharded state)."""
        self._worker_agrees(next((f.exception() for f in futures if f.exception() is not None), None))

    def _worker_agrees(self, error: BaseException | None) -> None:
        """Raises ``error`` (this rank's, or None) here, and on the worker's other ranks at the same
        point an error that names it: a worker's ranks go on to their collectives together or
        not at all (a rank left alone in an exchange would wait for the group's timeout)."""
        if self._workers.size > 1 and self._workers.least(-1.0 if error is not None else 0.0) < 0 \
                and error is None:
            raise RuntimeError(f"{_PREFIX}: another rank of this worker failed its synchronisation (its error names "
                               "the cause)")
        if error is not None:
            raise error

    def _move_onto_global(self, upto: int) -> None:
        """Moves the fragments of the round boundary's update landed since the last move (up to
        ``upto``) onto it (`_move_range`)."""
        if upto <= self._moved:
            return
        first, self._moved = self._moved, upto
        # The pseudo-gradient buffer not in flight is free (its synchronisation was waited for).
        scratch = self._deltas[self._next_delta]
        for f in range(first, upto):
            self._move_range(f, scratch[self._boundary[f][2]:self._boundary[f][3]])

    @torch.no_grad()
    def _move_range(self, f: int, scratch: torch.Tensor) -> None:
        """For fragment f, whose late update has landed: p ← θ^k + β (p − start), start ← θ^k
        (θ^k: the global parameters; β: ``early_weight``), through ``scratch`` (the fragment's
        elements here); then the worker's ranks share the replica's new values (sharded state).
        Counts as sync."""
        start = self._clock()
        self._moved_at[f] = (self._whole_sizes[f], self._r_steps)   # a fragment moved twice: its latest move
        i, j, a, b = self._fragments[f]
        params, glob = self._params[i:j], self._global[i:j]
        beta = self._early_weight
        for p, g, s, t in zip(params, glob, _flat.split(self._start[a:b], params), _flat.split(scratch, params)):
            new = g.detach().reshape(-1)
            if beta == 1.0:                             # p + θ^k − start: a small displacement added
                torch.sub(new, s, out=t)
                p.add_(t.view(p.shape).to(p.device, p.dtype))
            else:                                       # θ^k + β (p − start)
                t.copy_(p.detach().reshape(-1))         # to the CPU and the master precision
                t.sub_(s).mul_(beta).add_(new)
                p.copy_(t.view(p.shape))
            s.copy_(new)
        self._share([f])
        end = self._clock()
        self._totals["sync"] += end - start
        self._timeline.append(("sync", start, end))

    def _landed_steps(self) -> float:
        """Steps this round before the late update moved the replica (per element, averaged over
        its fragments; not yet moved: all of them; 0: nothing was in flight)."""
        if self._r_landed is not None:
            return self._r_landed
        n = sum(self._whole_sizes)             # (whole fragments: the same on a worker's ranks)
        if n == 0:
            return self._r_steps
        moves = self._moved_at.values()
        moved = sum(size for size, _ in moves)
        return (sum(size * steps for size, steps in moves) + (n - moved) * self._r_steps) / n

    def _background_jobs(self) -> list:
        """The background thread's jobs of this object (None where there is none)."""
        return [self._pending] + [j["future"] for j in self._flight.values()]

    def _wait_lifted(self, future) -> None:
        """Waits for the round boundary's job ``future``. Paced, the wait lifts its caps (the pace
        it was planned at, from a first step time, or for a link slower than measured, would cost
        idle time); the jobs after it keep theirs. (Paced, fragment 0 is the boundary's job.)"""
        lifted = self._pacer is not None and not future.done()
        if lifted:
            self._pacer.lift(0)
        try:
            concurrent.futures.wait([future])
        finally:
            if lifted:
                self._pacer.lift(None)

    def _wait_pending(self) -> None:
        start = self._clock()
        future = self._pending
        try:
            self._wait_lifted(future)
        finally:
            end = self._clock()
            self._totals["idle"] += end - start
            self._timeline.append(("idle", start, end))
        self._agree_landed([future])           # (a failed one stays ``_pending``: `elastic.carry` reads it)
        self._pending = None
        self._after_agreement(future.result()[0], ahead=True)

    def _warn_if_link_bound(self) -> None:
        """Once per object (group rank 0): says so when the synchronisation in flight, not compute,
        sets the length of `time`'s rounds. The replicas are then averaged less often per sample
        than H steps a round would (README, "When the link sets the pace")."""
        stretch = getattr(self._policy, "stretch", 1.0)
        if self._warned_link_bound or stretch < LINK_BOUND_WARNING or self._rank != 0:
            return
        self._warned_link_bound = True
        # Bytes per element: fp32 4, bf16/fp16 2, int8 about 1, int4 about 0.5 (plus a scale per block).
        fewer = {"fp32": "; compress='int8' sends about a quarter of fp32's bytes, 'int4' an eighth",
                 "bf16": "; compress='int8' sends about half the bytes of bf16, 'int4' a quarter",
                 "fp16": "; compress='int8' sends about half the bytes of fp16, 'int4' a quarter",
                 "int8": "; compress='int4' halves int8's bytes"}.get(self._codec.name, "")
        compute = self._policy.round_seconds / stretch
        warnings.warn(f"{_PREFIX}: the background synchronisation takes {self._policy.sync_seconds:.2f} s, longer "
                      f"than the {compute:.2f} s of {self._policy.steps} steps of the slowest worker: rounds last "
                      f"{stretch:.1f}x longer, so the replicas are averaged {stretch:.1f}x less often per sample than without "
                      f"overlap (the link, not compute, sets the pace){fewer}", RuntimeWarning, stacklevel=6)
