"""What a simulated cluster looks like: :class:`SimSpec`, its validation, and the bandwidths it implies.

Everything here is pure (no root, no ``ip``/``tc``), so the planner and the benchmark can compute
the physical bound of a simulated cluster without building it.

Units
-----
Rates are given in Mbit/s as ``tc`` understands them: 1 Mbit = 10**6 bit, so 100 Mbit/s is
12.5e6 bytes/s (rates as text are parsed by :mod:`hetcomm.rates`, which the links a user declares
share). :func:`effective_bandwidth` returns bytes/s. A TCP stream moves payload at about
``TCP_GOODPUT_FRACTION`` of the shaped rate (1448 payload bytes per 1514-byte frame: headers are
shaped too); measured on the development VM: 100 Mbit -> 11.9-12.0 MB/s, 400 -> 47.7-48.0 MB/s,
800 -> 94.4-94.9 MB/s, 1000 -> 117-120 MB/s.

``None`` (or ``inf`` on the command line) means "not shaped".
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping, Optional, Sequence

from hetcomm.labels import renumber
from hetcomm.rates import format_matrix, format_rate, mbit_to_bytes_per_s

MAX_RANKS = 250  # one /24 of addresses


#: payload bytes per shaped byte for a bulk TCP stream over the simulated (MTU 1500) links
TCP_GOODPUT_FRACTION = 1448 / 1514

#: SimSpec.tcp_cc unless told otherwise: the best algorithm this kernel lets a namespace use,
#: chosen when the cluster is built (see choose_tcp_cc)
AUTO_TCP_CC = "auto"
DEFAULT_TCP_CC = AUTO_TCP_CC
#: what "auto" picks, best first: cubic, mainline Linux's default; else reno, the loss-based
#: algorithm every kernel has built in (bbr, which some kernels allow instead, measured worst:
#: README, "Simulated heterogeneous cluster"); else the host's own default
TCP_CC_PREFERENCE = ("cubic", "reno")

class SimError(RuntimeError):
    """A simulated cluster cannot be described, built or run (the message says why)."""


def parse_float_list(text: str, what: str) -> list[float]:
    out = []
    for i, s in enumerate(text.replace(" ", "").split(",")):
        try:
            v = float(s)
        except ValueError:
            raise SimError(f"{what}: item {i} {s!r} is not a number") from None
        if not v > 0 or math.isinf(v):
            raise SimError(f"{what}: item {i} {s!r} must be a positive finite number")
        out.append(v)
    return out


@dataclasses.dataclass
class SimSpec:
    """A simulated heterogeneous cluster.

    nic_mbit: per-rank NIC rate in Mbit/s (None = unshaped). Applies to each rank's egress *and*
        its ingress (full duplex: a rank can send and receive at the NIC rate at the same time).
    link_mbit: optional PxP matrix of directed link rates (row = sender, column = receiver;
        diagonal ignored; None = only the NICs limit that link).
    sites, intra_mbit, inter_mbit: a shorthand for ``link_mbit``: ranks on the same site talk at
        ``intra_mbit``, across sites at ``inter_mbit`` (None = unshaped). Mutually exclusive with
        an explicit ``link_mbit``. ``inter_mbit`` shapes every cross-site *pair* on its own (the
        per-pair site model).
    wan_mbit: the shared-uplink site model: each site reaches the other sites through one WAN
        uplink of ``wan_mbit`` in each direction, which all of the site's cross-site flows share
        (out of the site, and into it). Needs ``sites`` with at least two sites; combines with
        ``intra_mbit`` (within a site) and ``inter_mbit`` (each cross-site pair, on top of the
        uplinks). None: no shared uplink (every cross-site pair on its own links).
    hosts: a host label per rank (e.g. ``[0, 0, 1, 1]``): the ranks of a host share one network
        namespace, one address and one NIC (one veth pair to the bridge, shaped in both
        directions), and talk to each other over the namespace's loopback, unshaped. Labels are
        renumbered 0, 1, ... in order of each host's lowest rank. With hosts, ``nic_mbit`` is
        either one rate per host (a list as long as the number of hosts) or one per rank whose
        ranks of a host agree; it is stored per rank. Hosts combine with ``nic_mbit``,
        ``cpu_quota`` (still per rank), ``latency_ms`` (on each host's egress) and ``sites`` +
        ``wan_mbit`` (each host wholly in one site; the site's uplink joins its hosts). Per-pair
        rates (``link_mbit``, ``intra_mbit``, ``inter_mbit``) are not supported with hosts: the
        simulated network of a hosts cluster is :meth:`network_spec`, one node per host.
        None: every rank is its own host (its own namespace and NIC).
    cpu_quota: per-rank CPU quota in cores (1.0 = one core, 0.25 = a quarter); None = no cgroup.
    cpu_period_ms: the CFS period of the quotas (1 to 1000 ms, default 100): every period a rank
        may run quota × period of CPU time, then waits for the next. A rank that stands for a
        slow GPU but whose network thread must also wait for the next period (up to
        (1 − quota) × period each time) communicates slower than a host would; a shorter period
        shrinks those waits at the same quota. quota × period must be at least 1 ms (the
        kernel's smallest quota).
    latency_ms: one-way delay added on each rank's egress (netem; the kernel must have it).
    nprocs: world size when no per-rank list gives it.
    tcp_cc: TCP congestion control of every namespace of the cluster: a name, ``None`` (inherit
        the host's), or ``"auto"`` (the default): the first of :data:`TCP_CC_PREFERENCE` that
        this kernel lets a namespace select, else the host's. Building the cluster replaces
        ``"auto"`` and ``None`` by the name actually in use, which is what the ranks, the run
        summary and the benchmark JSON then see. Not inheriting matters: a new namespace takes
        the host's choice, and the development VM's kernel defaults to ``bbr``. Under bbr, on
        800/800/800/100 Mbit/s, the slow rank's outgoing flow ran at half rate for the first
        ~0.2 s of every 16 MB allreduce, while the fast ranks' reduce-scatter flooded each other
        on the shared cores: hetcomm took 1.13-1.16x the bound there and 1.06-1.08x under cubic
        (README, "Simulated heterogeneous cluster"). Some kernels let a namespace select only
        ``net.ipv4.tcp_allowed_congestion_control`` (one seen: reno and bbr), hence "auto".
    """

    nic_mbit: Optional[list[Optional[float]]] = None
    link_mbit: Optional[list[list[Optional[float]]]] = None
    sites: Optional[list[int]] = None
    intra_mbit: Optional[float] = None
    inter_mbit: Optional[float] = None
    wan_mbit: Optional[float] = None
    cpu_quota: Optional[list[float]] = None
    cpu_period_ms: float = 100.0
    latency_ms: float = 0.0
    nprocs: Optional[int] = None
    tcp_cc: Optional[str] = DEFAULT_TCP_CC
    hosts: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.hosts is not None:
            self.hosts = list(renumber(self.hosts))
            self.nic_mbit = self._per_rank_nics()
        self.validate()

    def _per_rank_nics(self) -> Optional[list[Optional[float]]]:
        """``nic_mbit`` given per host or per rank, as one rate per rank (hosts given)."""
        assert self.hosts is not None
        if self.nic_mbit is None:
            return None
        nics = list(self.nic_mbit)
        p, h = len(self.hosts), max(self.hosts, default=-1) + 1
        if len(nics) == 1:                      # one rate: every host's NIC, as for every rank without hosts
            return nics * p
        if len(nics) == p:
            for host, ranks in self.host_groups():
                rates = {nics[k] for k in ranks}
                if len(rates) > 1:
                    raise SimError(
                        f"nic_mbit (--nic-mbit) gives the ranks {','.join(map(str, ranks))} of host {host} "
                        f"different rates ({', '.join(format_rate(nics[k]) for k in ranks)}): the ranks of "
                        f"a host share one NIC; give one rate per host ({h} rates) or equal rates per host")
            return nics
        if len(nics) == h:
            return [nics[host] for host in self.hosts]
        raise SimError(f"nic_mbit (--nic-mbit) has {len(nics)} rates, but hosts (--hosts) "
                       f"{','.join(map(str, self.hosts))} has {h} host{'s' if h != 1 else ''} and {p} ranks: "
                       f"give one rate for all, one per host ({h}) or one per rank ({p})")

    # -- size and validation ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        sizes = self._sizes()
        return next(iter(sizes.values()))

    def _sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        if self.nprocs is not None:
            sizes["nprocs"] = int(self.nprocs)
        if self.nic_mbit is not None:
            sizes["nic_mbit"] = len(self.nic_mbit)
        if self.link_mbit is not None:
            sizes["link_mbit"] = len(self.link_mbit)
        if self.sites is not None:
            sizes["sites"] = len(self.sites)
        if self.cpu_quota is not None:
            sizes["cpu_quota"] = len(self.cpu_quota)
        if self.hosts is not None:
            sizes["hosts"] = len(self.hosts)
        return sizes

    def validate(self) -> None:
        sizes = self._sizes()
        if not sizes:
            raise SimError("the world size is unknown: give nic_mbit (--nic-mbit), sites, link_mbit, "
                           "cpu_quota or nprocs (--nprocs)")
        if len(set(sizes.values())) != 1:
            raise SimError("inconsistent world sizes: " +
                           ", ".join(f"{k} gives {v}" for k, v in sizes.items()))
        p = next(iter(sizes.values()))
        if p < 1:
            raise SimError(f"the world size must be at least 1, got {p}")
        if p > MAX_RANKS:
            raise SimError(f"at most {MAX_RANKS} ranks can be simulated (one /24), got {p}")
        if self.link_mbit is not None and self.sites is not None:
            raise SimError("give either link_mbit (--link-mbit) or sites (--sites), not both")
        if self.hosts is not None:
            self._validate_hosts()
        if self.sites is None and (self.intra_mbit is not None or self.inter_mbit is not None):
            raise SimError("intra_mbit/inter_mbit (--intra-mbit/--inter-mbit) need sites (--sites)")
        if self.wan_mbit is not None:
            if self.sites is None:
                raise SimError("wan_mbit (--wan-mbit) gives each site a shared uplink: it needs sites "
                               "(--sites), e.g. --sites 0,0,1,1")
            if len(self.site_groups()) < 2:
                raise SimError(f"wan_mbit (--wan-mbit) needs at least two sites: sites (--sites) "
                               f"{','.join(map(str, self.sites))} is one site")
        if (self.sites is not None and self.intra_mbit is None and self.inter_mbit is None
                and self.wan_mbit is None):
            raise SimError("sites (--sites) needs --intra-mbit, --inter-mbit and/or --wan-mbit")
        if self.link_mbit is not None:
            for i, row in enumerate(self.link_mbit):
                if len(row) != p:
                    raise SimError(f"link_mbit row {i} has {len(row)} values, expected {p}")
                for j, v in enumerate(row):
                    if i != j and v is not None and not v > 0:
                        raise SimError(f"link_mbit[{i}][{j}] = {v}: must be positive (None = unshaped)")
        for name in ("intra_mbit", "inter_mbit", "wan_mbit"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise SimError(f"{name} = {v}: must be positive (None = unshaped)")
        if self.nic_mbit is not None:
            for i, v in enumerate(self.nic_mbit):
                if v is not None and not v > 0:
                    raise SimError(f"nic_mbit[{i}] = {v}: must be positive (None = unshaped)")
        if self.cpu_quota is not None:
            for i, q in enumerate(self.cpu_quota):
                if not (q > 0 and math.isfinite(q)) or q < 0.01:
                    raise SimError(f"cpu_quota[{i}] = {q}: must be a number of cores >= 0.01")
        if not (math.isfinite(self.cpu_period_ms) and 1.0 <= self.cpu_period_ms <= 1000.0):
            raise SimError(f"cpu_period_ms = {self.cpu_period_ms}: must be between 1 and 1000 ms")
        if self.cpu_quota is not None:
            for i, q in enumerate(self.cpu_quota):
                if q * self.cpu_period_ms < 1.0:
                    raise SimError(f"cpu_quota[{i}] = {q} with cpu_period_ms = {self.cpu_period_ms:g}: the quota "
                                   f"per period ({q * self.cpu_period_ms:g} ms) is below the kernel's 1 ms; "
                                   "use a longer period")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise SimError(f"latency_ms = {self.latency_ms}: must be >= 0")
        if self.tcp_cc is not None and not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", self.tcp_cc):
            raise SimError(f"tcp_cc = {self.tcp_cc!r}: not a TCP congestion control name "
                           f"(e.g. cubic, reno, bbr; see /proc/sys/net/ipv4/"
                           f"tcp_available_congestion_control)")

    def _validate_hosts(self) -> None:
        assert self.hosts is not None
        unsupported = [opt for opt, value in (("link_mbit (--link-mbit)", self.link_mbit),
                                              ("intra_mbit (--intra-mbit)", self.intra_mbit),
                                              ("inter_mbit (--inter-mbit)", self.inter_mbit))
                       if value is not None]
        if unsupported:
            raise SimError(f"hosts (--hosts) cannot be combined with {' or '.join(unsupported)}: per-pair "
                           "rates are not supported with hosts. Hosts combine with --nic-mbit (one NIC per "
                           "host), --cpu-quota (per rank), --latency-ms and --sites with --wan-mbit (a "
                           "shared uplink per site)")
        if self.sites is not None:
            if self.wan_mbit is None:
                raise SimError("hosts (--hosts) with sites (--sites) need --wan-mbit (a shared uplink "
                               "per site); per-pair site rates are not supported with hosts")
            for host, ranks in self.host_groups():
                labels = list(dict.fromkeys(self.sites[k] for k in ranks))
                if len(labels) > 1:
                    raise SimError(f"host {host} (ranks {','.join(map(str, ranks))}) is in sites "
                                   f"{', '.join(map(str, labels))}: each host must be wholly in one site")

    # -- derived quantities -----------------------------------------------------------------
    def nic(self, rank: int) -> Optional[float]:
        """Rank ``rank``'s NIC rate in Mbit/s (with hosts: its host's, shared with its host)."""
        return None if self.nic_mbit is None else self.nic_mbit[rank]

    def host_of(self, rank: int) -> int:
        """Rank ``rank``'s host (its own index without hosts)."""
        return rank if self.hosts is None else self.hosts[rank]

    @property
    def num_hosts(self) -> int:
        return self.world_size if self.hosts is None else max(self.hosts) + 1

    def host_groups(self) -> list[tuple[int, tuple[int, ...]]]:
        """``[(host, its ranks), ...]`` in host order (by lowest rank); one rank per host without hosts."""
        if self.hosts is None:
            return [(k, (k,)) for k in range(self.world_size)]
        groups: dict[int, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            groups.setdefault(host, []).append(rank)
        return [(host, tuple(ranks)) for host, ranks in sorted(groups.items())]

    def network_spec(self) -> "SimSpec":
        """The network as built: one node (namespace, address, NIC) per host.

        Without hosts, ``self``. With hosts, a spec whose "ranks" are the hosts: host h's NIC,
        its site, the same ``wan_mbit``, ``latency_ms`` and ``tcp_cc``, no CPU quotas (those stay
        per rank). :mod:`hetcomm.sim.cluster` builds and shapes this spec's network and places
        each rank in its host's namespace, so every ``tc`` plan of :mod:`hetcomm.sim.shaping`
        applies unchanged; the physical bound of the benchmark is that of this spec's nodes
        (ranks of one host exchange data over loopback, which no cut bound can charge).
        """
        if self.hosts is None:
            return self
        first = [ranks[0] for _, ranks in self.host_groups()]
        return SimSpec(nic_mbit=None if self.nic_mbit is None else [self.nic_mbit[k] for k in first],
                       sites=None if self.sites is None else [self.sites[k] for k in first],
                       wan_mbit=self.wan_mbit, latency_ms=self.latency_ms, nprocs=len(first),
                       tcp_cc=self.tcp_cc)

    def site_groups(self) -> list[tuple[Any, tuple[int, ...]]]:
        """``[(site label, its ranks), ...]``, sites in order of first appearance; [] without sites.

        A site's position in this list is its index in the names of its bridge and uplink
        (:mod:`hetcomm.sim.netns`).
        """
        groups: dict[Any, list[int]] = {}
        for rank, label in enumerate(self.sites or ()):
            groups.setdefault(label, []).append(rank)
        return [(label, tuple(ranks)) for label, ranks in groups.items()]

    def links(self) -> Optional[list[list[Optional[float]]]]:
        """The configured directed link matrix in Mbit/s (from link_mbit or sites), or None.

        Diagonal entries are None. Without per-link shaping, None. The shared uplinks of
        ``wan_mbit`` are not links of a pair: see :func:`effective_uplinks`.
        """
        p = self.world_size
        if self.link_mbit is not None:
            return [[None if i == j else self.link_mbit[i][j] for j in range(p)] for i in range(p)]
        if self.sites is not None:
            return [[None if i == j else
                     (self.intra_mbit if self.sites[i] == self.sites[j] else self.inter_mbit)
                     for j in range(p)] for i in range(p)]
        return None

    @property
    def per_link(self) -> bool:
        """True when the egress side needs one HTB class per destination."""
        links = self.links()
        return links is not None and any(v is not None for row in links for v in row)

    @property
    def shaped(self) -> bool:
        return (self.per_link or self.wan_mbit is not None
                or (self.nic_mbit is not None and any(v is not None for v in self.nic_mbit)))

    # -- environment ------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SimSpec":
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["SimSpec"]:
        """The spec of the simulated cluster this process runs in (``HETCOMM_SIM_SPEC``), or None."""
        env = os.environ if environ is None else environ
        if env.get("HETCOMM_SIM") != "1" or "HETCOMM_SIM_SPEC" not in env:
            return None
        return cls.from_json(env["HETCOMM_SIM_SPEC"])

    def describe(self) -> str:
        p = self.world_size
        parts = [f"{p} rank{'s' if p != 1 else ''}"]
        if self.hosts is not None:
            h = self.num_hosts
            parts.append(f"{h} host{'s' if h != 1 else ''} " + ",".join(map(str, self.hosts))
                         + " (one namespace and NIC per host)")
            if self.nic_mbit is not None:
                parts.append("NIC Mbit/s per host " + ",".join(
                    format_rate(self.nic_mbit[ranks[0]]) for _, ranks in self.host_groups()))
        elif self.nic_mbit is not None:
            parts.append("NIC Mbit/s " + ",".join(format_rate(v) for v in self.nic_mbit))
        if self.sites is not None and self.hosts is not None:
            parts.append(f"sites {','.join(map(str, self.sites))}")
        elif self.sites is not None:
            parts.append(f"sites {','.join(map(str, self.sites))} intra {format_rate(self.intra_mbit)} "
                         f"inter {format_rate(self.inter_mbit)} Mbit/s")
            if self.wan_mbit is not None:
                parts.append(f"one shared WAN uplink per site, {format_rate(self.wan_mbit)} Mbit/s "
                             "each way")
        elif self.link_mbit is not None:
            parts.append("links Mbit/s " + format_matrix(self.links() or []))
        if self.cpu_quota is not None:
            parts.append("CPU quota " + ",".join(f"{q:g}" for q in self.cpu_quota)
                         + (f" (period {self.cpu_period_ms:g} ms)" if self.cpu_period_ms != 100.0 else ""))
        if self.latency_ms:
            parts.append(f"latency {self.latency_ms:g} ms one-way")
        if not self.shaped:
            parts.append("network unshaped")
        if self.tcp_cc == AUTO_TCP_CC:
            parts.append("TCP: the best this kernel allows (cubic, else reno)")
        else:
            parts.append(f"TCP {self.tcp_cc}" if self.tcp_cc else "TCP: the host's default")
        return "; ".join(parts)


def effective_link_mbit(spec: SimSpec) -> list[list[Optional[float]]]:
    """Directed rate of a single flow i -> j in Mbit/s: min(NIC_i, NIC_j, link_ij); None = unshaped.

    Ranks of one host (``spec.hosts``) talk over loopback: None (unshaped) between them; between
    hosts NIC_i and NIC_j are the hosts' NICs, which all ranks of a host share.
    With shared uplinks (``wan_mbit``) a flow between sites is also at most ``wan_mbit``.
    This is what one TCP connection between i and j alone can get (times TCP_GOODPUT_FRACTION).
    Several concurrent flows also share NIC_i (all of i's outgoing flows) and NIC_j (all of j's
    incoming flows), and, between sites, the uplinks (:func:`effective_uplinks`). The diagonal
    is None.
    """
    p = spec.world_size
    links = spec.links()
    out: list[list[Optional[float]]] = []
    for i in range(p):
        row: list[Optional[float]] = []
        for j in range(p):
            if i == j or spec.host_of(i) == spec.host_of(j):
                row.append(None)
                continue
            cands = [spec.nic(i), spec.nic(j), links[i][j] if links is not None else None]
            if spec.wan_mbit is not None and spec.sites is not None and spec.sites[i] != spec.sites[j]:
                cands.append(spec.wan_mbit)
            vals = [v for v in cands if v is not None]
            row.append(min(vals) if vals else None)
        out.append(row)
    return out


def effective_bandwidth(spec: SimSpec) -> list[list[float]]:
    """The effective directed link-bandwidth matrix in **bytes/s** implied by ``spec``.

    ``bw[i][j] = min(NIC_i, NIC_j, link_ij) * 1e6 / 8``; ``math.inf`` where nothing is shaped and
    on the diagonal. This is the wire rate; TCP payload gets about ``TCP_GOODPUT_FRACTION`` of it.
    """
    return [[mbit_to_bytes_per_s(v) for v in row] for row in effective_link_mbit(spec)]


def effective_uplinks(spec: SimSpec) -> list[tuple[tuple[int, ...], float, float]]:
    """The shared uplinks of ``spec`` in **bytes/s**: ``[(ranks of site s, out_bps, in_bps), ...]``.

    All traffic from the ranks of a site to ranks of other sites shares ``out_bps``; all traffic
    into them from other sites shares ``in_bps`` (``hetcomm.planner.LinkModel.uplinks``). Sites
    in the order of :meth:`SimSpec.site_groups`; ``[]`` without ``wan_mbit``. Like
    :func:`effective_bandwidth` these are shaped wire rates: TCP payload gets about
    ``TCP_GOODPUT_FRACTION`` of them.
    """
    if spec.wan_mbit is None:
        return []
    rate = mbit_to_bytes_per_s(spec.wan_mbit)
    return [(ranks, rate, rate) for _, ranks in spec.site_groups()]


def effective_host_nics(spec: SimSpec) -> list[tuple[tuple[int, ...], float, float]]:
    """Each host's NIC as a shared uplink of its ranks, in **bytes/s**: ``[(ranks, out, in), ...]``.

    All traffic from a host's ranks to other hosts shares its NIC's egress, all traffic into them
    its ingress (``hetcomm.planner.LinkModel.uplinks``); unshaped NICs are ``math.inf``. Hosts in
    host order; ``[]`` without ``spec.hosts``. Wire rates, as :func:`effective_uplinks`.
    """
    if spec.hosts is None:
        return []
    return [(ranks, mbit_to_bytes_per_s(spec.nic(ranks[0])), mbit_to_bytes_per_s(spec.nic(ranks[0])))
            for _, ranks in spec.host_groups()]


def hosts_allreduce_bound_seconds(out_bps: Sequence[float], nbytes: float,
                                  in_bps: Optional[Sequence[float]] = None) -> float:
    """Lower bound on the time of any AllReduce of ``nbytes`` over hosts with these NICs.

    ``out_bps[h]``/``in_bps[h]``: what host h can send to / receive from the other hosts, in
    bytes/s (its NIC; ``in_bps`` defaults to ``out_bps``, ``inf`` = unshaped). Ranks of a host
    combine their data over loopback for free, so only the H hosts count, and

        T >= max( max_h N / out_h,  max_h N / in_h,
                  2 (H - 1) N / sum_h out_h,  2 (H - 1) N / sum_h in_h )

    * the cut {h} | the other hosts: the other hosts' result depends on every element of h's
      data, and h's on theirs, so at least N bytes leave h and N enter it (without compression
      or in-network reduction);
    * hosts as nodes: every element has H partial sums (one per host); merging them takes at
      least H - 1 inter-host messages and spreading the sum to every host H - 1 more (one-way
      gossip needs 2(H - 1) messages), so 2 (H - 1) N bytes leave hosts in all, each through
      one host's egress, and enter hosts through their ingresses.

    H = 2: ``2 N / (out_0 + out_1) <= N / min(out)``, the bound is ``N / slowest NIC``. Equal
    NICs ``nic``: ``max(1, 2 (H - 1) / H) N / nic = 2 (H - 1) / H * N / nic``, the uniform ring
    (design.md section 9). E.g. 3 hosts at 100 Mbit/s (12.5e6 B/s), 12 MB: 4/3 * 0.96 s =
    1.28 s; 1000,1000,100 Mbit/s: max(12e6 / 12.5e6, 4 * 12e6 / 262.5e6) = max(0.96, 0.18) = 0.96 s,
    the slow host's cut. One host: 0.
    Pass payload rates (``* TCP_GOODPUT_FRACTION``) for a bound on measured TCP times.
    """
    out_bps = list(out_bps)
    in_bps = list(out_bps if in_bps is None else in_bps)
    h = len(out_bps)
    if len(in_bps) != h:
        raise ValueError(f"out_bps has {h} hosts, in_bps {len(in_bps)}")
    if h <= 1 or nbytes <= 0:
        return 0.0
    rate = min(min(out_bps), min(in_bps), math.fsum(out_bps) / (2 * (h - 1)),
               math.fsum(in_bps) / (2 * (h - 1)))
    return 0.0 if math.isinf(rate) else nbytes / rate


def ring_allreduce_seconds(bw: Sequence[Sequence[float]], nbytes: float,
                           shares: Optional[Sequence[float]] = None,
                           order: Optional[Sequence[int]] = None) -> float:
    """Time of a pipelined ring AllReduce of ``nbytes`` on links of bandwidth ``bw`` (bytes/s).

    The ring cost model of design.md section 2: rank A owns (fully reduces) a fraction ``s_A``
    of the buffer. In reduce-scatter the link A->B carries every chunk except A's own; in
    all-gather every chunk except B's own, so it carries ``(2 - s_A - s_B) * nbytes`` in all and

        T = max over ring links A->B of (2 - s_A - s_B) * nbytes / bw(A->B)

    (no latency terms). ``shares`` defaults to uniform ``1/P`` (what Gloo and NCCL do), giving
    ``2 * nbytes * (P-1)/P / min(bw)`` when one link is the slowest; ``order`` defaults to
    ``0, 1, ..., P-1``. Example: NICs 800,800,800,100 Mbit/s, 16 MB, uniform: 24 MB through the
    12.5 MB/s NIC = 1.92 s.
    """
    p = len(bw)
    if p <= 1:
        return 0.0
    order = list(range(p)) if order is None else list(order)
    if sorted(order) != list(range(p)):
        raise ValueError(f"order must be a permutation of 0..{p - 1}, got {order}")
    if shares is None:
        shares = [1.0 / p] * p
    if len(shares) != p or abs(sum(shares) - 1.0) > 1e-6 or min(shares) < 0:
        raise ValueError(f"shares must be {p} non-negative fractions summing to 1, got {shares}")
    t = 0.0
    for k in range(p):
        a, b = order[k], order[(k + 1) % p]
        load = (2.0 - shares[a] - shares[b]) * nbytes
        t = max(t, load / bw[a][b] if bw[a][b] > 0 else math.inf)
    return t


def choose_tcp_cc(requested: Optional[str], host: str, available: Sequence[str],
                  allowed: Sequence[str]) -> tuple[str, bool, str]:
    """The congestion control a simulated cluster uses: ``(name, write, note)``.

    ``requested`` is ``SimSpec.tcp_cc``; ``host`` the host's default (what a new namespace
    inherits); ``available`` the kernel's ``tcp_available_congestion_control``; ``allowed`` its
    ``tcp_allowed_congestion_control``, the algorithms a namespace other than the host's may
    select (Linux refuses the others with EPERM, root or not). ``write`` says whether the
    namespaces' setting must be written (not when the name is what they inherit anyway); ``note``
    explains a choice the user did not spell out ("" otherwise). Pure: the kernel is read by the
    caller. An explicit name is returned as is (the write reports a refusal); ``"auto"`` never
    fails.
    """
    if requested is None:
        return host, False, ""
    if requested != AUTO_TCP_CC:
        return requested, requested != host, ""
    rule = f"net.ipv4.tcp_allowed_congestion_control = {' '.join(allowed) or '(empty)'}"
    for rank, name in enumerate(TCP_CC_PREFERENCE):
        if name == host or name in allowed:  # inherited, or selectable
            note = "" if rank == 0 else (f"TCP {name}: {', '.join(TCP_CC_PREFERENCE[:rank])} is not "
                                         f"allowed in network namespaces here ({rule})")
            return name, name != host, note
    return host, False, (f"TCP {host}, the host's: none of {', '.join(TCP_CC_PREFERENCE)} is allowed "
                         f"in network namespaces here ({rule})")
