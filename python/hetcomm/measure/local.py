"""What each rank measures by itself or in one small collective: its reduce throughput, and the
per-message latency of the group."""
from __future__ import annotations

import time

import torch

from hetcomm import _engine
from hetcomm.measure.rounds import allreduce


def measure_reduce_bps(nbytes: int = 1 << 20, repeats: int = 3) -> float:
    """This process's reduce-kernel throughput: the rate of its own kernel on a 1 MB fp32 SUM, in
    bytes of incoming data per second (what the reduce-scatter asks of it)."""
    reduce_into = _engine.extension().reduce_into
    dst = torch.zeros(nbytes // 4)
    src = torch.ones(nbytes // 4)
    reduce_into(dst, src, "sum")  # warm up (page faults, caches)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        reduce_into(dst, src, "sum")
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure_alpha(backend) -> float:
    """Per-message latency estimate (s): the fastest 8-byte allreduce over its exchange steps, the
    slowest rank's view (so that every rank builds the same model)."""
    best = _fastest_small_allreduce(backend)
    worst = allreduce(backend, torch.tensor([best], dtype=torch.float64), torch.distributed.ReduceOp.MAX).item()
    return worst / max(1, (backend.size() - 1).bit_length())


def gather_reduce_and_latency(backend, fastest_allreduce: float) -> tuple[tuple[float, ...], float]:
    """Every rank's `measure_reduce_bps` and the group's per-message latency, identical on every
    rank, in one allgather. The latency: the slowest rank's fastest small allreduce (the probe's
    agreements are such allreduces; ``inf``: none, time some here) over its exchange steps."""
    if fastest_allreduce == float("inf"):
        fastest_allreduce = _fastest_small_allreduce(backend)
    row = torch.tensor([measure_reduce_bps(), fastest_allreduce], dtype=torch.float64)
    out = [torch.empty_like(row) for _ in range(backend.size())]
    backend.allgather([out], [row]).wait()
    steps = max(1, (backend.size() - 1).bit_length())
    return tuple(float(t[0]) for t in out), max(float(t[1]) for t in out) / steps


def _fastest_small_allreduce(backend, repeats: int = 5) -> float:
    t = torch.zeros(2, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        allreduce(backend, t, torch.distributed.ReduceOp.SUM)
        best = min(best, time.perf_counter() - t0)
    return best
