"""Choosing among the schedules: the plan a group installs (`choose_plan`), and how it reads.

Per message size, the predicted times decide (`hetcomm.plan.cost`):

* the weighted ring (`order.make_plan`) from its crossover size on, uniform shares below it;
* the host-level schedule (`hierarchy.host_plan`) for every allreduce above the small-message
  size when the group's hosts share memory and there are no sites other than the hosts;
* else the site schedule (`hierarchy.best_site_plan`) from the smallest power of two at which it
  is predicted faster than the ring by ``min_gain`` (``SitePlan.min_bytes``), never by a fixed
  rule; one site: the ring.

Measured models are first snapped (`snap_measured`): rates within the probe's error of each
other become one rate, so a plan is not fitted to noise.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Sequence

import numpy as np

from hetcomm.plan.cost import (predict_allreduce_seconds, sites_bound_seconds_per_byte, predict_site_plan_seconds,
                               ring_seconds_per_byte, site_plan_seconds_per_byte)
from hetcomm.plan.hierarchy import best_site_plan, host_plan, three_level_plan
from hetcomm.labels import renumber
from hetcomm.plan.levels import Topology
from hetcomm.plan.model import LinkModel
from hetcomm.plan.order import DEFAULT_MIN_GAIN, crossover_bytes, make_plan, uniform_plan
from hetcomm.plan.schedules import Plan

# A measured model must predict a larger gain than a declared one before hetcomm leaves uniform
# shares: timing links between processes that share cores varies by ~10-20% (seen on 4 ranks on
# 2 cores over loopback, where identical links measured 0.3-0.6 GB/s), and a plan fitted to noise
# costs more than it saves (a two-site plan fitted to one mismeasured link ran 0.77x uniform).
MEASURED_MIN_GAIN = 0.20
DECLARED_MIN_GAIN = DEFAULT_MIN_GAIN

# A segment should cross the slowest ring link in about this long: a segment in flight on a slow
# link is pipeline fill and drain that nothing overlaps (1 MB on a 100 Mbit/s link is 80 ms; 64 KB
# measured 5-8% faster end to end on the simulated 800/800/800/100 cluster).
SEGMENT_SECONDS_ON_SLOWEST_LINK = 0.005

# Measured link rates within this factor of each other are taken as one rate (their group's
# median) before planning: the probe's error is of that order, and a plan fitted to it hands
# small shares around for nothing (800/800/800/100 measured as 101-138/11.4-12 MB/s gave rank 1
# 5% and ran at 1.12x the bound; the same links declared gave 0/0/0/100% and 1.065x).
MEASURED_RATE_TOLERANCE = 1.25


# The three-level plan is taken over the site plan (TCP rings inside the sites) unless predicted
# slower by more than this: both are bound by the same WAN cut when it is the narrowest, and the
# model prices the site ring's loopback links but not the copies and CPU they cost on the host.
THREE_LEVEL_TIE = 0.02


def hierarchical_enabled() -> bool:
    """False when HETCOMM_HIERARCHICAL=0: the ring at every size, whatever the sites."""
    return os.environ.get("HETCOMM_HIERARCHICAL", "1").strip() != "0"


def segment_for_rate(slowest: float) -> int:
    """The power of two in [32 KB, 1 MB] nearest (on a log scale) to SEGMENT_SECONDS_ON_SLOWEST_LINK
    worth of ``slowest`` bytes/s.

    Nearest rather than the next one down: a 100 Mbit/s link measures ~11.7 MB/s, 58 KB in 5 ms,
    and rounding down gave 32 KB, twice the wake-ups per byte of the 64 KB that measured best.
    """
    target = slowest * SEGMENT_SECONDS_ON_SLOWEST_LINK
    seg = 32 << 10
    while seg < (1 << 20) and seg * math.sqrt(2) < target:
        seg *= 2
    return seg


def segment_bytes_for(plan: Plan, model: LinkModel) -> int:
    """`segment_for_rate` of the slowest link of ``plan``'s ring."""
    order = np.asarray(plan.order)
    return segment_for_rate(float(model.bw[order, np.roll(order, -1)].min()))


def _slowest_used(site, model: LinkModel) -> float:
    src, dst, _ = site.load_arrays()
    return float(model.bw[src, dst].min())


def _snapped(values: np.ndarray, tolerance: float) -> np.ndarray:
    """``values`` grouped: sorted descending, a value joins the current group while it is within
    ``tolerance`` of the group's largest, and each becomes its group's median (of an even count,
    the lower middle one)."""
    ascending = np.sort(values)
    descending = ascending[::-1]
    widened = ascending * tolerance
    out = values.copy()
    start = 0
    while start < len(descending):
        largest = descending[start]
        end = max(len(descending) - int(np.searchsorted(widened, largest, side="left")), start + 1)
        out[(values <= largest) & (values >= descending[end - 1])] = descending[start + (end - start) // 2]
        start = end
    return out


def snap_measured(model: LinkModel, tolerance: float = MEASURED_RATE_TOLERANCE) -> LinkModel:
    """`model` with its link rates grouped (`_snapped`: rates within ``tolerance`` of each other
    become their group's median), and likewise the finite rates of its shared links."""
    P = model.world_size
    if P < 2:
        return model
    off = ~np.eye(P, dtype=bool)
    bw = model.bw.copy()
    bw[off] = _snapped(model.bw[off], tolerance)
    uplinks = model.uplinks
    rates = np.asarray([v for _, o, i in uplinks for v in (o, i)], dtype=np.float64)
    finite = np.isfinite(rates)
    if finite.any():
        rates[finite] = _snapped(rates[finite], tolerance)
        uplinks = tuple((g, float(rates[2 * k]), float(rates[2 * k + 1])) for k, (g, _, _) in enumerate(uplinks))
    return dataclasses.replace(model, bw=bw, uplinks=uplinks)


def _same_partition(a: Sequence[int], b: Sequence[int]) -> bool:
    return renumber(a) == renumber(b)


def with_host_plan(ring: Plan, host_labels: Sequence[int], model: Optional[LinkModel] = None,
                   min_gain: float = DECLARED_MIN_GAIN) -> Plan:
    """``ring`` plus the host-level schedule (`hierarchy.host_plan`) for every allreduce that
    takes the ring's path (those above HETCOMM_SMALL_ALLREDUCE_BYTES), when there is one; its
    host shares leave equal ones only when predicted faster by ``min_gain``."""
    hp = host_plan(host_labels, model, min_gain) if hierarchical_enabled() else None
    if hp is None:
        return ring
    if model is not None:
        hp = dataclasses.replace(hp, segment_bytes=segment_for_rate(_slowest_used(hp, model)))
    return dataclasses.replace(ring, sites=hp)


def choose_plan(model: LinkModel, min_gain: float = DECLARED_MIN_GAIN,
                site_labels: Optional[Sequence[int]] = None,
                host_labels: Optional[Sequence[int]] = None,
                topology: Optional[Topology] = None) -> Plan:
    """The large-message ring plan, with min_bytes set to the crossover (uniform if weighting gains
    nothing), and with ``site_labels`` (one site per rank; several sites) the site-aware schedule
    from the message size on where its predicted time beats the ring's by ``min_gain``.

    ``host_labels`` (one host per rank, given when the hosts' ranks share memory): with several
    hosts and no sites other than the hosts themselves, the host-level schedule (`with_host_plan`).
    Where sites hold several hosts, the three-level schedule (`hierarchy.three_level_plan`: shared
    memory inside hosts, the hosts' NICs inside sites, every host's part across the WAN) or the
    site schedule (TCP rings inside sites) replaces the host schedule only if predicted faster by
    ``min_gain``; of the two, the three-level one unless predicted slower by more than
    THREE_LEVEL_TIE.
    ``topology``: the group's levels (sites and hosts), which the ring search keeps together;
    by default the sites are ``site_labels`` and the hosts ``host_labels``.
    """
    if topology is None and (site_labels is not None or host_labels is not None):
        P = model.world_size
        sites = site_labels if site_labels is not None else (0,) * P
        hosts = host_labels if host_labels is not None and _nested(host_labels, sites) else None
        topology = Topology(sites=tuple(sites), hosts=None if hosts is None else tuple(hosts))
    best = make_plan(model, None, min_gain, topology)
    if not best.is_uniform:
        crossover = crossover_bytes(model, min_gain, topology=topology)
        best = Plan(best.order, best.shares, best.predicted_bw_seconds_per_byte,
                    min_bytes=crossover if crossover is not None else 0,
                    segment_bytes=segment_bytes_for(best, model))
    if not hierarchical_enabled():
        return best
    hosted = with_host_plan(best, host_labels, model, min_gain) if host_labels is not None else best
    if hosted.sites is not None and (site_labels is None or len(set(site_labels)) == 1
                                     or _same_partition(site_labels, host_labels)):
        return hosted
    if site_labels is None or len(set(site_labels)) == 1:
        return best
    # Each candidate must be able to beat the schedule it would replace by min_gain: the site plan
    # is never faster than the cut bound over its sites, so it is not even planned (an LP over as
    # many blocks as the largest site has ranks) when the host plan or the ring already comes
    # that close (a slow NIC taken for a site of its own: the ring meets the bound).
    incumbent = hosted.sites if hosted.sites is not None else None
    incumbent_per_byte = (site_plan_seconds_per_byte(incumbent, model) if incumbent is not None
                          else ring_seconds_per_byte(best.order, best.shares, model))
    if sites_bound_seconds_per_byte(model, site_labels) >= incumbent_per_byte * (1.0 - min_gain):
        return hosted
    site = best_site_plan(model, site_labels, None if topology is None else topology.hosts)
    three = three_level_plan(site_labels, host_labels, model, min_gain) if host_labels is not None else None
    if three is not None and (site is None or site_plan_seconds_per_byte(three, model)
                              <= site_plan_seconds_per_byte(site, model) * (1.0 + THREE_LEVEL_TIE)):
        site = three
    if site is None:
        return hosted
    if incumbent is not None and not (site_plan_seconds_per_byte(site, model)
                                      < incumbent_per_byte * (1.0 - min_gain)):
        return hosted
    site = dataclasses.replace(site, segment_bytes=segment_for_rate(_slowest_used(site, model)))
    # The site plan serves every size from min_bytes up, so min_bytes is the smallest power of two
    # from which it is predicted faster at every larger size (up to 1 TiB).
    uniform = uniform_plan(model.world_size)
    start = max(1, model.small_allreduce_bytes + 1).bit_length()
    min_bytes = None
    for k in range(40, start - 1, -1):
        n = 1 << k
        ring = best if n >= best.min_bytes else uniform
        if not (predict_site_plan_seconds(site, model, n)
                < predict_allreduce_seconds(ring, model, n) * (1.0 - min_gain)):
            break
        min_bytes = n
    if min_bytes is None:
        return hosted
    if site.three_level and hosted.sites is not None:
        # Below min_bytes the plan falls back to the ring, which would take the bytes between
        # ranks of a host off shared memory; the host plan (which the three-level plan extends
        # with the site step) serves every size, so the three-level plan does too.
        min_bytes = 0
    return dataclasses.replace(best, sites=dataclasses.replace(site, min_bytes=min_bytes))


def plan_for_group(model: LinkModel, topology: Topology, shared_hosts: Optional[Sequence[int]],
                   measured: bool) -> Plan:
    """What rank 0 of a new group plans (`hetcomm.topology.apply_model`): a measured model is
    snapped and each rank capped by its best link (unless the probe measured shared links), then
    `choose_plan` with the margin of its source, the group's levels, and the hosts when they
    share memory."""
    planning = snap_measured(model).with_rank_uplinks() if measured else model
    return choose_plan(planning, MEASURED_MIN_GAIN if measured else DECLARED_MIN_GAIN, topology.sites,
                       shared_hosts, topology=topology)


def _nested(hosts: Sequence[int], sites: Sequence[int]) -> bool:
    """True when every host lies in one site."""
    site_of_host: dict[int, int] = {}
    return all(site_of_host.setdefault(h, s) == s for h, s in zip(hosts, sites))


def _ranks_text(ranks: Sequence[int], limit: int = 16) -> str:
    if len(ranks) <= limit:
        return ">".join(str(r) for r in ranks)
    return ">".join(str(r) for r in ranks[:limit // 2]) + f">...({len(ranks) - limit} more)..." + \
        ">".join(str(r) for r in ranks[-limit // 2:])


def _shares_text(shares: Sequence[float], limit: int = 16) -> str:
    total = math.fsum(shares)
    if len(shares) <= limit:
        return " ".join(f"r{r}={100.0 * s / total:.1f}%" for r, s in enumerate(shares))
    values = np.asarray(shares) / total
    common = float(np.median(values))
    odd = [r for r in range(len(values)) if abs(values[r] - common) > 1e-9]
    shown = " ".join(f"r{r}={100.0 * values[r]:.1f}%" for r in odd[:limit])
    more = f" (+{len(odd) - limit} more)" if len(odd) > limit else ""
    return f"{100.0 * common:.3g}% each" + (f", except {shown}{more}" if odd else "")


def format_plan(plan: Plan, model: Optional[LinkModel] = None) -> str:
    """One line for a debug log: ring order, shares in %, predicted large-message algbw (a second
    line for the hierarchical schedule); long rings are abbreviated."""
    line = f"hetcomm plan: ring {_ranks_text(plan.order)} | shares {_shares_text(plan.shares)}"
    if plan.min_bytes:
        line += f" | for allreduces >= {plan.min_bytes} B"
    if plan.segment_bytes:
        line += f" | segments up to {plan.segment_bytes // 1024} KB"
    if model is not None and model.world_size > 1:
        per_byte = ring_seconds_per_byte(plan.order, plan.shares, model)
        uniform = ring_seconds_per_byte(tuple(range(model.world_size)), (1.0,) * model.world_size, model)
        line += (f" | predicted {1e-9 / per_byte:.4g} GB/s algbw"
                 f" (uniform ring {1e-9 / uniform:.4g} GB/s)")
    elif plan.predicted_bw_seconds_per_byte:
        line += f" | predicted {1e-9 / plan.predicted_bw_seconds_per_byte:.4g} GB/s algbw"
    if plan.sites is not None:
        sp = plan.sites
        total = math.fsum(sp.block_shares)
        blocks = " ".join(f"({','.join(map(str, b))})={100.0 * x / total:.1f}%"
                          for b, x in list(zip(sp.blocks, sp.block_shares))[:16])
        if len(sp.blocks) > 16:
            blocks += f" (+{len(sp.blocks) - 16} more)"
        level = "hosts (shared memory inside)" if sp.local_inner else "sites"
        groups = " ".join("{" + _ranks_text(s, 8) + "}" for s in sp.sites[:16])
        if len(sp.sites) > 16:
            groups += f" (+{len(sp.sites) - 16} more)"
        if sp.hosts:
            groups += " of hosts " + " ".join("{" + _ranks_text(h, 8) + "}" for h in sp.hosts[:16])
            if len(sp.hosts) > 16:
                groups += f" (+{len(sp.hosts) - 16} more)"
            level = "sites (three levels: shared memory inside hosts)"
        line += (f"\nhetcomm plan: hierarchical for allreduces >= {sp.min_bytes} B | {level} {groups}"
                 f" | blocks {blocks} | {level.split()[0][:-1]} shares "
                 + " ".join(f"{100.0 * w:.1f}%" for w in sp.site_shares[:16])
                 + (f" (+{len(sp.site_shares) - 16} more)" if len(sp.site_shares) > 16 else ""))
        if sp.segment_bytes:
            line += f" | segments up to {sp.segment_bytes // 1024} KB"
        if model is not None:
            line += f" | predicted {1e-9 / site_plan_seconds_per_byte(sp, model):.4g} GB/s algbw"
    return line
