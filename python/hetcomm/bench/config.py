"""Benchmark configuration: parsing of sizes and dtypes, and the frozen config every rank gets.

The config is built once, in the process that parsed the command line, and handed to every rank
unchanged (pickled for spawned workers, re-parsed identically under torchrun). Everything that
must be the same on all ranks -- sizes, warm-up count, iteration policy -- lives here, so ranks
cannot disagree on how many collectives they issue.

No torch import: dtypes are carried by name and sized from a table, so the CLI can reject a bad
argument before paying for ``import torch``.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

# Canonical dtype name -> element size in bytes. The names are torch attribute names.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "int64": 8,
}

DTYPE_ALIASES: dict[str, str] = {
    "float": "float32", "fp32": "float32",
    "double": "float64", "fp64": "float64",
    "half": "float16", "fp16": "float16",
    "bf16": "bfloat16",
    "int": "int32",
    "long": "int64",
}

# Binary multiples, as nccl-tests reads "-b 8 -e 128M".
_SIZE_SUFFIX: dict[str, int] = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)

DEFAULT_BACKENDS: tuple[str, ...] = ("hetcomm", "gloo")

# Bench-level backend names that run torch's "hetcomm" backend with one environment variable set
# at group creation (read by hetcomm.topology.configure_group), restored right after:
#   hetcomm-uniform   HETCOMM_PROBE=0 (and no HETCOMM_LINK_MBIT): the engine's uniform plan,
#                     links not probed -- what hetcomm does without its planner;
#   hetcomm-declared  HETCOMM_LINK_MBIT = the simulated cluster's rates (HETCOMM_SIM_NIC_MBIT, or
#                     the effective link matrix when links are shaped): the plan comes from
#                     declared bandwidths instead of a probe;
#   hetcomm-flat      HETCOMM_HIERARCHICAL=0: links probed and planned as by plain "hetcomm", but
#                     the (weighted) flat ring at every size, never the site-aware schedule.
# Plain "hetcomm" is the product default (links probed at group creation, weighted plan, the
# site-aware schedule where the planner predicts it faster).
BACKEND_VARIANTS: dict[str, str] = {
    "hetcomm-uniform": "hetcomm",
    "hetcomm-declared": "hetcomm",
    "hetcomm-flat": "hetcomm",
    "hetcomm-nccl": "hetcomm",
    "hetcomm-tcp": "hetcomm",
    "hetcomm-shm-pin": "hetcomm",
}

# Defaults of a run on a simulated cluster (--sim-*): the target sizes, few iterations
# (a 64 MB allreduce through a 100 Mbit/s NIC takes 6-9 s), a timeout that slow links survive.
SIM_DEFAULT_BACKENDS: tuple[str, ...] = ("hetcomm", "hetcomm-uniform", "gloo")
# With --sim-sites: the chosen plan, the flat ring it was chosen over, and gloo.
SIM_SITES_DEFAULT_BACKENDS: tuple[str, ...] = ("hetcomm", "hetcomm-flat", "gloo")
SIM_DEFAULT_SIZES = "16M,64M"
SIM_DEFAULT_WARMUP = 1
SIM_DEFAULT_SECONDS_PER_SIZE = 0.5
SIM_DEFAULT_MIN_ITERS = 3
SIM_MIN_TIMEOUT_S = 300.0


# What a declared model says for a link the simulation does not shape (the planner needs finite
# rates): 80000 Mbit/s = 10 GB/s, the same stand-in as hetcomm.bench.analysis.UNSHAPED_BYTES_PER_S.
UNSHAPED_DECLARED_MBIT = "80000"


# The sim launcher hands every rank the user's own command line here (JSON list), so the report
# records the command that was typed rather than the per-rank one it was turned into.
ARGV_ENV = "HETCOMM_BENCH_ARGV"


def torch_backend(name: str) -> str:
    """The torch.distributed backend behind a bench backend name (``hetcomm-uniform`` -> hetcomm)."""
    return BACKEND_VARIANTS.get(name, name)


def declared_link_mbit(environ: Mapping[str, str]) -> str:
    """``HETCOMM_LINK_MBIT`` for ``hetcomm-declared``: the simulated cluster's rates.

    In a simulated cluster (``HETCOMM_SIM=1``): the NIC rates ``HETCOMM_SIM_NIC_MBIT``, or, when
    links are shaped too or ranks share hosts (``HETCOMM_SIM_HOSTS``: per-rank NICs would
    declare the loopback between a host's ranks as slow as its NIC), the effective matrix
    ``HETCOMM_SIM_EFFECTIVE_MBIT`` (min of NICs and link); unshaped entries become
    ``UNSHAPED_DECLARED_MBIT``. Outside a simulation the user's own
    ``HETCOMM_LINK_MBIT``. Raises ValueError when there is nothing to declare.
    """
    if environ.get("HETCOMM_SIM") == "1":
        if (environ.get("HETCOMM_SIM_LINK_MBIT", "").strip()
                or environ.get("HETCOMM_SIM_HOSTS", "").strip()):
            text = environ.get("HETCOMM_SIM_EFFECTIVE_MBIT", "")
        else:
            text = environ.get("HETCOMM_SIM_NIC_MBIT", "")
        if text.strip():
            rows = [[UNSHAPED_DECLARED_MBIT if cell.strip().lower() == "inf" else cell.strip()
                     for cell in row.split(",")] for row in text.split(";")]
            return ";".join(",".join(row) for row in rows)
    declared = environ.get("HETCOMM_LINK_MBIT", "").strip()
    if declared:
        return declared
    raise ValueError("backend 'hetcomm-declared' declares the simulated cluster's rates: it needs "
                     "--sim-nic-mbit/--sim-sites/--sim-link-mbit (or HETCOMM_LINK_MBIT set)")


def variant_environment(name: str, environ: Mapping[str, str]) -> dict[str, Optional[str]]:
    """Variables to set (None: unset) while the group of backend ``name`` is created."""
    if name == "hetcomm-uniform":
        return {"HETCOMM_PROBE": "0", "HETCOMM_LINK_MBIT": None}
    if name == "hetcomm-declared":
        return {"HETCOMM_LINK_MBIT": declared_link_mbit(environ)}
    if name == "hetcomm-flat":
        return {"HETCOMM_HIERARCHICAL": "0"}
    if name == "hetcomm-nccl":
        return {"HETCOMM_LOCAL": "nccl"}
    if name == "hetcomm-tcp":
        return {"HETCOMM_LOCAL": "tcp"}
    if name == "hetcomm-shm-pin":
        return {"HETCOMM_SHM_PIN": "1"}
    return {}


def parse_size(text: str) -> int:
    """Parses ``"8"``, ``"1K"``, ``"16M"``, ``"1G"``, ``"64MiB"`` into bytes (binary suffixes)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"cannot parse size {text!r}: expected an integer number of bytes with an optional "
            f"K, M or G suffix, e.g. 8, 1M, 64M")
    return int(match.group(1)) * _SIZE_SUFFIX[match.group(2).upper()]


def parse_size_list(text: str) -> list[int]:
    """Parses a comma-separated size list such as ``"8,1M,16M,64M"``."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"empty size list {text!r}")
    return [parse_size(item) for item in items]


def canonical_dtype(name: str) -> str:
    """Maps a dtype name or alias to its canonical torch name; raises ValueError if unknown."""
    key = name.strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPE_BYTES)}")
    return key


def geometric_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min, min*factor, ...`` up to ``max``, with ``max`` itself appended if the steps miss it.

    Appending the end point departs from nccl-tests (which stops at the last step below ``-e``),
    but a user who asks for "up to 64M" expects a 64M row; with 8 B steps of x4 the sequence
    jumps from 32M to 128M and would otherwise never show it.
    """
    if min_bytes <= 0:
        raise ValueError(f"--min-bytes must be positive, got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"--max-bytes ({max_bytes}) is smaller than --min-bytes ({min_bytes})")
    if factor < 2:
        raise ValueError(f"--factor must be at least 2, got {factor}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def whole_element_sizes(sizes_bytes: Sequence[int], dtype: str) -> list[int]:
    """Rounds each size down to whole elements of ``dtype``; sorted, without duplicates.

    The rows then report the bytes actually moved. A size below one element is an error rather
    than a silent zero-length collective, whose bandwidth would be meaningless.
    """
    element = DTYPE_BYTES[dtype]
    rounded = set()
    for size in sizes_bytes:
        if size < element:
            raise ValueError(f"size {size} B is smaller than one {dtype} element ({element} B)")
        rounded.add(size - size % element)
    return sorted(rounded)


@dataclass(frozen=True)
class BenchConfig:
    """Everything a rank needs to run the benchmark; identical on every rank."""

    backends: tuple[str, ...]
    sizes: tuple[int, ...]          # bytes, whole elements of dtype, ascending
    dtype: str                      # canonical name, a key of DTYPE_BYTES
    warmup: int                     # untimed allreduces per size (also used to calibrate)
    iters: Optional[int]            # fixed timed iterations per size; None = adaptive
    min_iters: int                  # adaptive bounds and per-size time budget
    max_iters: int
    seconds_per_size: float
    timeout_s: float                # every process group, the control plane and the store
    nprocs: int                     # ranks to launch locally (ignored under torchrun)
    json_path: Optional[str]
    argv: tuple[str, ...]           # the exact command line, kept in the JSON output
    plot_path: Optional[str] = None # --plot: PNG written by rank 0 after the table
    device: str = "cpu"             # "cpu" or "cuda": where the allreduced tensors live

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The settings, without argv (the report carries the command line once)."""
        data = asdict(self)
        data.pop("argv")
        data["backends"] = list(self.backends)
        data["sizes"] = list(self.sizes)
        return data


def worker_argv(config: BenchConfig) -> list[str]:
    """Arguments of ``python -m hetcomm.bench`` that make a rank run exactly ``config``.

    Used to start the ranks of a simulated cluster (each re-runs the CLI as one rank, env mode):
    every resolved value is spelled out, so a rank never falls back on a default of its own.
    Paths are made absolute. The inverse of the parser for everything but ``nprocs``/``argv``.
    """
    def size_list(values: Sequence[int]) -> str:
        return ",".join(str(v) for v in values)

    args = ["--backends", ",".join(config.backends), "--sizes", size_list(config.sizes),
            "--dtype", config.dtype, "--warmup", str(config.warmup),
            "--seconds-per-size", repr(config.seconds_per_size),
            "--min-iters", str(config.min_iters), "--max-iters", str(config.max_iters),
            "--timeout", repr(config.timeout_s)]
    if config.iters is not None:
        args += ["--iters", str(config.iters)]
    if config.json_path is not None:
        args += ["--json", os.path.abspath(config.json_path)]
    if config.plot_path is not None:
        args += ["--plot", os.path.abspath(config.plot_path)]
    if config.device != "cpu":
        args += ["--device", config.device]
    return args
