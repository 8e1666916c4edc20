"""What hetcomm knows about a group's links, and the ring plan it derives from that.

At group creation (`configure_group`, called by the backend creator), every rank:

1. gets a `LinkModel`: declared bandwidths (``HETCOMM_LINK_MBIT``: per-rank NIC rates
   ``"800,800,800,100"`` or a matrix ``"0,800;800,0"``), else measured (`hetcomm.measure`), unless
   ``HETCOMM_PROBE=0`` (then the engine keeps its uniform plan);
2. rank 0 chooses the plan (`planner.make_plan` for large messages, and the crossover size below
   which allreduces stay uniform) and broadcasts it, so all ranks hold the same plan even if their
   numerics differed; every rank installs it.

Users can re-run this (`hetcomm.probe(group)`), read the plan (`get_plan`), or set their own
(`set_plan`): every rank must then set the same plan at the same point of its program.

Subgroups (``new_group``, DeviceMesh): links are a property of pairs of *global* ranks. Declared
rates (``HETCOMM_LINK_MBIT``) describe the whole job, indexed by global rank, and a subgroup takes
its rows and columns. A measured model is kept, by the group's global ranks, and a later group
whose ranks it covers takes its model from there instead of probing again (0.4-0.5 s a group).
Whether a group probes is decided the same way on all its ranks: every rank measured the same
model for the same earlier groups.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch

from hetcomm import planner
from hetcomm.measure import measure_model, model_from_declared, parse_mbit

log = logging.getLogger("hetcomm")

# The model behind each live backend's plan, by the backend's listening address (unique in the
# process). Python attributes cannot live on the backend: torch hands out fresh wrappers of it.
_models: dict[str, planner.LinkModel] = {}


def model_of(backend) -> Optional[planner.LinkModel]:
    return _models.get(backend.listen_address())


def _log_plan(line: str) -> None:
    log.debug(line)
    if int(os.environ.get("HETCOMM_LOG_LEVEL", "1") or 1) >= 2:
        print(f"[hetcomm INFO] {line}", file=sys.stderr, flush=True)


def declared_model(ranks: Sequence[int]) -> Optional[planner.LinkModel]:
    """The declared model (HETCOMM_LINK_MBIT, indexed by global rank) of the group of ``ranks``."""
    text = os.environ.get("HETCOMM_LINK_MBIT", "").strip()
    if not text:
        return None
    nic, matrix = parse_mbit(text)
    declared = len(nic) if nic is not None else len(matrix)
    if max(ranks) >= declared:
        raise ValueError(f"hetcomm: HETCOMM_LINK_MBIT declares {declared} ranks, but this group has global rank "
                         f"{max(ranks)}: declare the rates of every rank of the job, by global rank")
    return model_from_declared(declared, nic_mbit=nic, link_mbit=matrix).restricted(ranks)


# Measured models by the global ranks of their group, newest last (see the module docstring).
_measured: dict[tuple[int, ...], planner.LinkModel] = {}


def _covering_model(ranks: Sequence[int]) -> Optional[planner.LinkModel]:
    """A model measured for a group containing all of ``ranks`` (the smallest such, then the
    newest), restricted to them; None if no group measured so far covers them."""
    best = None
    for key, model in _measured.items():
        if set(ranks) <= set(key) and (best is None or len(key) <= len(best[0])):
            best = (key, model)
    if best is None:
        return None
    key, model = best
    return model.restricted([key.index(r) for r in ranks])


# A measured model must predict a larger gain than a declared one before hetcomm leaves uniform
# shares: timing links between processes that share cores varies by ~10-20% (seen on 4 ranks on
# 2 cores over loopback, where identical links measured 0.3-0.6 GB/s), and a plan fitted to noise
# costs more than it saves (a two-site plan fitted to one mismeasured link ran 0.77x uniform).
MEASURED_MIN_GAIN = 0.20
DECLARED_MIN_GAIN = planner.DEFAULT_MIN_GAIN


# A segment should cross the slowest ring link in about this long: a segment in flight on a slow
# link is pipeline fill and drain that nothing overlaps (1 MB on a 100 Mbit/s link is 80 ms; 64 KB
# measured 5-8% faster end to end on the simulated 800/800/800/100 cluster).
SEGMENT_SECONDS_ON_SLOWEST_LINK = 0.005


def segment_bytes_for(plan: planner.Plan, model: planner.LinkModel) -> int:
    """The power of two in [32 KB, 1 MB] nearest (on a log scale) to SEGMENT_SECONDS_ON_SLOWEST_LINK
    worth of the slowest ring link.

    Nearest rather than the next one down: a 100 Mbit/s link measures ~11.7 MB/s, 58 KB in 5 ms,
    and rounding down gave 32 KB, twice the wake-ups per byte of the 64 KB that measured best.
    """
    P = len(plan.order)
    slowest = min(model.bw[plan.order[p]][plan.order[(p + 1) % P]] for p in range(P))
    target = slowest * SEGMENT_SECONDS_ON_SLOWEST_LINK
    seg = 32 << 10
    while seg < (1 << 20) and seg * math.sqrt(2) < target:
        seg *= 2
    return seg


# Measured link rates within this factor of each other are taken as one rate (their group's
# median) before planning: the probe's error is of that order, and a plan fitted to it hands
# small shares around for nothing (800/800/800/100 measured as 101-138/11.4-12 MB/s gave rank 1
# 5% and ran at 1.12x the bound; the same links declared gave 0/0/0/100% and 1.065x).
MEASURED_RATE_TOLERANCE = 1.25


def snap_measured(model: planner.LinkModel, tolerance: float = MEASURED_RATE_TOLERANCE) -> planner.LinkModel:
    """`model` with its link rates grouped: sorted descending, a rate joins the current group while
    it is within `tolerance` of the group's fastest, and every rate becomes its group's median."""
    P = model.world_size
    links = sorted(((model.bw[i][j], i, j) for i in range(P) for j in range(P) if i != j), reverse=True)
    snapped = [list(row) for row in model.bw]
    group: list[tuple[float, int, int]] = []
    for entry in links + [(0.0, -1, -1)]:
        if group and not (entry[0] > 0 and entry[0] * tolerance >= group[0][0]):
            median = group[len(group) // 2][0]
            for _, i, j in group:
                snapped[i][j] = median
            group = []
        group.append(entry)
    return planner.LinkModel(bw=tuple(tuple(row) for row in snapped), reduce_bps=model.reduce_bps, alpha=model.alpha,
                             segment_bytes=model.segment_bytes, small_allreduce_bytes=model.small_allreduce_bytes)


def choose_plan(model: planner.LinkModel, min_gain: float = DECLARED_MIN_GAIN) -> planner.Plan:
    """The large-message plan, with min_bytes set to the crossover (uniform if weighting gains nothing)."""
    best = planner.make_plan(model, None, min_gain)
    if best.is_uniform:
        return best
    crossover = planner.crossover_bytes(model, min_gain)
    return planner.Plan(best.order, best.shares, best.predicted_bw_seconds_per_byte,
                        min_bytes=crossover if crossover is not None else 0,
                        segment_bytes=segment_bytes_for(best, model))


def _broadcast_plan(backend, plan: Optional[planner.Plan], size: int) -> planner.Plan:
    """Rank 0's plan, on every rank: [min_bytes, segment_bytes, order..., shares...] as float64."""
    buf = torch.zeros(2 + 2 * size, dtype=torch.float64)
    if backend.rank() == 0:
        buf[0] = float(plan.min_bytes)
        buf[1] = float(plan.segment_bytes)
        buf[2:2 + size] = torch.tensor(plan.order, dtype=torch.float64)
        buf[2 + size:] = torch.tensor(plan.shares, dtype=torch.float64)
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    backend.broadcast([buf], opts).wait()
    values = buf.tolist()
    return planner.Plan(tuple(int(v) for v in values[2:2 + size]), tuple(values[2 + size:]),
                        plan.predicted_bw_seconds_per_byte if plan is not None else None,
                        min_bytes=int(values[0]), segment_bytes=int(values[1]))


def apply_model(backend, model: planner.LinkModel, min_gain: float = DECLARED_MIN_GAIN,
                measured: bool = False) -> planner.Plan:
    """Chooses (rank 0), agrees on and installs the plan for `model`; returns it."""
    size = backend.size()
    plan = None
    if backend.rank() == 0:
        plan = choose_plan(snap_measured(model) if measured else model, min_gain)
    plan = _broadcast_plan(backend, plan, size)
    backend.set_plan(list(plan.order), list(plan.shares), plan.min_bytes, plan.segment_bytes)
    _models[backend.listen_address()] = model
    _log_plan(planner.format_plan(plan, model))
    return plan


def probe_backend(backend, ranks: Optional[Sequence[int]] = None) -> planner.LinkModel:
    """Measures (or reads the declared) model of a backend's group and installs its plan.

    ``ranks``: the group's global ranks (default: the group is the world).
    """
    ranks = tuple(ranks) if ranks is not None else tuple(range(backend.size()))
    start = time.perf_counter()
    model = declared_model(ranks)
    source, min_gain = "declared (HETCOMM_LINK_MBIT)", DECLARED_MIN_GAIN
    if model is None:
        model = measure_model(backend)
        _measured.pop(ranks, None)
        _measured[ranks] = model
        source, min_gain = "measured", MEASURED_MIN_GAIN
    apply_model(backend, model, min_gain, measured=source == "measured")
    _log_plan(f"hetcomm probe: {source} model in {time.perf_counter() - start:.3f} s")
    return model


def _hosts(backend) -> list[str]:
    """Every rank's listening host (IP), all-gathered through the backend."""
    host = backend.listen_address().rsplit(":", 1)[0].encode()[:63]
    row = torch.zeros(64, dtype=torch.uint8)
    row[:len(host)] = torch.tensor(list(host), dtype=torch.uint8)
    out = [torch.empty_like(row) for _ in range(backend.size())]
    backend.allgather([out], [row]).wait()
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in out]


def configure_group(backend, global_ranks: Optional[Sequence[int]] = None) -> None:
    """Called at group creation: the plan from declared or probed links, unless HETCOMM_PROBE=0.

    ``global_ranks``: the group's ranks in the job (torch passes them; default: the world).
    A group whose ranks all listen on one address is on one host: no NIC lies between its ranks,
    and timing "links" there measures how the host schedules processes (4 ranks on 2 cores over
    loopback: identical paths measured 0.3-0.6 GB/s), so it keeps uniform shares unless links
    are declared. A group covered by an earlier group's measurement reuses it.
    """
    if backend.size() == 1:
        return
    ranks = tuple(global_ranks) if global_ranks else tuple(range(backend.size()))
    if len(ranks) != backend.size():
        raise ValueError(f"hetcomm: {len(ranks)} global ranks given for a group of {backend.size()}")
    if os.environ.get("HETCOMM_LINK_MBIT"):
        probe_backend(backend, ranks)
        return
    if os.environ.get("HETCOMM_PROBE", "1").strip() == "0":
        return
    covering = _covering_model(ranks)
    if covering is not None:
        apply_model(backend, covering, MEASURED_MIN_GAIN, measured=True)
        _log_plan(f"hetcomm probe: global ranks {list(ranks)} were measured with an earlier group: no probe")
        return
    if len(set(_hosts(backend))) == 1:
        _log_plan("hetcomm probe: every rank is on one host (one listening address): uniform plan, no probe")
        return
    probe_backend(backend, ranks)
