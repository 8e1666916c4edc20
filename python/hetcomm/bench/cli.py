"""Command line of ``python -m hetcomm.bench``: parse, validate up front, dispatch to a launcher.

Bad input (an unknown backend, a size that does not parse, a dtype torch lacks) is rejected here,
in one process and before any worker starts, with argparse's usage line and exit status 2.

Three launchers: ``--nprocs`` local ranks (default); this process as one rank under torchrun
(``RANK``/``WORLD_SIZE`` set); or, with any ``--sim-*`` option, a simulated heterogeneous
cluster (:mod:`hetcomm.bench.sim_launch`, root only) whose ranks each re-run this CLI as one
rank. Sim mode has its own defaults (backends ``hetcomm,hetcomm-uniform,gloo``, sizes
``16M,64M``, few iterations, a timeout for slow links); an option given explicitly always wins.

Exit status: 0 all results correct; 1 some result had #wrong > 0; 2 bad arguments or a failed
rank; 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from hetcomm.bench.config import (BACKEND_VARIANTS, DEFAULT_BACKENDS, DTYPE_BYTES,
                                  SIM_DEFAULT_BACKENDS, SIM_DEFAULT_MIN_ITERS, SIM_SITES_DEFAULT_BACKENDS,
                                  SIM_DEFAULT_SECONDS_PER_SIZE, SIM_DEFAULT_SIZES,
                                  SIM_DEFAULT_WARMUP, SIM_MIN_TIMEOUT_S, BenchConfig,
                                  canonical_dtype, declared_link_mbit, geometric_sizes, parse_size,
                                  parse_size_list, torch_backend, whole_element_sizes)
from hetcomm.bench.report import PREFIX

DEFAULT_NPROCS = 4
DEFAULT_MIN_BYTES = "8"
DEFAULT_MAX_BYTES = "64M"
DEFAULT_WARMUP = 3
DEFAULT_SECONDS_PER_SIZE = 0.3
DEFAULT_MIN_ITERS = 3
DEFAULT_TIMEOUT_S = 120.0
# In sim mode the timeout is at least this many times a uniform ring allreduce of the largest
# size on the simulated links (a slow link must not look like a hung peer).
SIM_TIMEOUT_FACTOR = 10.0

# The --sim-* options, as the names of hetcomm.sim's own options (its spec_from_args reads them).
SIM_OPTIONS = ("nic_mbit", "link_mbit", "sites", "intra_mbit", "inter_mbit", "wan_mbit", "cpu_quota",
               "latency_ms", "hosts", "tcp_cc")
# Those that describe the cluster: any of them turns the simulation on.
SIM_CLUSTER_OPTIONS = SIM_OPTIONS[:-1]

# torch's own backends that can reduce CPU tensors (nccl and xccl need device tensors; "fake"
# moves nothing).
_CPU_BUILTIN_BACKENDS = ("gloo", "mpi", "ucc")
_OTHER_BUILTIN_BACKENDS = ("undefined", "nccl", "xccl", "fake")


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _size_list_arg(text: str) -> list[int]:
    try:
        return parse_size_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _dtype_arg(text: str) -> str:
    try:
        return canonical_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _backend_list_arg(text: str) -> tuple[str, ...]:
    names = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"empty backend list {text!r}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise argparse.ArgumentTypeError(f"backend(s) listed twice: {', '.join(duplicates)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hetcomm.bench",
        description="AllReduce benchmark of torch.distributed backends, nccl-tests style. "
                    "Launches --nprocs local ranks, or runs as one rank under torchrun "
                    "(when RANK and WORLD_SIZE are set).",
        epilog="Sizes accept K, M, G (binary) suffixes. Exit status: 0 ok, 1 wrong results, "
               "2 bad arguments or a failed rank.")
    parser.add_argument("--backends", type=_backend_list_arg, default=None,
                        help="comma-separated backends, run in this order in one run "
                             f"(default {','.join(DEFAULT_BACKENDS)}; with --sim-*: "
                             f"{','.join(SIM_DEFAULT_BACKENDS)}; with --sim-sites: "
                             f"{','.join(SIM_SITES_DEFAULT_BACKENDS)}). Besides torch's backends: "
                             "hetcomm-uniform (hetcomm with HETCOMM_PROBE=0: uniform plan), "
                             "hetcomm-flat (hetcomm without the site-aware schedule: the ring at every "
                             "size) and "
                             "hetcomm-declared (hetcomm planning from the simulated cluster's "
                             "declared rates, HETCOMM_LINK_MBIT), hetcomm-nccl (NCCL as the inner "
                             "level of a host: HETCOMM_LOCAL=nccl, CUDA tensors) and hetcomm-tcp "
                             "(no inner level: every byte over TCP, HETCOMM_LOCAL=tcp), hetcomm-shm-pin "
                             "(the shared-memory segment registered with the GPU: HETCOMM_SHM_PIN=1). With "
                             "--device cuda, nccl too; ranks that share a GPU then get an "
                             "NCCL_HOSTID each (unless it is set), so that NCCL starts")
    parser.add_argument("--nprocs", type=int, default=None,
                        help=f"local ranks to launch (default {DEFAULT_NPROCS}; "
                             "ignored under torchrun)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live (default cpu). With cuda, rank r uses GPU "
                             "r mod the GPUs visible, so that several ranks share one GPU when "
                             "there is only one; times include the device copies and end when "
                             "the result is on the device")
    parser.add_argument("--dtype", type=_dtype_arg, default="float32",
                        help=f"element type: {', '.join(DTYPE_BYTES)} (default float32)")
    parser.add_argument("--min-bytes", type=_size_arg, default=None,
                        help=f"smallest size (default {DEFAULT_MIN_BYTES})")
    parser.add_argument("--max-bytes", type=_size_arg, default=None,
                        help=f"largest size, always measured (default {DEFAULT_MAX_BYTES})")
    parser.add_argument("--factor", type=int, default=4,
                        help="size multiplier between steps (default 4)")
    parser.add_argument("--sizes", type=_size_list_arg, default=None,
                        help="explicit sizes instead of a range, e.g. 8,1M,16M,64M "
                             f"(with --sim-*, default {SIM_DEFAULT_SIZES})")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed allreduces per size; also calibrate the adaptive "
                             f"iteration count (default {DEFAULT_WARMUP}; with --sim-*: "
                             f"{SIM_DEFAULT_WARMUP})")
    parser.add_argument("--iters", type=int, default=None,
                        help="fixed timed allreduces per size (default: adaptive, see "
                             "--seconds-per-size)")
    parser.add_argument("--seconds-per-size", type=float, default=None,
                        help="adaptive mode: time budget of the timed loop per size and "
                             f"backend (default {DEFAULT_SECONDS_PER_SIZE}; with --sim-*: "
                             f"{SIM_DEFAULT_SECONDS_PER_SIZE})")
    parser.add_argument("--min-iters", type=int, default=None,
                        help="adaptive mode: at least this many timed calls (default "
                             f"{DEFAULT_MIN_ITERS}; with --sim-*: {SIM_DEFAULT_MIN_ITERS})")
    parser.add_argument("--max-iters", type=int, default=200,
                        help="adaptive mode: at most this many timed calls (default 200)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before a process group, the store or the control plane "
                             f"gives up on a peer (default {DEFAULT_TIMEOUT_S:g}; with --sim-*: "
                             f"at least {SIM_MIN_TIMEOUT_S:g}, more for very slow links)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write all measurements, with this command line, to PATH")
    parser.add_argument("--plot", metavar="PATH.png", default=None,
                        help="draw busbw against size, one line per backend (and the planner's "
                             "predictions and the physical bound with --sim-*), into a PNG; "
                             "needs matplotlib")
    sim = parser.add_argument_group(
        "simulated cluster (root only)",
        "Any of these runs the benchmark on a simulated heterogeneous cluster on this machine "
        "(hetcomm.sim: a network namespace per rank, tc shaping, cgroup CPU quotas); the world "
        "size is the length of the lists. The table then shows, beside each measurement, the "
        "planner's prediction for the plan the group used and the physical bound.")
    sim.add_argument("--sim-nic-mbit", metavar="LIST", default=None,
                     help="per-rank NIC rate in Mbit/s, e.g. 800,800,800,100 ('inf' = unshaped)")
    sim.add_argument("--sim-hosts", metavar="LIST", default=None,
                     help="host of each rank, e.g. 0,0,1,1: a host's ranks share one network namespace "
                          "and one NIC (--sim-nic-mbit then gives one rate per host, e.g. 1000,100, or "
                          "one per rank, equal within a host) and talk over loopback; combines with "
                          "--sim-cpu-quota and --sim-sites with --sim-wan-mbit")
    sim.add_argument("--sim-sites", metavar="LIST", default=None,
                     help="site of each rank, e.g. 0,0,1,1 (with --sim-intra-mbit and/or "
                          "--sim-inter-mbit)")
    sim.add_argument("--sim-intra-mbit", metavar="R", default=None,
                     help="rate between ranks of the same site, Mbit/s")
    sim.add_argument("--sim-inter-mbit", metavar="R", default=None,
                     help="rate between ranks of different sites, Mbit/s (each pair its own link)")
    sim.add_argument("--sim-wan-mbit", metavar="R", default=None,
                     help="each site's shared WAN uplink, Mbit/s each way: all of a site's cross-site "
                          "traffic passes one link (with --sim-sites)")
    sim.add_argument("--sim-link-mbit", metavar="MATRIX", default=None,
                     help="directed PxP link rates in Mbit/s, rows separated by ';' (row = "
                          "sender), e.g. '0,800,100;800,0,100;100,100,0', or a file")
    sim.add_argument("--sim-cpu-quota", metavar="LIST", default=None,
                     help="per-rank CPU quota in cores, e.g. 1,0.5,0.25,0.25")
    sim.add_argument("--sim-latency-ms", metavar="MS", type=float, default=None,
                     help="one-way delay added on each rank's egress (netem)")
    sim.add_argument("--sim-tcp-cc", metavar="NAME", default=None,
                     help="TCP congestion control of the simulated hosts (default: cubic, mainline "
                          "Linux's default, or the best this kernel lets a namespace select; "
                          "'host' keeps this machine's)")
    return parser


def sim_requested(args: argparse.Namespace) -> bool:
    """True when any --sim-* option was given."""
    return any(getattr(args, f"sim_{name}") is not None for name in SIM_CLUSTER_OPTIONS)


def sim_spec_from_args(args: argparse.Namespace):
    """The ``SimSpec`` of the --sim-* options; raises ValueError with a user-facing message."""
    from hetcomm.sim.__main__ import spec_from_args
    from hetcomm.sim.spec import SimError
    sim_args = argparse.Namespace(**{name: getattr(args, f"sim_{name}") for name in SIM_OPTIONS})
    if sim_args.latency_ms is None:
        sim_args.latency_ms = 0.0
    sim_args.nprocs = args.nprocs
    try:
        return spec_from_args(sim_args)
    except SimError as error:
        message = str(error)
        for name in SIM_OPTIONS:    # name our own options, not hetcomm.sim's
            dashed = name.replace("_", "-")
            message = message.replace(f"--{dashed}", f"--sim-{dashed}")
        raise ValueError(f"simulated cluster: {message}") from None


def sim_timeout_s(spec, largest_bytes: int) -> float:
    """A timeout that the simulated links cannot trip: a uniform ring of the largest size, x10."""
    from hetcomm.sim.spec import TCP_GOODPUT_FRACTION, effective_bandwidth, ring_allreduce_seconds
    bw = [[v * TCP_GOODPUT_FRACTION for v in row] for row in effective_bandwidth(spec)]
    ring = ring_allreduce_seconds(bw, largest_bytes)
    return max(SIM_MIN_TIMEOUT_S, SIM_TIMEOUT_FACTOR * ring)


def usable_backends() -> list[str]:
    """Backends that can reduce CPU tensors here: torch's available ones, then plugins."""
    import torch.distributed as dist
    available = {"gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available(),
                 "ucc": dist.is_ucc_available()}
    builtins = set(_CPU_BUILTIN_BACKENDS) | set(_OTHER_BUILTIN_BACKENDS)
    plugins = [name for name in dist.Backend.backend_list if name not in builtins]
    return [name for name in _CPU_BUILTIN_BACKENDS if available[name]] + plugins


def check_device(device: str, backends: Sequence[str]) -> Optional[str]:
    """An error message if ``device`` cannot be benchmarked here with ``backends``, else None."""
    if device == "cpu":
        return None
    import torch
    if not torch.cuda.is_available():
        return ("--device cuda: no CUDA GPU is usable here (torch.cuda.is_available() is False; "
                f"torch {torch.__version__} {'without' if torch.version.cuda is None else 'with'} "
                "CUDA)")
    if "hetcomm" in {torch_backend(name) for name in backends}:
        import hetcomm
        if "cuda" not in hetcomm.supported_devices():
            return ("--device cuda: this build of hetcomm has no CUDA support (built against a "
                    "CPU-only torch or without nvcc); rebuild it with `pip install "
                    "--no-build-isolation -e .` where both are present")
    return None


def check_backends(backends: Sequence[str], device: str = "cpu") -> Optional[str]:
    """An error message if some backend cannot run here, else None.

    ``hetcomm`` is imported first (it registers itself on import) so that a broken build is
    reported here, once, rather than as N identical worker failures. Variants
    (``hetcomm-uniform``, ``hetcomm-declared``) need what ``hetcomm`` needs.
    """
    requested = list(backends)
    backends = list(dict.fromkeys(torch_backend(name) for name in backends))
    if "hetcomm" in backends:
        try:
            importlib.import_module("hetcomm")
        except Exception as error:
            return f"backend 'hetcomm' requested, but `import hetcomm` failed: " \
                   f"{type(error).__name__}: {error}"
    usable = usable_backends()
    if device == "cuda":
        import torch.distributed as dist
        usable += ["nccl"] if dist.is_nccl_available() else []
    unknown = [name for name in requested if torch_backend(name) not in usable]
    if unknown:
        variants = [name for name in BACKEND_VARIANTS if torch_backend(name) in usable
                    and (device == "cuda" or name != "hetcomm-nccl")]
        return (f"unknown or unusable backend(s) {', '.join(map(repr, unknown))}: "
                f"usable here for {device.upper()} tensors are {', '.join(usable + variants)}")
    if device == "cpu" and "hetcomm-nccl" in requested:
        return "backend 'hetcomm-nccl' moves CUDA tensors through NCCL: use it with --device cuda"
    return None


def _default(value, local, sim, in_sim: bool):
    if value is not None:
        return value
    return sim if in_sim else local


def config_from_args(args: argparse.Namespace, argv: Sequence[str], spec=None) -> BenchConfig:
    """Builds the config; raises ValueError with a user-facing message on bad combinations.

    ``spec``: the simulated cluster of the --sim-* options (sim defaults, world size), or None.
    """
    in_sim = spec is not None
    if args.sizes is not None and (args.min_bytes is not None or args.max_bytes is not None):
        raise ValueError("--sizes cannot be combined with --min-bytes/--max-bytes")
    if args.sizes is not None:
        sizes = args.sizes
    elif in_sim and args.min_bytes is None and args.max_bytes is None:
        sizes = parse_size_list(SIM_DEFAULT_SIZES)
    else:
        min_bytes = args.min_bytes if args.min_bytes is not None else parse_size(DEFAULT_MIN_BYTES)
        max_bytes = args.max_bytes if args.max_bytes is not None else parse_size(DEFAULT_MAX_BYTES)
        sizes = geometric_sizes(min_bytes, max_bytes, args.factor)
    if in_sim:
        nprocs = spec.world_size
    else:
        nprocs = args.nprocs if args.nprocs is not None else DEFAULT_NPROCS
    if nprocs < 1:
        raise ValueError(f"--nprocs must be at least 1, got {nprocs}")
    sim_backends = SIM_SITES_DEFAULT_BACKENDS if in_sim and spec.sites is not None else SIM_DEFAULT_BACKENDS
    backends = tuple(_default(args.backends, DEFAULT_BACKENDS, sim_backends, in_sim))
    warmup = _default(args.warmup, DEFAULT_WARMUP, SIM_DEFAULT_WARMUP, in_sim)
    min_iters = _default(args.min_iters, DEFAULT_MIN_ITERS, SIM_DEFAULT_MIN_ITERS, in_sim)
    seconds_per_size = _default(args.seconds_per_size, DEFAULT_SECONDS_PER_SIZE,
                                SIM_DEFAULT_SECONDS_PER_SIZE, in_sim)
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if not 1 <= min_iters <= args.max_iters:
        raise ValueError(f"need 1 <= --min-iters ({min_iters}) <= --max-iters "
                         f"({args.max_iters})")
    sizes = whole_element_sizes(sizes, args.dtype)
    if args.timeout is not None:
        timeout_s = args.timeout
    elif in_sim:
        timeout_s = sim_timeout_s(spec, max(sizes))
    else:
        timeout_s = DEFAULT_TIMEOUT_S
    if seconds_per_size <= 0 or timeout_s <= 0:
        raise ValueError("--seconds-per-size and --timeout must be positive")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            directory = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(directory):
                raise ValueError(f"{option} {path}: directory {directory} does not exist")
    if "hetcomm-declared" in backends and not in_sim:
        declared_link_mbit(os.environ)   # raises ValueError: nothing to declare
    return BenchConfig(
        backends=backends, sizes=tuple(sizes),
        dtype=args.dtype, warmup=warmup, iters=args.iters, min_iters=min_iters,
        max_iters=args.max_iters, seconds_per_size=seconds_per_size,
        timeout_s=timeout_s, nprocs=nprocs, json_path=args.json, argv=tuple(argv),
        plot_path=args.plot, device=args.device)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv[1:])
    from hetcomm.bench import launch
    spec = None
    if sim_requested(args):
        if launch.in_env_mode():
            parser.error("--sim-* options build a simulated cluster and launch its ranks; they "
                         "cannot be used when this process is already one rank (RANK and "
                         "WORLD_SIZE are set, e.g. under torchrun)")
        try:
            spec = sim_spec_from_args(args)
        except ValueError as error:
            parser.error(str(error))
    elif args.sim_tcp_cc is not None:
        parser.error("--sim-tcp-cc sets the TCP of a simulated cluster: give the cluster too "
                     "(--sim-nic-mbit, --sim-hosts, --sim-sites or --sim-link-mbit)")
    try:
        config = config_from_args(args, argv, spec)
    except ValueError as error:
        parser.error(str(error))
    backend_error = (check_backends(config.backends, config.device)
                     or check_device(config.device, config.backends))
    if backend_error:
        parser.error(backend_error)
    if config.plot_path is not None:
        from hetcomm.bench.plot import PlotError, require_matplotlib
        try:
            require_matplotlib()
        except PlotError as error:
            parser.error(str(error))

    if spec is not None:
        from hetcomm.bench import sim_launch
        problem = sim_launch.unavailable_reason()
        if problem:
            parser.error(problem)
        return sim_launch.launch_sim(config, spec)
    if launch.in_env_mode():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.nprocs is not None and args.nprocs != world_size and os.environ["RANK"] == "0":
            print(f"{PREFIX}: --nprocs {args.nprocs} ignored: WORLD_SIZE is {world_size}",
                  file=sys.stderr)
        return launch.run_env_rank(config)
    return launch.launch_local(config)
