"""The probe behind group creation and `hetcomm.probe()`: runs the rounds of
`hetcomm.measure.schedule` and builds the planner's model. Collectives: every rank of the group
calls them, and every rank ends with the same model (every measured number is agreed)."""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional, Sequence

import numpy as np

from hetcomm.measure import schedule
from hetcomm.measure.local import gather_reduce_and_latency
from hetcomm.measure.rounds import SendBuffer, _transfer, run_round
from hetcomm.labels import renumber
from hetcomm.plan.levels import detect_sites
from hetcomm.plan.model import LinkModel


@dataclasses.dataclass
class ProbeResult:
    """The model, the sites it found (a label per rank), what it took, ``spread``: the median over
    every unit measured of its fastest timed repeat over its slowest (>= 1: how far apart two
    readings of one link landed while probed; only logged, for whoever reads a plan), and
    ``equal_model``: the same levels with every class of link at one rate (the counterpart of
    `hetcomm.measure.trial`)."""

    model: LinkModel
    sites: tuple[int, ...]
    rounds: list[str]
    spread: float
    equal_model: LinkModel   # every class of link at its class's median (`schedule.model_from_rates`)


def _median_spread(spreads: Sequence[float]) -> float:
    return float(statistics.median(spreads)) if spreads else 1.0


def _predicted(rates: dict, rnd: schedule.Round) -> dict:
    """A rate for the round's NIC units between hosts measured before (each sent and received in
    some earlier round): min of the sender's fastest out-unit and the receiver's fastest in-unit."""
    out: dict[int, float] = {}
    into: dict[int, float] = {}
    for label, rate in rates.items():
        if label[0] == "nic":
            out[label[1]] = max(out.get(label[1], 0.0), rate)
            into[label[2]] = max(into.get(label[2], 0.0), rate)
    return {u.label: min(out[u.label[1]], into[u.label[2]]) for u in rnd.units
            if u.label[0] == "nic" and u.label[1] in out and u.label[2] in into}


def _run(backend, rounds: Sequence[schedule.Round], rates: dict, per_flow: dict, log: list[str],
         send_buf: SendBuffer, spreads: list[float], **sizes) -> None:
    for rnd in rounds:
        start = time.perf_counter()
        try:
            r, f, spread = run_round(backend, rnd, send_buf=send_buf, predicted=_predicted(rates, rnd), **sizes)
        except Exception as e:
            raise RuntimeError(f"hetcomm probe: the {rnd.what} round ({len(rnd.flows)} flows) failed on rank "
                               f"{backend.rank()}: {e}") from e
        rates.update(r)
        per_flow.update(f)
        spreads.extend(spread.values())
        log.append(f"{rnd.what} ({len(rnd.units)} units, {len(rnd.flows)} flows, {time.perf_counter() - start:.2f} s, "
                   f"repeats within {max(spread.values(), default=1.0):.2f}x)")


def _connect(backend, rounds: Sequence[schedule.Round], send_buf: SendBuffer, log: list[str]) -> None:
    if rounds:
        start = time.perf_counter()
        rnd = schedule.connect_round(rounds)
        _transfer(backend, rnd, [1] * len(rnd.flows), send_buf)
        log.append(f"connect ({len(rnd.flows)} pairs, {time.perf_counter() - start:.2f} s)")


def measure_levels(backend, host_labels: Sequence[int], declared_sites: Optional[Sequence[int]] = None,
                   shared_memory: bool = False, *, target_seconds: float = 0.05,
                   max_bytes: int = 16 << 20) -> ProbeResult:
    """The level probe (`hetcomm.measure.schedule`): loopback and NIC rounds, the sites (declared,
    else detected from the host pairs), then the cross-site and uplink rounds. ``shared_memory``:
    the ranks of each host share memory (no loopback round)."""
    hosts = renumber(host_labels)
    H = max(hosts) + 1
    send_buf = SendBuffer()
    sizes = dict(target_seconds=target_seconds, max_bytes=max_bytes)
    rates: dict[tuple, float] = {}
    per_flow: dict[tuple, float] = {}
    log: list[str] = []
    spreads: list[float] = []
    first = schedule.first_rounds(hosts, declared_sites, shared_memory and H > 1)
    _connect(backend, first, send_buf, log)
    _run(backend, first, rates, per_flow, log, send_buf, spreads, **sizes)
    confirm = schedule.confirm_round(hosts, declared_sites, rates)
    if confirm is not None:
        _connect(backend, [confirm], send_buf, log)
        _run(backend, [confirm], rates, per_flow, log, send_buf, spreads, **sizes)
    if declared_sites is not None:
        sites, measured_pairs = renumber(declared_sites), None
    else:
        host_sites = detect_sites(schedule.host_pair_rates(H, rates)) if H > 1 else (0,)
        sites = tuple(host_sites[h] for h in hosts)
        measured_pairs = [label[1:] for label in rates if label[0] == "nic"]
    if len(set(sites)) > 1:
        later = schedule.site_rounds(hosts, sites, measured_pairs)
        _connect(backend, later, send_buf, log)
        _run(backend, later, rates, per_flow, log, send_buf, spreads, **sizes)
    start = time.perf_counter()
    reduce_bps, alpha = gather_reduce_and_latency(backend, send_buf.fastest_allreduce)
    model = schedule.model_from_rates(hosts, sites, rates, per_flow, reduce_bps, alpha)
    equal = schedule.model_from_rates(hosts, sites, rates, per_flow, reduce_bps, alpha, equal=True)
    log.append(f"reduce and latency ({time.perf_counter() - start:.2f} s)")
    return ProbeResult(model, tuple(sites), log, _median_spread(spreads), equal)


def measure_pairs(backend, declared_sites: Optional[Sequence[int]] = None, host_labels: Optional[Sequence[int]] = None,
                  *, target_seconds: float = 0.05, max_bytes: int = 16 << 20) -> ProbeResult:
    """The all-pairs probe (``HETCOMM_PROBE=pairs``): every ordered pair of ranks in P - 1 rounds,
    then, where the rates show sites (or they are declared), each site's cut with the flow
    pattern of the site schedule (`schedule.uplink_rounds`), as shared links of the model.
    ``host_labels``: ranks of one host are one site whatever their rates."""
    P = backend.size()
    send_buf = SendBuffer()
    sizes = dict(target_seconds=target_seconds, max_bytes=max_bytes)
    rates: dict[tuple, float] = {}
    per_flow: dict[tuple, float] = {}
    log: list[str] = []
    spreads: list[float] = []
    pairs = schedule.pair_rounds(P)
    _connect(backend, pairs, send_buf, log)
    _run(backend, pairs, rates, per_flow, log, send_buf, spreads, **sizes)
    bw = np.zeros((P, P))
    for (_, i, j), rate in rates.items():
        bw[i, j] = rate
    sites = (renumber(declared_sites) if declared_sites is not None
             else detect_sites(bw, hosts=host_labels) if P > 1 else (0,))
    reduce_bps, alpha = gather_reduce_and_latency(backend, send_buf.fastest_allreduce)
    model = LinkModel(bw=bw + np.eye(P), reduce_bps=reduce_bps, alpha=alpha)
    S = len(set(sites))
    if S > 1:
        up: dict[tuple, float] = {}
        _run(backend, schedule.uplink_rounds(sites), up, {}, log, send_buf, spreads, **sizes)
        members = [tuple(r for r in range(P) if sites[r] == s) for s in range(S)]
        out = [up.get(("uplink", s, "out"), np.inf) for s in range(S)]
        into = [up.get(("uplink", s, "in"), np.inf) for s in range(S)] if S > 2 else [out[1], out[0]]
        model = dataclasses.replace(model, uplinks=tuple(zip(members, out, into)))
    return ProbeResult(model, tuple(sites), log, _median_spread(spreads),
                       _equal_pairs(model, host_labels if host_labels is not None else range(P), sites))


def _equal_pairs(model: LinkModel, hosts: Sequence[int], sites: Sequence[int]) -> LinkModel:
    """The all-pairs model's counterpart with equal links: each class of pair (same host; same
    site, other host; other site) at its class's median, the shared links at theirs, the reduce
    rates at theirs."""
    P = model.world_size
    if P < 2:
        return model
    h, s = np.asarray(renumber(hosts)), np.asarray(renumber(sites))
    same_host = h[:, None] == h[None, :]
    same_site = s[:, None] == s[None, :]
    off = ~np.eye(P, dtype=bool)
    bw = np.array(model.bw)
    for cls in (same_host & off, same_site & ~same_host, ~same_site):
        if cls.any():
            bw[cls] = float(np.median(bw[cls]))
    rates = [v for _, o, i in model.uplinks for v in (o, i) if np.isfinite(v)]
    up = float(np.median(rates)) if rates else np.inf
    uplinks = tuple((g, up if np.isfinite(o) else o, up if np.isfinite(i) else i) for g, o, i in model.uplinks)
    reduce = np.asarray(model.reduce_bps, dtype=np.float64)
    finite = np.isfinite(reduce)
    if finite.any():
        reduce[finite] = float(np.median(reduce[finite]))
    return dataclasses.replace(model, bw=bw, uplinks=uplinks, reduce_bps=tuple(float(v) for v in reduce))


def measure_model(backend) -> LinkModel:
    """Every pair's rate, the reduce throughputs and the latency (`measure_pairs`' model): the
    name the all-pairs probe had before the level probe."""
    return measure_pairs(backend).model
