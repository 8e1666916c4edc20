"""A simulated heterogeneous cluster on one Linux machine (root): ``python -m hetcomm.sim``.

One network namespace per rank (or per host with ``--hosts``), joined by a bridge, with ``tc``
shaping each NIC (both directions) and optionally every directed link or a shared WAN uplink per
site, and a CPU quota per rank (cgroups)::

    python -m hetcomm.sim --nic-mbit 800,800,800,100 [--cpu-quota 1,1,0.5,0.25] -- CMD ARGS...

From Python: `SimSpec`, `SimCluster`, `effective_bandwidth`. `spec` and `shaping` are pure and
import without root; building a cluster needs root, ``ip`` and ``tc``. The modules: `netns`
(namespaces), `shaping` (``tc``), `cluster` (build and tear down), `launcher` (one command per
rank). Options, Python use and the internals: docs/simulator.md.
"""
from hetcomm.rates import MBIT, mbit_to_bytes_per_s, parse_matrix, parse_rate_list
from hetcomm.sim.spec import (TCP_GOODPUT_FRACTION, SimError, SimSpec, effective_bandwidth, effective_host_nics,
                              effective_link_mbit, effective_uplinks, hosts_allreduce_bound_seconds,
                              ring_allreduce_seconds)
from hetcomm.sim.launcher import RankProcess, RunResult, SimInterrupted
from hetcomm.sim.cluster import SimCluster
from hetcomm.sim.registry import cleanup_stale
from hetcomm.sim.netns import check_prerequisites

__all__ = [
    "SimSpec", "SimCluster", "SimError", "SimInterrupted", "RankProcess", "RunResult",
    "effective_bandwidth", "effective_link_mbit", "effective_uplinks", "ring_allreduce_seconds",
    "effective_host_nics", "hosts_allreduce_bound_seconds",
    "mbit_to_bytes_per_s",
    "parse_matrix", "parse_rate_list", "check_prerequisites", "cleanup_stale",
    "TCP_GOODPUT_FRACTION", "MBIT",
]
