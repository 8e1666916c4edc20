"""Pacing of staggered fragments: their transfers spread over a share of the round's planned
compute at one rate, so that the WAN carries the fragments at a steady rate instead of bursts.

Staggering alone (`hetcomm.train.diloco.stream`) lowers the peak rate to about 1/F of a whole
model's only while a fragment's transfer, at the rate the link or the ranks' CPUs allow, is
shorter than the windows the rate is measured over and the gap to the next fragment: at H = 20
on the simulator's 100 Mbit/s NICs a 1 s window held one fragment and part of the next, 0.46×
(docs/diloco-results.md#staggered-fragments). Paced, the fragments' bytes take ``share`` of
the round's planned compute at one rate, however fast the link could carry them.

How: the kernel's own TCP pacing (``SO_MAX_PACING_RATE``; no qdisc needed since Linux 4.13) on
hetcomm's TCP/TLS links of the group that carries the synchronisation between workers
(`ProcessGroupHetcomm.set_pacing`). The fragments send at one rate R: their jobs' bytes over
``share`` × the round's planned compute (`Pacer.plan`; a slot is that compute over F), each job
planned from its trigger, or behind the job before it, and catching up when it started late
(`Pacer.rate`). A fragment not measured yet counts the bytes per element of those measured
(``sizes``), so that once one fragment has sent a job every job is paced. Each phase of the
reduction (an all-to-all, then an all-gather along the ring) shares R over the links in
proportion to what each carried in that phase last time (`Pacer.caps`), so the host sends at
about R throughout. The caps are set when the fragment's reduction starts, changed at its phase
boundaries and lifted when it ends; a round boundary that waits for the previous round's job
lifts that job's caps (`Pacer.lift`). Unpaced: jobs before any fragment has sent one, rounds
with no agreed step time (or a slot outside 1 ns to 10^6 s), the last, synchronous round, and
the jobs in flight once someone waits for them (`Pacer.hurry`: the last round, a checkpoint, the
global parameters). (Pacing the start and the last round too lowered the run's peak to 0.29×
the whole update's at 100 Mbit/s, but only with the staggered fragments held back in the
measurement rounds, which cost 5-7% of the loss: docs/diloco-results.md#over-the-whole-run-12-05-later-tried-not-kept.)
Pacing changes when bytes leave, never which: every rank reduces the same values whether or not
it paces, or paces differently.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator

import torch.distributed as dist

from hetcomm._backend import backend_or_none
from hetcomm.compress.collective import phase_marks

_PREFIX = "hetcomm DiLoCo"
# A paced job that takes longer than this many times the transfer time its rate planned was held
# back by the link or the ranks' CPUs, not by its cap (below it, the coding and summing between
# the phases, which pacing does not hide, can add a fifth to a third at a fifth of a core).
_BOUND = 1.5
_MIN_SHARE = 0.05
# Seconds: a slot outside these is not paced by (it comes from the agreed step times, which a
# corrupt table could make 1e-300 or inf: the rate would overflow or be 0).
_MIN_SLOT, _MAX_SLOT = 1e-9, 1e6
_MAX_CAP = 0xFFFFFFFE               # bytes/s: the kernel's 32-bit field (0xFFFFFFFF: no cap)


def check_pace(pace, overlap: bool, fragments: int, stagger: bool) -> float | None:
    """``pace``: None, or the share [0.05, 1] of the round's planned compute the fragments'
    transfers are spread over."""
    if pace is None:
        return None
    if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not _MIN_SHARE <= float(pace) <= 1.0:
        raise ValueError(f"{_PREFIX}: pace must be None or a share of the round's planned compute in "
                         f"[{_MIN_SHARE}, 1], got {pace!r}")
    if not (overlap and fragments > 1 and stagger):
        raise ValueError(f"{_PREFIX}: pace spreads staggered fragments' transfers: it needs overlap=True, "
                         f"fragments > 1 and stagger=True (got overlap={overlap}, fragments={fragments}, "
                         f"stagger={stagger})")
    return float(pace)


def make_pacer(share: float | None, group: dist.ProcessGroup | None, wan: dist.ProcessGroup | None,
               clock: Callable[[], float], sizes: list[int] | None = None) -> "Pacer | None":
    """The pacer of the links of ``wan``, the group that carries the fragments between workers
    (None without ``share``, or on a rank that has no such group: it sends nothing between
    workers). Refused unless DiLoCo's ``group`` uses the hetcomm backend, checked on the group
    every rank shares, so that every rank refuses together; timed by DiLoCo's ``clock``."""
    if share is None:
        return None
    if backend_or_none(group) is None:
        raise ValueError(f"{_PREFIX}: pace caps the send rate of hetcomm's links: DiLoCo's group must use the "
                         "hetcomm backend")
    backend = backend_or_none(wan) if wan is not None else None
    return None if backend is None else Pacer(share, backend, clock, sizes)


class Pacer:
    """The caps of one DiLoCo's fragments on the group that carries them (see the module doc).
    `plan`, `fired` and `hurry` are called on the training thread, `job` and `take_delay` on the
    synchronisation's."""

    def __init__(self, share: float, backend, clock: Callable[[], float], sizes: list[int] | None = None) -> None:
        """``backend``: the hetcomm backend (`ProcessGroupHetcomm`) whose links carry the fragments;
        ``sizes``: the fragments' elements, by which a fragment not measured yet is estimated from
        those measured (None: it is not, and its first job is unpaced)."""
        self.share = share
        self._sizes = list(sizes) if sizes is not None else None
        self._backend = backend
        self._clock = clock
        self.slot: float | None = None              # seconds between two triggers this round (`plan`)
        self._sent: dict[int, list[list[int]]] = {}  # f -> bytes sent to each peer, per phase of its last job
        self._need: dict[int, float] = {}           # f -> the least time a job of it took unpaced
        self._delay = 0.0                           # seconds pacing added to jobs since `take_delay`
        self._fired: dict[int, tuple[float, float | None]] = {}   # f -> (when it was last triggered, the slot then)
        self._fragments = 1                         # F, this round (`plan`)
        self._free = float("-inf")                  # the planned end of the last paced job's transfer (`rate`)
        self._lock = threading.Lock()               # caps set, and `hurry`
        self._hurried = False
        self._running: int | None = None           # the fragment whose job runs now
        self._lift: int | None = None               # the fragment whose job runs uncapped (`lift`)
        self.paced_jobs = 0
        self.refused_links = 0                      # links the kernel refused a cap on (summed over jobs)

    def plan(self, steps: float | None, step_seconds: float | None, fragments: int) -> None:
        """At a round's start: the slot is this worker's planned steps over F at its agreed step
        time, the compute the round is planned to take; not the wall time rounds took, nor a
        round ``time`` stretched for the link (a paced job that made a round wait or stretch
        would lengthen the next slot, and so the next job). None when either is not known yet."""
        ok = steps is not None and step_seconds is not None and step_seconds > 0
        slot = steps * step_seconds / fragments if ok else None
        # (from the agreed table: a value no round could last is not paced by)
        self.slot = slot if slot is not None and _MIN_SLOT <= slot <= _MAX_SLOT else None
        self._fragments = fragments

    def fired(self, f: int) -> None:
        """Fragment f's trigger: its job's time counts from here, in this round's slot."""
        self._fired[f] = (self._clock(), self.slot)

    def hurry(self) -> None:
        """Someone waits for the jobs in flight (the last round, a checkpoint, the global
        parameters): the caps are lifted now, and no job is paced until `resume`. (A boundary
        that waits for the previous round's job lifts that job's alone: `lift`.)"""
        with self._lock:
            self._hurried = True
            self._backend.set_pacing([0] * self._backend.size())

    def lift(self, f: int | None) -> None:
        """Someone waits for fragment f's job in flight (a round boundary, for the previous
        round's): it runs uncapped, now if it runs, else from its start, until ``lift(None)``
        after the wait; the jobs of other fragments are paced as planned."""
        with self._lock:
            self._lift = f
            if f is not None and self._running == f:
                self._backend.set_pacing([0] * self._backend.size())

    def resume(self) -> None:
        """The wait for the jobs is over: the next jobs are paced again."""
        with self._lock:
            self._hurried = False

    def _bytes(self, f: int) -> float:
        """The bytes of fragment f's last whole job; not measured yet, or its last job sent nothing
        (with ``sizes``): the bytes per element of the fragments measured, times its elements
        (0: nothing to go by)."""
        sent = self._sent_by(f)
        if sent or self._sizes is None or f >= len(self._sizes):
            return sent
        known = [g for g in self._sent if g < len(self._sizes) and self._sizes[g] > 0 and self._sent_by(g)]
        elements = sum(self._sizes[g] for g in known)
        return sum(self._sent_by(g) for g in known) * self._sizes[f] / elements if elements else 0

    def _sent_by(self, f: int) -> int:
        """The bytes fragment f's last whole job sent (0: none yet)."""
        return sum(sum(phase) for phase in self._sent.get(f, ()))

    def _phases(self, f: int) -> list[list[int]]:
        """Fragment f's bytes per phase and link last time; not measured yet, those of the largest
        fragment measured (the same reduction: the links share its bytes alike)."""
        if f in self._sent:
            return self._sent[f]
        return max(self._sent.values(), key=lambda phases: sum(sum(p) for p in phases))

    def rate(self, f: int, now: float) -> float | None:
        """Bytes/s this rank may send for fragment f's job, started at ``now``. Once every fragment
        has sent a job (with ``sizes``: once one has, the others estimated from it), one rate for
        them all: their last jobs' bytes over ``share`` × the round's
        planned compute (F slots), so that a fragment larger than the others (fragments are cut at
        tensor boundaries: 1.37 times the smallest in the example's model) takes longer at the same
        rate instead of sending faster: the peak was the largest fragment's rate, 1.13–1.20 times
        the mean. Before, each fragment's bytes over its own share × slot.

        Each job has a planned transfer on a schedule of the link (`_free`): from its trigger, or
        from the end planned for the job before it when that is later (it queued behind a larger
        fragment), for its bytes at the rate; the rate is its bytes over the time left to that end,
        so a job that starts late for other reasons (the wait for the other ranks' triggers, a job
        held back by the link) catches up: without that, jobs a little longer than a slot queue up
        until a round boundary waits for them. A planned end is never more than two of the job's
        slots' shares past its trigger (no backlog builds up over the rounds), and a job that
        catches up sends at most three times its planned rate, not in one burst. (Not less the
        job's time besides the transfer: measured on each rank, it holds the wait for the other
        ranks' transfers, and the rates swung between 6 and 21 Mbit/s from one job to the next.)
        None: unpaced."""
        fired, slot = self._fired.get(f, (now, self.slot))
        total = self._bytes(f)
        if slot is None or not slot > 0 or total == 0 or self._hurried:
            return None
        planned = self.share * slot
        if all(self._bytes(g) for g in range(self._fragments)):
            whole = sum(self._bytes(g) for g in range(self._fragments))
            steady = whole / (planned * self._fragments)
        else:                                       # (a fragment not measured yet: its own slot)
            steady = total / planned
        if not (math.isfinite(steady) and steady > 0):
            return None
        took = total / steady
        if not (math.isfinite(took) and took > 0):
            return None
        end = min(max(fired, self._free) + took, fired + 2 * planned)
        self._free = end
        return total / max(end - now, took / 3)

    def caps(self, f: int, rate: float, k: int) -> list[int]:
        """The cap on each link in phase k of fragment f's job, for ``rate`` bytes/s in all: the
        rate shared over the links in proportion to what each carried in the same phase last
        time, so that every phase sends at ``rate`` whatever links it uses. (One cap on every
        link would let the all-to-all send at (P − 1) times the rate; each link's bytes of the
        whole job over the slot would make the all-to-all alone take the whole slot: measured,
        1.75 times the planned time.) A link the phase did not use last time, or a phase not
        seen last time: ``rate`` (bytes left in a socket's buffer from the phase before, or a
        ring that changed, never go out uncapped)."""
        last = self._phases(f)
        phase = last[k] if k < len(last) else None
        total = sum(phase) if phase is not None else 0

        def cap(x: float) -> int:
            return min(_MAX_CAP, max(1, int(x)))

        if total == 0:
            return [cap(rate)] * len(last[0])
        return [cap(rate * b / total) if b else cap(rate) for b in phase]

    @contextlib.contextmanager
    def job(self, f: int) -> Iterator[None]:
        """Around fragment f's reduction (a background job): each phase capped from the last job's
        bytes (`caps`), counting this one's for the next. The reduction marks its phases
        (`hetcomm.compress.collective.phase_marks`); unmarked, the job is one phase."""
        start = self._clock()
        rate = self.rate(f, start)
        phases: list[list[int]] = []
        mark = list(self._backend.traffic()["bytes_sent"])

        def cap_next() -> None:
            if rate is None:
                return
            with self._lock:
                if not self._hurried and self._lift != f:
                    refused = self._backend.set_pacing(self.caps(f, rate, len(phases)))
                    if refused and not self.refused_links:
                        warnings.warn(f"{_PREFIX}: the kernel refused a send-rate cap (SO_MAX_PACING_RATE) on "
                                      f"{refused} link(s): pace has no effect on them", RuntimeWarning, stacklevel=2)
                    self.refused_links += refused

        def boundary() -> None:
            nonlocal mark
            now = list(self._backend.traffic()["bytes_sent"])
            phases.append([a - b for a, b in zip(now, mark)])
            mark = now
            cap_next()

        if rate is not None:
            self.paced_jobs += 1
        with self._lock:
            self._running = f
        try:
            cap_next()
            with phase_marks(boundary):
                yield
        finally:
            with self._lock:
                if rate is not None:
                    self._backend.set_pacing([0] * len(mark))
                self._running = None
            ended = self._clock()
            self._free = min(self._free, ended)     # (a job that ended early, or failed, freed the link then)
        # (a failed job's bytes are a part of a fragment's: the last whole one's stand)
        took = ended - start
        end = list(self._backend.traffic()["bytes_sent"])
        phases.append([a - b for a, b in zip(end, mark)])
        total = self._bytes(f) if rate is not None else 0
        need = self._need_of(f) if rate is not None else None
        self._sent[f] = phases
        # What the link needs: the least time an unpaced job of the fragment took (the first
        # pays for new connections); paced from the start, the need of those measured per byte.
        # A paced job held back by the link, not the cap, counts whole; from the others, what
        # they took beyond it is pacing's. (Paced times never lower it: they would become the
        # baseline, and pacing's time would count as the link's again.)
        if rate is None or need is None:
            self._need[f] = min(self._need.get(f, took), took)
        elif took <= _BOUND * total / rate:
            self._delay += max(0.0, took - need)

    def _need_of(self, f: int) -> float | None:
        """The least time fragment f's unpaced jobs took; never unpaced, the seconds per byte of
        the fragments that were, times its bytes (None: no fragment was)."""
        if f in self._need:
            return self._need[f]
        known = [g for g in self._need if self._sent_by(g)]
        sent = sum(self._sent_by(g) for g in known)
        return sum(self._need[g] for g in known) * self._bytes(f) / sent if sent else None

    def take_delay(self) -> float:
        """Seconds pacing added to the jobs since the last call: `DiLoCo` leaves them out of the
        synchronisation's duration that ``time`` plans rounds by (else a paced job, by design
        as long as share × a slot, would lengthen the rounds, then the slots, then the jobs)."""
        delay, self._delay = self._delay, 0.0
        return delay
