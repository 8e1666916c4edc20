"""Human and machine output of a run: progress lines, the nccl-tests style table, the JSON file.

Only rank 0 calls these. No torch import: a later ``--plot`` (or a tool comparing two JSON files)
reuses this module and :mod:`hetcomm.bench.results` without the distributed machinery.

The JSON file (``--json``) holds records, one per line (:mod:`hetcomm.bench.records`), each with
the run's command: a ``run`` header (configuration, machine, ``sim``), one ``plan`` per backend
(``backend``, ``plan``), then per size one ``result`` per backend (``size_bytes``, ``count``,
``type``, ``redop``, ``backend``, the times) and one ``size`` record of the figures across
backends (busbw ratio, bound, speedups). :func:`read_report` gives back the document of
:meth:`~hetcomm.bench.results.BenchReport.to_json`, from such a file or from an older
single-document one.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, TextIO

from hetcomm.bench.records import (RESULT, RUN, fields, header, is_legacy, read_with_trace, record,
                                   write_records)
from hetcomm.bench.results import (RATIO_DENOMINATOR, RATIO_NUMERATOR, BenchReport, SizeResult,
                                   average_busbw, busbw_ratio, speedup)

PREFIX = "hetcomm.bench"

# Width of each column; the header and the rows are formatted from the same table.
_SIZE_COLUMNS = (("size(B)", 12), ("count", 11), ("type", 9), ("redop", 6))
_BACKEND_COLUMNS = (("time(us)", 10), ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7))
_RATIO_HEADER = f"busbw ratio {RATIO_NUMERATOR}/{RATIO_DENOMINATOR}"


def print_progress(result: SizeResult, stream: TextIO = sys.stderr) -> None:
    """One line per finished (backend, size), so that long runs are not silent."""
    print(f"{PREFIX}: {result.backend:>8} {result.size_bytes:>11} B  {result.iters:>4} iters  "
          f"{result.time_us:>11.1f} us  busbw {result.busbw_gbps:7.3f} GB/s  "
          f"#wrong {result.wrong}" + (f"  path {result.path}" if result.path else ""), file=stream, flush=True)


def print_plan(record: dict, stream: TextIO = sys.stderr) -> None:
    """The plan a hetcomm group uses, printed once, right after the group was created."""
    if record.get("kind") != "hetcomm":
        return
    print(f"{PREFIX}: {record['backend']}: [{record.get('source', '?')}] {record.get('text', '')}",
          file=stream, flush=True)


def _fields(cells: list[str], widths: list[int]) -> str:
    return " ".join(cell.rjust(width) for cell, width in zip(cells, widths))


def format_table(bench_report: BenchReport) -> str:
    """The table: per size, each backend's columns side by side, then the busbw ratio.

    On a simulated cluster (``bench_report.sim``) the sim table instead (:func:`format_sim_table`).
    """
    if bench_report.sim is not None:
        return format_sim_table(bench_report)
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
        f"{bench_report.dtype} sum on {bench_report.config.get('device', 'cpu')} tensors, "
        f"torch {bench_report.torch_version}, host {bench_report.hostname}",
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


# Columns of the sim table: one row per (size, backend), sizes in blocks.
_SIM_COLUMNS = (("size(B)", 12), ("count", 11), ("type", 9), ("redop", 6), ("backend", -16),
                ("time(ms)", 11), ("busbw(GB/s)", 12), ("#wrong", 7), ("pred(ms)", 11),
                ("meas/pred", 10), ("bound(ms)", 11), ("meas/bound", 11))


def _sim_fields(cells: list[str]) -> str:
    out = []
    for cell, (_, width) in zip(cells, _SIM_COLUMNS):
        out.append(cell.ljust(-width) if width < 0 else cell.rjust(width))
    return " ".join(out)


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _x(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def plan_lines(bench_report: BenchReport, prefix: str = "#   ") -> list[str]:
    """One line per backend: where its plan came from, then ``format_plan`` of it."""
    if not bench_report.plans:
        return []
    width = max(len(name) for name in bench_report.plans)
    lines = []
    for name in bench_report.backends:
        record = bench_report.plans.get(name)
        if record is None:
            continue
        text = record.get("text_physical") or record.get("text", "")
        lines.append(f"{prefix}{name:<{width}}  [{record.get('source', '?')}] {text}")
        model = record.get("model")
        if model and model.get("bw_bytes_per_s"):
            lines.append(f"{prefix}{'':<{width}}  its model's links MB/s (row sends to column): "
                         + format_mb_matrix(model["bw_bytes_per_s"]))
    return lines


def format_mb_matrix(bw) -> str:
    """``bw`` in bytes/s as MB/s, rows joined by ``;``, the diagonal as ``-``."""
    def cell(i: int, j: int, v) -> str:
        if i == j or v is None:
            return "-"
        return "inf" if v == float("inf") else f"{v / 1e6:.3g}"
    return "; ".join(",".join(cell(i, j, v) for j, v in enumerate(row)) for i, row in enumerate(bw))


def format_sim_table(bench_report: BenchReport) -> str:
    """The table of a run on a simulated cluster: measurement, prediction, bound, speedups."""
    sim = bench_report.sim
    assert sim is not None
    alpha_us = sim.get("alpha_s", 0.0) * 1e6
    lines = [
        f"# {PREFIX}: allreduce, {bench_report.world_size} ranks ({bench_report.launch} launch), "
        f"{bench_report.dtype} sum, torch {bench_report.torch_version}, "
        f"host {bench_report.hostname}",
        f"# cluster: {sim.get('description', '?')}",
        "# time: slowest rank's mean per call; busbw = algbw * 2(n-1)/n",
        f"# bound: {sim.get('bound_text', '-')}",
        *([f"#   note: {sim['aggregate_bound_text']}"] if sim.get("aggregate_bound_text") else []),
        "# pred: hetcomm.planner.predict_allreduce_seconds(the plan the group used, physical model, N);"
        " gloo: a uniform ring",
        f"#   physical model: min(NIC_i, link_ij, NIC_j) wire rates, alpha {alpha_us:g} us; TCP payload "
        "gets ~95.6% of a wire rate, so even a perfect run shows meas/pred, meas/bound ~1.05",
    ]
    plans = plan_lines(bench_report)
    if plans:
        lines.append("# plans (algbw predicted on the physical model):")
        lines += plans
    baselines = bench_report.speedup_baselines()
    header = _sim_fields([name for name, _ in _SIM_COLUMNS])
    if baselines:
        header += "  speedup of hetcomm (time ratio)"
    lines += ["#", "#" + header[1:]]
    for size, per_backend in bench_report.by_size().items():
        first = True
        for name in bench_report.backends:
            result = per_backend.get(name)
            if result is None:
                continue
            lead = ([str(size), str(result.count), result.dtype, result.redop] if first
                    else ["", "", "", ""])
            first = False
            cells = lead + [name, f"{result.time_us / 1e3:.2f}", f"{result.busbw_gbps:.4f}",
                            str(result.wrong), _ms(bench_report.predicted(result)),
                            _x(bench_report.pred_ratio(result)), _ms(bench_report.bound(size)),
                            _x(bench_report.time_over_bound(result))]
            line = _sim_fields(cells)
            if name == RATIO_NUMERATOR and baselines:
                line += "  " + ", ".join(
                    f"{_x(speedup(per_backend, b))}x over {b}" for b in baselines)
            lines.append(line)

    lines.append("#")
    for name in bench_report.backends:
        runs = [r for r in bench_report.results if r.backend == name]
        ratios = [bench_report.pred_ratio(r) for r in runs]
        ratios = [r for r in ratios if r is not None]
        extra = f", meas/pred {min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
        lines.append(f"# {name}: avg busbw {average_busbw(runs):.4f} GB/s, "
                     f"#wrong {sum(r.wrong for r in runs)}{extra}")
    for baseline in baselines:
        per_size = [(size, speedup(per_backend, baseline))
                    for size, per_backend in bench_report.by_size().items()]
        lines.append(f"# hetcomm speedup over {baseline} (time {baseline} / time hetcomm): "
                     + ", ".join(f"{_x(v)}x at {_size_label(size)}" for size, v in per_size))
    verdict = "OK" if bench_report.total_wrong == 0 else "FAILED"
    lines.append(f"# total #wrong: {bench_report.total_wrong} {verdict}")
    return "\n".join(lines)


def _size_label(size: int) -> str:
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return f"{size} B"


def print_table(bench_report: BenchReport, stream: TextIO = sys.stdout) -> None:
    print(format_table(bench_report), file=stream, flush=True)


# The document's per-size keys that every backend shares; the rest of a row is its backends and
# the figures across backends.
_SIZE_KEYS = ("size_bytes", "count", "type", "redop")
_PLAN, _SIZE = "plan", "size"
RATIO_KEY = f"busbw_ratio_{RATIO_NUMERATOR}_{RATIO_DENOMINATOR}"     # as BenchReport.to_json names it


def report_records(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of a run's document (:meth:`BenchReport.to_json`), command left out."""
    head = {key: value for key, value in document.items()
            if key not in ("command", "rows", "ratios", "plans")}
    out = [record(RUN, head)]
    out += [record(_PLAN, backend=name, plan=plan)
            for name, plan in (document.get("plans") or {}).items()]
    for row in document["rows"]:
        shared = {key: row[key] for key in _SIZE_KEYS}
        out += [record(RESULT, shared, backend=name, **result)
                for name, result in row["backends"].items()]
        across = {key: value for key, value in row.items()
                  if key not in _SIZE_KEYS and key != "backends"}
        if across:
            out.append(record(_SIZE, size_bytes=row["size_bytes"], **across))
    return out


def report_document(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The document :func:`report_records` came from (an old file's document as it is)."""
    if is_legacy(records):
        return dict(records[0])
    document = header(records)
    rows: dict[int, dict[str, Any]] = {}
    plans = {}
    for rec in records:
        data = fields(rec)
        if rec.get("kind") == RESULT:
            shared = {key: data.pop(key) for key in _SIZE_KEYS}
            row = rows.setdefault(shared["size_bytes"], {**shared, "backends": {}})
            row["backends"][data.pop("backend")] = data
        elif rec.get("kind") == _SIZE:
            rows[data.pop("size_bytes")].update(data)
        elif rec.get("kind") == _PLAN:
            plans[data["backend"]] = data["plan"]
    document["rows"] = list(rows.values())
    document["ratios"] = [{"size_bytes": row["size_bytes"], RATIO_KEY: row[RATIO_KEY]}
                          for row in document["rows"] if RATIO_KEY in row]
    if plans:
        document["plans"] = plans
    return document


def read_report(path: str) -> dict[str, Any]:
    """The document of a run saved by ``--json`` (either format; a trace, if the file names one,
    joined: :func:`~hetcomm.bench.records.read_with_trace`)."""
    return report_document(read_with_trace(path))


def write_json(bench_report: BenchReport, path: str) -> None:
    """Writes the report's records atomically, so a reader never sees a half-written file."""
    document = bench_report.to_json()
    write_records(path, report_records(document), document["command"])
    print(f"{PREFIX}: wrote {path}", file=sys.stderr, flush=True)
