"""Running one probe round over a group: every flow of the round at once, timed at its receiver.

Every rank of the group runs `run_round` with the same round (`hetcomm.measure.schedule.Round`):
it is a collective, and ranks outside the round's flows still take part in its agreements. A
short warm-up sizes each unit's flows to take about ``target_seconds``; three timed transfers
follow, and the median is kept. Every size and time is agreed by an allreduce, so every rank
holds identical numbers.

How a flow is timed, which errors that leaves, and the sizes:
docs/planner.md#timing-a-probe-round.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from hetcomm import _engine
from hetcomm.measure.schedule import Round

_TAG = 0x4843  # point-to-point tag of the probe


def allreduce(backend, t: torch.Tensor, op) -> torch.Tensor:
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = op
    backend.allreduce([t], opts).wait()
    return t


class SendBuffer:
    """Zeros to send from, grown on demand: a probe of small flows never touches 16 MB a rank
    (32 ranks zeroing 16 MB each at once took a second on a two-core machine). Also keeps the
    fastest of the probe's small agreement allreduces (``fastest_allreduce``), this rank's view of
    the group's per-message latency."""

    def __init__(self) -> None:
        self.data = torch.zeros(0, dtype=torch.uint8)
        self.fastest_allreduce = float("inf")

    def at_least(self, nbytes: int) -> torch.Tensor:
        if self.data.numel() < nbytes:
            self.data = torch.zeros(nbytes, dtype=torch.uint8)
        return self.data


def _transfer(backend, rnd: Round, sizes: list[int], send_buf: SendBuffer) -> list[float]:
    """One concurrent transfer of every flow of ``rnd`` (``sizes[k]`` bytes for flow k).

    Returns ``[start_0, end_0, start_1, end_1, ...]``, agreed on every rank: for each flow, when
    its receiver had the first of its start messages and when it had all of its payloads (its
    monotonic clock, in seconds)."""
    rank = backend.rank()
    flows = rnd.flows
    incoming = [k for k, (_, dst) in enumerate(flows) if dst == rank]
    outgoing = [k for k, (src, _) in enumerate(flows) if src == rank]
    starts, payloads = [], []
    for k in incoming:
        src = flows[k][0]
        starts.append(backend.recv([torch.empty(1, dtype=torch.uint8)], src, _TAG))
        payloads.append(backend.recv([torch.empty(sizes[k], dtype=torch.uint8)], src, _TAG))
    start_out = torch.zeros(1, dtype=torch.uint8)
    data = send_buf.at_least(max((sizes[k] for k in outgoing), default=0))
    sends = []
    for k in outgoing:
        dst = flows[k][1]
        sends.append(backend.send([start_out], dst, _TAG))
        sends.append(backend.send([data[:sizes[k]]], dst, _TAG))
    # The interval starts when the first start message arrives, not the last: the flows of a unit
    # share its bottleneck, and a sender that started late (a busy core) would otherwise leave
    # out what the others had already sent through it (seen: a 100 Mbit/s site uplink measured
    # at 490 Mbit/s with 32 flows on two busy cores). A late sender lengthens the interval
    # instead, which underestimates (the planner's noise guards then keep equal shares).
    #
    # When each message was in is what the engine thread noted as it completed the receive
    # (completed_at, on time.perf_counter()'s clock), not when this thread looks: on a busy machine
    # it looks late, and a start seen late leaves out what arrived meanwhile (seen: a NIC shaped
    # to 3.1 MB/s probed at 4.2 with eight ranks and a test suite on two cores). Another backend's
    # work has no such note: then the time this thread saw it.
    while starts and not any(w.is_completed() for w in starts):
        time.sleep(50e-6)
    t0 = time.perf_counter()
    for w in starts:
        w.wait()
    for w in payloads:
        w.wait()
    t1 = time.perf_counter()
    completed_at = _engine.extension().completed_at
    noted_starts = [completed_at(w) for w in starts]
    noted_ends = [completed_at(w) for w in payloads]
    if starts and all(t > 0 for t in noted_starts + noted_ends):
        t0, t1 = min(noted_starts), max(noted_ends)
    for w in sends:
        w.wait()
    stamps = torch.zeros(2 * max(len(flows), 1), dtype=torch.float64)
    for k in incoming:
        stamps[2 * k], stamps[2 * k + 1] = t0, max(t1, t0 + 1e-9)
    t2 = time.perf_counter()
    out = allreduce(backend, stamps, torch.distributed.ReduceOp.MAX).tolist()
    send_buf.fastest_allreduce = min(send_buf.fastest_allreduce, time.perf_counter() - t2)
    return out


def _unit_times(rnd: Round, stamps: list[float]) -> list[float]:
    """Each unit's time: from its first flow's start to its last flow's end where its receivers
    share a clock (one host), else the longest of its receivers' own intervals."""
    out = []
    k = 0
    for unit in rnd.units:
        spans = [(stamps[2 * j], stamps[2 * j + 1]) for j in range(k, k + len(unit.flows))]
        k += len(unit.flows)
        if unit.one_clock:
            out.append(max(e for _, e in spans) - min(s for s, _ in spans))
        else:
            out.append(max(e - s for s, e in spans))
    return [max(t, 1e-9) for t in out]


def _flow_bytes(unit_bytes: float, flows: int, max_bytes: int) -> int:
    """Each flow's share of a unit's bytes: whole 4 KB pages, at least one, at most max_bytes."""
    return max(4096, int(min(max_bytes, unit_bytes / flows)) // 4096 * 4096)


def run_round(backend, rnd: Round, *, target_seconds: float = 0.05, warmup_bytes: int = 256 << 10,
              min_bytes: int = 64 << 10, max_bytes: int = 16 << 20, send_buf: Optional[SendBuffer] = None,
              predicted: Optional[dict[tuple, float]] = None
              ) -> tuple[dict[tuple, float], dict[tuple, float], dict[tuple, float]]:
    """Measures every unit of ``rnd``: ``(rates, per_flow, spread)`` by unit label: bytes/s (all
    of the unit's bytes over its time, and that divided by its number of flows), and the fastest
    of the unit's timed repeats over its slowest (>= 1: how far one reading of it can be off).
    ``predicted``: rates for some units (from earlier rounds, the same on every rank), which size
    their warm-up. A collective."""
    if not rnd.units:
        return {}, {}, {}
    if send_buf is None:
        send_buf = SendBuffer()
    flow_unit = [u for u, unit in enumerate(rnd.units) for _ in unit.flows]
    counts = [len(unit.flows) for unit in rnd.units]

    def rates_of(sizes: list[int]) -> tuple[list[float], list[float]]:
        times = _unit_times(rnd, _transfer(backend, rnd, sizes, send_buf))
        nbytes = [0.0] * len(rnd.units)
        for k, u in enumerate(flow_unit):
            nbytes[u] += sizes[k]
        return [b / t for b, t in zip(nbytes, times)], times

    # Warm-up: about warmup_bytes a unit, or an eighth of the target's worth of its predicted rate.
    # A transfer that fits in socket buffers looks instantaneous, so a unit that took under a
    # tenth of the target is warmed up again with 8x the bytes (at most three times).
    per_unit = []
    for u, unit in enumerate(rnd.units):
        guess = (predicted or {}).get(unit.label)
        total = max(min_bytes / 4 * min(counts[u], 4), guess * target_seconds / 8) if guess else warmup_bytes
        per_unit.append(_flow_bytes(total, counts[u], max_bytes))
    for _ in range(4):
        estimate, times = rates_of([per_unit[u] for u in flow_unit])
        short = [u for u in range(len(rnd.units)) if times[u] < target_seconds / 10 and per_unit[u] < max_bytes]
        if not short:
            break
        for u in short:
            per_unit[u] = min(max_bytes, per_unit[u] * 8)
    # At least min_bytes a flow for the first four flows of a unit (a short transfer is timed
    # badly), whatever its estimate; a unit of many flows lets each carry less.
    per_unit = [_flow_bytes(max(min_bytes * min(counts[u], 4), min(estimate[u] * target_seconds, 4.0 * max_bytes)),
                            counts[u], max_bytes) for u in range(len(rnd.units))]
    sizes = [per_unit[u] for u in flow_unit]
    repeats = [rates_of(sizes)[0] for _ in range(3)]
    rates, per_flow, spread = {}, {}, {}
    for u, unit in enumerate(rnd.units):
        rate = statistics.median(r[u] for r in repeats)
        rates[unit.label] = rate
        per_flow[unit.label] = rate / counts[u]
        spread[unit.label] = max(r[u] for r in repeats) / min(r[u] for r in repeats)
    return rates, per_flow, spread
