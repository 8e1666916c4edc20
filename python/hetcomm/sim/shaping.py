"""Which ``tc`` commands shape a simulated cluster, and where (pure: builds argument lists only).

Every packet passes two shaping points: the sender's ``eth0`` (HTB: a parent class at the NIC
rate, one leaf per destination capped at the link rate, a default leaf) and the receiver's
hub-side port (``tbf`` at the NIC rate). Shared WAN uplinks get the same HTB on both ends of the
site's uplink veth (`uplink_plan`); hosts are shaped as the ranks of ``spec.network_spec()``;
``--latency-ms`` adds netem on each egress. Burst: ``max(2 ms * rate, 4000 bytes)``.

What is shaped where, why a queue per destination even for a NIC-only cluster (measured), and
the burst measurements: docs/simulator.md#what-is-shaped-where.
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
    queue behind what it sends (docs/simulator.md#why-a-queue-per-destination).
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
