"""What a simulated cluster should give: its physical link model, the physical bound of an
AllReduce, and the planner's prediction for the plan each backend's group actually used.

Only rank 0 calls this, after the measurements, with plain data: the ``SimSpec`` the ranks run in
(``HETCOMM_SIM_SPEC``) and the plan records the worker took right after each group's creation.
No torch; :mod:`hetcomm.planner` and :mod:`hetcomm.sim.spec` are imported when first needed.
The physical model is the shaped *wire* rate, so even a perfect run shows about 1.05
(``TCP_GOODPUT_FRACTION``); the bound is N over the narrowest cut of the ranks (of the hosts,
with ``--sim-hosts``).

The model, the bound (with hosts) and the predictions, derived:
docs/bench-cli.md#physical-model-bound-and-predictions.
"""
from __future__ import annotations

import itertools
import json
import math
from typing import Any, Optional, Sequence

SIM_ALPHA_S = 1e-4                 # seconds per message on the simulated links (veth, TCP)
UNSHAPED_BYTES_PER_S = 10e9        # stand-in rate of a link nothing shapes (planner needs finite)
MAX_CUT_RANKS = 16                 # every cut is tried up to this world size (2^(P-1) - 1 cuts)


def _finite_or_none(value: float) -> Optional[float]:
    return None if math.isinf(value) else value


def _fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:g} Mbit/s = {bytes_per_s / 1e6:.4g} MB/s"


Uplinks = Sequence[tuple[Sequence[int], float, float]]


def one_way_capacity(src: Sequence[int], dst: Sequence[int], nic_bps: Sequence[float],
                     eff_bw: Sequence[Sequence[float]], uplinks: Uplinks = ()
                     ) -> tuple[float, str, tuple[int, ...]]:
    """An upper bound on the bytes/s that ranks ``src`` can send to ranks ``dst`` altogether.

    Returns ``(capacity, what limits it, uplinks)``: ``what`` is ``"sender NICs"``,
    ``"receiver NICs"``, ``"links"``, ``"out-uplinks"`` or ``"in-uplinks"``, and ``uplinks`` the
    indices (into ``uplinks``) of the uplinks that make that limit (empty otherwise).

    ``uplinks``: ``(ranks, out_bps, in_bps)`` as ``LinkModel.uplinks``. A pair i -> j whose
    ranks are in different uplink groups (or one in none) crosses i's out-uplink and j's
    in-uplink, those it has. Such pairs together carry at most their links, at most the
    out-uplinks of the groups they leave plus what leaves ranks of no group, and at most the
    in-uplinks of the groups they enter plus what enters ranks of no group; the other pairs
    (within a group, or between ranks of no group) add their links.
    """
    group = {r: g for g, (ranks, _, _) in enumerate(uplinks) for r in ranks}
    free, shared, free_out, free_in = [], [], [], []
    leaving, entering = set(), set()
    for i in src:
        for j in dst:
            gi, gj = group.get(i), group.get(j)
            if gi == gj:
                free.append(eff_bw[i][j])
                continue
            shared.append(eff_bw[i][j])
            if gi is None:
                free_out.append(eff_bw[i][j])
            else:
                leaving.add(gi)
            if gj is None:
                free_in.append(eff_bw[i][j])
            else:
                entering.add(gj)
    out_cap = math.fsum(uplinks[g][1] for g in leaving) + math.fsum(free_out)
    in_cap = math.fsum(uplinks[g][2] for g in entering) + math.fsum(free_in)
    limits = [(math.fsum(nic_bps[i] for i in src), "sender NICs", ()),
              (math.fsum(nic_bps[j] for j in dst), "receiver NICs", ()),
              (math.fsum(free + shared), "links", ()),   # to the last bit the value without uplinks
              (math.fsum(free + [out_cap]), "out-uplinks", tuple(sorted(leaving))),
              (math.fsum(free + [in_cap]), "in-uplinks", tuple(sorted(entering)))]
    return min(limits, key=lambda limit: limit[0])  # the first of equals: NICs, then links


def cut_bound(nic_bps: Sequence[float], eff_bw: Sequence[Sequence[float]],
              sites: Optional[Sequence[Any]] = None,
              uplinks: Uplinks = ()) -> tuple[float, tuple[int, ...]]:
    """The narrowest cut: (capacity in bytes/s, the ranks on one side). ``inf`` if unshaped.

    ``nic_bps``: per-rank NIC rate (``inf`` = unshaped); ``eff_bw``: directed effective link
    rates (``inf`` = unshaped, diagonal ignored); ``uplinks``: shared uplinks, as
    ``LinkModel.uplinks``. Capacity of S -> T is :func:`one_way_capacity`: bounded by the sum of
    S's NICs, the sum of T's NICs and the sum of the links from S to T, of which the part
    between uplink groups is bounded by the uplinks it crosses; the cut's capacity is the smaller
    direction. Uplinks only add limits, so they never raise a capacity.
    """
    P = len(nic_bps)
    if P < 2:
        return math.inf, ()

    def capacity(side: tuple[int, ...]) -> float:
        rest = tuple(j for j in range(P) if j not in side)
        return min(one_way_capacity(side, rest, nic_bps, eff_bw, uplinks)[0],
                   one_way_capacity(rest, side, nic_bps, eff_bw, uplinks)[0])

    if P <= MAX_CUT_RANKS:
        # Sides containing rank 0 enumerate every cut once.
        sides = [(0,) + rest for k in range(0, P - 1)
                 for rest in itertools.combinations(range(1, P), k)]
    else:
        sides = [(i,) for i in range(P)]
        if sites is not None:
            for label in sorted(set(map(str, sites))):
                side = tuple(i for i in range(P) if str(sites[i]) == label)
                if 0 < len(side) < P:
                    sides.append(side)
    best_cap, best_side = math.inf, ()
    for side in sides:
        cap = capacity(side)
        if cap < best_cap:
            best_cap, best_side = cap, side
    return best_cap, best_side


def _cut_limit_text(limit: tuple[float, str, tuple[int, ...]], uplinks: Uplinks,
                    site_labels: Sequence[Any]) -> str:
    """What limits a cut, in words, to follow its name: ``: N over the 100 Mbit/s uplink of
    site 0 (out)``, `` (at most 400 Mbit/s = 50 MB/s each way over all its links)``."""
    capacity, what, used = limit
    if what in ("out-uplinks", "in-uplinks") and used:
        rates = [uplinks[g][1 if what == "out-uplinks" else 2] for g in used]
        direction = "out" if what == "out-uplinks" else "in"
        names = ",".join(str(site_labels[g]) for g in used)
        if len(used) == 1 and rates[0] == capacity:
            return f": N over the {rates[0] * 8 / 1e6:g} Mbit/s uplink of site {names} ({direction})"
        return (f": N over the uplinks of sites {names} ({direction}) and the links within sites, "
                f"{_fmt_rate(capacity)} together")
    how = {"sender NICs": "through its senders' NICs",
           "receiver NICs": "through its receivers' NICs"}.get(what, "over all its links")
    return f" (at most {_fmt_rate(capacity)} each way {how})"


def physical_model(spec) -> dict[str, Any]:
    """The ``sim`` section of the report: spec, physical bandwidths, the bound and how it is made.

    JSON-ready: unshaped rates are ``None``. The bound is that of the network's nodes
    (``spec.network_spec()``): the ranks, or with ``spec.hosts`` the hosts (see the module
    docstring, "Hosts"); ``bw_bytes_per_s`` and ``uplinks`` are per rank, for the planner.
    """
    from hetcomm.sim.spec import effective_bandwidth

    P = spec.world_size
    bw = effective_bandwidth(spec)
    net = spec.network_spec()
    node = "rank" if spec.hosts is None else "host"
    capacity, kind, text, aggregate, aggregate_text = _node_bound(net, node)
    if spec.hosts is not None and net.world_size > 1:
        rate, how = _hosts_as_nodes_rate(net)
        if rate < capacity * (1 - 1e-9):
            H = net.world_size
            capacity, kind = rate, "hosts"
            text = (f"hosts as nodes: 2(H-1) N = {2 * (H - 1)} N bytes leave the {H} hosts in all, "
                    f"through {how}: bound = N / {capacity / 1e6:.4g} MB/s")
        if aggregate_text is not None and aggregate >= capacity * (1 - 1e-9):
            aggregate_text = None    # the note's total-traffic bound is the one shown now
    return {
        "spec": json.loads(spec.to_json()),
        "description": spec.describe(),
        "world_size": P,
        "bw_bytes_per_s": [[None if i == j else _finite_or_none(v) for j, v in enumerate(row)]
                           for i, row in enumerate(bw)],
        "uplinks": _model_uplinks(spec),
        "unshaped_bytes_per_s": UNSHAPED_BYTES_PER_S,
        "alpha_s": SIM_ALPHA_S,
        "bound_kind": kind,
        "bound_bytes_per_s": _finite_or_none(capacity),
        "bound_text": text,
        "aggregate_bound_bytes_per_s": _finite_or_none(aggregate),
        "aggregate_bound_text": aggregate_text,
        "wire_rate_note": "rates are shaped wire rates; TCP payload gets about 95.6% of them",
    }


def _node_bound(spec, node: str = "rank") -> tuple[float, str, str, float, Optional[str]]:
    """``(rate, kind, text, aggregate rate, aggregate note)`` of a network whose nodes are the
    "ranks" of ``spec`` (ranks, or hosts: ``SimSpec.network_spec()``); rates in bytes/s."""
    from hetcomm.rates import mbit_to_bytes_per_s
    from hetcomm.sim.spec import effective_bandwidth, effective_uplinks

    P = spec.world_size
    if P < 2:
        what = "one rank" if node == "rank" else "every rank on one host (loopback, unshaped)"
        return math.inf, "nic", f"none: {what}", math.inf, None
    bw = effective_bandwidth(spec)
    nic_bps = [mbit_to_bytes_per_s(spec.nic(k)) for k in range(P)]
    uplinks = effective_uplinks(spec)
    site_labels = [label for label, _ in spec.site_groups()]
    if spec.per_link or uplinks:
        capacity, side = cut_bound(nic_bps, bw, spec.sites, uplinks)
        if math.isinf(capacity):
            text = "none: nothing is shaped"
        else:
            other = tuple(k for k in range(P) if k not in side)
            limit = min(one_way_capacity(side, other, nic_bps, bw, uplinks),
                        one_way_capacity(other, side, nic_bps, bw, uplinks), key=lambda v: v[0])
            hosts = "hosts " if node == "host" else ""
            text = (f"N bytes each way across the narrowest cut {hosts}{{{','.join(map(str, side))}}}|"
                    f"{{{','.join(map(str, other))}}}"
                    f"{_cut_limit_text(limit, uplinks, site_labels)}: "
                    f"bound = N / {capacity / 1e6:.4g} MB/s")
        kind = "cut"
        if spec.sites is not None and len(set(spec.sites)) > 2:
            sites_rate = _sites_as_nodes_rate(spec, bw, uplinks)
            if sites_rate < capacity * (1 - 1e-9):
                capacity, kind = sites_rate, "sites"
                S = len(set(spec.sites))
                text = (f"sites as nodes: 2(S-1) N = {2 * (S - 1)} N bytes leave the {S} sites in all, through "
                        f"the sum of their cuts: bound = N / {capacity / 1e6:.4g} MB/s")
    else:
        capacity = min(nic_bps) if nic_bps else math.inf
        if math.isinf(capacity):
            text = "none: nothing is shaped"
        else:
            slow = [k for k, v in enumerate(nic_bps) if v == capacity]
            who = (f"every {node}" if len(slow) == P else
                   f"{node}{'s' if len(slow) > 1 else ''} {','.join(map(str, slow))}")
            text = (f"N bytes through the slowest NIC ({who}, {_fmt_rate(capacity)}): "
                    f"bound = N / {capacity / 1e6:.4g} MB/s")
        kind = "nic"
    # Every element needs P-1 combining transfers and P-1 to spread the result: 2(P-1) N bytes
    # leave (and enter) NICs in all; a classic bound, tighter than the slowest NIC when NICs are
    # alike. Shown as a note for ranks; the table's bound stays the one above.
    total_nic = math.fsum(nic_bps)
    aggregate = total_nic / (2 * (P - 1)) if math.isfinite(total_nic) else math.inf
    aggregate_text = None
    if aggregate < capacity * (1 - 1e-9):
        aggregate_text = (f"the total-traffic bound 2(P-1) N / sum of NICs = N / "
                          f"{aggregate / 1e6:.4g} MB/s is tighter here: a perfect run shows "
                          f"meas/bound {capacity / aggregate:.2f}")
    return capacity, kind, text, aggregate, aggregate_text


def _hosts_as_nodes_rate(net) -> tuple[float, str]:
    """Bytes of N per second that the hosts' bound allows, and through what, in words.

    ``net`` is ``SimSpec.network_spec()`` (a node per host). Host h sends at most
    ``out_h = one_way_capacity({h}, others)`` (its NIC, unless the others' NICs or its site's
    uplink are narrower) and receives at most ``in_h``; with those,
    :func:`hetcomm.sim.spec.hosts_allreduce_bound_seconds` (2(H-1) N bytes leave hosts and as
    many enter hosts in all; N leave and enter each host)."""
    from hetcomm.rates import mbit_to_bytes_per_s
    from hetcomm.sim.spec import effective_bandwidth, effective_uplinks, hosts_allreduce_bound_seconds

    H = net.world_size
    bw = effective_bandwidth(net)
    nic_bps = [mbit_to_bytes_per_s(net.nic(h)) for h in range(H)]
    uplinks = effective_uplinks(net)
    out_bps, in_bps = [], []
    for h in range(H):
        rest = tuple(g for g in range(H) if g != h)
        out_bps.append(one_way_capacity((h,), rest, nic_bps, bw, uplinks)[0])
        in_bps.append(one_way_capacity(rest, (h,), nic_bps, bw, uplinks)[0])
    seconds = hosts_allreduce_bound_seconds(out_bps, 1.0, in_bps)
    how = ("the sum of their NICs" if out_bps == nic_bps == in_bps else
           "what each host can send to (receive from) the others, summed")
    return (1.0 / seconds if seconds > 0 else math.inf), how


def _model_uplinks(spec) -> list[dict[str, Any]]:
    """The shared links of the planner's model (``LinkModel.uplinks``), JSON-ready.

    Sites' WAN uplinks (``wan_mbit``): ``{"site", "ranks", "out_bytes_per_s", "in_bytes_per_s"}``.
    Hosts (``spec.hosts``): each shaped host NIC as an uplink of the host's ranks, ``{"host",
    ...}``. The planner's groups must be disjoint, so with hosts *and* WAN uplinks a site of one
    host gets one uplink at the narrower of the two rates, and otherwise the site uplinks win and
    the host NICs stay only as the per-pair rates of ``bw_bytes_per_s`` (the bound keeps both).
    """
    from hetcomm.sim.spec import effective_host_nics, effective_uplinks

    sites = [{"site": label, "ranks": list(ranks), "out_bytes_per_s": out_bps, "in_bytes_per_s": in_bps}
             for (label, _), (ranks, out_bps, in_bps) in zip(spec.site_groups(), effective_uplinks(spec))]
    hosts = [{"host": h, "ranks": list(ranks), "out_bytes_per_s": out_bps, "in_bytes_per_s": in_bps}
             for h, (ranks, out_bps, in_bps) in enumerate(effective_host_nics(spec))
             if math.isfinite(out_bps)]
    if not sites:
        return hosts
    by_ranks = {tuple(u["ranks"]): u for u in hosts}
    for u in sites:
        nic = by_ranks.get(tuple(u["ranks"]))
        if nic is not None:   # a site of one host: its NIC and the WAN uplink, the narrower
            u["out_bytes_per_s"] = min(u["out_bytes_per_s"], nic["out_bytes_per_s"])
            u["in_bytes_per_s"] = min(u["in_bytes_per_s"], nic["in_bytes_per_s"])
    return sites


def _sites_as_nodes_rate(spec, bw, uplinks) -> float:
    """Bytes of N per second that the classic bound with S >= 3 sites as nodes allows
    (`hetcomm.plan.cut_bound_seconds`): every site's cut, NICs ignored (the cut bound
    above keeps them)."""
    from hetcomm.planner import LinkModel
    from hetcomm.plan import cut_bound_seconds

    P = spec.world_size
    # (The cut bound does not depend on the engine's settings: 0 keeps the engine unasked.)
    model = LinkModel(bw=[[0.0 if i == j else (bw[i][j] if math.isfinite(bw[i][j]) else UNSHAPED_BYTES_PER_S)
                           for j in range(P)] for i in range(P)], uplinks=tuple(uplinks),
                      segment_bytes=0, small_allreduce_bytes=0)
    return 1.0 / cut_bound_seconds(model, 1, [spec.sites[r] for r in range(P)])


def bound_seconds(sim: dict[str, Any], nbytes: int) -> Optional[float]:
    rate = sim.get("bound_bytes_per_s")
    return None if not rate else nbytes / rate


def _planner_model(sim: dict[str, Any], segment_bytes: int = 0, small_allreduce_bytes: int = 0):
    from hetcomm.planner import LinkModel

    P = sim["world_size"]
    stand_in = sim.get("unshaped_bytes_per_s", UNSHAPED_BYTES_PER_S)
    rows = sim["bw_bytes_per_s"]
    bw = [[0.0 if i == j else (rows[i][j] if rows[i][j] is not None else stand_in)
           for j in range(P)] for i in range(P)]
    uplinks = tuple((tuple(u["ranks"]), u["out_bytes_per_s"], u["in_bytes_per_s"])
                    for u in sim.get("uplinks") or ())
    return LinkModel(bw=bw, alpha=sim.get("alpha_s", SIM_ALPHA_S), segment_bytes=segment_bytes,
                     small_allreduce_bytes=small_allreduce_bytes,
                     **({"uplinks": uplinks} if uplinks else {}))


def effective_plan(record: dict[str, Any], nbytes: int, world_size: int):
    """The (planner) Plan the engine runs for an allreduce of ``nbytes``, its segment cap with it
    (``segment_bytes`` of the plan, or of its site plan)."""
    from hetcomm.planner import Plan, uniform_plan

    if record.get("kind") != "hetcomm":
        return uniform_plan(world_size)
    sites = record.get("sites")
    if sites and nbytes >= int(sites.get("min_bytes") or 0):
        from hetcomm.plan import SitePlan
        return Plan(tuple(record["order"]), tuple(record["shares"]), sites=SitePlan(**sites))
    if nbytes < int(record.get("min_bytes") or 0):
        return uniform_plan(world_size)
    return Plan(tuple(record["order"]), tuple(record["shares"]), segment_bytes=int(record.get("segment_bytes") or 0))


def predict_seconds(sim: dict[str, Any], record: dict[str, Any], nbytes: int) -> Optional[float]:
    """The planner's prediction for ``nbytes`` under the plan of ``record`` on the physical model."""
    P = sim["world_size"]
    plan = effective_plan(record, nbytes, P)
    if record.get("kind") == "hetcomm":
        small = record.get("small_allreduce_bytes")
        if small is None:  # a record from before records kept it: the engine's default
            from hetcomm.plan.model import engine_setting
            small = engine_setting("default_small_allreduce_bytes")
        # HETCOMM_SEGMENT_BYTES of the rank, if it had one, is forced; else the plan's caps.
        model = _planner_model(sim, int(record.get("env_segment_bytes") or 0), int(small))
    else:
        model = _planner_model(sim, 0, 0)   # gloo: a ring at every size, adaptive segments
    from hetcomm.planner import predict_allreduce_seconds
    return predict_allreduce_seconds(plan, model, int(nbytes))


def uniform_record(backend: str, world_size: int, note: str) -> dict[str, Any]:
    """The plan record of a backend that does not plan (gloo): a uniform ring, modelled."""
    ring = ">".join(str(r) for r in range(world_size))
    return {"backend": backend, "kind": "gloo", "source": note,
            "order": list(range(world_size)), "shares": [1.0 / world_size] * world_size,
            "min_bytes": 0, "segment_bytes": 0, "model": None,
            "text": f"uniform ring {ring} | shares {100.0 / world_size:.1f}% each"}


def plan_line(sim: Optional[dict[str, Any]], record: dict[str, Any]) -> str:
    """``format_plan`` of a record, evaluated on the physical model when there is one."""
    from hetcomm.planner import Plan, format_plan

    from hetcomm.plan import SitePlan

    sites = record.get("sites")
    plan = Plan(tuple(record["order"]), tuple(record["shares"]),
                min_bytes=int(record.get("min_bytes") or 0), segment_bytes=int(record.get("segment_bytes") or 0),
                sites=SitePlan(**sites) if sites else None)
    model = _planner_model(sim) if sim is not None else None
    line = format_plan(plan, model)
    if record.get("kind") != "hetcomm":
        line = line.replace("hetcomm plan: ", "", 1)
    if model is not None:
        line = line.replace("| predicted", "| on the physical model:", 1)
    return line


def annotate(report) -> None:
    """Fills ``report.predicted_s`` and ``report.bound_s`` from ``report.sim`` and ``report.plans``."""
    sim = report.sim
    if sim is None:
        return
    for result in report.results:
        report.bound_s[result.size_bytes] = bound_seconds(sim, result.size_bytes)
        record = report.plans.get(result.backend)
        if record is not None:
            report.predicted_s.setdefault(result.backend, {})[result.size_bytes] = \
                predict_seconds(sim, record, result.size_bytes)
    for name, record in report.plans.items():
        record["text_physical"] = plan_line(sim, record)
