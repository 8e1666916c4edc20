"""Kernel micro-benchmarks (pytest-benchmark). Collected only when benchmarks were asked for:

    python -m pytest benchmarks --benchmark-only --benchmark-json benchmarks/results/reduce_kernels.json

A plain ``pytest`` (or ``pytest tests``) does not collect anything here.

pytest-benchmark writes ``--benchmark-json`` as one pretty-printed document; at the end of the
session this file is rewritten as a summary of records, one per line (hetcomm.bench.records), each
with the pytest command: a ``run`` header (``machine_info``, ``commit_info``, ``datetime``,
``version``), then one ``result`` per benchmark (its ``stats`` without ``data``). Every timing of a
benchmark (``stats.data``: hundreds of floats each) goes to the trace, ``traces/NAME.jsonl.gz``
beside it, as one ``timings`` record (``fullname``, ``data``). For ``pytest-benchmark compare``,
turn the summary back into one document (its stats are what compare reads; pytest-benchmark's own
saved runs leave ``data`` out too): ``python -m hetcomm.bench.records FILE benchmarks=result >
DOC.json``.
"""
import shlex
import sys

import pytest

BENCHMARKS = {"benchmarks": "result"}   # pytest-benchmark's list, one record per benchmark
TIMINGS = "timings"                     # a benchmark's every timing: the trace
BENCHMARK_KEY = ("fullname",)           # what ties its timings to a benchmark's result


def _option(config, name: str):
    try:
        return config.getoption(name)
    except ValueError:  # pytest-benchmark is not installed
        return None


def _benchmarks_requested(config) -> bool:
    return bool(_option(config, "benchmark_only") or _option(config, "benchmark_enable"))


def benchmark_records(document: dict) -> list[dict]:
    """The records of pytest-benchmark's document: the header, then per benchmark its ``result``
    without ``stats.data``, followed by a ``timings`` record that holds it."""
    from hetcomm.bench.records import RESULT, record, split_document
    out = []
    for rec in split_document(document, BENCHMARKS):
        stats = rec.get("stats") if rec["kind"] == RESULT else None
        if isinstance(stats, dict) and "data" in stats:
            out.append({**rec, "stats": {key: value for key, value in stats.items() if key != "data"}})
            out.append(record(TIMINGS, {"fullname": rec["fullname"], "data": stats["data"]}))
        else:
            out.append(rec)
    return out


def pytest_sessionfinish(session):
    """Rewrites pytest-benchmark's ``--benchmark-json`` file as records. pytest-benchmark writes it
    from a hook wrapper, which has finished before this hook runs."""
    handle = _option(session.config, "benchmark_json")
    if handle is None:
        return
    from hetcomm.bench.records import read_records, write_with_trace
    try:
        [document] = read_records(handle.name)
    except ValueError:  # empty: no benchmark ran, nothing was saved
        return
    command = shlex.join([sys.executable, "-m", "pytest", *session.config.invocation_params.args])
    write_with_trace(handle.name, benchmark_records(document), command, [TIMINGS], BENCHMARK_KEY)


def pytest_ignore_collect(collection_path, config):
    if collection_path.name.startswith("test_") and not _benchmarks_requested(config):
        return True
    return None


@pytest.fixture(scope="session")
def hetcomm_C():
    """The compiled extension; skips when it is missing or has no reduce_into (build it first:
    ``pip install --no-build-isolation -e .``)."""
    try:
        from hetcomm._engine import extension
        _C = extension()
    except ImportError as e:
        pytest.skip(f"hetcomm._C is not importable: {e}")
    if not hasattr(_C, "reduce_into"):
        pytest.skip("hetcomm._C has no reduce_into binding")
    return _C
