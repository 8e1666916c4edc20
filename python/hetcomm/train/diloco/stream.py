"""Staggered fragments (Streaming DiLoCo): with ``fragments=F`` fragment f ≥ 1 is synchronised at
step ⌊f·H/F⌋ of every round instead of at its boundary, so that the link carries one fragment
at a time and its peak rate is about 1/F of a whole model's.

Each fragment has its own window of one round, shifted by f/F of it: at its trigger it takes its
pseudo-gradient Δ_f = start_f − p_f (the steps since its previous trigger), the replica's
fragment jumps to the start estimate Opt*(θ_f, Δ_f) (`outer.estimate_step`), and a job on the
background thread agrees on the window's steps and samples (the outer weights), reduces Δ_f and
takes the outer step of the fragment's parameters. When it has landed (at once, or with
``overlap_steps`` = τ after τ steps, waiting for it if need be) the fragment moves onto it as
the round boundary's update does: p_f ← θ_f + β (p_f − start_f). Moved on arrival, a fragment
whose previous update has not landed by its trigger fires once it has (the later fragments wait
with it: the jobs stay in order); with τ, or at the boundary, a fragment not moved by then keeps
its steps whole (the move is dropped, as at the boundary).

Fragment 0 is the round boundary's (`schedule.Overlap`, with the agreement on the round's
table). A rank reaches the triggers at its own steps; the jobs queue on one thread in the same
order on every rank (every fragment once per round, those not reached by the round's end at its
boundary, before fragment 0), so the collectives line up. H is the worker's planned steps for
the round (`LocalStepPolicy.planned_steps`: identical on a worker's ranks); a policy that
plans none triggers every fragment at the boundary. The last round, synchronous, reduces every
fragment's steps since its trigger at the boundary. Derivation and figures:
docs/diloco.md#staggered-fragments.
"""
from __future__ import annotations

import concurrent.futures
import math

import torch

from hetcomm.train import flat as _flat
from hetcomm.train.diloco import handoff
from hetcomm.train.diloco.agreement import NonFinite
from hetcomm.train.diloco.outer import estimate_step, outer_weights
from hetcomm.train.diloco.pacing import make_pacer
from hetcomm.train.diloco.schedule import own_error
from hetcomm.train.partition import exchange_columns

_PREFIX = "hetcomm DiLoCo"
# Rows of a fragment's column: which fragment, the window's steps and samples, its finiteness and
# sum (the replica's fingerprint, equal over a worker's ranks).
_F_INDEX, _F_STEPS, _F_SAMPLES, _F_FINITE, _F_SUM = range(5)
_F_AGGREGATE = ("max", "max", "sum", "min", "max")


def stagger_triggers(planned: int | None, fragments: int) -> list[float]:
    """The step of the round after which fragment f (1 ≤ f < F) is synchronised: ⌊f·H/F⌋, at
    least 1 (after a step); infinity (at the boundary) when no H is planned."""
    if planned is None:
        return [math.inf] * (fragments - 1)
    return [max(1, (f * int(planned)) // fragments) for f in range(1, fragments)]


class Streams:
    """The staggered fragments of `DiLoCo` (f ≥ 1): their triggers, jobs and moves."""

    def _init_streams(self, stagger: bool, pace: float | None) -> None:
        F = len(self._fragments)
        self._stagger = bool(stagger) and F > 1
        # (`pacing`: on the group that carries the fragments between workers; none on a rank
        # that holds no share of a worker's state and so sends nothing over it)
        wan = self._sync_group if self._workers.single else self._workers.cross_group
        self._pacer = None
        if pace is not None and self._stagger:
            self._pacer = make_pacer(pace, self._sync_group, wan, lambda: self._clock(),
                                     sizes=[b - a for _, _, a, b in self._fragments])
        # The fragments the round boundary reduces (fragment 0 alone when staggered).
        self._boundary = self._fragments[:1] if self._stagger else self._fragments
        self._flight: dict[int, dict] = {}        # f -> {future, seq, steps}: its job not yet moved onto
        self._fired = [False] * F                  # triggered this round
        self._triggers: list[float] = []
        self._seen = [0, 0]                        # steps and samples of this rank so far (cumulative)
        self._at_trigger = [[0, 0] for _ in range(F)]   # ... at each fragment's last trigger
        self._stream_seq = 0                       # jobs submitted
        self._stream_landed = 0                    # jobs landed (in order: one thread runs them)
        self._stream_failed = False
        self._stream_busy = 0.0                    # seconds of jobs since the boundary's job
        self._stream_moves = 0                     # moves onto fragments' updates (f >= 1)
        # Fragments 1.. only: their pseudo-gradients, and the moves' scratch.
        self._stream_base = self._fragments[1][2] if self._stagger else 0
        if self._stagger:
            n = self._start.numel() - self._stream_base
            self._stream_delta = torch.empty(n, dtype=self._master, device=self._start.device)
            self._stream_scratch = torch.empty(n, dtype=self._master, device=self._start.device)

    def _plan_triggers(self) -> None:
        """At a round's start: this round's triggers (`stagger_triggers`), nothing fired yet.
        (Holding the fragments f >= 1 back in measurement rounds, which lowered the run's peak
        rate, cost 5-7% of the loss at equal samples: docs/diloco-results.md#over-the-whole-run-12-05-later-tried-not-kept.)"""
        if not self._stagger:
            return
        self._fired = [False] * len(self._fragments)
        planned = self._policy.planned_steps(self._times)
        self._triggers = stagger_triggers(planned, len(self._fragments))
        if self._pacer is not None:          # (the planned compute: without `time`'s stretch for the link)
            t = self._times.estimates()
            steps = None if planned is None else planned / getattr(self._policy, "stretch", 1.0)
            self._pacer.plan(steps, None if t is None else t[self._col], len(self._fragments))

    def _count_window(self, samples: int) -> None:
        self._seen[0] += 1
        self._seen[1] += samples

    def _after_step_streams(self, boundary: bool) -> None:
        """After every step: counts it for the jobs in flight, moves those that landed, then fires
        the fragments due (inside the round; at its ``boundary`` `_fire_rest` does). Moved onto
        as they land, a fragment whose previous job has not landed yet fires at the first step
        after it has (or at the boundary) instead of idling for it; with ``overlap_steps`` the
        schedule is the fixed one."""
        for job in self._flight.values():
            job["steps"] += 1
        self._move_landed_streams()
        if boundary:
            return
        for f in range(1, len(self._fragments)):     # in order: every rank queues the same jobs
            if self._fired[f]:
                continue
            if self._r_steps < self._triggers[f - 1] or (self._rebase_after is None and f in self._flight):
                break
            self._fire(f)

    def _fire_rest(self) -> None:
        """At the round boundary, before fragment 0: the fragments not yet fired this round."""
        for f in range(1, len(self._fragments)):
            if not self._fired[f]:
                self._fire(f)
        if self._pacer is not None:
            self._pacer.fired(0)                 # (the boundary's job comes next)

    def _fire_last(self) -> None:
        """The last, synchronous round's boundary, every job waited for (`_join_streams`, before
        the round begins to send: those jobs hold none of its steps): the fragments this round
        did not fire, then every fragment's steps since its trigger, here (so that every rank runs
        the same collectives: each fragment once per round, then once more)."""
        for f in range(1, len(self._fragments)):
            if not self._fired[f]:                  # (another rank's may be a job: numbered alike)
                self._fire(f, inline=True, numbered=True)
        for f in range(1, len(self._fragments)):
            self._fire(f, inline=True)

    def _wait_job(self, job: dict, *, check: bool = True) -> None:
        start = self._clock()
        try:
            concurrent.futures.wait([job["future"]])
        finally:
            end = self._clock()
            if end - start > 1e-4:
                self._totals["idle"] += end - start
                self._timeline.append(("idle", start, end))
        if check:
            job["future"].result()                  # raises here if it failed

    def _wait_stream(self, f: int, *, move: bool = False, agree: bool = False) -> None:
        """Waits for fragment f's job in flight (idle); then moves onto it if ``move``, else drops
        the move (the steps since its trigger are kept whole). ``agree``: the worker's ranks agree
        that it did not fail (where nothing agreed on it before)."""
        job = self._flight.get(f)
        if job is None:
            return
        self._wait_job(job, check=not agree)
        if agree:
            self._agree_landed([job["future"]])
        del self._flight[f]                         # (a failed job stays: `elastic.carry` reads it)
        if move:
            self._stream_moves += 1
            _, _, a, b = self._fragments[f]
            self._move_range(f, self._stream_scratch[a - self._stream_base:b - self._stream_base])

    def _join_streams(self, agree: bool = False) -> None:
        """Every job in flight waited for, its move still to come (a checkpoint, the global
        parameters, the last round: unpaced from here to the next round); ``agree``: the worker's
        ranks agree that none failed (a collective)."""
        self._hurry_streams()
        for f in sorted(self._flight):
            self._wait_job(self._flight[f], check=not agree)
        if self._pacer is not None:
            self._pacer.resume()
        if agree:
            self._agree_landed([self._flight[f]["future"] for f in sorted(self._flight)])

    def _hurry_streams(self) -> None:
        """Someone waits for the jobs in flight (their caps lifted until `_join_streams` ends)."""
        if self._pacer is not None and (self._flight or self._pending is not None):
            self._pacer.hurry()

    @torch.no_grad()
    def _window_delta(self, f: int) -> torch.Tensor:
        """Δ_f = start_f − p_f (master precision) into the fragment's slice of the stream buffer."""
        i, j, a, b = self._fragments[f]
        out = self._stream_delta[a - self._stream_base:b - self._stream_base]
        params = self._params[i:j]
        for p, s, o in zip(params, _flat.split(self._start[a:b], params), _flat.split(out, params)):
            src = p.detach().reshape(-1)
            if src.device != o.device or src.dtype != o.dtype:
                o.copy_(src)
                src = o
            torch.sub(s, src, out=o)
        return out

    def _fire(self, f: int, *, inline: bool = False, numbered: bool = False) -> None:
        """Fragment f's trigger: its window's pseudo-gradient, the replica's jump to the start
        estimate, and its job (on the background thread; ``inline``: here, in the last round,
        ``numbered`` among the jobs where it stands for another rank's, `_jobs`)."""
        # its previous job (not moved by now: steps kept whole)
        self._wait_stream(f, agree=self._workers.size > 1 and not inline)
        self._fired[f] = True
        begin = self._clock()                  # (the wait counted as idle)
        i, j, a, b = self._fragments[f]
        delta = self._window_delta(f)
        total = float(torch.sum(delta, dtype=torch.float64)) if delta.numel() else 0.0
        column = [0.0] * 5
        column[_F_INDEX] = f
        column[_F_STEPS] = self._seen[0] - self._at_trigger[f][0]
        column[_F_SAMPLES] = self._seen[1] - self._at_trigger[f][1]
        column[_F_FINITE] = 1.0 if math.isfinite(total) else 0.0
        column[_F_SUM] = total if self._layout is None else self._replica_print(f)
        window = self._at_trigger[f]                # (its start: the job's window, if the job is lost)
        self._at_trigger[f] = list(self._seen)
        travel = delta.float()
        if inline:
            self._count_sync(begin)
            self._send(f)
            applied, order = self._applied, None
            if numbered:
                order, self._jobs = self._jobs, self._jobs + 1
            try:
                self._stream_job(f, column, travel, timed=True, order=order)
            except BaseException:
                if self._applied == applied:        # (its steps stay in the replica: so does their window)
                    self._at_trigger[f] = window
                raise
            return
        params = self._params[i:j]
        start = _flat.split(self._start[a:b], params)
        # θ_f is final: its previous job was waited for, and only this fragment's job steps it.
        estimate_step(self.outer_optimizer, self._global[i:j], _flat.split(delta, params), start)
        _flat.load(params, start)
        self._share([f])
        self._stream_seq += 1
        if self._pacer is not None:
            self._pacer.fired(f)
        job = handoff.after(handoff.fence(self._device), self._device, self._stream_job)
        order, self._jobs = self._jobs, self._jobs + 1
        future = self._executor.submit(job, f, column, travel, timed=False, order=order)
        self._flight[f] = {"future": future, "seq": self._stream_seq, "steps": 0, "window": window, "order": order}
        self._count_sync(begin)

    def _stream_job(self, f: int, column: list[float], delta: torch.Tensor, *, timed: bool,
                    order: int | None = None) -> None:
        """Agrees on fragment f's window (weights, finiteness), reduces Δ_f and steps its
        parameters. Background thread (``order``: its number, `_jobs`), or the last round's
        (``timed``)."""
        try:
            start = self._clock()
            ranks = exchange_columns(column, group=self._sync_group)
            if len(set(ranks[_F_INDEX])) > 1:
                raise ValueError(f"{_PREFIX}: the ranks reduce different fragments at once: "
                                 f"{dict(enumerate(int(x) for x in ranks[_F_INDEX]))}; construct DiLoCo with the same "
                                 "fragments, stagger and model everywhere")
            bad = [r for r, ok in enumerate(ranks[_F_FINITE]) if ok == 0.0]
            if bad:
                raise NonFinite(f"{_PREFIX}: fragment {f}: the pseudo-gradient of rank(s) {bad} is not finite "
                                "(NaN or Inf in their parameters); no outer update was applied", bad)
            split = self._workers.diverged(ranks[_F_SUM], ranks[_F_STEPS])
            if split:
                raise ValueError(f"{_PREFIX}: fragment {f}: the ranks of worker(s) {split} hold different replicas "
                                 "(a worker's ranks must step together on the same replica)")
            # Timed from the agreement, as the boundary's job: not the wait for the last rank.
            agreed = self._clock()
            table = self._workers.aggregate(ranks, _F_AGGREGATE)
            weights = outer_weights(self.weighting, table[_F_SAMPLES], table[_F_STEPS])
            if any(s > 0 for s in table[_F_STEPS]) and any(w != 0.0 for w in weights):
                i, j, _, _ = self._fragments[f]
                part = self._reduce_agreed(delta, weights, self._feedback[f] if self._feedback is not None else None,
                                           background=not timed, fragment=f)
                for g, piece in zip(self._global[i:j], _flat.split(part, self._global[i:j])):
                    g.grad = piece.view(g.shape).to(g.device, g.dtype)
                self.outer_optimizer.step()
                self.outer_optimizer.zero_grad(set_to_none=True)
                self._applied += 1
                if order is not None:
                    self._applied_jobs.add(order)
            end = self._clock()
            self._timeline.append(("sync", start, end))
            if timed:
                self._totals["sync"] += end - start
            else:
                self._stream_busy += end - agreed
                self._stream_landed += 1
        except BaseException:
            self._stream_failed = True
            raise

    def _move_landed_streams(self) -> None:
        """Moves the fragments whose job has landed (on every rank of the worker: they agree on how
        many jobs have), or with ``overlap_steps`` = τ those τ steps after their trigger."""
        if not self._flight:
            return
        if self._rebase_after is not None:
            due = [f for f, job in self._flight.items() if job["steps"] >= self._rebase_after]
            if due and self._workers.size > 1:      # the same on the worker's ranks: agree on failures
                for f in due:
                    self._wait_job(self._flight[f], check=False)
                self._agree_landed([self._flight[f]["future"] for f in due])
        else:
            landed = -1 if self._stream_failed else self._stream_landed
            if self._workers.size > 1:
                landed = int(self._workers.least(landed))
            if landed < 0:
                # this rank's own failure: its error, not "another's" (its job may be a moment
                # from raising it: `own_error`)
                own_error([job["future"] for job in sorted(self._flight.values(), key=lambda j: j["seq"])])
                raise RuntimeError(f"{_PREFIX}: another rank of this worker failed a fragment's synchronisation "
                                   "(its error names the cause)")
            due = [f for f, job in self._flight.items() if job["seq"] <= landed]
        for f in sorted(due, key=lambda f: self._flight[f]["seq"]):
            self._wait_stream(f, move=True)          # at once when landed; with τ, waits if need be

    def _stream_state(self) -> dict | None:
        """For a checkpoint (every job waited for): what is still to move, and the windows."""
        if not self._stagger:
            return None
        return {"bounds": [list(x) for x in self._fragments],
                "unmoved": {f: job["steps"] for f, job in self._flight.items()},
                "seen": list(self._seen), "at_trigger": [list(x) for x in self._at_trigger]}

    def _load_stream_state(self, state: dict | None) -> None:
        if not self._stagger or state is None:
            return
        self._seen = list(state["seen"])
        self._at_trigger = [list(x) for x in state["at_trigger"]]
        for f, steps in state["unmoved"].items():
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            self._stream_seq += 1
            self._stream_landed += 1
            self._flight[int(f)] = {"future": done, "seq": self._stream_seq, "steps": int(steps)}
