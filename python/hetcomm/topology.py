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

import dataclasses
import logging
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch

from hetcomm import hosts, planner, site_planner, sites
from hetcomm.measure import measure_model, measure_site_uplinks, model_from_declared, parse_mbit

log = logging.getLogger("hetcomm")

# The model behind each live backend's plan, by the backend's listening address (unique in the
# process). Python attributes cannot live on the backend: torch hands out fresh wrappers of it.
_models: dict[str, planner.LinkModel] = {}
_topologies: dict[str, sites.Topology] = {}
_host_labels: dict[str, tuple[int, ...]] = {}
# Whether the group's hosts share memory (the same answer on every rank; `hosts.setup_shared_memory`).
_shared_memory: dict[str, bool] = {}


def model_of(backend) -> Optional[planner.LinkModel]:
    return _models.get(backend.listen_address())


def topology_of(backend) -> Optional[sites.Topology]:
    return _topologies.get(backend.listen_address())


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
    return _segment_for_rate(min(model.bw[plan.order[p]][plan.order[(p + 1) % P]] for p in range(P)))


def _segment_for_rate(slowest: float) -> int:
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
    return dataclasses.replace(model, bw=tuple(tuple(row) for row in snapped))


def _same_partition(a: Sequence[int], b: Sequence[int]) -> bool:
    return sites._renumber(a) == sites._renumber(b)


def with_host_plan(ring: planner.Plan, host_labels: Sequence[int],
                   model: Optional[planner.LinkModel] = None) -> planner.Plan:
    """``ring`` plus the host-level schedule (`site_planner.host_plan`) for every allreduce that
    takes the ring's path (those above HETCOMM_SMALL_ALLREDUCE_BYTES), when there is one."""
    hp = site_planner.host_plan(host_labels, model) if hierarchical_enabled() else None
    if hp is None:
        return ring
    if model is not None:
        hp = dataclasses.replace(hp, segment_bytes=_segment_for_rate(min(model.bw[a][b] for a, b in hp.link_loads())))
    return dataclasses.replace(ring, sites=hp)


def choose_plan(model: planner.LinkModel, min_gain: float = DECLARED_MIN_GAIN,
                site_labels: Optional[Sequence[int]] = None,
                host_labels: Optional[Sequence[int]] = None) -> planner.Plan:
    """The large-message ring plan, with min_bytes set to the crossover (uniform if weighting gains
    nothing), and with ``site_labels`` (one site per rank; several sites) the site-aware schedule
    from the message size on where its predicted time beats the ring's by ``min_gain``.

    ``host_labels`` (one host per rank, given when the hosts' ranks share memory): with several
    hosts and no sites other than the hosts themselves, the host-level schedule (`with_host_plan`).
    Sites made of several hosts keep the site schedule, whose steps inside a site run over TCP."""
    best = planner.make_plan(model, None, min_gain)
    if not best.is_uniform:
        crossover = planner.crossover_bytes(model, min_gain)
        best = planner.Plan(best.order, best.shares, best.predicted_bw_seconds_per_byte,
                            min_bytes=crossover if crossover is not None else 0,
                            segment_bytes=segment_bytes_for(best, model))
    if not hierarchical_enabled():
        return best
    if host_labels is not None and (site_labels is None or len(set(site_labels)) == 1
                                    or _same_partition(site_labels, host_labels)):
        hosted = with_host_plan(best, host_labels, model)
        if hosted.sites is not None:
            return hosted
    if site_labels is None:
        return best
    site = site_planner.best_site_plan(model, site_labels)
    if site is None:
        return best
    site = dataclasses.replace(site, segment_bytes=_segment_for_rate(min(model.bw[a][b] for a, b in site.link_loads())))
    # The site plan serves every size from min_bytes up, so min_bytes is the smallest power of two
    # from which it is predicted faster at every larger size (up to 1 TiB).
    uniform = planner.uniform_plan(model.world_size)
    start = max(1, model.small_allreduce_bytes + 1).bit_length()
    min_bytes = None
    for k in range(40, start - 1, -1):
        n = 1 << k
        ring = best if n >= best.min_bytes else uniform
        if not (site_planner.predict_site_plan_seconds(site, model, n)
                < planner.predict_allreduce_seconds(ring, model, n) * (1.0 - min_gain)):
            break
        min_bytes = n
    if min_bytes is None:
        return best
    return dataclasses.replace(best, sites=dataclasses.replace(site, min_bytes=min_bytes))


def hierarchical_enabled() -> bool:
    """False when HETCOMM_HIERARCHICAL=0: the ring at every size, whatever the sites."""
    return os.environ.get("HETCOMM_HIERARCHICAL", "1").strip() != "0"


def _broadcast_floats(backend, values: Optional[list[float]]) -> list[float]:
    """Rank 0's list of floats on every rank (its length first, then the values)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    n = torch.tensor([float(len(values)) if backend.rank() == 0 else 0.0], dtype=torch.float64)
    backend.broadcast([n], opts).wait()
    buf = torch.zeros(int(n.item()), dtype=torch.float64)
    if backend.rank() == 0:
        buf[:] = torch.tensor(values, dtype=torch.float64)
    backend.broadcast([buf], opts).wait()
    return buf.tolist()


def _encode_plan(plan: planner.Plan) -> list[float]:
    """[min_bytes, segment_bytes, order..., shares..., has_sites, (site plan)]; exact in float64."""
    out = [float(plan.min_bytes), float(plan.segment_bytes), *map(float, plan.order), *plan.shares]
    sp = plan.sites
    if sp is None:
        return out + [0.0]
    out += [1.0, float(len(sp.sites)), *(float(len(s)) for s in sp.sites), *(float(r) for s in sp.sites for r in s),
            float(len(sp.blocks)), *(float(r) for b in sp.blocks for r in b), *sp.block_shares, *sp.site_shares,
            float(sp.min_bytes), float(sp.segment_bytes), float(sp.local_inner)]
    return out


def _decode_plan(values: list[float], size: int, topology: Optional[sites.Topology]) -> planner.Plan:
    it = iter(values)

    def take(n: int) -> list[float]:
        return [next(it) for _ in range(n)]

    min_bytes, segment_bytes = (int(v) for v in take(2))
    order, shares = tuple(int(v) for v in take(size)), tuple(take(size))
    site = None
    if next(it):
        S = int(next(it))
        lengths = [int(v) for v in take(S)]
        members = iter(int(v) for v in take(sum(lengths)))
        groups = tuple(tuple(next(members) for _ in range(n)) for n in lengths)
        B = int(next(it))
        owners = [int(v) for v in take(B * S)]
        blocks = tuple(tuple(owners[b * S:(b + 1) * S]) for b in range(B))
        block_shares, site_shares = tuple(take(B)), tuple(take(S))
        site = site_planner.SitePlan(groups, blocks, block_shares, site_shares, min_bytes=int(next(it)),
                                     segment_bytes=int(next(it)), local_inner=bool(next(it)))
    return planner.Plan(order, shares, None, min_bytes=min_bytes, segment_bytes=segment_bytes, sites=site,
                        topology=topology)


def install_plan(backend, plan: planner.Plan) -> None:
    """Sets ``plan`` (the ring and, if any, the site plan) on this rank's backend."""
    backend.set_plan(list(plan.order), list(plan.shares), int(plan.min_bytes), int(plan.segment_bytes))
    sp = plan.sites
    if sp is not None:
        backend.set_site_plan([list(s) for s in sp.sites], [list(b) for b in sp.blocks], list(sp.block_shares),
                              list(sp.site_shares), int(sp.min_bytes), int(sp.segment_bytes), bool(sp.local_inner))


def group_topology(backend, model: planner.LinkModel) -> sites.Topology:
    """Sites (HETCOMM_SITES, else detected from the model's rates) and hosts (`hetcomm.hosts`).
    A collective: every rank of the group calls it.

    A group whose ranks are all on one host is a one-box setup whose links were declared
    (configure_group does not probe it): its declaration describes the cluster being modelled, so
    the address does not tie its ranks into one site."""
    labels = host_labels_of(backend)
    addresses = None if labels is None or len(set(labels)) == 1 else [str(h) for h in labels]
    return sites.topology_from(rates=model.bw, declared=os.environ.get("HETCOMM_SITES"), addresses=addresses)


def apply_model(backend, model: planner.LinkModel, min_gain: float = DECLARED_MIN_GAIN,
                measured: bool = False) -> planner.Plan:
    """Chooses (rank 0), agrees on and installs the plan for `model`; returns it."""
    topology = group_topology(backend, model)
    values = None
    if backend.rank() == 0:
        planning = snap_measured(model).with_rank_uplinks() if measured else model
        values = _encode_plan(choose_plan(planning, min_gain, topology.sites, shared_host_labels(backend)))
    plan = _decode_plan(_broadcast_floats(backend, values), backend.size(), topology)
    install_plan(backend, plan)
    _models[backend.listen_address()] = model
    _topologies[backend.listen_address()] = topology
    _log_plan(f"hetcomm topology: {topology.describe()}")
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
        # Sites seen in the pair rates get their cuts measured with all their flows at once.
        model = measure_site_uplinks(backend, model, group_topology(backend, model).sites)
        _measured.pop(ranks, None)
        _measured[ranks] = model
        source, min_gain = "measured", MEASURED_MIN_GAIN
    apply_model(backend, model, min_gain, measured=source == "measured")
    _log_plan(f"hetcomm probe: {source} model in {time.perf_counter() - start:.3f} s")
    return model


def host_labels_of(backend) -> Optional[tuple[int, ...]]:
    """The host of every rank of the backend's group (`hetcomm.hosts`), as found at its creation."""
    return _host_labels.get(backend.listen_address())


def shared_host_labels(backend) -> Optional[tuple[int, ...]]:
    """The group's host labels when its hosts' ranks share memory (the host level can run), else None."""
    key = backend.listen_address()
    return _host_labels.get(key) if _shared_memory.get(key) else None


def configure_group(backend, global_ranks: Optional[Sequence[int]] = None) -> None:
    """Called at group creation: the plan from declared or probed links, unless HETCOMM_PROBE=0.

    ``global_ranks``: the group's ranks in the job (torch passes them; default: the world).
    A group whose ranks are all on one host (`hetcomm.hosts`): no NIC lies between its ranks,
    and timing "links" there measures how the host schedules processes (4 ranks on 2 cores over
    loopback: identical paths measured 0.3-0.6 GB/s), so it keeps uniform shares unless links
    are declared. A group covered by an earlier group's measurement reuses it.
    """
    if backend.size() == 1:
        return
    ranks = tuple(global_ranks) if global_ranks else tuple(range(backend.size()))
    if len(ranks) != backend.size():
        raise ValueError(f"hetcomm: {len(ranks)} global ranks given for a group of {backend.size()}")
    labels, host_error = hosts.host_labels(backend, ranks)
    hosts.check_agreement(backend, hosts.settings(labels, host_error))
    if host_error:
        raise ValueError(host_error)  # every rank has the same error (checked just above)
    _host_labels[backend.listen_address()] = labels
    _shared_memory[backend.listen_address()] = hosts.setup_shared_memory(backend, labels)
    if os.environ.get("HETCOMM_LINK_MBIT"):
        probe_backend(backend, ranks)
        return
    if os.environ.get("HETCOMM_PROBE", "1").strip() == "0":
        # No rates, but the hosts are known: the host level with equal pieces (every rank computes
        # the same plan from the same labels; the engine checks that they agree).
        shared = shared_host_labels(backend)
        declared_sites = os.environ.get("HETCOMM_SITES", "").strip()
        if declared_sites and shared is not None:
            # Sites made of several hosts keep the ring here (no rates to plan a site schedule).
            try:
                site_labels = sites.topology_from(declared=declared_sites,
                                                  addresses=[str(h) for h in shared]).sites
            except ValueError:  # a declaration for the whole job, not this subgroup: no host level
                site_labels = None
            if site_labels is None or not _same_partition(site_labels, shared):
                shared = None
        if shared is not None:
            plan = with_host_plan(planner.uniform_plan(backend.size()), shared)
            if plan.sites is not None:
                install_plan(backend, plan)
                _log_plan(planner.format_plan(plan))
        return
    covering = _covering_model(ranks)
    if covering is not None:
        apply_model(backend, covering, MEASURED_MIN_GAIN, measured=True)
        _log_plan(f"hetcomm probe: global ranks {list(ranks)} were measured with an earlier group: no probe")
        return
    if len(set(labels)) == 1:
        _log_plan("hetcomm probe: every rank is on one host: uniform plan, no probe")
        return
    probe_backend(backend, ranks)
