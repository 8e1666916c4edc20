"""Benchmark configuration: parsing of sizes and dtypes, and the frozen config every rank gets.

The config is built once, in the process that parsed the command line, and handed to every rank
unchanged (pickled for spawned workers, re-parsed identically under torchrun). Everything that
must be the same on all ranks -- sizes, warm-up count, iteration policy -- lives here, so ranks
cannot disagree on how many collectives they issue.

No torch import: dtypes are carried by name and sized from a table, so the CLI can reject a bad
argument before paying for ``import torch``.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

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
