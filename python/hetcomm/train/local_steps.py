"""How many inner steps each rank runs in a DiLoCo round: the ``fixed``, ``speed`` and ``time`` policies.

A policy answers one question after every inner step of this rank: *is the round over for me?*
(`LocalStepPolicy.round_over`), from this rank's own clock and step count and the per-rank step
times every rank holds identically (`StepTimes`). Every decision that involves other ranks is a
pure function of those agreed values, so all ranks decide the same without further communication.
``fixed``: H steps everywhere; ``speed``: H_r ∝ measured speed, with hysteresis; ``time``: steps
until an agreed deadline. Both adaptive policies start with `MEASUREMENT_STEPS` rounds.

Each policy's rule, the measurement rounds and the rounds with overlap:
docs/diloco.md#how-the-policies-decide.
"""
from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence

# Steps per rank in a round before step times are agreed.
MEASUREMENT_STEPS = 1
# ``time`` with overlap: a round lasts at least this many times the synchronisation's duration,
# the median of the last SYNC_WINDOW agreed ones (the lower of two): one synchronisation that a
# busy CPU slowed down does not plan a round many times H steps long.
SYNC_MARGIN = 1.1
SYNC_WINDOW = 3

__all__ = ["StepTimes", "LocalStepPolicy", "FixedSteps", "SpeedSteps", "TimeSteps", "make_policy", "POLICIES"]

_PREFIX = "hetcomm local steps"
POLICIES = ("fixed", "speed", "time")


def _positive_int(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_PREFIX}: {what} must be an integer >= 1, got {value!r}")
    return value


class StepTimes:
    """Agreed estimate of every rank's seconds per inner step, updated identically on every rank.

    `update` takes one agreed window per rank (seconds computing, steps); a rank without steps in
    the window keeps its previous estimate. The estimate is a ratio of two exponential moving
    averages, of the windows' seconds and of their steps (weight ``ema``): for windows of equal
    length it is the EMA of the seconds per step, and a long window outweighs short ones as its
    steps do (a round of 170 steps after measurement rounds of 3 sets the estimate almost alone,
    where an EMA of the per-window rates kept 70% of the short windows' slow warm-up steps: on
    the simulator's elastic benchmark, rounds 1.9, 1.7, 1.5 and 1.4x H steps long after the
    first). A rank's first two windows replace the estimate instead of
    blending into it: the first holds the run's first step, which pays for allocations and caches,
    and must not linger in the average. `estimates` fills ranks never measured with the slowest
    measured one (None before any measurement).
    """

    def __init__(self, world_size: int, ema: float = 0.3) -> None:
        if not 0 < ema <= 1:
            raise ValueError(f"{_PREFIX}: ema must be in (0, 1], got {ema!r}")
        self.world_size, self.ema = world_size, float(ema)
        self._t: list[float | None] = [None] * world_size
        self._windows = [0] * world_size
        # The EMA of the windows' steps (None: unknown, as for an estimate set from outside; the
        # next window then blends as in a plain EMA of the rates).
        self._n: list[float | None] = [None] * world_size

    def update(self, seconds: Sequence[float], steps: Sequence[float]) -> None:
        if len(seconds) != self.world_size or len(steps) != self.world_size:
            raise ValueError(f"{_PREFIX}: expected {self.world_size} values per row")
        for r, (s, n) in enumerate(zip(seconds, steps)):
            if n <= 0 or not math.isfinite(s) or s < 0 or not math.isfinite(n):
                continue
            old, old_n = self._t[r], self._n[r]
            if self._windows[r] < 2 or old is None:
                self._t[r], self._n[r] = s / n, float(n)
            else:
                prior = n if old_n is None else old_n            # the EMAs' previous values: t·N and N
                blended = (1.0 - self.ema) * prior + self.ema * n
                self._t[r] = ((1.0 - self.ema) * prior * old + self.ema * s) / blended
                self._n[r] = blended
            self._windows[r] += 1

    def retire(self, done: Sequence[bool]) -> None:
        """Ranks that take no more steps (out of data) count as measured: a policy waiting for
        every rank's measurements must not wait for theirs."""
        for r, d in enumerate(done):
            if d:
                self._windows[r] = max(self._windows[r], 2)

    @property
    def windows(self) -> list[int]:
        """How many windows with steps each rank has had agreed."""
        return list(self._windows)

    def state_dict(self) -> dict:
        return {"t": list(self._t), "windows": list(self._windows), "n": list(self._n)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["t"]) != self.world_size:
            raise ValueError(f"{_PREFIX}: step times of {len(state['t'])} workers, this run has {self.world_size}")
        self._t, self._windows = list(state["t"]), [int(w) for w in state["windows"]]
        # (checkpoints before the steps' EMA was kept have none: the next window blends plainly)
        n = state.get("n")
        self._n = list(n) if n is not None and len(n) == self.world_size else [None] * self.world_size

    def estimates(self) -> list[float] | None:
        known = [t for t in self._t if t is not None]
        if not known:
            return None
        slowest = max(known)
        # A rank whose steps take no measurable time still gets a positive estimate (no 1/0).
        floor = max(slowest * 1e-6, 1e-9)
        return [max(floor, slowest if t is None else t) for t in self._t]


class LocalStepPolicy:
    """Base class. DiLoCo calls `start_round` when a round begins and `round_over` after each step."""

    name = "base"

    def __init__(self, steps: int) -> None:
        self.steps = _positive_int(steps, "steps")
        self.world_size = 1
        self.rank = 0

    def bind(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def agreed(self, times: StepTimes) -> None:
        """New agreed step times (identical on every rank): re-plan."""

    def sync_took(self, seconds: float) -> None:
        """With overlap, before `agreed`: the longest time (agreed, over the ranks) that the last
        background synchronisation whose duration is agreed took from the agreement on its
        table to its last outer step (0 or NaN: no new measurement, the last one stands; none
        before the first)."""

    def start_round(self, now: float, start: float | None = None) -> None:
        """A round begins at ``now``; ``start`` is when it is deemed to start (``time`` chains deadlines)."""

    def round_over(self, steps_done: int, now: float, step_estimate: float) -> bool:
        raise NotImplementedError

    @property
    def measuring(self) -> bool:
        """True in a measurement round (nothing agreed yet to plan it by; for ``time`` with
        overlap, also no synchronisation's duration yet): its length matters only as a
        measurement, so with overlap DiLoCo stretches it until the previous synchronisation has
        landed instead of idling for it."""
        return False

    def plan(self) -> dict:
        """What this policy decided for the round: identical on every rank."""
        return {"policy": self.name}

    def planned_steps(self, times: StepTimes) -> int | None:
        """The steps this rank (worker) is planned to take in the round that starts, from agreed
        values only (identical on a worker's ranks); None: not known in advance. Staggered
        fragments are spaced by it (`hetcomm.train.diloco.stream`)."""
        return None

    # What a checkpoint keeps: the policy's decisions so far; not its configuration (the resumed
    # run's constructor arguments win), where this process is bound, nor deadlines on this
    # process's clock (the next round starts a new one).
    _NOT_SAVED = ("steps", "threshold", "_fixed_seconds", "rank", "world_size", "deadline")

    def state_dict(self) -> dict:
        """The policy's state (plain values), for `DiLoCo.state_dict`."""
        return {"name": self.name,
                **{k: copy.deepcopy(v) for k, v in vars(self).items() if k not in self._NOT_SAVED}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"{_PREFIX}: the checkpoint holds a {state.get('name')!r} policy, this run uses "
                             f"{self.name!r}")
        for k, v in state.items():
            if k != "name":
                setattr(self, k, copy.deepcopy(v))


class FixedSteps(LocalStepPolicy):
    name = "fixed"

    def round_over(self, steps_done: int, now: float, step_estimate: float) -> bool:
        return steps_done >= self.steps

    def plan(self) -> dict:
        return {"policy": self.name, "steps": [self.steps] * self.world_size}

    def planned_steps(self, times: StepTimes) -> int | None:
        return self.steps


class SpeedSteps(LocalStepPolicy):
    name = "speed"

    def __init__(self, steps: int, threshold: float = 0.01) -> None:
        super().__init__(steps)
        if not threshold >= 0:
            raise ValueError(f"{_PREFIX}: threshold must be >= 0, got {threshold!r}")
        self.threshold = float(threshold)
        self._counts: list[int] | None = None
        self.changes = 0

    def bind(self, rank: int, world_size: int) -> None:
        super().bind(rank, world_size)
        self._counts = None                      # until the first agreement: measurement rounds

    @staticmethod
    def idle_fraction(counts: Sequence[int], times: Sequence[float]) -> float:
        busy = [h * t for h, t in zip(counts, times)]
        longest = max(busy)
        return sum(longest - b for b in busy) / (len(busy) * longest) if longest > 0 else 0.0

    def proposal(self, times: Sequence[float]) -> list[int]:
        slowest = max(times)
        return [max(1, round(self.steps * slowest / t)) for t in times]

    def agreed(self, times: StepTimes) -> None:
        t = times.estimates()
        if t is None or min(times.windows) < 2:   # only the warm-up step measured so far
            return
        new = self.proposal(t)
        if self._counts is None or (new != self._counts and (self.idle_fraction(self._counts, t)
                                                             - self.idle_fraction(new, t) > self.threshold)):
            self._counts = new
            self.changes += 1

    @property
    def counts(self) -> list[int]:
        return [MEASUREMENT_STEPS] * self.world_size if self._counts is None else list(self._counts)

    def round_over(self, steps_done: int, now: float, step_estimate: float) -> bool:
        return steps_done >= self.counts[self.rank]

    @property
    def measuring(self) -> bool:
        return self._counts is None

    def plan(self) -> dict:
        return {"policy": self.name, "steps": self.counts}

    def planned_steps(self, times: StepTimes) -> int | None:
        return self.counts[self.rank]


class TimeSteps(LocalStepPolicy):
    name = "time"

    def __init__(self, steps: int, round_seconds: float | None = None) -> None:
        super().__init__(steps)
        if round_seconds is not None and not (round_seconds > 0 and math.isfinite(round_seconds)):
            raise ValueError(f"{_PREFIX}: round_seconds must be finite and > 0, got {round_seconds!r}")
        self._fixed_seconds = round_seconds
        self.round_seconds: float | None = round_seconds
        self.deadline: float | None = None
        self.sync_seconds: float | None = None       # None: no overlap (never told)
        self.recent_syncs: list[float] = []          # the last SYNC_WINDOW durations agreed
        # With overlap: how many times longer than H steps the synchronisation in flight made the
        # round (1.0: not at all, compute sets the pace)
        self.stretch: float = 1.0

    def sync_took(self, seconds: float) -> None:
        # A warm-up (DiLoCo's first background synchronisation, also the first after resuming
        # from a checkpoint) reports 0: the duration agreed before it still plans the rounds.
        if math.isfinite(seconds) and seconds > 0:
            # (a policy given its duration some other way, as a new generation's is, starts from it)
            recent = list(self.recent_syncs) or ([self.sync_seconds] if self.sync_seconds else [])
            self.recent_syncs = (recent + [float(seconds)])[-SYNC_WINDOW:]
            self.sync_seconds = statistics.median_low(self.recent_syncs)
        elif not self.sync_seconds:
            self.sync_seconds = 0.0

    def agreed(self, times: StepTimes) -> None:
        if self._fixed_seconds is not None:
            return
        t = times.estimates()
        # Not from the warm-up step alone: it pays for allocations and caches (0.4-0.7 s against
        # 0.15 s a step on the simulator's slowest rank) and would plan a round 3-4x too long,
        # a quarter to two fifths of a short run's samples in it. Until then rounds measure.
        if t is not None and min(times.windows) >= 2:
            # With overlap a round shorter than the synchronisation in flight ends in idling for
            # it: a round lasts at least that long (with a margin for its spread).
            compute = self.steps * max(t)
            self.round_seconds = max(compute, SYNC_MARGIN * (self.sync_seconds or 0.0))
            self.stretch = self.round_seconds / compute if compute > 0 else 1.0

    def start_round(self, now: float, start: float | None = None) -> None:
        if self.round_seconds is None:
            self.deadline = None
        else:
            self.deadline = (now if start is None else start) + self.round_seconds

    def round_over(self, steps_done: int, now: float, step_estimate: float) -> bool:
        if self.deadline is None:                        # no agreed round length yet: measure
            return steps_done >= MEASUREMENT_STEPS
        return steps_done >= 1 and now + step_estimate > self.deadline

    @property
    def measuring(self) -> bool:
        # With overlap, also while no synchronisation's duration is agreed yet (the first one's
        # arrives two rounds after it started): a round planned without it may be far shorter
        # than the synchronisation in flight (at 10 Mbit/s, 1.1 s of steps and 3.6 s of idling).
        return self.round_seconds is None or (self._fixed_seconds is None and self.sync_seconds == 0.0)

    def plan(self) -> dict:
        return {"policy": self.name, "round_seconds": self.round_seconds}

    def planned_steps(self, times: StepTimes) -> int | None:
        """The round's seconds over this worker's agreed step time (a measurement round: its
        steps)."""
        t = times.estimates()
        if self.round_seconds is None or t is None:
            return MEASUREMENT_STEPS
        return max(1, int(self.round_seconds / t[self.rank]))

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self._fixed_seconds is not None:          # a round length given to the constructor wins
            self.round_seconds = self._fixed_seconds
            self.stretch = 1.0                       # and is never stretched by the link


def make_policy(policy: str | LocalStepPolicy, steps: int, *, round_seconds: float | None = None,
                threshold: float = 0.01) -> LocalStepPolicy:
    if round_seconds is not None and policy != "time":
        raise ValueError(f"{_PREFIX}: round_seconds is an option of local_steps='time' (rounds of that many seconds "
                         f"on every worker), not of {policy!r}" + (" (give a policy object its own)" if isinstance(
                             policy, LocalStepPolicy) else ""))
    if isinstance(policy, LocalStepPolicy):
        return policy
    if policy == "fixed":
        return FixedSteps(steps)
    if policy == "speed":
        return SpeedSteps(steps, threshold=threshold)
    if policy == "time":
        return TimeSteps(steps, round_seconds=round_seconds)
    raise ValueError(f"{_PREFIX}: unknown policy {policy!r}; expected one of {', '.join(POLICIES)} "
                     "or a LocalStepPolicy")
