"""One AllReduce measurement: warm-up, an iteration count all ranks agree on, timing, a check.

The backend under test carries only the measured ``allreduce(SUM)``; barriers and the small
reductions that judge it (iteration count, slowest rank's time, #wrong) run on a gloo *control
plane* of their own. Timed calls reduce zeros in place (the buffer must stay zero), then one
checked call reduces a per-rank pattern whose sums are exact in the dtype.

The two planes, the timing, the check's pattern and the iteration count:
docs/bench-cli.md#one-measurement.
"""
from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hetcomm.bench.config import BenchConfig, torch_backend
from hetcomm.bench.results import SizeResult, allreduce_bus_factor

# Largest integer N such that every integer in [0, N] is exactly representable in the dtype.
_EXACT_INTEGER_LIMIT: dict[torch.dtype, int] = {
    torch.float16: 2 ** 11,
    torch.bfloat16: 2 ** 8,
    torch.float32: 2 ** 24,
    torch.float64: 2 ** 53,
    torch.int32: 2 ** 31 - 1,
    torch.int64: 2 ** 63 - 1,
}
_MAX_PATTERN_MODULUS = 8
_RANK_STRIDE = 3                    # coprime to the default modulus: neighbouring ranks differ
_CHECK_CHUNK_ELEMENTS = 1 << 22     # bounds the temporary of the comparison on 64M+ buffers

# A rank calls this before each phase with the seconds the phase should take at most; a launcher
# that hears nothing more within that (plus slack) knows the rank is hung.
Heartbeat = Callable[[float], None]

# The timed loop is sized from the agreed warm-up time; it may run this much slower than predicted
# (a noisy 2-core machine, a slow rank) before it counts as hung.
_HANG_SLOWDOWN = 10.0
# Calls shorter than this are timed in batches before the timed loop is sized (_calibrate).
_CALIBRATION_SECONDS = 0.02


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class ControlPlane:
    """Barrier and small reductions on a gloo group of its own (docs/bench-cli.md#one-measurement)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        prefixed = dist.PrefixStore("hetcomm.bench/control/", store)
        self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self.rank = rank
        self.world_size = world_size

    def barrier(self) -> None:
        self._pg.barrier().wait()

    def _allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._pg.allreduce([tensor], options).wait()
        return tensor

    def max(self, value: float) -> float:
        return float(self._allreduce(torch.tensor([value], dtype=torch.float64), dist.ReduceOp.MAX))

    def sum(self, value: int) -> int:
        return int(self._allreduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.SUM))

    def gather_all(self, value: float) -> list[float]:
        """Every rank's value, by rank: each rank fills its slot of a zero vector, then SUM.

        Exact, since each slot is one value plus zeros.
        """
        slots = torch.zeros(self.world_size, dtype=torch.float64)
        slots[self.rank] = value
        return self._allreduce(slots, dist.ReduceOp.SUM).tolist()


def iterations_for_budget(op_seconds: float, budget_seconds: float,
                          min_iters: int, max_iters: int) -> int:
    """How many timed calls fit ``budget_seconds`` at ``op_seconds`` each, within the bounds.

    >>> iterations_for_budget(0.01, 0.3, 3, 200)
    30
    >>> iterations_for_budget(1.0, 0.3, 3, 200), iterations_for_budget(0.0, 0.3, 3, 200)
    (3, 200)
    """
    if op_seconds <= 0.0:
        return max_iters
    return max(min_iters, min(max_iters, int(budget_seconds / op_seconds)))


def pattern_modulus(dtype: torch.dtype, world_size: int) -> int:
    """Largest ``m <= 8`` with ``(m-1) * world_size`` exactly representable in ``dtype``.

    >>> pattern_modulus(torch.bfloat16, 4), pattern_modulus(torch.bfloat16, 64)
    (8, 5)
    """
    limit = _EXACT_INTEGER_LIMIT[dtype]
    return max(1, min(_MAX_PATTERN_MODULUS, limit // world_size + 1))


def _periodic(period: torch.Tensor, count: int) -> torch.Tensor:
    repeats = -(-count // period.numel())
    return period.repeat(repeats)[:count]


def fill_pattern(buffer: torch.Tensor, rank: int, modulus: int) -> None:
    """``buffer[i] = (i + 3*rank) % modulus``."""
    period = (torch.arange(modulus) + _RANK_STRIDE * rank) % modulus
    buffer.copy_(_periodic(period.to(buffer.dtype), buffer.numel()))


def count_wrong(buffer: torch.Tensor, world_size: int, modulus: int) -> int:
    """Elements of ``buffer`` that differ from ``sum over ranks r of (i + 3r) % modulus``."""
    index = torch.arange(modulus)
    period = sum((index + _RANK_STRIDE * r) % modulus for r in range(world_size))
    period = period.to(buffer.dtype)
    wrong = 0
    chunk = _CHECK_CHUNK_ELEMENTS - _CHECK_CHUNK_ELEMENTS % modulus   # chunks start at i % m == 0
    for start in range(0, buffer.numel(), chunk):
        part = buffer[start:start + chunk]
        wrong += int((part != _periodic(period, part.numel())).sum())
    return wrong


def _timed_allreduces(buffer: torch.Tensor, calls: int) -> float:
    """Seconds for ``calls`` back-to-back synchronous allreduces on the default group, until the
    result is usable (on a GPU: until the current stream has reached it)."""
    synchronize = torch.cuda.current_stream().synchronize if buffer.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    synchronize()
    return time.perf_counter() - start


def _warm_up(buffer: torch.Tensor, calls: int) -> Optional[float]:
    """Runs ``calls`` allreduces; returns the median seconds per call (None if no calls)."""
    durations = [_timed_allreduces(buffer, 1) for _ in range(calls)]
    return statistics.median(durations) if durations else None


def _calibrate(buffer: torch.Tensor, control: "ControlPlane", first_guess: float, heartbeat: "Heartbeat",
               timeout_s: float, max_calls: int) -> float:
    """Seconds per call of back-to-back allreduces, the slowest rank's, from batches that grow
    fourfold until one lasts ``_CALIBRATION_SECONDS`` (or reaches ``max_calls``).

    One call at a time (the warm-up's median) counts, for a call of microseconds, the ranks'
    skew after the control plane's barrier: one slow call then made the estimate milliseconds
    and the timed loop a few dozen calls. Every rank runs the same batches (each batch's time is
    agreed before the next is chosen)."""
    calls, per_call = 1, first_guess
    while True:
        heartbeat(timeout_s + _HANG_SLOWDOWN * calls * per_call)
        seconds = control.max(_timed_allreduces(buffer, calls))
        per_call = seconds / calls
        if seconds >= _CALIBRATION_SECONDS or calls >= max_calls:
            return per_call
        calls = min(max_calls, calls * 4)


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: the CPU, or GPU ``LOCAL_RANK`` (else rank) mod the GPUs visible."""
    if device == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _paths(backend: str) -> Optional[dict]:
    """hetcomm's count of collectives per path on this rank (hetcomm.stats), None for others."""
    if torch_backend(backend) != "hetcomm":
        return None
    import hetcomm
    return dict(hetcomm.stats()["collectives_by_path"])


def _path_taken(before: Optional[dict], after: Optional[dict]) -> str:
    """The path most of the collectives between two `_paths` snapshots took ("" when unknown)."""
    if before is None or after is None:
        return ""
    grown = {k: after[k] - before.get(k, 0) for k in after}
    name, n = max(grown.items(), key=lambda kv: kv[1])
    return name if n > 0 else ""


def measure_allreduce(backend: str, size_bytes: int, config: BenchConfig,
                      control: ControlPlane, heartbeat: Heartbeat) -> SizeResult:
    """Measures ``allreduce(SUM)`` of ``size_bytes`` on the default group (``backend``)."""
    dtype = torch_dtype(config.dtype)
    count = size_bytes // config.element_bytes
    rank, world_size = control.rank, control.world_size
    buffer = torch.zeros(count, dtype=dtype, device=rank_device(config.device, rank))

    # Adaptive mode needs at least one timed call to estimate from, even with --warmup 0.
    warmup = config.warmup if config.iters is not None else max(1, config.warmup)
    timeout_s = config.timeout_s
    heartbeat((warmup + 1) * timeout_s)
    control.barrier()
    warmup_seconds = _warm_up(buffer, warmup)
    # The slowest rank's call time, the same number on every rank (None if no warm-up).
    agreed_seconds = control.max(warmup_seconds) if warmup_seconds is not None else None

    if config.iters is not None:
        iters = config.iters
    else:
        assert agreed_seconds is not None      # adaptive mode always warms up at least once
        if agreed_seconds < _CALIBRATION_SECONDS:
            agreed_seconds = _calibrate(buffer, control, agreed_seconds, heartbeat, timeout_s, config.max_iters)
        iters = iterations_for_budget(agreed_seconds, config.seconds_per_size,
                                      config.min_iters, config.max_iters)

    if agreed_seconds is None:
        heartbeat((iters + 1) * timeout_s)
    else:
        heartbeat(timeout_s + _HANG_SLOWDOWN * iters * agreed_seconds)
    control.barrier()
    paths_before = _paths(backend)
    rank_seconds = _timed_allreduces(buffer, iters) / iters
    path = _path_taken(paths_before, _paths(backend))
    rank_times_us = [t * 1e6 for t in control.gather_all(rank_seconds)]

    # Zeros must have stayed zeros through every timed call.
    wrong = int(torch.count_nonzero(buffer))
    modulus = pattern_modulus(dtype, world_size)
    fill_pattern(buffer, rank, modulus)
    heartbeat(2 * timeout_s)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    wrong += count_wrong(buffer.cpu(), world_size, modulus)
    wrong = control.sum(wrong)

    time_us = max(rank_times_us)
    algbw_gbps = size_bytes / (time_us * 1e-6) / 1e9
    return SizeResult(
        backend=backend, size_bytes=size_bytes, count=count, dtype=config.dtype, redop="sum",
        warmup=warmup, iters=iters, time_us=time_us, algbw_gbps=algbw_gbps,
        busbw_gbps=algbw_gbps * allreduce_bus_factor(world_size), wrong=wrong,
        rank_time_us=tuple(rank_times_us), path=path)
