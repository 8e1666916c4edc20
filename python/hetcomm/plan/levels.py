"""Levels: the host and the site of every rank, from measured rates or a declaration.

A *host* is the ranks of one machine; a *site* a cluster of hosts joined by fast links. The ranks
of one host are always in one site. `detect_sites` finds sites in a rate matrix (links within
``DEFAULT_SITE_RATIO`` of each other), ``HETCOMM_SITES`` declares them; sites and hosts are
numbered by lowest rank. Pure and deterministic: numpy, no torch, no processes, no environment.

What the levels are for, the inputs and the numbering:
docs/hosts-and-sites.md#levels-hosts-and-sites-found-or-declared.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import numpy as np

from hetcomm.labels import ranks_by_label, renumber

# Two links whose rates are within this factor are "equally fast". 3 is about the geometric middle
# of 1x (one site) and the 10x at which sites start to matter (WAN links 10-100x slower than LAN
# links: docs/hosts-and-sites.md#levels-hosts-and-sites-found-or-declared), so it leaves a factor
# of ~3 of measurement error on either side; see `detect_sites` for the exact margins.
DEFAULT_SITE_RATIO = 3.0

Matrix = Sequence[Sequence[Optional[float]]]


def _directed_rates(rates: Matrix) -> np.ndarray:
    """``rates`` as floats, validated: diagonal and unknown entries (None, NaN, 0) become 0.0."""
    if isinstance(rates, np.ndarray):
        out = np.array(rates, dtype=np.float64)
    else:
        rows = [list(row) for row in rates]
        P = len(rows)
        if P < 1:
            raise ValueError("hetcomm sites: the rate matrix is empty")
        for i, row in enumerate(rows):
            if len(row) != P:
                raise ValueError(f"hetcomm sites: the rate matrix must be {P}x{P}; row {i} has {len(row)} entries")
        try:
            out = np.array(rows, dtype=np.float64)
        except (TypeError, ValueError):
            for i, row in enumerate(rows):
                for j, value in enumerate(row):
                    try:
                        float(value if value is not None else 0.0)
                    except (TypeError, ValueError):
                        raise ValueError(f"hetcomm sites: rate of link {i} -> {j} is not a number: {value!r}") from None
            raise
    if out.ndim != 2 or out.shape[0] != out.shape[1] or out.shape[0] < 1:
        raise ValueError(f"hetcomm sites: the rate matrix must be square, got shape {out.shape}")
    np.fill_diagonal(out, 0.0)
    out[np.isnan(out)] = 0.0
    bad = (out < 0) | np.isinf(out)
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"hetcomm sites: rate of link {i} -> {j} must be finite and >= 0 "
                         f"(0, None or NaN: unknown), got {rates[i][j]!r}")
    return out


def _pair_rates(directed: np.ndarray) -> np.ndarray:
    """The symmetric rate of each pair: the slower known direction; 0.0 when neither is known.

    An allreduce sends both ways, so a pair is as fast as its slower direction. A direction that
    is unknown borrows the other's rate, so that a probe which timed each pair once (one triangle
    of the matrix) is enough.
    """
    t = directed.T
    known_both = (directed > 0) & (t > 0)
    return np.where(known_both, np.minimum(directed, t), np.maximum(directed, t))


def _check_ratio(ratio: float) -> float:
    ratio = float(ratio)
    if not (math.isfinite(ratio) and ratio > 1):
        raise ValueError(f"hetcomm sites: ratio must be finite and > 1, got {ratio!r}")
    return ratio


def detect_sites(rates: Matrix, *, hosts: Optional[Sequence[Hashable]] = None,
                 ratio: float = DEFAULT_SITE_RATIO) -> tuple[int, ...]:
    """The site of each rank: clusters of fast links in the measured ``rates``.

    Method (single linkage on a per-rank relative threshold):

    1. The rate of a pair is ``w(i, j) = min(rates[i][j], rates[j][i])`` (an allreduce uses both
       directions); a direction that is unknown (None, NaN, 0) takes the other's rate; a pair with
       neither direction known is unknown.
    2. Each rank's fastest link ``best(i) = max_j w(i, j)``, over known pairs with ranks on *other*
       hosts (``hosts``: a label per rank, equal labels = one host; default: every rank its own
       host). Loopback between processes of one host is no network link: it can be 10x faster
       than the LAN and would split a site into its hosts.
    3. A pair is *intra-site* iff it is known and ``w(i, j) * ratio >= max(best(i), best(j))``:
       it is within a factor ``ratio`` of the fastest link of *both* ends. Taking the larger
       ``best`` is what keeps a rank alone in its site apart: its fastest link is a WAN link,
       but its partner's fastest is a LAN link, which the WAN link is not close to.
    4. Sites are the connected components of the intra-site pairs, together with "same host".

    Guarantees. Let every measured entry lie within ``[lo, hi]`` times its true value, and
    ``q = hi / lo`` (±20% jitter: q = 1.2 / 0.8 = 1.5). Write ``t`` for true pair rates.

    * No site is split if, in each site of two or more ranks, the internal pair rates are within
      a factor ``v`` of each other, every rank's fastest link is inside its site, and
      ``q * v <= ratio``: every internal pair then has ``w >= lo * t_min`` and both ends
      ``best <= hi * v * t_min``. Uniform links (v = 1) stay one site for any q <= ratio (3 by
      default: a probe may be off by up to a factor 3 between two links).
    * Two sites are never joined if, for every pair (i, j) across them, one end has another link
      more than ``q * ratio`` times faster: ``hi * t(i, j) * ratio < lo * t(i, k) <= best(i)``.
      1000 vs 100 Mbit/s (10x) is recovered exactly under any q < 10 / 3; with ±20% jitter any
      factor above 4.5 is. Two ranks that are each alone in their site are only kept apart if
      one of them has a much faster link elsewhere (2+1+1 where the lone ranks reach site 0 at
      100 but each other at 10): from rates alone, two one-rank sites joined at the WAN rate
      look exactly like one site of two slow ranks, and are one site.
    * One rank on a slow NIC (every link of it slow, e.g. 800/800/800/100) is a site of its own:
      from rates alone a one-rank site and a slow NIC look the same. The planner's cost model,
      not this function, decides whether a site schedule pays.
    * Transitivity, the chain: a-b fast, b-c fast, a-c slow. a-b and b-c are intra-site, so
      single linkage puts a, b and c in **one** site, although a-c is slow. Splitting the chain
      would have to pick a side for b, and no choice is both order-independent and free of ties;
      declare ``HETCOMM_SITES`` to split it. The schedule inside a site must therefore order its
      ranks by the measured links, not assume every internal pair is fast.
    * Unknown pairs join nothing and count for no ``best``: a rank with no known link to another
      host is alone in its site (with its host's ranks).
    * Deterministic and independent of rank order: every step is symmetric in the ranks, so
      permuting the ranks permutes the partition; only the numbering (by lowest rank) depends
      on the order.

    Returns the site of each rank, numbered by lowest rank (rank 0 is in site 0).
    """
    ratio = _check_ratio(ratio)
    pair = _pair_rates(_directed_rates(rates))
    P = len(pair)
    host_of = np.asarray(renumber(hosts) if hosts is not None else tuple(range(P)))
    if len(host_of) != P:
        raise ValueError(f"hetcomm sites: {len(host_of)} hosts given for {P} ranks")
    same_host = host_of[:, None] == host_of[None, :]
    best = np.where(same_host, 0.0, pair).max(axis=1)
    intra = same_host | ((pair > 0) & (pair * ratio >= np.maximum(best[:, None], best[None, :])))
    return renumber(_components(intra))


def _components(adjacent: np.ndarray) -> list[int]:
    """The connected components of a graph given by its boolean adjacency matrix (undirected:
    an edge either way joins), each vertex labelled by the lowest vertex of its component.

    A breadth-first walk in NumPy rather than SciPy's csgraph: every rank of a group runs the
    site detection at creation, and importing scipy.sparse costs each process 0.2 s of CPU
    (32 ranks on 2 cores: 3 s of the probe). O(P^2) per component, P a few thousand at most.
    """
    adjacent = np.asarray(adjacent, dtype=bool)
    adjacent = adjacent | adjacent.T
    P = len(adjacent)
    labels = np.full(P, -1, dtype=np.int64)
    for start in range(P):
        if labels[start] >= 0:
            continue
        reached = np.zeros(P, dtype=bool)
        reached[start] = True
        frontier = reached.copy()
        while frontier.any():
            new = adjacent[frontier].any(axis=0) & ~reached
            reached |= new
            frontier = new
        labels[reached] = start
    return labels.tolist()


_INTEGER = re.compile(r"[+-]?\d+")


def parse_sites(text: str, world_size: int) -> tuple[int, ...]:
    """``HETCOMM_SITES``: one site label per rank, comma-separated, renumbered by lowest rank.

    Labels are any text (``"a,a,b,b"``, ``"3,3,1,1"``); spaces around them are ignored and
    integer labels compare as integers (``"1"`` and ``"01"`` are one site). ``"3,3,1,1"`` gives
    ``(0, 0, 1, 1)``. Raises ValueError for an empty declaration, an empty label, or a number of
    labels other than ``world_size``.
    """
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"hetcomm: HETCOMM_SITES: world size must be a positive integer, got {world_size!r}")
    if not text or not text.strip():
        raise ValueError(f"hetcomm: HETCOMM_SITES is empty: give one site label per rank, e.g. "
                         f"{','.join('0' * world_size)}")
    items = [item.strip() for item in text.split(",")]
    empty = [k for k, item in enumerate(items) if not item]
    if empty:
        raise ValueError(f"hetcomm: HETCOMM_SITES={text!r}: item {empty[0]} (from 0) is empty; give one site label "
                         f"per rank, e.g. 0,0,1,1")
    if len(items) != world_size:
        raise ValueError(f"hetcomm: HETCOMM_SITES={text!r} gives {len(items)} site labels for {world_size} ranks: "
                         f"give one per rank")
    return renumber([int(item) if _INTEGER.fullmatch(item) else item for item in items])


def _format_groups(labels: Sequence[int]) -> str:
    return " ".join("{" + ",".join(map(str, ranks)) + "}" for ranks in ranks_by_label(labels))


@dataclass(frozen=True)
class Topology:
    """The site and the host of every rank, each numbered by lowest rank.

    ``sites[r]``, ``hosts[r]``: indices of rank r's site and host. ``hosts`` defaults to one host
    per rank (nothing known joins ranks). Any labels are accepted and renumbered by lowest rank,
    so two topologies compare equal iff they group the ranks alike. Raises ValueError when the
    lengths differ or a host's ranks are in different sites.
    """

    sites: tuple[int, ...]
    hosts: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        sites = renumber(self.sites)
        if not sites:
            raise ValueError("hetcomm sites: a topology needs at least one rank")
        hosts = tuple(range(len(sites))) if self.hosts is None else renumber(self.hosts)
        if len(hosts) != len(sites):
            raise ValueError(f"hetcomm sites: {len(sites)} sites but {len(hosts)} hosts given; one of each per rank")
        site_of_host: dict[int, int] = {}
        for rank, (site, host) in enumerate(zip(sites, hosts)):
            first = site_of_host.setdefault(host, site)
            if first != site:
                other = hosts.index(host)
                raise ValueError(f"hetcomm sites: ranks {other} and {rank} are on one host (host {host}) but in "
                                 f"sites {first} and {site}; ranks on one host are always in one site")
        object.__setattr__(self, "sites", sites)
        object.__setattr__(self, "hosts", hosts)

    @property
    def world_size(self) -> int:
        return len(self.sites)

    @property
    def num_sites(self) -> int:
        return max(self.sites) + 1

    @property
    def num_hosts(self) -> int:
        return max(self.hosts) + 1

    def site_members(self, site: int) -> tuple[int, ...]:
        """The ranks of ``site``, ascending."""
        if not 0 <= site < self.num_sites:
            raise ValueError(f"hetcomm sites: no site {site}; this topology has {self.num_sites}")
        return tuple(r for r, s in enumerate(self.sites) if s == site)

    def describe(self) -> str:
        """One line for the debug log: ``"2 sites: {0,2} {1,3}; hosts: one per rank"``."""
        sites = f"{self.num_sites} site{'s' if self.num_sites != 1 else ''}: {_format_groups(self.sites)}"
        hosts = "one per rank" if self.num_hosts == self.world_size else _format_groups(self.hosts)
        return f"{sites}; hosts: {hosts}"


def topology_from(rates: Optional[Matrix] = None, *, declared: Optional[str] = None,
                  addresses: Optional[Sequence[str]] = None, ratio: float = DEFAULT_SITE_RATIO) -> Topology:
    """The group's topology from what is known; at least one argument must be given.

    * Hosts: ranks whose ``addresses`` (listening host, e.g. IP) are equal are one host; without
      addresses, every rank is its own host.
    * Sites: the declaration ``declared`` (the text of ``HETCOMM_SITES``; None or blank: none)
      wins over ``rates``, which are only checked for size then. Else `detect_sites` on
      ``rates`` (measured, or the links declared in ``HETCOMM_LINK_MBIT``). With neither, one
      site: nothing known separates the ranks, and a flat ring is what is run today.

    Raises ValueError when the arguments disagree on the number of ranks, an address is empty,
    or the declaration puts ranks of one host in different sites.
    """
    sizes = {}
    if rates is not None:
        sizes["rates"] = len(rates)
    if addresses is not None:
        sizes["addresses"] = len(addresses)
    if declared is not None and not declared.strip():
        declared = None
    if len(set(sizes.values())) > 1:
        raise ValueError(f"hetcomm sites: the rate matrix has {sizes['rates']} ranks but {sizes['addresses']} "
                         f"addresses are given")
    if sizes:
        world_size = next(iter(sizes.values()))
    elif declared is not None:
        world_size = len(declared.split(","))
    else:
        raise ValueError("hetcomm sites: give rates, a declaration or addresses: the number of ranks is unknown")

    hosts = None
    if addresses is not None:
        for rank, address in enumerate(addresses):
            if not isinstance(address, str) or not address.strip():
                raise ValueError(f"hetcomm sites: rank {rank} has no host address ({address!r})")
        hosts = renumber([a.strip() for a in addresses])

    if declared is not None:
        sites = parse_sites(declared, world_size)
        if rates is not None:
            _directed_rates(rates)  # still a valid matrix, though the declaration decides
        if hosts is not None:
            # The first rank of each host must share its site with every other rank of the host.
            first_of_host: dict[int, int] = {}
            for j in range(world_size):
                i = first_of_host.setdefault(hosts[j], j)
                if sites[i] != sites[j]:
                    raise ValueError(f"hetcomm: HETCOMM_SITES={declared!r} puts ranks {i} and {j} in different "
                                     f"sites, but both are on host {addresses[i].strip()}: ranks on one host "
                                     f"are always in one site")
    elif rates is not None:
        sites = detect_sites(rates, hosts=hosts, ratio=ratio)
    else:
        sites = (0,) * world_size
    return Topology(sites=sites, hosts=hosts)
