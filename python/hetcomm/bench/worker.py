"""What every rank does, however it was launched.

For each backend in turn, in the same processes: ``init_process_group`` (its own key space on
the store, so nothing leaks between groups), every size (`hetcomm.bench.measure`),
``destroy_process_group``. Rank 0 records the plan each group uses, evaluates it against the
physical model inside a simulated cluster (`hetcomm.bench.analysis`), and reports. Every rank
returns the same exit status.

Why the same processes, the key spaces, backend variants and the exit status:
docs/bench-cli.md#what-every-rank-does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import platform
import shlex
import socket
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hetcomm.bench import report
from hetcomm.bench.config import ARGV_ENV, BenchConfig, torch_backend, variant_environment
from hetcomm.bench.measure import ControlPlane, Heartbeat, measure_allreduce
from hetcomm.bench.results import BenchReport, SizeResult

EXIT_OK = 0
EXIT_WRONG_RESULTS = 1
EXIT_PLOT_FAILED = 2


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def import_backend_modules(backends: tuple[str, ...]) -> None:
    """Imports the modules that register plugin backends (before any init_process_group)."""
    if "hetcomm" in {torch_backend(name) for name in backends}:
        importlib.import_module("hetcomm")


@contextlib.contextmanager
def backend_environment(backend: str) -> Iterator[dict[str, Optional[str]]]:
    """Sets the variables of a backend variant for the duration of the block, then restores them."""
    overrides = variant_environment(backend, os.environ)
    saved = {key: os.environ.get(key) for key in overrides}
    try:
        _set_environment(overrides)
        yield overrides
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, Optional[str]]) -> None:
    """Sets each variable to its value; None unsets it."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _finite(value: float) -> Optional[float]:
    return value if value == value and abs(value) != float("inf") else None


def model_json(model) -> Optional[dict[str, Any]]:
    """A hetcomm ``LinkModel`` as JSON-ready data (unmeasured/infinite entries as None)."""
    if model is None:
        return None
    P = model.world_size
    return {"bw_bytes_per_s": [[None if i == j else _finite(model.bw[i][j]) for j in range(P)]
                               for i in range(P)],
            "reduce_bps": [_finite(v) for v in model.reduce_bps],
            "alpha_s": model.alpha, "segment_bytes": model.segment_bytes,
            "small_allreduce_bytes": model.small_allreduce_bytes}


def plan_source(world_size: int) -> str:
    """Where the plan of a hetcomm group created now comes from (hetcomm.topology's rules)."""
    if world_size == 1:
        return "single rank: no plan"
    declared = os.environ.get("HETCOMM_LINK_MBIT", "").strip()
    if declared:
        return f"declared HETCOMM_LINK_MBIT={declared}"
    if os.environ.get("HETCOMM_PROBE", "1").strip() == "0":
        return "HETCOMM_PROBE=0: links not probed, uniform plan"
    return "links probed at group creation"


def record_plan(backend: str, world_size: int) -> dict[str, Any]:
    """The plan the default group (just created on ``backend``) uses, as JSON-ready data."""
    if torch_backend(backend) != "hetcomm":
        from hetcomm.bench.analysis import uniform_record
        return uniform_record(backend, world_size,
                              f"{backend} does not plan: modelled as a uniform ring")
    import hetcomm
    from hetcomm._engine import engine_settings
    from hetcomm.planner import format_plan
    engine = engine_settings()
    plan = hetcomm.get_plan()
    model = hetcomm.link_model()
    return {
        "backend": backend, "kind": "hetcomm", "source": plan_source(world_size),
        "order": list(plan.order), "shares": list(plan.shares), "min_bytes": int(plan.min_bytes),
        "segment_bytes": int(getattr(plan, "segment_bytes", 0)),
        "sites": None if plan.sites is None else dataclasses.asdict(plan.sites),
        "topology": None if plan.topology is None else plan.topology.describe(),
        "text": format_plan(plan, model), "model": model_json(model),
        # engine settings that decide which algorithm and segment size an allreduce gets, as the
        # engine itself reads them (hetcomm._C.engine_settings, through hetcomm._engine)
        "env_segment_bytes": int(engine["segment_bytes"]),
        "small_allreduce_bytes": int(engine["small_allreduce_bytes"]),
    }


def rendezvous(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """The shared store, this rank and the world size, from the ``env://`` variables."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return store, rank, world_size


def run_backend(backend: str, index: int, config: BenchConfig, store: dist.Store,
                control: ControlPlane, heartbeat: Heartbeat,
                on_result: Callable[[SizeResult], None],
                on_plan: Callable[[dict[str, Any]], None] = lambda record: None,
                ) -> list[SizeResult]:
    """Inits the default group on ``backend``, measures every size, destroys the group."""
    timeout = timedelta(seconds=config.timeout_s)
    heartbeat(2 * config.timeout_s)
    with backend_environment(backend):
        dist.init_process_group(
            torch_backend(backend),
            store=dist.PrefixStore(f"hetcomm.bench/pg/{index}.{backend}/", store),
            rank=control.rank, world_size=control.world_size, timeout=timeout)
        if control.rank == 0:
            on_plan(record_plan(backend, control.world_size))
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


def give_ranks_nccl_hosts(backends: Sequence[str], rank: int, world_size: int) -> None:
    """Ranks that share a GPU get an NCCL_HOSTID each, unless it is set: NCCL refuses a GPU twice
    on one machine, and so takes them for machines of their own (it then connects them through
    its network transport, not through the GPU's memory). hetcomm's host is unchanged. Only when
    this machine's ranks (LOCAL_WORLD_SIZE, as torchrun and the local launcher set it) outnumber
    its GPUs: machines whose ranks each have a GPU keep NCCL's transports within a machine."""
    uses_nccl = any(name in ("nccl", "hetcomm-nccl") for name in backends)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if not uses_nccl or local_ranks <= torch.cuda.device_count() or os.environ.get("NCCL_HOSTID"):
        return
    os.environ["NCCL_HOSTID"] = f"rank{rank}-{socket.gethostname()}"  # the rank first: it must survive a cut
    if rank == 0:
        print(f"{report.PREFIX}: {local_ranks} ranks share {torch.cuda.device_count()} GPU(s): each has an "
              "NCCL_HOSTID of its own, so NCCL connects them as separate machines", file=sys.stderr, flush=True)


def new_report(config: BenchConfig, launch: str, world_size: int) -> BenchReport:
    argv = list(config.argv)
    if os.environ.get(ARGV_ENV):
        argv = list(json.loads(os.environ[ARGV_ENV]))
    return BenchReport(
        argv=argv,
        command=shlex.join([sys.executable, "-m", "hetcomm.bench", *argv[1:]]),
        launch=launch, world_size=world_size, backends=list(config.backends),
        dtype=config.dtype, hostname=socket.gethostname(), torch_version=torch.__version__,
        python_version=platform.python_version(), started_at=_now(), config=config.to_json())


def run_rank(config: BenchConfig, launch: str, heartbeat: Heartbeat) -> int:
    """The whole benchmark on this rank; returns the exit status (same on every rank)."""
    import_backend_modules(config.backends)
    sim_spec = simulated_cluster()
    if sim_spec is not None:
        launch = "sim"
    store, rank, world_size = rendezvous(timedelta(seconds=config.timeout_s))
    if config.device == "cuda":
        from hetcomm.bench.measure import rank_device
        torch.cuda.set_device(rank_device(config.device, rank))
        give_ranks_nccl_hosts(config.backends, rank, world_size)
    control = ControlPlane(store, rank, world_size, timedelta(seconds=config.timeout_s))
    bench_report = new_report(config, launch, world_size)
    if rank == 0 and sim_spec is not None:
        from hetcomm.bench.analysis import physical_model
        bench_report.sim = physical_model(sim_spec)

    def on_result(result: SizeResult) -> None:
        if rank == 0:
            report.print_progress(result)

    def on_plan(record: dict[str, Any]) -> None:
        bench_report.plans[record["backend"]] = record
        report.print_plan(record)

    for index, backend in enumerate(config.backends):
        bench_report.results += run_backend(backend, index, config, store, control,
                                            heartbeat, on_result, on_plan)
    heartbeat(config.timeout_s)
    # Nobody leaves while a peer may still need the store or the control plane.
    control.barrier()
    bench_report.finished_at = _now()

    status = EXIT_WRONG_RESULTS if bench_report.total_wrong else EXIT_OK
    if rank == 0:
        if bench_report.sim is not None:
            from hetcomm.bench.analysis import annotate
            annotate(bench_report)
        report.print_table(bench_report)
        if config.json_path:
            report.write_json(bench_report, config.json_path)
        if config.plot_path:
            from hetcomm.bench.plot import PlotError, write_plot
            try:
                write_plot(bench_report.to_json(), config.plot_path)
            except PlotError as error:
                print(f"{report.PREFIX}: --plot failed: {error}", file=sys.stderr, flush=True)
                status = EXIT_PLOT_FAILED
            else:
                print(f"{report.PREFIX}: wrote {config.plot_path}", file=sys.stderr, flush=True)
    return status


def simulated_cluster():
    """The ``SimSpec`` of the simulated cluster this rank runs in, or None (not simulated)."""
    if os.environ.get("HETCOMM_SIM") != "1" or not os.environ.get("HETCOMM_SIM_SPEC"):
        return None
    from hetcomm.sim.spec import SimSpec
    return SimSpec.from_env()
