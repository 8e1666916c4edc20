"""What the probe measures, round by round: a pure schedule over hosts and sites, and the model
it builds.

The planner needs the rate of a few *classes* of link, not P^2 pairs: loopback inside a host,
host NICs, cross-site links and site uplinks. Each class is measured with all of its flows at
once, in rounds whose number does not grow with the ranks: `loopback_round`, `nic_rounds` (and
`confirm_round`, `repair_round`), `cross_rounds`, `uplink_rounds`; at most 13 for four sites
(`round_count`). `model_from_rates` turns the rates into the planner's `LinkModel`.

Pure: no torch, no processes; `hetcomm.measure.probe` runs the rounds. Each round, and why it
suffices: docs/planner.md#the-probes-rounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hetcomm.labels import ranks_by_label, renumber
from hetcomm.plan.model import LinkModel

UNMEASURED_LOOPBACK_FACTOR = 10.0
NIC_SPREAD = 1.25             # units within this of a NIC's fastest were not held back by their partner
CONFIRM_FACTOR = 2.0          # a NIC in doubt is confirmed against a host at least this much faster
ALL_PAIRS_FLOWS = 64          # an uplink round pairs every rank of a site with every other site's up to here
MAX_NIC_ROUNDS = 3


@dataclass(frozen=True)
class Unit:
    """Flows of one round measured together: ``rate = their bytes / their time``. ``label``: what
    the unit measures, e.g. ``("nic", a, b)`` for host a to host b. ``one_clock``: all its
    receivers are on one host, so their clocks compare and the unit's time runs from the first
    flow's start to the last one's end (else the longest of its receivers' own times)."""

    label: tuple
    flows: tuple[tuple[int, int], ...]       # (src rank, dst rank)
    one_clock: bool = True


@dataclass(frozen=True)
class Round:
    what: str                                # loopback, nic, repair, cross, uplink
    units: tuple[Unit, ...]

    @property
    def flows(self) -> list[tuple[int, int]]:
        return [f for u in self.units for f in u.flows]


def nic_shifts(m: int) -> list[int]:
    """The host-ring shifts of the NIC rounds for a site of ``m`` hosts."""
    return [d for d in (1, 2, 3) if d < m]


def _host_pair_unit(label: tuple, src: Sequence[int], dst: Sequence[int]) -> Unit:
    """Every rank of the source host to one rank of the destination (round robin)."""
    return Unit(label, tuple((r, dst[k % len(dst)]) for k, r in enumerate(src)))


def loopback_round(hosts: Sequence[int]) -> Optional[Round]:
    units = []
    for h, ranks in enumerate(ranks_by_label(renumber(hosts))):
        L = len(ranks)
        if L > 1:
            units.append(Unit(("loopback", h), tuple((ranks[k], ranks[(k + 1) % L]) for k in range(L))))
    return Round("loopback", tuple(units)) if units else None


def nic_rounds(hosts: Sequence[int], sites: Optional[Sequence[int]] = None) -> list[Round]:
    """Host rings per site (one ring of every host without sites), shifts of `nic_shifts`."""
    host_labels = renumber(hosts)
    ranks_of = ranks_by_label(host_labels)
    site_of_host = [0] * len(ranks_of)
    if sites is not None:
        for r, h in enumerate(host_labels):
            site_of_host[h] = sites[r]
    rings = ranks_by_label(site_of_host)                        # hosts of each site, ascending
    per_ring = [nic_shifts(len(ring)) for ring in rings]
    rounds = []
    for j in range(max((len(d) for d in per_ring), default=0)):
        units = []
        for ring, shifts in zip(rings, per_ring):
            if j < len(shifts):
                m = len(ring)
                for i, a in enumerate(ring):
                    b = ring[(i + shifts[j]) % m]
                    units.append(_host_pair_unit(("nic", a, b), ranks_of[a], ranks_of[b]))
        rounds.append(Round("nic", tuple(units)))
    return rounds


def repair_round(hosts: Sequence[int], sites: Sequence[int], measured: Sequence[tuple[int, int]]) -> Optional[Round]:
    """For hosts with no measured out- (in-) pair inside their site among ``measured`` host pairs,
    a flow to (from) the next (previous) host of their site."""
    host_labels = renumber(hosts)
    ranks_of = ranks_by_label(host_labels)
    site_of_host = [0] * len(ranks_of)
    for r, h in enumerate(host_labels):
        site_of_host[h] = sites[r]
    has_out = {a for a, b in measured if site_of_host[a] == site_of_host[b]}
    has_in = {b for a, b in measured if site_of_host[a] == site_of_host[b]}
    pairs = []
    for ring in ranks_by_label(site_of_host):
        m = len(ring)
        if m < 2:
            continue
        for i, a in enumerate(ring):
            nxt = ring[(i + 1) % m]
            if a not in has_out or nxt not in has_in:
                pairs.append((a, nxt))
    units = tuple(_host_pair_unit(("nic", a, b), ranks_of[a], ranks_of[b]) for a, b in dict.fromkeys(pairs))
    return Round("repair", units) if units else None


def confirm_round(hosts: Sequence[int], sites: Optional[Sequence[int]], rates: dict[tuple, float]) -> Optional[Round]:
    """One more NIC round for the NICs the shifted rings could not pin down (at most one round).

    A unit a -> b runs at ``min(out_a, in_b)``: if every host a sent to has an in-rate below
    ``NIC_SPREAD`` times a's estimate, a's estimate may be its partners' (half of a site slower and
    numbered together does that). Such a host then sends to the host of its site with the fastest
    in-rate it has not met, if that is at least `CONFIRM_FACTOR` times its estimate (well beyond
    the probe's noise, so that timing errors alone do not add the round); likewise for in-rates.
    Each host sends at most once and receives at most once in the round. None when no NIC is in
    doubt."""
    host_labels = renumber(hosts)
    ranks_of = ranks_by_label(host_labels)
    H = len(ranks_of)
    pair = host_pair_rates(H, rates)
    out_est = np.array([nic_estimate(pair[h]) for h in range(H)])
    in_est = np.array([nic_estimate(pair[:, h]) for h in range(H)])
    site_of_host = [0] * H
    if sites is not None:
        for r, h in enumerate(host_labels):
            site_of_host[h] = sites[r]
    sending, receiving, pairs = set(), set(), []

    def pick(a: int, estimate: np.ndarray, mine: float, met: np.ndarray, busy: set) -> Optional[int]:
        choices = [c for c in range(H) if c != a and site_of_host[c] == site_of_host[a] and met[c] <= 0
                   and c not in busy and estimate[c] >= mine * CONFIRM_FACTOR]
        return max(choices, key=lambda c: (estimate[c], -c)) if choices else None

    # Hosts in doubt, those whose other direction reads faster first (NICs are mostly symmetric,
    # so a host slow one way only is the likeliest to have been held back by its partners).
    doubts = []
    for a in range(H):
        partners = np.flatnonzero(pair[a] > 0)
        if len(partners) and in_est[partners].max() < out_est[a] * NIC_SPREAD:
            doubts.append((-in_est[a] / out_est[a], a, "out"))
        partners = np.flatnonzero(pair[:, a] > 0)
        if len(partners) and out_est[partners].max() < in_est[a] * NIC_SPREAD:
            doubts.append((-out_est[a] / in_est[a], a, "in"))
    for _, a, direction in sorted(doubts):
        if direction == "out" and a not in sending:
            c = pick(a, in_est, out_est[a], pair[a], receiving)
            if c is not None:
                pairs.append((a, c))
                sending.add(a)
                receiving.add(c)
        elif direction == "in" and a not in receiving:
            d = pick(a, out_est, in_est[a], pair[:, a], sending)
            if d is not None:
                pairs.append((d, a))
                sending.add(d)
                receiving.add(a)
    units = tuple(_host_pair_unit(("nic", a, b), ranks_of[a], ranks_of[b]) for a, b in pairs)
    return Round("confirm", units) if units else None


def cross_rounds(sites: Sequence[int]) -> list[Round]:
    ranks_of = ranks_by_label(renumber(sites))
    S = len(ranks_of)
    return [Round("cross", tuple(Unit(("cross", s, (s + d) % S), ((ranks_of[s][0], ranks_of[(s + d) % S][0]),))
                                 for s in range(S)))
            for d in range(1, S)]


def _site_flows(src: Sequence[int], dst_sites: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """Flows from the ranks ``src`` to the sites ``dst_sites``: every pair when the site plan
    would pair them all (at most ALL_PAIRS_FLOWS), else one partner per rank in each site."""
    everyone = [r for site in dst_sites for r in site]
    if len(src) * len(everyone) <= ALL_PAIRS_FLOWS:
        return tuple((a, b) for a in src for b in everyone)
    return tuple((a, site[k % len(site)]) for site in dst_sites for k, a in enumerate(src))


def uplink_rounds(sites: Sequence[int], hosts: Optional[Sequence[int]] = None) -> list[Round]:
    ranks_of = ranks_by_label(renumber(sites))
    S = len(ranks_of)
    if S < 2:
        return []

    def unit(label: tuple, flows: tuple[tuple[int, int], ...]) -> Unit:
        receivers = {hosts[b] if hosts is not None else b for _, b in flows}
        return Unit(label, flows, one_clock=len(receivers) == 1)

    if S == 2:
        return [Round("uplink", (unit(("uplink", 0, "out"), _site_flows(ranks_of[0], [ranks_of[1]])),
                                 unit(("uplink", 1, "out"), _site_flows(ranks_of[1], [ranks_of[0]]))))]
    rounds = []
    for s in range(S):
        others = [ranks_of[t] for t in range(S) if t != s]
        into = tuple((a, b) for t in range(S) if t != s for a, b in _site_flows(ranks_of[t], [ranks_of[s]]))
        rounds.append(Round("uplink", (unit(("uplink", s, "out"), _site_flows(ranks_of[s], others)),
                                       unit(("uplink", s, "in"), into))))
    return rounds


def site_rounds(hosts: Sequence[int], sites: Sequence[int], measured_host_pairs: Optional[Sequence[tuple[int, int]]]
                ) -> list[Round]:
    """Rounds 3-5 once the sites are known (``measured_host_pairs``: the NIC rounds' host pairs when
    the sites were detected after them, None when declared before)."""
    rounds = []
    if measured_host_pairs is not None:
        repair = repair_round(hosts, sites, measured_host_pairs)
        if repair is not None:
            rounds.append(repair)
        if not needs_site_rounds(hosts, sites):
            return rounds
    return rounds + cross_rounds(sites) + uplink_rounds(sites, hosts)


def needs_site_rounds(hosts: Sequence[int], sites: Sequence[int]) -> bool:
    """For *detected* sites: False for two sites of which one is a single host (a slow NIC looks
    like that): the NIC rounds, run over every host, already sent that host's flows across to the
    other site, so its NIC units are the cross-site rates, and the other site's uplink toward one
    host is bounded by that host's NIC. (Declared sites keep the NIC rounds inside each site, so
    a lone host there is measured by the site rounds alone: they always run.)"""
    host_labels = renumber(hosts)
    per_site: dict[int, set[int]] = {}
    for r, s in enumerate(renumber(sites)):
        per_site.setdefault(s, set()).add(host_labels[r])
    return len(per_site) > 2 or min(len(h) for h in per_site.values()) > 1


def first_rounds(hosts: Sequence[int], sites: Optional[Sequence[int]] = None,
                 shared_memory: bool = False) -> list[Round]:
    """Rounds 1-2: loopback (unless the hosts' ranks share memory) and the NIC rounds (within
    declared sites, else over every host)."""
    loop = None if shared_memory else loopback_round(hosts)
    return ([loop] if loop is not None else []) + nic_rounds(hosts, sites)


def connect_round(rounds: Sequence[Round]) -> Round:
    """Every pair of ranks the rounds will use, once: one tiny transfer opens all their connections
    at once, so that no round's warm-up pays for them one after the other."""
    pairs = tuple(dict.fromkeys(f for rnd in rounds for f in rnd.flows))
    return Round("connect", (Unit(("connect",), pairs, one_clock=False),))


def round_count(hosts: Sequence[int], sites: Sequence[int], declared: bool = True,
                shared_memory: bool = False) -> int:
    """Measuring rounds of the whole probe for these hosts and sites (the sites found when not
    declared); the connect rounds, which time nothing, are not counted."""
    first = first_rounds(hosts, sites if declared else None, shared_memory)
    if len(set(sites)) < 2:
        return len(first)
    pairs = None if declared else [u.label[1:] for r in first if r.what == "nic" for u in r.units]
    return len(first) + len(site_rounds(hosts, sites, pairs))


def pair_rounds(world_size: int) -> list[Round]:
    """Every ordered pair of ranks, one flow each, in P - 1 rounds (round s: rank r to r + s),
    each rank sending one flow and receiving one: the all-pairs probe (``HETCOMM_PROBE=pairs``),
    for comparison and for links that follow no levels."""
    P = world_size
    return [Round("pairs", tuple(Unit(("pair", r, (r + s) % P), ((r, (r + s) % P),)) for r in range(P)))
            for s in range(1, P)]


def host_pair_rates(H: int, rates: dict[tuple, float]) -> np.ndarray:
    """The H x H matrix of measured host-pair (NIC unit) rates, 0 where not measured."""
    out = np.zeros((H, H))
    for label, rate in rates.items():
        if label[0] == "nic":
            out[label[1], label[2]] = max(out[label[1], label[2]], rate)
    return out


def nic_estimate(unit_rates: np.ndarray) -> float:
    """A NIC's rate from its units' (0: not measured): each unit ran at ``min(this NIC, the
    partner's)``, so units well below the fastest were held back by their partner; the median of
    those within `NIC_SPREAD` of the fastest is the NIC (the fastest alone would be the largest
    timing error too). 0 when nothing was measured."""
    measured = unit_rates[unit_rates > 0]
    if not len(measured):
        return 0.0
    top = measured.max()
    return float(np.median(measured[measured * NIC_SPREAD >= top]))


def _class_median(values: np.ndarray) -> np.ndarray:
    """``values`` with every finite positive entry replaced by their median."""
    out = values.copy()
    use = np.isfinite(out) & (out > 0)
    if use.any():
        out[use] = float(np.median(out[use]))
    return out


def model_from_rates(hosts: Sequence[int], sites: Sequence[int], rates: dict[tuple, float],
                     per_flow: dict[tuple, float], reduce_bps: Sequence[float], alpha: float,
                     equal: bool = False) -> LinkModel:
    """The planner's model from the units' rates (``rates``: aggregate, ``per_flow``: per flow).
    ``equal``: every class of link (host NICs, both directions; loopback; cross-site links; site
    uplinks, both directions) and the ranks' reduce rates at their class's median instead, i.e.
    the same levels with no link of a class faster than another: the counterpart the trial at
    creation times the measured plan against (`hetcomm.measure.trial`).

    Host NICs: `nic_estimate` of each host's out- and in-units; a host that met no other host of
    its site takes its site's uplink (a site of one host: its NIC is its uplink). Loopback: the
    per-flow rate of the host's unit (not measured: `UNMEASURED_LOOPBACK_FACTOR` times the fastest
    NIC). Cross-site: the single flow's rate, capped by the NICs. Site uplinks: the units'
    aggregate rates; with two sites what leaves one enters the other; not measured: unlimited
    (the NICs alone)."""
    host_labels = np.asarray(renumber(hosts))
    site_labels = np.asarray(renumber(sites))
    H, S = int(host_labels.max()) + 1, int(site_labels.max()) + 1
    pair = host_pair_rates(H, rates)
    out_h = np.array([nic_estimate(pair[h]) for h in range(H)])
    in_h = np.array([nic_estimate(pair[:, h]) for h in range(H)])
    site_of_host = np.zeros(H, dtype=np.int64)
    site_of_host[host_labels] = site_labels
    site_out = np.zeros(S)
    site_in = np.zeros(S)
    for label, rate in rates.items():
        if label[0] == "uplink":
            s, direction = label[1], label[2]
            if S == 2:                       # what leaves one site enters the other
                site_out[s], site_in[1 - s] = rate, rate
            elif direction == "out":
                site_out[s] = rate
            else:
                site_in[s] = rate
    cross = np.zeros((S, S))
    for label, rate in per_flow.items():
        if label[0] == "cross":
            cross[label[1], label[2]] = rate
    loop = np.zeros(H)
    for label, rate in per_flow.items():
        if label[0] == "loopback":
            loop[label[1]] = rate
    # A host that met no host of its site is its site: its NIC is the site's uplink. A group of one
    # host has no NIC at all (every link is loopback). Anything else is a schedule that left a NIC
    # unmeasured, and guessing its rate would plan on a made-up number.
    for h in range(H):
        s = site_of_host[h]
        if out_h[h] <= 0:
            out_h[h] = site_out[s]
        if in_h[h] <= 0:
            in_h[h] = site_in[s]
        if H > 1 and (out_h[h] <= 0 or in_h[h] <= 0):
            raise ValueError(f"hetcomm probe: nothing measured the NIC of host {h}")
    if H == 1:
        out_h[:] = in_h[:] = loop[0] if loop[0] > 0 else 1.0
    if equal:
        nics = _class_median(np.concatenate([out_h, in_h]))
        out_h, in_h = nics[:H], nics[H:]
        loop = _class_median(loop)
        cross = _class_median(cross)
        ups = _class_median(np.concatenate([site_out, site_in]))
        site_out, site_in = ups[:S], ups[S:]
    nic_max = max(out_h.max(), in_h.max())
    loop = np.where(loop > 0, loop, UNMEASURED_LOOPBACK_FACTOR * nic_max)
    if S > 1:
        # Not measured (`needs_site_rounds`): nothing between the sites but the NICs.
        cross = np.where(cross > 0, cross, np.inf)
        site_out = np.where(site_out > 0, site_out, np.inf)
        site_in = np.where(site_in > 0, site_in, np.inf)
    if equal:
        reduce_bps = list(_class_median(np.asarray(reduce_bps, dtype=np.float64)))
    return LinkModel.from_levels(host_labels, site_labels, host_out=out_h, host_in=in_h, loopback=loop,
                                 cross_site=cross if S > 1 else None, site_out=site_out if S > 1 else None,
                                 site_in=site_in if S > 1 else None, reduce_bps=reduce_bps, alpha=alpha)
