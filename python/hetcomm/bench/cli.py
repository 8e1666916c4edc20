"""Command line of ``python -m hetcomm.bench``: parse, validate up front, dispatch to a launcher.

Bad input (an unknown backend, a size that does not parse, a dtype torch lacks) is rejected here,
in one process and before any worker starts, with argparse's usage line and exit status 2.

Exit status: 0 all results correct; 1 some result had #wrong > 0; 2 bad arguments or a failed
rank; 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from hetcomm.bench.config import (DEFAULT_BACKENDS, DTYPE_BYTES, BenchConfig, canonical_dtype,
                                  geometric_sizes, parse_size, parse_size_list,
                                  whole_element_sizes)
from hetcomm.bench.report import PREFIX

DEFAULT_NPROCS = 4
DEFAULT_MIN_BYTES = "8"
DEFAULT_MAX_BYTES = "64M"

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
    parser.add_argument("--backends", type=_backend_list_arg, default=DEFAULT_BACKENDS,
                        help="comma-separated backends, run in this order in one run "
                             f"(default {','.join(DEFAULT_BACKENDS)})")
    parser.add_argument("--nprocs", type=int, default=None,
                        help=f"local ranks to launch (default {DEFAULT_NPROCS}; "
                             "ignored under torchrun)")
    parser.add_argument("--dtype", type=_dtype_arg, default="float32",
                        help=f"element type: {', '.join(DTYPE_BYTES)} (default float32)")
    parser.add_argument("--min-bytes", type=_size_arg, default=None,
                        help=f"smallest size (default {DEFAULT_MIN_BYTES})")
    parser.add_argument("--max-bytes", type=_size_arg, default=None,
                        help=f"largest size, always measured (default {DEFAULT_MAX_BYTES})")
    parser.add_argument("--factor", type=int, default=4,
                        help="size multiplier between steps (default 4)")
    parser.add_argument("--sizes", type=_size_list_arg, default=None,
                        help="explicit sizes instead of a range, e.g. 8,1M,16M,64M")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed allreduces per size; also calibrate the adaptive "
                             "iteration count (default 3)")
    parser.add_argument("--iters", type=int, default=None,
                        help="fixed timed allreduces per size (default: adaptive, see "
                             "--seconds-per-size)")
    parser.add_argument("--seconds-per-size", type=float, default=0.3,
                        help="adaptive mode: time budget of the timed loop per size and "
                             "backend (default 0.3)")
    parser.add_argument("--min-iters", type=int, default=3,
                        help="adaptive mode: at least this many timed calls (default 3)")
    parser.add_argument("--max-iters", type=int, default=200,
                        help="adaptive mode: at most this many timed calls (default 200)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before a process group, the store or the control plane "
                             "gives up on a peer (default 120)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write all measurements, with this command line, to PATH")
    return parser


def usable_backends() -> list[str]:
    """Backends that can reduce CPU tensors here: torch's available ones, then plugins."""
    import torch.distributed as dist
    available = {"gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available(),
                 "ucc": dist.is_ucc_available()}
    builtins = set(_CPU_BUILTIN_BACKENDS) | set(_OTHER_BUILTIN_BACKENDS)
    plugins = [name for name in dist.Backend.backend_list if name not in builtins]
    return [name for name in _CPU_BUILTIN_BACKENDS if available[name]] + plugins


def check_backends(backends: Sequence[str]) -> Optional[str]:
    """An error message if some backend cannot run here, else None.

    ``hetcomm`` is imported first (it registers itself on import) so that a broken build is
    reported here, once, rather than as N identical worker failures.
    """
    if "hetcomm" in backends:
        try:
            importlib.import_module("hetcomm")
        except Exception as error:
            return f"backend 'hetcomm' requested, but `import hetcomm` failed: " \
                   f"{type(error).__name__}: {error}"
    usable = usable_backends()
    unknown = [name for name in backends if name not in usable]
    if unknown:
        return (f"unknown or unusable backend(s) {', '.join(map(repr, unknown))}: "
                f"usable here for CPU tensors are {', '.join(usable)}")
    return None


def config_from_args(args: argparse.Namespace, argv: Sequence[str]) -> BenchConfig:
    """Builds the config; raises ValueError with a user-facing message on bad combinations."""
    if args.sizes is not None and (args.min_bytes is not None or args.max_bytes is not None):
        raise ValueError("--sizes cannot be combined with --min-bytes/--max-bytes")
    if args.sizes is not None:
        sizes = args.sizes
    else:
        min_bytes = args.min_bytes if args.min_bytes is not None else parse_size(DEFAULT_MIN_BYTES)
        max_bytes = args.max_bytes if args.max_bytes is not None else parse_size(DEFAULT_MAX_BYTES)
        sizes = geometric_sizes(min_bytes, max_bytes, args.factor)
    nprocs = args.nprocs if args.nprocs is not None else DEFAULT_NPROCS
    if nprocs < 1:
        raise ValueError(f"--nprocs must be at least 1, got {nprocs}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if not 1 <= args.min_iters <= args.max_iters:
        raise ValueError(f"need 1 <= --min-iters ({args.min_iters}) <= --max-iters "
                         f"({args.max_iters})")
    if args.seconds_per_size <= 0 or args.timeout <= 0:
        raise ValueError("--seconds-per-size and --timeout must be positive")
    if args.json is not None:
        directory = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(directory):
            raise ValueError(f"--json {args.json}: directory {directory} does not exist")
    return BenchConfig(
        backends=tuple(args.backends), sizes=tuple(whole_element_sizes(sizes, args.dtype)),
        dtype=args.dtype, warmup=args.warmup, iters=args.iters, min_iters=args.min_iters,
        max_iters=args.max_iters, seconds_per_size=args.seconds_per_size,
        timeout_s=args.timeout, nprocs=nprocs, json_path=args.json, argv=tuple(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv[1:])
    try:
        config = config_from_args(args, argv)
    except ValueError as error:
        parser.error(str(error))
    backend_error = check_backends(config.backends)
    if backend_error:
        parser.error(backend_error)

    from hetcomm.bench import launch
    if launch.in_env_mode():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.nprocs is not None and args.nprocs != world_size and os.environ["RANK"] == "0":
            print(f"{PREFIX}: --nprocs {args.nprocs} ignored: WORLD_SIZE is {world_size}",
                  file=sys.stderr)
        return launch.run_env_rank(config)
    return launch.launch_local(config)
