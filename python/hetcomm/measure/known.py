"""Links this process measured before, by the hosts of the ranks (`hetcomm.hosts.host_identity`).

A measured model is also kept by global rank (`hetcomm.topology`), which serves subgroups of one
world; a new world (``init_process_group`` again: `hetcomm.ElasticDiLoCo` and
``DiLoCo(membership=Elastic(...))`` form one per generation of workers) numbers other processes
with the same ranks, so that memory is cleared. What a process measured between hosts does not
change with the ranks' numbers, though: a generation that keeps some workers and readmits one
restarted on its old host has the same links as the generation it measured. Probing them again
costs the group's creation a constant number of timed rounds (0.4-0.9 s on the simulated cluster
of docs/benchmarks.md), during which every member waits.

So a measured model is also remembered here, by the identities of its ranks' hosts (boot id,
network namespace and shared memory, or ``HETCOMM_HOST_ID``), and a new group whose hosts were all
in one earlier group takes that group's model, restricted to them, in place of a probe: rank 0
looks it up and broadcasts it (a joiner, a new process, remembers nothing), and every rank
installs it (its plan as for a group covered by an earlier one: from the model's levels, no
trial). A host that moved (a worker restarted elsewhere) has another identity: the group probes.
A measurement is reused for ``HETCOMM_PROBE_REUSE`` seconds (default 600, read on rank 0; 0:
never), so that links that changed are measured again. Ranks declared on hosts one by one
(``HETCOMM_HOST_ID=0,0,1,1``) are not remembered. Only this process's memory: nothing is read
from the store or a file.
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from typing import Callable, Optional, Sequence

from hetcomm import plan as planner

# Models by their ranks' host identities (in rank order), with when they were measured
# (time.monotonic), newest last; a handful is plenty.
_known: list[tuple[tuple[str, ...], planner.LinkModel, float]] = []
_KEEP = 8
DEFAULT_SECONDS = 600.0


def max_age() -> float:
    """``HETCOMM_PROBE_REUSE``: how many seconds a measurement is reused (0: never)."""
    text = os.environ.get("HETCOMM_PROBE_REUSE", "").strip()
    try:
        seconds = float(text) if text else DEFAULT_SECONDS
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"hetcomm: HETCOMM_PROBE_REUSE={text!r}: give the seconds a measurement of links is reused "
                         f"for by later groups on the same hosts (default {DEFAULT_SECONDS:.0f}; 0: never)")
    return seconds


def remember(identities: Sequence[str], model: planner.LinkModel) -> None:
    """Keeps ``model``, measured now for ranks on hosts ``identities`` (in rank order)."""
    key = tuple(identities)
    if len(key) != model.world_size or len(set(key)) < 2:
        return
    _known[:] = [e for e in _known if e[0] != key][-(_KEEP - 1):] + [(key, model, time.monotonic())]


def lookup(identities: Sequence[str], within: float = math.inf) -> Optional[planner.LinkModel]:
    """The newest remembered model, measured at most ``within`` seconds ago, whose hosts include
    every rank's here (a host's ranks at most as many as it had), restricted to these ranks in
    this order; None if none."""
    want = Counter(identities)
    if not want:
        return None
    for key, model, when in reversed(_known):
        if time.monotonic() - when > within:
            continue
        have = Counter(key)
        if any(have[h] < n for h, n in want.items()):
            continue
        free: dict[str, list[int]] = {}
        for index, h in enumerate(key):
            free.setdefault(h, []).append(index)
        return model.restricted([free[h].pop(0) for h in identities])
    return None


def forget() -> None:
    """Forgets every remembered model (tests)."""
    _known.clear()


def encode(model: Optional[planner.LinkModel]) -> list[float]:
    """[0] (none), else [P, bw (P x P), reduce rates (P), alpha, segment bytes, small-allreduce bytes,
    uplinks, then per uplink: its ranks' count, ranks, out rate, in rate]; exact in float64."""
    if model is None:
        return [0.0]
    P = model.world_size
    out = [float(P), *map(float, model.bw.reshape(-1)), *map(float, model.reduce_bps), model.alpha,
           float(model.segment_bytes), float(model.small_allreduce_bytes), float(len(model.uplinks))]
    for ranks, out_bps, in_bps in model.uplinks:
        out += [float(len(ranks)), *map(float, ranks), float(out_bps), float(in_bps)]
    return out


def decode(values: Sequence[float], size: int) -> Optional[planner.LinkModel]:
    """The model `encode` wrote for a group of ``size`` ranks (None for [0]); ValueError when the
    values are not one (a rank that sent garbage: every rank decodes the same values)."""
    values = list(values)
    if values == [0.0]:
        return None
    pos = 0

    def take(n: int) -> list[float]:
        nonlocal pos
        if n < 0 or pos + n > len(values):
            raise ValueError("hetcomm: rank 0's remembered link model is truncated")
        pos += n
        return values[pos - n:pos]

    def whole(x: float, what: str, most: int) -> int:
        if not (math.isfinite(x) and x == int(x) and 0 <= x <= most):
            raise ValueError(f"hetcomm: rank 0's remembered link model has {x!r} as its {what}")
        return int(x)

    P = whole(take(1)[0], "size", 1 << 20)
    if P != size:
        raise ValueError(f"hetcomm: rank 0's remembered link model is for {P} ranks, the group has {size}")
    import numpy as np
    bw = np.array(take(P * P), dtype=np.float64).reshape(P, P)
    reduce_bps = tuple(take(P))
    alpha, segment, small = take(3)
    count = whole(take(1)[0], "uplink count", 4 * P)
    uplinks = []
    for _ in range(count):
        n = whole(take(1)[0], "uplink size", P)
        ranks = tuple(whole(r, "uplink rank", P - 1) for r in take(n))
        out_bps, in_bps = take(2)
        uplinks.append((ranks, out_bps, in_bps))
    if pos != len(values):
        raise ValueError("hetcomm: rank 0's remembered link model has trailing values")
    return planner.LinkModel(bw=bw, reduce_bps=reduce_bps, alpha=alpha,
                             segment_bytes=whole(segment, "segment bytes", 1 << 40),
                             small_allreduce_bytes=whole(small, "small-allreduce bytes", 1 << 40),
                             uplinks=tuple(uplinks))


def agreed(backend, identities: Sequence[str], broadcast: Callable) -> Optional[planner.LinkModel]:
    """Rank 0's remembered model for the group's hosts, on every rank (None: probe). A
    collective (``broadcast(backend, values, failure, most)``: rank 0's list of floats to every
    rank, or its error to raise on every rank)."""
    mine, failure, P = None, None, backend.size()
    if backend.rank() == 0:
        try:
            seconds = max_age()
            mine = encode(lookup(identities, seconds) if seconds > 0 else None)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, not wait for values
            failure = e
    return decode(broadcast(backend, mine, failure, 5 * P * P + 13 * P + 5), P)
