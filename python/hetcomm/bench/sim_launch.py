"""``--sim-*``: run the benchmark on a simulated heterogeneous cluster (:mod:`hetcomm.sim`).

The launcher builds a :class:`~hetcomm.sim.SimCluster` (root only) and starts, in each rank's
namespace, ``python -m hetcomm.bench`` with every resolved option spelled out
(:func:`hetcomm.bench.config.worker_argv`): the env-mode rank of the ordinary CLI, so the ranks
run exactly the worker code of a local run. Failures follow
:func:`hetcomm.sim.launcher.supervise` (``GRACE_S``); the cluster is removed on every exit path.

Details: docs/bench-cli.md#how-ranks-come-to-exist.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

from hetcomm.bench.config import ARGV_ENV, BenchConfig, worker_argv
from hetcomm.bench.report import PREFIX

EXIT_SETUP_FAILED = 2
GRACE_S = 30.0


def unavailable_reason() -> Optional[str]:
    """Why no simulated cluster can be built here (not root, no iproute2), or None."""
    if os.geteuid() != 0:
        return ("--sim-* options need root: the simulated cluster is made of network namespaces, "
                "tc shaping and cgroups (run as root, e.g. `sudo -E python -m hetcomm.bench "
                "--sim-nic-mbit ...`, or drop the --sim-* options for a local run)")
    from hetcomm.sim.netns import check_prerequisites
    from hetcomm.sim.spec import SimError
    try:
        check_prerequisites()
    except SimError as error:
        return f"--sim-*: {error}"
    return None


def _log(message: str) -> None:
    print(f"{PREFIX}: sim: {message}", file=sys.stderr, flush=True)


def rank_environment(config: BenchConfig, spec) -> dict[str, str]:
    """What each rank gets on top of the cluster's own variables."""
    env = {ARGV_ENV: json.dumps(list(config.argv))}
    # As the local launcher (and torchrun): ranks sharing few cores must not each start a full
    # OpenMP pool. With CPU quotas the cluster sets it from each rank's quota.
    if spec.cpu_quota is None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def launch_sim(config: BenchConfig, spec) -> int:
    """Runs the benchmark on the simulated cluster ``spec``; returns the exit status."""
    from hetcomm.sim import SimCluster, SimError, SimInterrupted
    from hetcomm.sim.launcher import binary_writer, start_pump, supervise

    command = [sys.executable, "-m", "hetcomm.bench", *worker_argv(config)]
    try:
        with SimCluster(spec, log=_log) as cluster:
            for line in cluster.describe().splitlines():
                _log(line)
            _log(f"{spec.world_size} ranks run: python -m hetcomm.bench "
                 + " ".join(worker_argv(config)))
            ranks = cluster.launch(command, rank_environment(config, spec))
            write_out, write_err = binary_writer(sys.stdout), binary_writer(sys.stderr)
            pumps = []
            for rank in ranks:
                prefix = b"" if rank.rank == 0 else f"[rank {rank.rank}] ".encode()
                pumps.append(start_pump(rank.popen.stdout, prefix, write_out))
                pumps.append(start_pump(rank.popen.stderr, prefix, write_err))
            result = supervise(ranks, grace_s=GRACE_S, log=_log, pumps=pumps)
            if result.status != 0:
                _log("statuses by rank: " + ", ".join(
                    f"{k}:{s}{'(terminated)' if t else ''}"
                    for k, (s, t) in enumerate(zip(result.statuses, result.terminated_by_sim))))
        return result.status
    except SimInterrupted as interrupt:
        _log(f"interrupted ({interrupt}); the cluster was removed")
        return interrupt.exit_status
    except KeyboardInterrupt:
        _log("interrupted; the cluster was removed")
        return 130
    except SimError as error:
        print(f"{PREFIX}: simulated cluster: {error}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
