"""A simulated heterogeneous cluster on one Linux machine (root): ``python -m hetcomm.sim``.

One network namespace per rank (or per host with ``--hosts``: its ranks share it), joined by a bridge in a hub namespace, with ``tc`` shaping each
rank's NIC (both directions) and optionally every directed link, and a CPU quota per rank
(cgroups). Commands run once per rank inside their namespace with the usual torch.distributed
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and ``HETCOMM_SIM_*`` describing the
shaping. See :mod:`hetcomm.sim.shaping` for exactly what is shaped where,
:mod:`hetcomm.sim.cluster` for the clean-up guarantees and :mod:`hetcomm.sim.launcher` for the
failure rules.

Command line::

    python -m hetcomm.sim --nic-mbit 800,800,800,100 [--cpu-quota 1,1,0.5,0.25] -- CMD ARGS...
    python -m hetcomm.sim --sites 0,0,1,1 --intra-mbit 1000 --inter-mbit 100 -- CMD ...   # per pair
    python -m hetcomm.sim --sites 0,0,1,1 --intra-mbit 1000 --wan-mbit 100 -- CMD ...     # shared uplinks
    python -m hetcomm.sim --link-mbit "0,800,100;800,0,100;100,100,0" -- CMD ...
    python -m hetcomm.sim --hosts 0,0,1,1 --nic-mbit 1000,100 -- CMD ...   # 2 ranks per host

Python::

    from hetcomm.sim import SimSpec, SimCluster, effective_bandwidth
    spec = SimSpec(nic_mbit=[800, 800, 800, 100])
    effective_bandwidth(spec)            # bytes/s, no root needed
    with SimCluster(spec) as cluster:    # root
        status = cluster.run([sys.executable, "train.py"])

Pure parts (:mod:`hetcomm.sim.spec`, :mod:`hetcomm.sim.shaping`) import without root;
building a cluster needs root, ``ip`` and ``tc``.
"""
from hetcomm.rates import MBIT, mbit_to_bytes_per_s, parse_matrix, parse_rate_list
from hetcomm.sim.spec import (TCP_GOODPUT_FRACTION, SimError, SimSpec, effective_bandwidth, effective_host_nics,
                              effective_link_mbit, effective_uplinks, hosts_allreduce_bound_seconds,
                              ring_allreduce_seconds)
from hetcomm.sim.launcher import RankProcess, RunResult, SimInterrupted
from hetcomm.sim.cluster import SimCluster, cleanup_stale
from hetcomm.sim.netns import check_prerequisites

__all__ = [
    "SimSpec", "SimCluster", "SimError", "SimInterrupted", "RankProcess", "RunResult",
    "effective_bandwidth", "effective_link_mbit", "effective_uplinks", "ring_allreduce_seconds",
    "effective_host_nics", "hosts_allreduce_bound_seconds",
    "mbit_to_bytes_per_s",
    "parse_matrix", "parse_rate_list", "check_prerequisites", "cleanup_stale",
    "TCP_GOODPUT_FRACTION", "MBIT",
]
