"""Adaptive batch partitioning (python/hetcomm/train/partition.py).

Pure parts (split_batch, probe_max_batch, profile_speed, the decision rule, a Partitioner without
torch.distributed) run in this process. One 3-rank job on the backend under test drives
Partitioners with fake compute times (rank r takes ``T_MS[r]`` ms per sample) through every
multi-rank scenario at once, and the tests check what each rank returned: identical partitions
on every rank at every step, exact sums, the shift toward the fast rank, caps, hysteresis, and
a HeteroBatchSampler over a Partitioner that changes mid-epoch.
"""
from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import types

import pytest
import torch

from harness import run_ranks
from hetcomm.train import partition
from hetcomm.train.data import HeteroBatchSampler

split_batch = partition.split_batch

WORLD_SIZE = 3
T_MS = [1.0, 2.0, 4.0]          # fake compute milliseconds per sample of each rank


# --------------------------------------------------------------------------------------------
# split_batch
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, expected", [
    ((10, [1, 1, 1, 1]), {}, [3, 3, 2, 2]),                       # ties to the lower rank
    ((100, [4, 2, 1, 1]), {}, [50, 25, 13, 12]),                  # 12.5 / 12.5: rank 2 wins
    ((12, [3, 1]), {}, [9, 3]),                                   # exact
    ((7, [1.0, 2.0, 4.0]), {}, [1, 2, 4]),
    ((100, [4, 2, 1, 1]), {"max_per_rank": [40, None, None, None]}, [40, 30, 15, 15]),
    # Cascade: rank 0 capped at 40, then 60 over 2:1:1 puts 30 > 26 on rank 1, capped too.
    ((100, [4, 2, 1, 1]), {"max_per_rank": [40, 26, None, None]}, [40, 26, 17, 17]),
    ((60, [1, 1, 1]), {"max_per_rank": [20, 20, 20]}, [20, 20, 20]),  # every cap binding
    ((10, [100, 1, 1]), {"min_per_rank": 2}, [6, 2, 2]),          # minimums take from rank 0
    ((3, [10, 1, 1]), {"min_per_rank": 0}, [3, 0, 0]),            # 2.5, .25, .25
    ((3, [10, 1, 1]), {}, [1, 1, 1]),                             # default minimum 1
    ((7, [1, 2, 3]), {"min_per_rank": 0, "max_per_rank": [0, None, 1]}, [0, 6, 1]),
    ((0, [1, 2]), {"min_per_rank": 0}, [0, 0]),
])
def test_split_batch_hand_solved(args, kwargs, expected) -> None:
    assert split_batch(*args, **kwargs) == expected


@pytest.mark.parametrize("args, kwargs, match", [
    ((10, []), {}, "zero ranks"),
    ((3, [1, 1, 1, 1]), {}, "at least 1"),
    ((5, [1, 1]), {"min_per_rank": 3}, "at least 3"),
    ((62, [1, 1, 1]), {"max_per_rank": [20, 20, 21]}, "exceeds the sum"),
    ((10, [1, 1]), {"min_per_rank": 2, "max_per_rank": [1, None]}, "below min_per_rank"),
    ((10, [1, 0]), {}, "rank 1"),
    ((10, [1, -2]), {}, "rank 1"),
    ((10, [math.nan, 1]), {}, "rank 0"),
    ((10, [math.inf, 1]), {}, "rank 0"),
    ((10, [1, 1]), {"max_per_rank": [5]}, "1 caps for 2 ranks"),
    ((-1, [1]), {"min_per_rank": 0}, "global_batch"),
    ((2.5, [1]), {}, "global_batch"),
    ((4, [1]), {"max_per_rank": [-1]}, "cap of rank 0"),
])
def test_split_batch_infeasible_raises(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        split_batch(*args, **kwargs)


def reference_targets(total, speeds, lo, caps) -> list[Fraction]:
    """Water-filling targets by brute force over which ranks sit at their minimum or cap.

    For each labelling (low / free / high) solve lam from the sum and keep the consistent one;
    independent of the breakpoint search in partition.py.
    """
    s = [Fraction(x) for x in speeds]
    for labels in itertools.product("lfh", repeat=len(s)):
        if any(lab == "h" and c is None for lab, c in zip(labels, caps)):
            continue
        fixed = sum(lo if lab == "l" else caps[r] for r, lab in enumerate(labels) if lab != "f")
        slope = sum(s[r] for r, lab in enumerate(labels) if lab == "f")
        if slope == 0:  # consistent if some lam puts every "h" at or above and every "l" below
            up_to = min((lo / s[r] for r, lab in enumerate(labels) if lab == "l"), default=None)
            if fixed != total or any(up_to is not None and caps[r] / s[r] > up_to
                                     for r, lab in enumerate(labels) if lab == "h"):
                continue
            return [Fraction(lo if lab == "l" else caps[r]) for r, lab in enumerate(labels)]
        lam = (total - fixed) / slope
        ok = all((lab == "l" and lam * s[r] <= lo)
                 or (lab == "h" and lam * s[r] >= caps[r])
                 or (lab == "f" and lo <= lam * s[r] and (caps[r] is None or lam * s[r] <= caps[r]))
                 for r, lab in enumerate(labels))
        if ok:
            return [lo if lab == "l" else caps[r] if lab == "h" else lam * s[r]
                    for r, lab in enumerate(labels)]
    raise AssertionError("no consistent labelling")


def random_case(rng: random.Random, max_ranks: int, max_batch: int):
    P = rng.randint(1, max_ranks)
    speeds = [rng.choice([1, 2, 3, 0.5, rng.uniform(0.1, 10)]) for _ in range(P)]
    lo = rng.choice([0, 1, 1, 2])
    caps = [rng.choice([None, None, rng.randint(lo, lo + max_batch // P + 2)]) for _ in range(P)]
    top = max_batch if None in caps else min(max_batch, sum(caps))
    if top < P * lo:
        caps = [None] * P
        top = max_batch
    return rng.randint(P * lo, max(P * lo, top)), speeds, lo, caps


def test_split_batch_sweep_sums_bounds_and_rounding() -> None:
    rng = random.Random(1)
    for _ in range(1500):
        total, speeds, lo, caps = random_case(rng, 6, 400)
        got = split_batch(total, speeds, min_per_rank=lo, max_per_rank=caps)
        case = (total, speeds, lo, caps, got)
        assert sum(got) == total, case
        assert all(lo <= b and (c is None or b <= c) for b, c in zip(got, caps)), case
        targets = reference_targets(total, speeds, lo, caps)
        assert all(abs(b - x) < 1 for b, x in zip(got, targets)), case


def test_split_batch_matches_brute_force_optimum() -> None:
    """Among all integer vectors within the bounds that sum to B, none is closer to the targets
    (max and sum of |b_r - x_r|), and ties go to the lower rank."""
    rng = random.Random(2)
    for _ in range(250):
        total, speeds, lo, caps = random_case(rng, 4, 12)
        targets = reference_targets(total, speeds, lo, caps)
        got = split_batch(total, speeds, min_per_rank=lo, max_per_rank=caps)
        ranges = [range(lo, (c if c is not None else total) + 1) for c in caps]
        feasible = [v for v in itertools.product(*ranges) if sum(v) == total]
        max_dev = min(max(abs(b - x) for b, x in zip(v, targets)) for v in feasible)
        sum_dev = min(sum(abs(b - x) for b, x in zip(v, targets)) for v in feasible)
        case = (total, speeds, lo, caps, got)
        assert max(abs(b - x) for b, x in zip(got, targets)) == max_dev, case
        assert sum(abs(b - x) for b, x in zip(got, targets)) == sum_dev, case


def test_split_batch_is_deterministic() -> None:
    speeds = [0.1 * k + 0.37 for k in range(9)]
    first = split_batch(1000, speeds, max_per_rank=[None] * 8 + [50])
    for _ in range(3):
        assert split_batch(1000, list(speeds), max_per_rank=[None] * 8 + [50]) == first
    assert split_batch(1000, tuple(speeds), max_per_rank=(None,) * 8 + (50,)) == first
    assert split_batch(10, [2, 2]) == split_batch(10, [2.0, 2.0]) == [5, 5]


# --------------------------------------------------------------------------------------------
# probe_max_batch, profile_speed
# --------------------------------------------------------------------------------------------

def oom_above(threshold: int, tries: list[int]):
    def try_batch(b: int) -> None:
        tries.append(b)
        if b > threshold:
            raise torch.OutOfMemoryError(f"fake: batch {b} > {threshold}")
    return try_batch


def test_probe_max_batch_doubles_then_bisects() -> None:
    tries: list[int] = []
    assert partition.probe_max_batch(oom_above(37, tries), limit=1000) == 37
    assert tries == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]


@pytest.mark.parametrize("threshold, start, limit, expected", [
    (1000, 1, 100, 100),     # the limit runs: stop there
    (5, 5, 64, 5),           # the start is the largest
    (37, 3, 37, 37),
    (36, 3, 37, 36),
    (2 ** 20, 1, 2 ** 20, 2 ** 20),
])
def test_probe_max_batch_bounds(threshold, start, limit, expected) -> None:
    tries: list[int] = []
    assert partition.probe_max_batch(oom_above(threshold, tries), start=start,
                                     limit=limit) == expected
    assert max(tries) <= limit and len(tries) == len(set(tries))


def test_probe_max_batch_errors() -> None:
    with pytest.raises(RuntimeError, match="batch size 8 .* already"):
        partition.probe_max_batch(oom_above(7, []), start=8, limit=100)
    with pytest.raises(ValueError, match="start <= limit"):
        partition.probe_max_batch(oom_above(7, []), start=8, limit=4)

    def broken(b: int) -> None:
        raise KeyError("not an out-of-memory error")
    with pytest.raises(KeyError):
        partition.probe_max_batch(broken, limit=4)


def test_profile_speed_median_after_warmup(monkeypatch) -> None:
    clock = [0.0]
    durations = iter([50.0, 0.1, 0.3, 0.2])   # a slow warm-up step, then three timed steps
    calls = []

    def step(b: int) -> None:
        calls.append(b)
        clock[0] += next(durations)

    monkeypatch.setattr(partition, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert partition.profile_speed(step, 8, warmup=1, steps=3) == pytest.approx(8 / 0.2)
    assert calls == [8, 8, 8, 8]


# --------------------------------------------------------------------------------------------
# The decision rule
# --------------------------------------------------------------------------------------------

def test_rebalanced_sizes_moves_toward_fast_rank() -> None:
    assert partition.predicted_step_seconds([30, 30], [1.0, 2.0]) == 60.0
    assert partition.rebalanced_sizes([30, 30], [1.0, 2.0]) == [40, 20]
    assert partition.rebalanced_sizes([30, 30], [1.0, 2.0], max_per_rank=[35, None]) == [35, 25]
    assert partition.rebalanced_sizes([40, 20], [1.0, 2.0]) is None   # already balanced


def test_rebalanced_sizes_hysteresis() -> None:
    # Proposal [21, 19, 20]: step time 22 -> 21, a 4.5% gain.
    t = [1.0, 1.1, 1.0]
    assert partition.rebalanced_sizes([20, 20, 20], t, threshold=0.05) is None
    assert partition.rebalanced_sizes([20, 20, 20], t, threshold=0.04) == [21, 19, 20]
    with pytest.raises(ValueError, match="threshold"):
        partition.rebalanced_sizes([20, 20], [1, 1], threshold=-0.1)


# --------------------------------------------------------------------------------------------
# Partitioner without torch.distributed
# --------------------------------------------------------------------------------------------

def test_partitioner_single_process() -> None:
    p = partition.Partitioner(16, interval=2, ema=0.3, max_per_rank=20)
    assert (p.sizes, p.local_batch, p.world_size, p.rank, p.caps) == ([16], 16, 1, 0, [20])
    assert p.record(1.6, 0.5) is False and p.seconds_per_sample is None
    assert p.stats()["as_of_step"] == 0
    assert p.record(1.6, 0.5, samples=16) is False          # window: 3.2 s / 32 samples
    assert p.seconds_per_sample == pytest.approx([0.1])
    p.record(4.0, samples=10)
    assert p.record(4.0, samples=10) is False               # window: 0.4 s/sample
    assert p.seconds_per_sample == pytest.approx([0.7 * 0.1 + 0.3 * 0.4])
    stats = p.stats()
    assert stats == {"compute_seconds": pytest.approx([11.2]), "idle_seconds": pytest.approx([1.0]),
                     "samples": [52], "samples_per_second": pytest.approx([52 / 11.2]),
                     "sizes": [16], "repartitions": 0, "as_of_step": 4}
    p.record(1.0)
    assert p.stats()["as_of_step"] == 4 and p.gather_stats()["samples"] == [68]
    assert p.version == 0 and p.sizes == [16]


@pytest.mark.parametrize("kwargs, match", [
    ({"ema": 0.0}, "ema"), ({"ema": 1.5}, "ema"), ({"threshold": -1}, "threshold"),
    ({"interval": 0}, "interval"), ({"speeds": [1, 2]}, "2 speeds for 1 ranks"),
    ({"max_per_rank": 3}, "exceeds the sum"), ({"group": object()}, "not initialised"),
])
def test_partitioner_rejects_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        partition.Partitioner(8, **kwargs)


def test_partitioner_record_rejects_bad_measurements() -> None:
    p = partition.Partitioner(8)
    for args in [(-1.0,), (math.nan,), (1.0, -0.5), (1.0, math.inf)]:
        with pytest.raises(ValueError, match="must be finite"):
            p.record(*args)
    with pytest.raises(ValueError, match="samples"):
        p.record(1.0, samples=-3)


# --------------------------------------------------------------------------------------------
# Partitioner on 3 ranks
# --------------------------------------------------------------------------------------------

def drive(rank: int, p: partition.Partitioner, t_ms: list[float], steps: int) -> dict:
    """Runs ``steps`` fake steps; the slowest rank's compute time sets the step time."""
    history = []
    for _ in range(steps):
        compute = [b * t / 1000 for b, t in zip(p.sizes, t_ms)]
        changed = p.record(compute[rank], idle_seconds=max(compute) - compute[rank])
        history.append((p.sizes, p.version, changed))
    return {"history": history, "stats": p.stats(), "caps": p.caps,
            "seconds_per_sample": p.seconds_per_sample}


def sampler_epoch(rank: int, length: int, global_batch: int) -> dict:
    p = partition.Partitioner(global_batch, interval=2)
    sampler = HeteroBatchSampler(length, p, seed=5)
    batches, sizes = [], []
    for batch in sampler:
        sizes.append(p.sizes)
        batches.append(batch)
        p.record(len(batch) * T_MS[rank] / 1000, samples=len(batch))
    return {"batches": batches, "sizes": sizes, "version": p.version,
            "gathered": p.gather_stats()}


def partitioner_job(rank: int, world_size: int) -> dict:
    P = partition.Partitioner
    return {
        "shift": drive(rank, P(60, interval=2), T_MS, 12),
        "caps": drive(rank, P(60, interval=2, max_per_rank=25 if rank == 0 else None), T_MS, 6),
        "declared": drive(rank, P(70, interval=3, speeds=[4, 2, 1]), T_MS, 6),
        "hysteresis": drive(rank, P(60, interval=2, threshold=0.05), [1.0, 1.1, 1.0], 6),
        "low_threshold": drive(rank, P(60, interval=2, threshold=0.04), [1.0, 1.1, 1.0], 6),
        "sampler": sampler_epoch(rank, 203, 24),
    }


@pytest.fixture(scope="module")
def job(backend_importable) -> list[dict]:
    """What every rank of the one 3-rank job returned (the job runs once per module)."""
    return run_ranks(WORLD_SIZE, partitioner_job, timeout=180)


@pytest.mark.parametrize("scenario", ["shift", "caps", "declared", "hysteresis", "low_threshold"])
def test_ranks_agree_at_every_step(job, scenario) -> None:
    for rank in range(1, WORLD_SIZE):
        assert job[rank][scenario] == job[0][scenario], f"rank {rank} disagrees with rank 0"


def test_partition_shifts_toward_fast_rank(job) -> None:
    history = job[0]["shift"]["history"]
    # First agreement after step 2: t = 1, 2, 4 ms exactly; 60 * (4, 2, 1) / 7 = 34.3, 17.1, 8.6.
    assert history[0] == ([20, 20, 20], 0, False)
    assert history[1] == ([34, 17, 9], 1, True)
    assert all(h[0] == [34, 17, 9] and h[1] == 1 for h in history[1:])   # then stable
    assert all(sum(h[0]) == 60 for h in history)
    assert job[0]["shift"]["seconds_per_sample"] == pytest.approx([t / 1000 for t in T_MS])
    stats = job[0]["shift"]["stats"]
    # Steps 1-2 at 20/20/20, steps 3-12 at 34/17/9.
    assert stats["samples"] == [40 + 340, 40 + 170, 40 + 90]
    assert stats["samples_per_second"] == pytest.approx([1000 / t for t in T_MS])
    assert stats["repartitions"] == 1 and stats["as_of_step"] == 12
    # Idle: the others wait for rank 2, 80 ms of compute per step at first, then 36 ms.
    assert stats["idle_seconds"] == pytest.approx([2 * 0.060 + 10 * 0.002,
                                                   2 * 0.040 + 10 * 0.002, 0.0])


def test_caps_are_exchanged_and_respected(job) -> None:
    result = job[0]["caps"]
    assert result["caps"] == [25, None, None]
    # Rank 0 capped at 25; 35 over speeds 2:1 -> 23.3, 11.7.
    assert result["history"][-1][0] == [25, 23, 12]
    assert all(h[0][0] <= 25 and sum(h[0]) == 60 for h in result["history"])


def test_declared_speeds_set_the_start_and_measurements_take_over(job) -> None:
    history = job[0]["declared"]["history"]
    assert history[0][0] == [40, 20, 10]
    assert history[-1][0] == [40, 20, 10] and history[-1][1] == 0  # the measured 1:2:4 agrees


def test_hysteresis_holds_below_threshold(job) -> None:
    held = job[0]["hysteresis"]["history"]
    assert all(h[0] == [20, 20, 20] and h[1] == 0 and not h[2] for h in held)
    moved = job[0]["low_threshold"]["history"]
    assert moved[-1][0] == [21, 19, 20] and moved[-1][1] == 1


def test_sampler_over_partitioner_covers_epoch_across_change(job) -> None:
    per_rank = [r["sampler"] for r in job]
    for r in per_rank[1:]:
        assert (r["sizes"], r["version"], r["gathered"]) == \
            (per_rank[0]["sizes"], per_rank[0]["version"], per_rank[0]["gathered"])
    steps = len(per_rank[0]["batches"])
    assert all(len(r["batches"]) == steps for r in per_rank)
    assert per_rank[0]["version"] >= 1           # the partition did change mid-epoch
    seen = [i for r in per_rank for b in r["batches"] for i in b]
    assert sorted(seen) == list(range(203))
    for k in range(steps - 1):                   # full steps follow the partition of the step
        assert [len(r["batches"][k]) for r in per_rank] == per_rank[0]["sizes"][k]
    assert per_rank[0]["gathered"]["samples"] == [
        sum(len(b) for b in r["batches"]) for r in per_rank]
