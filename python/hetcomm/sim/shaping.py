"""Which ``tc`` commands shape a simulated cluster, and where (pure: builds argument lists only).

Topology (see :mod:`hetcomm.sim.netns`): rank k lives in namespace ``hcsim-<id>-r<k>`` with one
interface ``eth0``; its veth peer ``hc<id>p<k>`` is a port of the bridge in the hub namespace.
A packet from rank i to rank j leaves i's ``eth0`` (rank i's egress), crosses the bridge and
leaves the hub through ``hc<id>p<j>`` towards j (rank j's ingress). So every packet passes
exactly two shaping points: the sender's ``eth0`` and the receiver's hub-side port.

What is shaped where
--------------------
Egress, ``eth0`` in rank i's namespace (with a NIC rate, per-link rates, or both): HTB, root ``1:``

* ``1:1``    parent class, rate = ceil = NIC_i (absent when NIC_i is unshaped)
* ``1:<10+j>`` (hex minor) one leaf per destination j, ``ceil = min(link_ij, NIC_i)``,
  guaranteed ``rate = min(ceil, NIC_i/P)`` so that the guarantees sum to at most NIC_i and
  every byte above them is borrowed from ``1:1`` (an HTB leaf below its own ``rate`` never
  asks its parent, so a leaf rate above NIC_i would escape the NIC cap)
* ``1:2``    default class for everything else (ARP, traffic to the hub address), ceil NIC_i
* u32 filters ``match ip dst <addr_j>/32 flowid 1:<10+j>``

-> i's egress: each flow i->j at most link_ij, all of i's flows together at most NIC_i.

Ingress, ``hc<id>p<j>`` in the hub: ``tbf rate NIC_j`` -> all flows into j at most NIC_j.

Shared WAN uplinks (``--wan-mbit``; :mod:`hetcomm.sim.netns` has the layout): a packet between
sites also leaves its site's bridge through the site-side end of the site's uplink veth,
``hc<id>o<s>`` (egress: the site's *out* direction), and enters the destination site from the
core bridge through the core-side end ``hc<id>i<t>`` (egress: site t's *in* direction). Each end
gets the HTB of a NIC at ``wan_mbit`` (a leaf per destination rank under a parent at the uplink
rate, :func:`uplink_plan`), so all of a site's cross-site flows share one rate per direction.
Per-pair rates (``--inter-mbit``) still apply at the sender's ``eth0``, on top.

Why a queue per destination even for a NIC-only cluster: a host's NIC queue is not one FIFO
(Linux's default qdisc, fq_codel, keeps a queue per flow). With one FIFO, a rank that sends and
receives at full rate at once -- the slow rank of a weighted ring does exactly that -- has the
ACKs of what it receives wait behind up to ``latency`` (100 ms) of what it sends, and full
throughput in both directions then needs both queues full: every allreduce ends 100 ms after its
last byte was sent. Measured on 800/800/800/100 Mbit/s, 4 ranks, 16 MB: hetcomm at 1.16x and
1.19x the bound in two runs with one egress FIFO (tbf), 1.07x and 1.13x with a leaf per
destination (this kernel has no fq_codel); gloo stayed 1.45-1.5x slower than hetcomm.

Hosts (``SimSpec.hosts``): the cluster shapes ``spec.network_spec()``, whose ranks are the
hosts, with these same plans: host h's ``eth0`` (egress, a leaf per destination host) and its
hub-side port (ingress) carry the NIC of all of h's ranks together; traffic between ranks of
one host stays on the namespace's loopback and is never shaped.

The link rate is enforced at the sender only; a flow i->j therefore gets
``min(NIC_i, link_ij, NIC_j)`` (:func:`hetcomm.sim.spec.effective_bandwidth`).

Latency (``--latency-ms``): a netem qdisc adds a one-way delay on each rank's egress (the leaf
qdisc of every HTB class, or the root qdisc of an unshaped rank); the round trip is
twice the value. It needs CONFIG_NET_SCH_NETEM: on a kernel without it setup fails with a clear
message (the development VM's kernel has no netem).

Burst
-----
``tbf``'s bucket is ``burst = max(2 ms * rate, 4000 bytes)``. The 32 kbit (4000 B) bucket that
shapes 100 Mbit/s correctly is far too small at high rates (at 800 Mbit/s TCP got only 49 MB/s
of 100). Measured TCP goodput through one tbf on a veth, on the 2-core development VM:

=========  ============  ==========  =========  ============
rate       burst 32kbit  1 ms worth  2 ms worth 4 ms worth
=========  ============  ==========  =========  ============
100 Mbit   11.7 MB/s     11.96       11.98      12.00
400 Mbit   -             47.1        48.0       48.0
800 Mbit   49.0          93.4        94.9       88.0 (noise)
1000 Mbit  54.6          119.1       116.9      120.1
=========  ============  ==========  =========  ============

(the TCP ceiling is 1448/1514 = 95.6 % of the rate: 11.95, 47.8, 95.6, 119.5 MB/s). 2 ms keeps
the error below the noise while the extra burst is tiny (25 kB at 100 Mbit/s). ``latency 100ms``
bounds the queue (limit = burst + 100 ms of traffic), as in design.md.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from hetcomm.rates import MBIT
from hetcomm.sim.spec import SimSpec

BURST_SECONDS = 0.002
MIN_BURST_BYTES = 4000
TBF_LATENCY = "100ms"
NETEM_LIMIT_PACKETS = 100000

Cmd = list[str]


def rate_arg(mbit: float) -> str:
    """A ``tc`` rate for ``mbit`` Mbit/s, exact to 1 kbit/s (``tc``: 1 kbit = 1000 bit)."""
    kbit = max(1, int(round(mbit * 1000)))
    return f"{kbit}kbit"


def burst_bytes(mbit: float) -> int:
    return max(MIN_BURST_BYTES, int(math.ceil(mbit * MBIT * BURST_SECONDS)))


def htb_quantum(mbit: float) -> int:
    # rate/10 like the default r2q, clamped into HTB's quiet range (no "quantum is big" warnings)
    return max(1514, min(200000, int(mbit * MBIT / 10)))


def tbf_args(mbit: float) -> Cmd:
    return ["tbf", "rate", rate_arg(mbit), "burst", str(burst_bytes(mbit)), "latency", TBF_LATENCY]


def netem_args(latency_ms: float) -> Cmd:
    return ["netem", "delay", f"{latency_ms:g}ms", "limit", str(NETEM_LIMIT_PACKETS)]


def htb_class_args(rate_mbit: float, ceil_mbit: float) -> Cmd:
    return ["htb", "rate", rate_arg(rate_mbit), "ceil", rate_arg(ceil_mbit),
            "burst", str(burst_bytes(ceil_mbit)), "cburst", str(burst_bytes(ceil_mbit)),
            "quantum", str(htb_quantum(rate_mbit))]


def leaf_classid(dest: int) -> str:
    return f"1:{10 + dest:x}"


def destination_leaf(dev: str, parent: str, dest: int, addr: str, rate_mbit: float,
                     ceil_mbit: float) -> list[Cmd]:
    """The HTB leaf ``1:<10+dest>`` under ``parent`` and the u32 filter sending ``addr`` to it."""
    cid = leaf_classid(dest)
    return [["class", "add", "dev", dev, "parent", parent, "classid", cid]
            + htb_class_args(rate_mbit, ceil_mbit),
            ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "dst", f"{addr}/32", "flowid", cid]]


def egress_plan(spec: SimSpec, rank: int, dev: str, addrs: Sequence[str]) -> list[Cmd]:
    """``tc`` argument lists (without ``tc -n NS``) for rank ``rank``'s egress on ``dev``."""
    nic = spec.nic(rank)
    lat = spec.latency_ms
    p = spec.world_size
    if not spec.per_link and nic is None:
        return [["qdisc", "add", "dev", dev, "root", "handle", "1:"] + netem_args(lat)] if lat else []

    links = spec.links() or [[None] * p for _ in range(p)]
    cmds: list[Cmd] = []
    top = "1:1" if nic is not None else "1:"
    qdisc = ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]
    if nic is not None:
        qdisc += ["default", "2"]
    cmds.append(qdisc)
    leaves: list[tuple[str, Optional[int]]] = []
    if nic is not None:
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", "1:1"] + htb_class_args(nic, nic))
        cmds.append(["class", "add", "dev", dev, "parent", "1:1", "classid", "1:2"]
                    + htb_class_args(nic / p, nic))
        leaves.append(("1:2", None))
    for j in range(p):
        if j == rank:
            continue
        link = links[rank][j]
        if link is None and nic is None:
            continue  # unshaped: HTB without a default class sends unclassified packets directly
        ceil = link if nic is None else (nic if link is None else min(link, nic))
        rate = ceil if nic is None else min(ceil, nic / p)
        cmds += destination_leaf(dev, top, j, addrs[j], rate, ceil)
        leaves.append((leaf_classid(j), j))
    if lat:
        for cid, _ in leaves:
            minor = int(cid.split(":")[1], 16)
            cmds.append(["qdisc", "add", "dev", dev, "parent", cid, "handle", f"{minor + 0x100:x}:"]
                        + netem_args(lat))
    return cmds


def ingress_plan(spec: SimSpec, rank: int, hub_dev: str) -> list[Cmd]:
    """``tc`` argument lists for rank ``rank``'s ingress: egress of its hub-side port ``hub_dev``."""
    nic = spec.nic(rank)
    if nic is None:
        return []
    return [["qdisc", "add", "dev", hub_dev, "root", "handle", "1:"] + tbf_args(nic)]


def uplink_plan(spec: SimSpec, site: int, direction: str, dev: str, addrs: Sequence[str]) -> list[Cmd]:
    """``tc`` argument lists shaping one direction of site ``site``'s shared WAN uplink on ``dev``.

    ``site`` indexes :meth:`SimSpec.site_groups`; ``direction`` is ``"out"`` (``dev`` is the
    site-side end of the uplink veth: everything the site sends to other sites) or ``"in"``
    (the core-side end: everything other sites send to it). The same HTB as a NIC: a parent at
    ``wan_mbit``, a leaf per destination rank (out: every rank of the other sites; in: the site's
    own ranks) and a default leaf, so that the ACKs a site returns for what it receives do not
    queue behind what it sends (see the module docstring).
    """
    wan = spec.wan_mbit
    if wan is None:
        return []
    if direction not in ("out", "in"):
        raise ValueError(f"uplink direction must be 'out' or 'in', got {direction!r}")
    inside = set(spec.site_groups()[site][1])
    dests = [j for j in range(spec.world_size) if (j in inside) == (direction == "in")]
    guarantee = wan / (len(dests) + 1)
    cmds: list[Cmd] = [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1"] + htb_class_args(wan, wan),
        ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:2"] + htb_class_args(guarantee, wan),
    ]
    for j in dests:
        cmds += destination_leaf(dev, "1:1", j, addrs[j], guarantee, wan)
    return cmds
