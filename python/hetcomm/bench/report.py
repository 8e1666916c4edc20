"""Human and machine output of a run: progress lines, the nccl-tests style table, the JSON file.

Only rank 0 calls these. No torch import: a later ``--plot`` (or a tool comparing two JSON files)
reuses this module and :mod:`hetcomm.bench.results` without the distributed machinery.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, TextIO

from hetcomm.bench.results import (RATIO_DENOMINATOR, RATIO_NUMERATOR, BenchReport, SizeResult,
                                   average_busbw, busbw_ratio)

PREFIX = "hetcomm.bench"

# Width of each column; the header and the rows are formatted from the same table.
_SIZE_COLUMNS = (("size(B)", 12), ("count", 11), ("type", 9), ("redop", 6))
_BACKEND_COLUMNS = (("time(us)", 10), ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7))
_RATIO_HEADER = f"busbw ratio {RATIO_NUMERATOR}/{RATIO_DENOMINATOR}"


def print_progress(result: SizeResult, stream: TextIO = sys.stderr) -> None:
    """One line per finished (backend, size), so that long runs are not silent."""
    print(f"{PREFIX}: {result.backend:>8} {result.size_bytes:>11} B  {result.iters:>4} iters  "
          f"{result.time_us:>11.1f} us  busbw {result.busbw_gbps:7.3f} GB/s  "
          f"#wrong {result.wrong}", file=stream, flush=True)


def _fields(cells: list[str], widths: list[int]) -> str:
    return " ".join(cell.rjust(width) for cell, width in zip(cells, widths))


def format_table(bench_report: BenchReport) -> str:
    """The table: per size, each backend's columns side by side, then the busbw ratio."""
    backends = bench_report.backends
    size_widths = [w for _, w in _SIZE_COLUMNS]
    backend_widths = [w for _, w in _BACKEND_COLUMNS]
    backend_span = sum(backend_widths) + len(backend_widths) - 1
    show_ratio = bench_report.has_ratio()

    size_part = _fields([name for name, _ in _SIZE_COLUMNS], size_widths)
    group_line = " " * len(size_part) + "".join(f" | {name:^{backend_span}}" for name in backends)
    column_line = size_part + "".join(
        " | " + _fields([name for name, _ in _BACKEND_COLUMNS], backend_widths) for _ in backends)
    if show_ratio:
        group_line += " |"
        column_line += f" | {_RATIO_HEADER}"

    lines = [
        f"# {PREFIX}: allreduce, {bench_report.world_size} ranks ({bench_report.launch} launch), "
        f"{bench_report.dtype} sum, torch {bench_report.torch_version}, "
        f"host {bench_report.hostname}",
        "# time: slowest rank's mean per call; busbw = algbw * 2(n-1)/n",
        "#",
        "#" + group_line[1:],
        "#" + column_line[1:],
    ]
    for size, per_backend in bench_report.by_size().items():
        first = next(iter(per_backend.values()))
        line = _fields([str(size), str(first.count), first.dtype, first.redop], size_widths)
        for name in backends:
            line += " | " + _fields(_backend_cells(per_backend.get(name)), backend_widths)
        if show_ratio:
            line += f" | {_format_ratio(busbw_ratio(per_backend)):>{len(_RATIO_HEADER)}}"
        lines.append(line)

    lines.append("#")
    for name in backends:
        runs = [r for r in bench_report.results if r.backend == name]
        lines.append(f"# {name}: avg busbw {average_busbw(runs):.3f} GB/s, "
                     f"#wrong {sum(r.wrong for r in runs)}")
    verdict = "OK" if bench_report.total_wrong == 0 else "FAILED"
    lines.append(f"# total #wrong: {bench_report.total_wrong} {verdict}")
    return "\n".join(lines)


def _backend_cells(result: Optional[SizeResult]) -> list[str]:
    if result is None:
        return ["-"] * len(_BACKEND_COLUMNS)
    return [f"{result.time_us:.1f}", f"{result.algbw_gbps:.3f}", f"{result.busbw_gbps:.3f}",
            str(result.wrong)]


def _format_ratio(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def print_table(bench_report: BenchReport, stream: TextIO = sys.stdout) -> None:
    print(format_table(bench_report), file=stream, flush=True)


def write_json(bench_report: BenchReport, path: str) -> None:
    """Writes the report atomically, so a reader never sees a half-written file."""
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w") as handle:
        json.dump(bench_report.to_json(), handle, indent=2)
        handle.write("\n")
    os.replace(temporary, path)
    print(f"{PREFIX}: wrote {path}", file=sys.stderr, flush=True)
