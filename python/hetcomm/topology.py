"""A group's creation, from its ranks to its installed plan: probe -> model -> plan -> backend.

`configure_group` (called by the backend creator) runs on every rank: find the hosts and check
the settings agree (`hetcomm.hosts`), get a `LinkModel` (declared, or measured by
`hetcomm.measure`), and let rank 0 plan and broadcast the plan, which every rank installs.
Users re-run the probe with `hetcomm.probe(group)` (`probe_backend` here) or set their own plan
(`hetcomm.set_plan`, `install_plan`). A measured model is kept by the group's global ranks, so a
later group (a subgroup) whose ranks it covers reuses it instead of probing again.

The steps, and subgroups: docs/planner.md#group-creation-step-by-step.
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

from hetcomm import hosts
from hetcomm import plan as planner
from hetcomm.measure import known, measure_levels, measure_pairs, model_from_declared, parse_mbit
from hetcomm.measure.trial import measured_plan_wins, same_shares, trial_bytes
from hetcomm.plan import levels as sites
from hetcomm.plan.choose import (DECLARED_MIN_GAIN, MEASURED_MIN_GAIN, _same_partition, choose_plan,  # noqa: F401
                                 hierarchical_enabled, plan_for_group, segment_bytes_for, snap_measured,
                                 with_host_plan)  # (choose_plan & co.: the names this module had before hetcomm.plan)
from hetcomm.plan.hierarchy import three_level_plan
from hetcomm.plan.schedules import SitePlan

log = logging.getLogger("hetcomm")

# The model behind each live backend's plan, by the backend's listening address (unique in the
# process). Python attributes cannot live on the backend: torch hands out fresh wrappers of it.
_models: dict[str, planner.LinkModel] = {}
_topologies: dict[str, sites.Topology] = {}
_host_labels: dict[str, tuple[int, ...]] = {}
# Whether the group's hosts have an inner level: shared memory, or a torch group (the same answer on
# every rank; `hosts.setup_inner_levels`).
_shared_memory: dict[str, bool] = {}


def model_of(backend) -> Optional[planner.LinkModel]:
    return _models.get(backend.listen_address())


def topology_of(backend) -> Optional[sites.Topology]:
    return _topologies.get(backend.listen_address())


def _log_plan(line) -> None:
    """Logs ``line`` (the text, or a function that makes it: called only when the line is shown,
    since describing a plan predicts its time, CPU that every rank would spend at creation)."""
    shown = int(os.environ.get("HETCOMM_LOG_LEVEL", "1") or 1) >= 2
    if not shown and not log.isEnabledFor(logging.DEBUG):
        return
    text = line() if callable(line) else line
    log.debug(text)
    if shown:
        print(f"[hetcomm INFO] {text}", file=sys.stderr, flush=True)


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


# Measured models by the global ranks of their group, newest last (docs/planner.md#group-creation-step-by-step).
# The model each kept: the measured one, or its equal counterpart when that won the group's trial.
_measured: dict[tuple[int, ...], planner.LinkModel] = {}


def _covering_model(ranks: Sequence[int]) -> Optional[planner.LinkModel]:
    """The model kept by a group containing all of ``ranks`` (the smallest such, then the newest:
    measured, or its equal counterpart when that won the group's trial), restricted to them; None
    if no group measured so far covers them."""
    best = None
    for key, model in _measured.items():
        if set(ranks) <= set(key) and (best is None or len(key) <= len(best[0])):
            best = (key, model)
    if best is None:
        return None
    key, model = best
    return model.restricted([key.index(r) for r in ranks])


def _broadcast_floats(backend, values: Optional[list[float]], failure: Optional[BaseException] = None,
                      most: int = 1 << 26) -> list[float]:
    """Rank 0's list of floats on every rank (its length first, then the values). When rank 0
    could not compute them (``failure``), it sends minus the length of its error message instead,
    then the message, and every rank raises, rank 0 its own exception, the others one quoting it,
    instead of waiting for a broadcast that never comes. A length that is not a whole number
    within ``most`` values (or 4,000 bytes of message) is a ValueError on every rank, before
    anything is allocated for it."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    why = f"{type(failure).__name__}: {failure}".encode()[:4000] if failure is not None else b""
    length = -float(len(why)) - 1 if failure is not None else float(len(values)) if backend.rank() == 0 else 0.0
    n = torch.tensor([length], dtype=torch.float64)
    backend.broadcast([n], opts).wait()
    count = n.item()
    if not (math.isfinite(count) and count == int(count) and -4001 <= count <= most):
        raise ValueError(f"hetcomm: rank 0 announced {count!r} values at group creation (at most {most}): "
                         "a corrupted or malicious rank 0")
    if n.item() < 0:
        text = torch.zeros(int(-n.item()) - 1, dtype=torch.uint8)
        if failure is not None:
            text[:] = torch.frombuffer(bytearray(why), dtype=torch.uint8)
        backend.broadcast([text], opts).wait()
        if failure is not None:
            raise failure
        raise RuntimeError(f"hetcomm: rank 0 could not plan this group, so group creation failed on every rank; "
                           f"rank 0 said: {bytes(text.tolist()).decode(errors='replace')}")
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
            float(sp.min_bytes), float(sp.segment_bytes), float(sp.local_inner),
            float(len(sp.hosts)), *(float(len(h)) for h in sp.hosts), *(float(r) for h in sp.hosts for r in h),
            *(float(r) for b in sp.holders for r in b)]
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
        site_min, site_seg, local_inner = int(next(it)), int(next(it)), bool(next(it))
        H = int(next(it))
        host_lengths = [int(v) for v in take(H)]
        host_members = iter(int(v) for v in take(sum(host_lengths)))
        hosts = tuple(tuple(next(host_members) for _ in range(n)) for n in host_lengths)
        held = [int(v) for v in take(B * H)] if H else []
        holders = tuple(tuple(held[b * H:(b + 1) * H]) for b in range(B)) if H else ()
        site = SitePlan(groups, blocks, block_shares, site_shares, min_bytes=site_min, segment_bytes=site_seg,
                        local_inner=local_inner, hosts=hosts, holders=holders)
    return planner.Plan(order, shares, None, min_bytes=min_bytes, segment_bytes=segment_bytes, sites=site,
                        topology=topology)


def install_plan(backend, plan: planner.Plan) -> None:
    """Sets ``plan`` (the ring and, if any, the site plan) on this rank's backend."""
    backend.set_plan(list(plan.order), list(plan.shares), int(plan.min_bytes), int(plan.segment_bytes))
    sp = plan.sites
    if sp is not None:
        backend.set_site_plan([list(s) for s in sp.sites], [list(b) for b in sp.blocks], list(sp.block_shares),
                              list(sp.site_shares), int(sp.min_bytes), int(sp.segment_bytes), bool(sp.local_inner),
                              [list(h) for h in sp.hosts], [list(b) for b in sp.holders])


# The global ranks of every configured group (by listen address), for job-wide declarations.
_group_ranks: dict[str, tuple[int, ...]] = {}


def declared_sites(backend) -> Optional[str]:
    """HETCOMM_SITES (one label per global rank of the job) restricted to ``backend``'s group, as
    text; None when not declared. A declaration with one label per rank of this very group (and
    not of the job) is accepted as it is."""
    text = os.environ.get("HETCOMM_SITES", "").strip()
    if not text:
        return None
    items = [item.strip() for item in text.split(",")]
    ranks = _group_ranks.get(backend.listen_address(), tuple(range(backend.size())))
    if max(ranks) < len(items):
        return ",".join(items[r] for r in ranks)
    if len(items) == backend.size():
        return text
    raise ValueError(f"hetcomm: HETCOMM_SITES={text!r} gives {len(items)} site labels, but this group has "
                     f"global rank {max(ranks)}: give one label per global rank of the job")


def group_topology(backend, model: planner.LinkModel) -> sites.Topology:
    """Sites (HETCOMM_SITES, else detected from the model's rates) and hosts (`hetcomm.hosts`).
    A collective: every rank of the group calls it.

    A group whose ranks are all on one host is a one-box setup whose links were declared
    (configure_group does not probe it): its declaration describes the cluster being modelled, so
    the address does not tie its ranks into one site."""
    labels = host_labels_of(backend)
    addresses = None if labels is None or len(set(labels)) == 1 else [str(h) for h in labels]
    return sites.topology_from(rates=model.bw, declared=declared_sites(backend), addresses=addresses)


def apply_model(backend, model: planner.LinkModel, *, measured: bool = False,
                topology: Optional[sites.Topology] = None,
                equal_model: Optional[planner.LinkModel] = None) -> tuple[planner.Plan, planner.LinkModel]:
    """Chooses (rank 0), agrees on and installs the plan for `model`; returns it and the model it
    was made for. ``topology``: the group's levels when the probe found them, else from
    `group_topology`. ``equal_model`` (measured models): the same levels with every class of link
    at one rate; when its plan's shares differ, the trial (`hetcomm.measure.trial`) decides which
    of the two plans stays (and the second value is then ``equal_model`` if it won)."""
    if topology is None:
        topology = group_topology(backend, model)
    shared = shared_host_labels(backend)
    plan = _agreed_plan(backend, lambda: plan_for_group(model, topology, shared, measured), topology, "chosen")
    install_plan(backend, plan)
    kept = model
    if measured and equal_model is not None:
        plan, kept = _trial_against_equal(backend, plan, model, equal_model, topology, shared)
    # The model the installed plan was made from: the equal counterpart when the trial kept its
    # plan (hetcomm.link_model says what the plan rests on; re-planning from it must not bring
    # back the shares the trial discarded).
    _models[backend.listen_address()] = kept
    _topologies[backend.listen_address()] = topology
    _log_plan(lambda: f"hetcomm topology: {topology.describe()}")
    _log_plan(lambda: planner.format_plan(plan, kept))
    return plan, kept


def _trial_against_equal(backend, plan: planner.Plan, model: planner.LinkModel, equal_model: planner.LinkModel,
                         topology: sites.Topology, shared) -> tuple[planner.Plan, planner.LinkModel]:
    """The trial of `hetcomm.measure.trial` between ``plan`` (installed) and the plan for
    ``equal_model``; returns the plan left installed and its model."""
    try:
        equal = _agreed_plan(backend, lambda: plan_for_group(equal_model, topology, shared, True), topology,
                             "for equal links")
    except Exception as e:  # noqa: BLE001 - rank 0 could not plan it: every rank raised (rank 0 its own error)
        _log_plan(f"hetcomm plan trial: no plan for equal links ({e}); the measured plan stays")
        return plan, model
    if same_shares(plan, equal):
        return plan, model
    size = None
    if backend.rank() == 0:
        try:
            size = [float(trial_bytes(plan, equal, model))]
        except Exception as e:  # noqa: BLE001 - the others wait for the size: they hear 0, no trial
            _log_plan(f"hetcomm plan trial: no trial size ({type(e).__name__}: {e}); the measured plan stays")
            size = [-1.0]
    nbytes = int(_broadcast_floats(backend, size)[0])
    if nbytes <= 0:
        if nbytes == 0:
            _log_plan("hetcomm plan trial: the plans differ only above the largest trial size; the measured plan stays")
        return plan, model
    wins, line = measured_plan_wins(backend, plan, equal, nbytes, install_plan)
    _log_plan(line)
    if wins:
        install_plan(backend, plan)
        return plan, model
    return equal, equal_model


def _agreed_plan(backend, choose, topology: sites.Topology, what: str) -> planner.Plan:
    """Rank 0's ``choose()`` on every rank (a failure there raises on every rank)."""
    values, failure = None, None
    if backend.rank() == 0:
        start = time.perf_counter()
        try:
            values = _encode_plan(choose())
        except Exception as e:  # noqa: BLE001 - every rank must hear of it (_broadcast_floats)
            failure = e
        _log_plan(f"hetcomm plan {what}: by rank 0 in {time.perf_counter() - start:.3f} s")
    return _decode_plan(_broadcast_floats(backend, values, failure), backend.size(), topology)


def probe_backend(backend, ranks: Optional[Sequence[int]] = None) -> planner.LinkModel:
    """Measures (or reads the declared) model of a backend's group and installs its plan.

    ``ranks``: the group's global ranks (default: the group is the world). The level probe
    (`hetcomm.measure.schedule`: a constant number of rounds whatever the group's size) unless
    ``HETCOMM_PROBE=pairs``, which times every pair of ranks (P - 1 rounds).
    """
    ranks = tuple(ranks) if ranks is not None else tuple(range(backend.size()))
    start = time.perf_counter()
    model = declared_model(ranks)
    if model is not None:
        apply_model(backend, model, measured=False)
        _log_plan(f"hetcomm probe: declared (HETCOMM_LINK_MBIT) model in {time.perf_counter() - start:.3f} s")
        return model
    labels = host_labels_of(backend) or tuple(range(backend.size()))
    text = declared_sites(backend)
    declared = sites.parse_sites(text, backend.size()) if text else None
    if probe_mode() == "pairs":
        result = measure_pairs(backend, declared, labels)
    else:
        result = measure_levels(backend, labels, declared, shared_memory=bool(shared_host_labels(backend)))
    model = result.model
    measured_in = time.perf_counter() - start
    _measured.pop(ranks, None)
    hosts_known = len(set(labels)) > 1
    topology = sites.Topology(sites=result.sites, hosts=labels if hosts_known else None)
    _, kept = apply_model(backend, model, measured=True, topology=topology, equal_model=result.equal_model)
    _measured[ranks] = kept
    if hosts.declared_labels(ranks) is None:
        known.remember(hosts.identities_of(backend) or (), kept)
    _log_plan(f"hetcomm probe: measured in {measured_in:.3f} s ({'; '.join(result.rounds)}; a link's repeats a median "
              f"{result.spread:.2f}x apart), planned and installed "
              f"by {time.perf_counter() - start:.3f} s")
    return model


_PROBE_MODES = {"": "levels", "1": "levels", "on": "levels", "true": "levels", "yes": "levels", "levels": "levels",
                "pairs": "pairs", "0": "0", "off": "0", "false": "0", "no": "0"}


def probe_mode() -> str:
    """``HETCOMM_PROBE``: ``0`` (no probe: uniform plan), ``pairs`` (every pair), else the levels."""
    mode = os.environ.get("HETCOMM_PROBE", "1").strip().lower()
    if mode not in _PROBE_MODES:
        raise ValueError(f"hetcomm: HETCOMM_PROBE={mode!r}: choose levels (the default, or 1), pairs, or 0 (no probe)")
    return _PROBE_MODES[mode]


def host_labels_of(backend) -> Optional[tuple[int, ...]]:
    """The host of every rank of the backend's group (`hetcomm.hosts`), as found at its creation."""
    return _host_labels.get(backend.listen_address())


def shared_host_labels(backend) -> Optional[tuple[int, ...]]:
    """The group's host labels when its hosts have an inner level (the host level can run), else None."""
    key = backend.listen_address()
    return _host_labels.get(key) if _shared_memory.get(key) else None


def configure_group(backend, global_ranks: Optional[Sequence[int]] = None, *, store=None,
                    timeout_ms: int = 300_000) -> None:
    """Called at group creation: the plan from declared or probed links, unless HETCOMM_PROBE=0.

    ``global_ranks``: the group's ranks in the job (torch passes them; default: the world).
    ``store``, ``timeout_ms``: the group's, for a torch process group as a host's inner level
    (`hetcomm.hosts.setup_inner_levels`; without a store only shared memory can be).
    A group whose ranks are all on one host (`hetcomm.hosts`): no NIC lies between its ranks,
    and timing "links" there measures how the host schedules processes (4 ranks on 2 cores over
    loopback: identical paths measured 0.3-0.6 GB/s), so it keeps uniform shares unless links
    are declared. A group covered by an earlier group's measurement reuses it.
    """
    if torch.distributed.group.WORLD is None:
        # The default group is being created: a new world, whose ranks may be other processes
        # than the ranks of the same numbers before it (`hetcomm.ElasticDiLoCo` forms one per
        # generation of workers). Measurements by global rank from before would be reused by the
        # processes that took them and not by the new ones, which then probe alone.
        _measured.clear()
    if backend.size() == 1:
        return
    ranks = tuple(global_ranks) if global_ranks else tuple(range(backend.size()))
    if len(ranks) != backend.size():
        raise ValueError(f"hetcomm: {len(ranks)} global ranks given for a group of {backend.size()}")
    _group_ranks[backend.listen_address()] = ranks
    start = time.perf_counter()
    labels, host_error = hosts.host_labels(backend, ranks)
    hosts.check_agreement(backend, hosts.settings(labels, host_error))
    if host_error:
        raise ValueError(host_error)  # every rank has the same error (checked just above)
    _host_labels[backend.listen_address()] = labels
    agreed = time.perf_counter()
    _shared_memory[backend.listen_address()] = hosts.setup_inner_levels(backend, labels, store, timeout_ms)
    _log_plan(f"hetcomm group: hosts found and settings agreed in {agreed - start:.3f} s, inner levels "
              f"{'/'.join(backend.inner_levels()) or 'none'} set up in {time.perf_counter() - agreed:.3f} s")
    if os.environ.get("HETCOMM_LINK_MBIT"):
        probe_backend(backend, ranks)
        return
    if probe_mode() == "0":
        # No rates, but the hosts are known: the host level (or hosts inside sites: three levels)
        # with equal pieces (every rank computes the same plan from the same labels; the engine
        # checks that they agree).
        shared = shared_host_labels(backend)
        declared_text = declared_sites(backend)
        if declared_text and shared is not None:
            try:
                site_labels = sites.topology_from(declared=declared_text,
                                                  addresses=[str(h) for h in shared]).sites
            except ValueError:  # a declaration for the whole job, not this subgroup: no host level
                site_labels = None
            if site_labels is not None and not _same_partition(site_labels, shared):
                # Sites made of several hosts: three levels with equal shares, which need no rates.
                three = three_level_plan(site_labels, shared) if hierarchical_enabled() else None
                if three is not None:
                    plan = dataclasses.replace(planner.uniform_plan(backend.size()), sites=three)
                    install_plan(backend, plan)
                    _log_plan(lambda: planner.format_plan(plan))
                    return
            if site_labels is None or not _same_partition(site_labels, shared):
                shared = None
        if shared is not None:
            plan = with_host_plan(planner.uniform_plan(backend.size()), shared)
            if plan.sites is not None:
                install_plan(backend, plan)
                _log_plan(lambda: planner.format_plan(plan))
        return
    covering = _covering_model(ranks)
    if covering is not None:
        apply_model(backend, covering, measured=True)
        _log_plan(f"hetcomm probe: global ranks {list(ranks)} were measured with an earlier group: no probe")
        return
    if len(set(labels)) == 1:
        _log_plan("hetcomm probe: every rank is on one host: uniform plan, no probe")
        return
    # (ranks declared on hosts one by one, HETCOMM_HOST_ID=0,0,1,1: their processes' own hosts are
    # not those of the declaration; nothing is remembered for them)
    identities = None if hosts.declared_labels(ranks) is not None else hosts.identities_of(backend)
    remembered = known.agreed(backend, identities or (), _broadcast_floats)
    if remembered is not None:
        apply_model(backend, remembered, measured=True)
        _measured[ranks] = remembered
        _log_plan(f"hetcomm probe: the links of these hosts were measured by an earlier group of rank 0's process: "
                  f"no probe (HETCOMM_PROBE_REUSE sets for how long) in {time.perf_counter() - start:.3f} s")
        return
    probe_backend(backend, ranks)
