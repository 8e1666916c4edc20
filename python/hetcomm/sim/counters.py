"""What a simulated cluster's kernel counted: its queues (``tc -s``), its ranks' CPU throttling,
its sites' shared uplinks' bytes. A mixin of `hetcomm.sim.cluster.SimCluster`."""
from __future__ import annotations

import json
from typing import Any

from hetcomm.sim.netns import RANK_IFNAME
from hetcomm.sim.spec import SimError


class Counters:
    """`SimCluster`'s readings of the kernel's counters (the cluster must be up)."""

    def tc_show(self) -> str:
        """``tc -s qdisc/class`` of every shaped device (for debugging and reports)."""
        self._require_up()
        assert self._run is not None
        parts = []
        for k, ns in enumerate(self.node_namespaces):
            name = self._node_name(k)
            for what in ("qdisc", "class"):
                p = self._run(["tc", "-n", ns, "-s", what, "show", "dev", RANK_IFNAME], check=False)
                if p.stdout.strip():
                    parts.append(f"## {name} egress ({ns} {RANK_IFNAME}) {what}\n{p.stdout.rstrip()}")
            p = self._run(["tc", "-n", self.hub_namespace, "-s", "qdisc", "show", "dev",
                           self.hub_ports[k]], check=False)
            if p.stdout.strip():
                parts.append(f"## {name} ingress ({self.hub_namespace} {self.hub_ports[k]})\n"
                             f"{p.stdout.rstrip()}")
        for label, _, out_port, in_port in self._uplinks():
            for direction, dev in (("out", out_port), ("in", in_port)):
                p = self._run(["tc", "-n", self.hub_namespace, "-s", "class", "show", "dev", dev],
                              check=False)
                parts.append(f"## site {label} uplink {direction} ({self.hub_namespace} {dev})\n"
                             f"{p.stdout.rstrip()}")
        return "\n".join(parts)

    def cpu_stat(self, rank: int) -> dict[str, int]:
        """How the kernel throttled rank's CPU quota so far (its cgroup's cpu.stat: nr_periods,
        nr_throttled, throttled time); {} without --cpu-quota."""
        return {} if self._cgroups is None else self._cgroups.cpu_stat(rank)

    def uplink_bytes(self) -> dict[Any, dict[str, int]]:
        """Bytes each site's shared uplink has sent so far: ``{site label: {"out": n, "in": n}}``.

        ``out``: everything the site sent to other sites, ``in``: everything other sites sent to
        it; read from the uplink qdiscs (``tc -s -j qdisc show``, the root HTB's ``bytes``).
        These are frames as the kernel queues them: TCP payload plus TCP/IP/Ethernet headers
        (about 1514 bytes per 1448 of payload, ``TCP_GOODPUT_FRACTION``), ACKs and ARP. Sites
        in the order of ``spec.site_groups()``; ``{}`` without shared uplinks.
        """
        self._require_up()
        assert self._run is not None
        out: dict[Any, dict[str, int]] = {}
        for label, _, out_port, in_port in self._uplinks():
            out[label] = {"out": self._root_qdisc_bytes(out_port), "in": self._root_qdisc_bytes(in_port)}
        return out

    def _uplinks(self) -> list[tuple[Any, tuple[int, ...], str, str]]:
        """``[(site label, its nodes, out device, in device), ...]``; [] without shared uplinks.

        Nodes are ranks, or hosts with ``spec.hosts`` (the sites in the same order either way:
        by lowest rank)."""
        if not self.site_bridges:
            return []
        return [(label, nodes, self.uplink_out_ports[n], self.uplink_in_ports[n])
                for n, (label, nodes) in enumerate(self.net.site_groups())]

    def _root_qdisc_bytes(self, dev: str) -> int:
        assert self._run is not None
        argv = ["tc", "-n", self.hub_namespace, "-s", "-j", "qdisc", "show", "dev", dev]
        proc = self._run(argv, what=f"reading the counters of {dev}")
        try:
            qdiscs = json.loads(proc.stdout)
            return next(int(q["bytes"]) for q in qdiscs if q.get("root"))
        except (ValueError, KeyError, TypeError, StopIteration):
            raise SimError(f"`tc {' '.join(argv[1:])}` printed no root qdisc with a byte count: "
                           f"{proc.stdout.strip()[:200]!r}") from None
