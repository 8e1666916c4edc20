"""The local-step policies' arithmetic (`hetcomm.train.local_steps`), without a process group:
hand-computed step counts, round lengths and deadlines from given step times and synchronisation
durations."""
from __future__ import annotations

import pytest

from hetcomm.train.local_steps import SYNC_MARGIN, SpeedSteps, StepTimes, TimeSteps


def test_policy_arithmetic():
    times = StepTimes(3, ema=0.5)
    speed = SpeedSteps(5, threshold=0.05)                # a wide band, to test it
    speed.bind(0, 3)
    assert speed.counts == [1, 1, 1]                      # measurement rounds first
    times.update([9.0, 9.0, 1.0], [1, 1, 1])             # the first (warm-up) window: replaced
    speed.agreed(times)
    assert speed.counts == [1, 1, 1], "counts set from the warm-up step alone"
    early = TimeSteps(5)
    early.agreed(times)
    assert early.round_seconds is None and early.measuring, "a round planned from the warm-up step alone (45 s)"
    times.update([1.0, 2.0, 4.0], [10, 10, 10])          # 0.1, 0.2, 0.4 s per step
    assert times.estimates() == pytest.approx([0.1, 0.2, 0.4])
    speed.agreed(times)
    assert speed.counts == [20, 10, 5]
    # Within the hysteresis band the counts stay (from the third window on, an EMA).
    times.update([1.0, 2.2, 4.0], [10, 10, 10])
    assert times.estimates() == pytest.approx([0.1, 0.21, 0.4])
    speed.agreed(times)
    assert speed.counts == [20, 10, 5]
    timed = TimeSteps(5)
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(2.0)
    timed.start_round(100.0)
    assert not timed.round_over(1, 101.0, 0.5)
    assert timed.round_over(1, 101.6, 0.5)               # 101.6 + 0.5 > 102
    assert not timed.round_over(0, 105.0, 0.5)           # at least one step
    # With overlap a round lasts at least SYNC_MARGIN times the agreed synchronisation.
    assert TimeSteps(5).measuring and not timed.measuring
    assert timed.stretch == 1.0
    timed.sync_took(3.0)
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 3.0)
    assert timed.stretch == pytest.approx(SYNC_MARGIN * 3.0 / 2.0)      # the link sets the pace
    assert not timed.measuring
    # A warm-up reports no duration (0; NaN alike): the one agreed before stands (after resuming
    # from a checkpoint, the first background synchronisation pays for new connections again).
    timed.sync_took(0.0)
    timed.sync_took(float("nan"))
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 3.0) and not timed.measuring
    # Nothing measured yet (the first agreements with overlap): H steps, and the round goes on
    # until the synchronisation in flight has landed (DiLoCo stretches measuring rounds).
    timed = TimeSteps(5)
    timed.sync_took(float("nan"))
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(2.0) and timed.measuring
    timed.sync_took(0.0)
    assert timed.measuring
    timed.sync_took(1.0)                                 # shorter than H steps: H steps
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(2.0) and not timed.measuring and timed.stretch == 1.0
    given = TimeSteps(5, round_seconds=1.0)
    given.sync_took(0.0)
    given.agreed(times)
    assert given.round_seconds == 1.0 and not given.measuring    # a round length given wins
    given.sync_took(3.0)
    given.agreed(times)
    assert given.round_seconds == 1.0 and not given.measuring
    # Nor stretched by the link: not even by the state of a run whose rounds were.
    stretched = TimeSteps(5)
    stretched.sync_took(3.0)
    stretched.agreed(times)
    assert stretched.stretch > 1.25
    given.load_state_dict(stretched.state_dict())
    given.agreed(times)
    assert given.round_seconds == 1.0 and given.stretch == 1.0
    assert SpeedSteps(5).measuring


def test_one_slow_synchronisation_does_not_plan_a_long_round():
    """With overlap a `time` round lasts at least SYNC_MARGIN times the median of the last three
    agreed synchronisation durations (the lower of two): one that a busy CPU slowed down (30 s
    against 2 s) leaves the rounds alone, a lasting change is followed from its second
    measurement."""
    times = StepTimes(1)
    times.update([1.0], [1])                             # the warm-up window
    times.update([2.0], [10])                            # 0.2 s per step: H = 5 steps take 1 s
    timed = TimeSteps(5)
    timed.sync_took(0.0)                                 # the first background sync: a warm-up
    timed.sync_took(2.0)
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 2.0)
    timed.sync_took(30.0)                                # one slow: the lower of [2, 30]
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 2.0), "one slow synchronisation planned a 33 s round"
    timed.sync_took(2.5)                                 # median of [2, 30, 2.5]
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 2.5)
    saved = timed.state_dict()
    timed.sync_took(20.0)                                # [30, 2.5, 20]: the link got slower
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 20.0)
    timed.sync_took(0.0)                                 # a warm-up after resuming: no change
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(SYNC_MARGIN * 20.0)
    # A checkpoint keeps the window: the same slow one after resuming gives the same round.
    resumed = TimeSteps(5)
    resumed.load_state_dict(saved)
    resumed.sync_took(20.0)
    resumed.agreed(times)
    assert resumed.round_seconds == pytest.approx(SYNC_MARGIN * 20.0)
    # A policy told only the last duration (a new generation of an elastic run) starts from it.
    told = TimeSteps(5)
    told.load_state_dict({"name": "time", "round_seconds": 2.75, "sync_seconds": 2.5, "stretch": 2.75})
    told.sync_took(30.0)                                 # [2.5, 30]
    told.agreed(times)
    assert told.round_seconds == pytest.approx(SYNC_MARGIN * 2.5)
    # No shorter than H steps, whatever the link: 0.5 s syncs leave the 1 s of H steps.
    fast = TimeSteps(5)
    for s in (0.5, 0.5, 0.5):
        fast.sync_took(s)
    fast.agreed(times)
    assert fast.round_seconds == pytest.approx(1.0) and fast.stretch == 1.0


def test_a_long_window_outweighs_the_short_measurement_windows():
    """The step times are a ratio of EMAs (seconds over steps): after 3-step measurement windows
    at 0.4 s a step, a 100-step round at 0.26 s sets the estimate almost alone (hand-computed:
    (0.7·3·0.4 + 0.3·26) / (0.7·3 + 0.3·100) = 0.26916), where an EMA of the rates gave
    0.7·0.4 + 0.3·0.26 = 0.358 and a `time` round of H = 96 steps planned 34.4 s instead of 25.8 s."""
    times = StepTimes(2, ema=0.3)
    times.update([5.0, 5.0], [1, 1])                     # warm-up: replaced
    times.update([1.2, 0.6], [3, 3])                     # replaced: 0.4, 0.2
    times.update([1.2, 0.6], [3, 3])                     # equal windows: a plain EMA, no change
    assert times.estimates() == pytest.approx([0.4, 0.2])
    times.update([26.0, 0.0], [100, 0])                  # rank 1 took no step: keeps its estimate
    assert times.estimates() == pytest.approx([(0.7 * 3 * 0.4 + 0.3 * 26.0) / (0.7 * 3 + 0.3 * 100), 0.2])
    timed = TimeSteps(96)
    timed.agreed(times)
    assert timed.round_seconds == pytest.approx(96 * 0.269159, rel=1e-5)
    # A short window after it moves the estimate less than a plain EMA would: the steps' EMA
    # still holds the long window.
    t0 = times.estimates()[0]
    times.update([3.0, 0.0], [10, 0])                    # 0.3 s a step over 10 steps
    n = 0.7 * (0.7 * 3 + 0.3 * 100) + 0.3 * 10
    assert times.estimates()[0] == pytest.approx((0.7 * (0.7 * 3 + 0.3 * 100) * t0 + 0.3 * 3.0) / n)
    # A checkpoint keeps both EMAs; one saved without the steps' EMA blends plainly next.
    again = StepTimes(2, ema=0.3)
    again.load_state_dict(times.state_dict())
    assert again.estimates() == times.estimates()
    old = StepTimes(2, ema=0.3)
    old.load_state_dict({"t": [0.4, 0.2], "windows": [3, 3]})
    old.update([26.0, 0.0], [100, 0])
    assert old.estimates() == pytest.approx([0.7 * 0.4 + 0.3 * 0.26, 0.2])
