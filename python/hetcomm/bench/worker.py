"""What every rank does, however it was launched.

Process groups: one per backend, in turn, in the same processes
-----------------------------------------------------------------
For each backend: ``init_process_group(backend)``, all sizes, ``destroy_process_group()``, next
backend. Same processes, because a fresh set of processes per backend would pay process start
and ``import torch`` again and lose the control plane. Re-initialising is made robust by not
reusing anything between groups: every group gets its own key space on the store
(``PrefixStore("hetcomm.bench/pg/<i>.<backend>/")``), so keys a previous group left behind
(rank addresses, barrier counters) can never be read by the next one; and the store itself
outlives all groups (the launcher's, or torchrun's agent's, or rank 0's), so no port is reused.

The store comes from the ``env://`` rendezvous in both launch modes: under torchrun the agent
hosts it; in local mode the launcher hosts it and sets the same variables torchrun would. Every
group has ``timeout = --timeout``.

Rank 0 reports: progress on stderr as each (backend, size) finishes, and at the end the table
and the JSON file. Every rank returns the same exit status (all know the global #wrong).
"""
from __future__ import annotations

import datetime
import importlib
import platform
import shlex
import socket
import sys
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from hetcomm.bench import report
from hetcomm.bench.config import BenchConfig
from hetcomm.bench.measure import ControlPlane, Heartbeat, measure_allreduce
from hetcomm.bench.results import BenchReport, SizeResult

EXIT_OK = 0
EXIT_WRONG_RESULTS = 1


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def import_backend_modules(backends: tuple[str, ...]) -> None:
    """Imports the modules that register plugin backends (before any init_process_group)."""
    if "hetcomm" in backends:
        importlib.import_module("hetcomm")


def rendezvous(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """The shared store, this rank and the world size, from the ``env://`` variables."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return store, rank, world_size


def run_backend(backend: str, index: int, config: BenchConfig, store: dist.Store,
                control: ControlPlane, heartbeat: Heartbeat,
                on_result: Callable[[SizeResult], None]) -> list[SizeResult]:
    """Inits the default group on ``backend``, measures every size, destroys the group."""
    timeout = timedelta(seconds=config.timeout_s)
    heartbeat(2 * config.timeout_s)
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"hetcomm.bench/pg/{index}.{backend}/", store),
        rank=control.rank, world_size=control.world_size, timeout=timeout)
    results = []
    for size in config.sizes:
        result = measure_allreduce(backend, size, config, control, heartbeat)
        results.append(result)
        on_result(result)
    # Destroyed on success only. After a failure the process exits anyway, and tearing the group
    # down first would close its connections, so that peers fail ("connection closed by peer")
    # before this rank has reported the actual cause.
    dist.destroy_process_group()
    return results


def new_report(config: BenchConfig, launch: str, world_size: int) -> BenchReport:
    argv = list(config.argv)
    return BenchReport(
        argv=argv,
        command=shlex.join([sys.executable, "-m", "hetcomm.bench", *argv[1:]]),
        launch=launch, world_size=world_size, backends=list(config.backends),
        dtype=config.dtype, hostname=socket.gethostname(), torch_version=torch.__version__,
        python_version=platform.python_version(), started_at=_now(), config=config.to_json())


def run_rank(config: BenchConfig, launch: str, heartbeat: Heartbeat) -> int:
    """The whole benchmark on this rank; returns the exit status (same on every rank)."""
    import_backend_modules(config.backends)
    store, rank, world_size = rendezvous(timedelta(seconds=config.timeout_s))
    control = ControlPlane(store, rank, world_size, timedelta(seconds=config.timeout_s))
    bench_report = new_report(config, launch, world_size)

    def on_result(result: SizeResult) -> None:
        if rank == 0:
            report.print_progress(result)

    for index, backend in enumerate(config.backends):
        bench_report.results += run_backend(backend, index, config, store, control,
                                            heartbeat, on_result)
    heartbeat(config.timeout_s)
    # Nobody leaves while a peer may still need the store or the control plane.
    control.barrier()
    bench_report.finished_at = _now()

    if rank == 0:
        report.print_table(bench_report)
        if config.json_path:
            report.write_json(bench_report, config.json_path)
    return EXIT_WRONG_RESULTS if bench_report.total_wrong else EXIT_OK
