"""The probe behind `hetcomm.probe()`: directed link bandwidths and reduce throughput, the planner's inputs.

Links are measured in P-1 rounds; in round s every rank sends to rank+s and receives from
rank-s at the same time. Each rank then carries exactly one outgoing and one incoming
measurement flow, so per-NIC limits (the common case: a slow NIC, a slow site uplink per node)
are measured without the flows of one round competing for the same NIC. Within a round, every
size step is agreed by all ranks (an allreduce), so sender and receiver never disagree on what
comes next.

A link's bandwidth is timed at its receiver: a one-element "start" message, then the payload on
the same connection; bandwidth = payload / (arrival of its last byte - arrival of the start).
Sizes double from 64 KB until every link of the round took at least ``target_seconds`` or
``max_bytes`` is reached; the final size is timed three times and the median kept. Errors go
both ways: interference (other processes, other flows) makes a transfer look slower, while the
clock starting late (the start message is noticed a little after it arrived, and payload that
came meanwhile looks instantaneous; token-bucket bursts too) makes it look faster. Long transfers
shrink both; the median discards one outlier of either kind. (Seen on the simulated two-site
cluster with 20 ms transfers and best-of-two: a 100 Mbit/s link measured 151% of its rate, and
the planner fitted a plan to the error.)

Reduce throughput is the rate of this rank's own reduce kernel on a 4 MB fp32 SUM, in bytes of
incoming data per second: what the reduce-scatter asks of it.

Everything measured is all-gathered, so every rank holds identical numbers; rank 0 then chooses
the plan and broadcasts it (see `hetcomm.topology`), so no rank can end up with another plan
because of floating-point differences.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

import torch

from hetcomm import _C
from hetcomm.planner import LinkModel

_TAG = 0x4843  # point-to-point tag used by the probe


def _wait(work) -> None:
    work.wait()


def _allreduce(backend, t: torch.Tensor, op) -> torch.Tensor:
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = op
    _wait(backend.allreduce([t], opts))
    return t


def _allgather_rows(backend, row: torch.Tensor, size: int) -> torch.Tensor:
    out = [torch.empty_like(row) for _ in range(size)]
    _wait(backend.allgather([out], [row]))
    return torch.stack(out)


def measure_reduce_bps(nbytes: int = 4 << 20, repeats: int = 3) -> float:
    """This process's reduce-kernel throughput (bytes of input reduced per second)."""
    dst = torch.zeros(nbytes // 4)
    src = torch.ones(nbytes // 4)
    _C.reduce_into(dst, src, "sum")  # warm up (page faults, caches)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _C.reduce_into(dst, src, "sum")
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure_links(backend, rank: int, size: int, *, min_bytes: int = 64 << 10, max_bytes: int = 16 << 20,
                  target_seconds: float = 0.05) -> torch.Tensor:
    """Incoming bandwidth (bytes/s) of every link src -> rank; index src (own entry 0)."""
    incoming = torch.zeros(size, dtype=torch.float64)
    if size == 1:
        return incoming
    send_buf = torch.zeros(max_bytes, dtype=torch.uint8)
    recv_buf = torch.empty(max_bytes, dtype=torch.uint8)
    start_out = torch.zeros(1, dtype=torch.uint8)
    start_in = torch.empty(1, dtype=torch.uint8)
    def transfer(dst: int, src: int, nbytes: int) -> float:
        recv_start = backend.recv([start_in], src, _TAG)
        recv_payload = backend.recv([recv_buf[:nbytes]], src, _TAG)
        send_start = backend.send([start_out], dst, _TAG)
        send_payload = backend.send([send_buf[:nbytes]], dst, _TAG)
        _wait(recv_start)
        t0 = time.perf_counter()
        _wait(recv_payload)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        _wait(send_start)
        _wait(send_payload)
        return elapsed

    for shift in range(1, size):
        dst, src = (rank + shift) % size, (rank - shift) % size
        nbytes = min_bytes
        while True:
            elapsed = transfer(dst, src, nbytes)
            shortest = _allreduce(backend, torch.tensor([elapsed], dtype=torch.float64),
                                  torch.distributed.ReduceOp.MIN).item()
            if shortest >= target_seconds or nbytes >= max_bytes:
                break
            nbytes = min(max_bytes, nbytes * 2)
        times = sorted([elapsed, transfer(dst, src, nbytes), transfer(dst, src, nbytes)])
        incoming[src] = nbytes / times[1]
    return incoming


def measure_site_uplinks(backend, model: LinkModel, site_labels: Sequence[int], *, min_bytes: int = 64 << 10,
                         max_bytes: int = 4 << 20, target_seconds: float = 0.05) -> LinkModel:
    """``model`` with each site's cut measured as an uplink: what all of its ranks together can send
    to (and receive from) the rest at once.

    Links timed one pair at a time cannot tell a site behind one shared uplink (every pair then
    gets the whole uplink, but together they share it) from sites joined by independent links,
    nor a rank with one slow NIC from a rank with several slow links. Both matter as soon as a
    schedule talks to several peers at once (the hierarchical allreduce). So for every site, in
    turn, every rank of the site sends ``nbytes`` to every rank outside it at once ("out"), then
    the reverse ("in"); the receivers time from the last start message to the last byte, and
    the site's rate is all the bytes over the slowest receiver's time (sizes doubling as in
    `measure_links`, median of three at the final size). Identical on every rank: the times are
    agreed by an allreduce. A collective over the group; one site: ``model`` unchanged.
    """
    rank, size = backend.rank(), backend.size()
    labels = list(site_labels)
    sites = sorted(set(labels), key=labels.index)
    if len(sites) < 2:
        return model
    send_buf = torch.zeros(max_bytes, dtype=torch.uint8)
    recv_bufs = {src: torch.empty(max_bytes, dtype=torch.uint8) for src in range(size) if src != rank}
    start_out = torch.zeros(1, dtype=torch.uint8)
    starts_in = {src: torch.empty(1, dtype=torch.uint8) for src in range(size) if src != rank}

    def round_seconds(senders: list[int], receivers: list[int], nbytes: int) -> float:
        elapsed = 0.0
        works = []
        if rank in receivers:
            starts = [backend.recv([starts_in[src]], src, _TAG + 1) for src in senders]
            payloads = [backend.recv([recv_bufs[src][:nbytes]], src, _TAG + 1) for src in senders]
        if rank in senders:
            for dst in receivers:
                works.append(backend.send([start_out], dst, _TAG + 1))
                works.append(backend.send([send_buf[:nbytes]], dst, _TAG + 1))
        if rank in receivers:
            for w in starts:
                _wait(w)
            t0 = time.perf_counter()
            for w in payloads:
                _wait(w)
            elapsed = time.perf_counter() - t0
        for w in works:
            _wait(w)
        return _allreduce(backend, torch.tensor([elapsed], dtype=torch.float64),
                          torch.distributed.ReduceOp.MAX).item()

    uplinks = []
    for site in sites:
        members = [r for r in range(size) if labels[r] == site]
        others = [r for r in range(size) if labels[r] != site]
        rates = []
        for senders, receivers in ((members, others), (others, members)):
            nbytes = min_bytes
            while True:
                longest = round_seconds(senders, receivers, nbytes)
                if longest >= target_seconds or nbytes >= max_bytes:
                    break
                nbytes = min(max_bytes, nbytes * 2)
            times = sorted([longest, round_seconds(senders, receivers, nbytes),
                            round_seconds(senders, receivers, nbytes)])
            rates.append(nbytes * len(senders) * len(receivers) / max(times[1], 1e-9))
        uplinks.append((tuple(members), rates[0], rates[1]))
    return dataclasses.replace(model, uplinks=tuple(uplinks))


def measure_alpha(backend, repeats: int = 5) -> float:
    """Per-message latency estimate (s): the fastest 8-byte allreduce over its exchange steps."""
    t = torch.zeros(2, dtype=torch.float32)
    size = backend.size()
    steps = max(1, (size - 1).bit_length())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _allreduce(backend, t, torch.distributed.ReduceOp.SUM)
        best = min(best, time.perf_counter() - t0)
    # Agree on one number (the slowest rank's view) so that every rank builds the same model.
    worst = _allreduce(backend, torch.tensor([best], dtype=torch.float64), torch.distributed.ReduceOp.MAX).item()
    return worst / steps


def measure_model(backend, *, max_bytes: int = 16 << 20, target_seconds: float = 0.05) -> LinkModel:
    """Measures links, reduce throughput and latency of a hetcomm backend; identical on every rank."""
    rank, size = backend.rank(), backend.size()
    incoming = measure_links(backend, rank, size, max_bytes=max_bytes, target_seconds=target_seconds)
    row = torch.cat([incoming, torch.tensor([measure_reduce_bps()], dtype=torch.float64)])
    rows = _allgather_rows(backend, row, size)  # rows[dst] = [bw(src -> dst) for src] + [reduce_bps]
    bw = rows[:, :size].t().contiguous()       # bw[src][dst]
    for i in range(size):
        bw[i, i] = float("inf")
    alpha = measure_alpha(backend)
    return LinkModel(bw=tuple(tuple(float(v) for v in r) for r in bw.tolist()),
                     reduce_bps=tuple(float(v) for v in rows[:, size].tolist()),
                     alpha=alpha)


def model_from_declared(size: int, nic_mbit: Optional[Sequence[float]] = None,
                        link_mbit: Optional[Sequence[Sequence[float]]] = None) -> LinkModel:
    """A model from bandwidths the user knows: per-rank NIC rates or a full link matrix (Mbit/s)."""
    if (nic_mbit is None) == (link_mbit is None):
        raise ValueError("hetcomm: declare either per-rank NIC rates or a link matrix, not both/neither")
    if nic_mbit is not None:
        if len(nic_mbit) != size:
            raise ValueError(f"hetcomm: {len(nic_mbit)} NIC rates declared for {size} ranks")
        return LinkModel.from_nics([m * 1e6 / 8 for m in nic_mbit])
    if len(link_mbit) != size or any(len(r) != size for r in link_mbit):
        raise ValueError(f"hetcomm: the declared link matrix must be {size}x{size}")
    bw = tuple(tuple(float("inf") if i == j else link_mbit[i][j] * 1e6 / 8 for j in range(size))
               for i in range(size))
    return LinkModel(bw=bw, reduce_bps=tuple([float("inf")] * size))


def parse_mbit(text: str) -> tuple[Optional[list[float]], Optional[list[list[float]]]]:
    """``"800,800,100"`` -> NIC rates; ``"0,800;800,0"`` (or a file) -> a link matrix; Mbit/s.

    The same formats as the simulator's ``--nic-mbit`` / ``--link-mbit`` (one parser for both),
    except that every rate must be given: a declared model has no "unshaped" links.
    """
    from hetcomm.sim.spec import SimError, parse_matrix, parse_rate_list

    try:
        if ";" in text or os.path.isfile(text):
            matrix = parse_matrix(text, "HETCOMM_LINK_MBIT")
            missing = [(i, j) for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j and v is None]
            if missing:
                raise ValueError(f"hetcomm: HETCOMM_LINK_MBIT: links {missing} have no rate")
            return None, [[0.0 if v is None else v for v in row] for row in matrix]
        nics = parse_rate_list(text, "HETCOMM_LINK_MBIT")
        if any(v is None for v in nics):
            raise ValueError("hetcomm: HETCOMM_LINK_MBIT: every NIC needs a rate in Mbit/s")
        return nics, None
    except SimError as e:
        raise ValueError(f"hetcomm: {e}") from None
