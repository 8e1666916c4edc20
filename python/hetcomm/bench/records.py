"""Result files as data: JSON Lines, one record per line, each with the command that made it.

A result file holds a ``"kind": "run"`` header, then one record per measurement, every record
with ``"kind"`` and ``"command"``. `write_records` / `read_records`; `write_with_trace` /
`read_with_trace` keep per-round series in a gzip trace beside the summary (`trace_path`),
checked by digest; `is_legacy` marks the earlier one-document format. No torch import: tools
that only read results use this module alone. As a command::

    python -m hetcomm.bench.records FILE.json [KEY=KIND ...]

prints the header's fields plus, for each ``KEY=KIND``, the records of that kind (trace records
included) as a list under ``KEY``. The format: benchmarks/README.md#result-files,
benchmarks/results/README.md and docs/bench-cli.md#result-files.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import shlex
import sys
from typing import Any, Collection, Iterable, Mapping, Optional, Sequence

RUN = "run"
RESULT = "result"
ROWS = {"rows": RESULT}     # the common document: a header plus "rows", one "result" record each
NOT_RECORDED = "the command that produced this file was not recorded"
TRACE = "trace"             # the header's field that names the trace file
TRACES_DIR = "traces"       # the trace of DIR/NAME.json is DIR/traces/NAME.jsonl.gz
_STAMP = ("kind", "command")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """This process's command line, shell-quoted so that it can be pasted and run again."""
    return shlex.join([sys.executable, *(sys.argv if argv is None else argv)])


def record(kind: str, data: Mapping[str, Any] = (), **more: Any) -> dict[str, Any]:
    """``{"kind": kind, **data, **more}``; ValueError if the data already name a kind or a
    command (a row's own ``kind``, a plan's for instance, must be nested under another key)."""
    body = {**dict(data), **more}
    clash = [key for key in _STAMP if key in body]
    if clash:
        raise ValueError(f"a {kind!r} record cannot carry its own {clash}: nest it under another key")
    return {"kind": kind, **body}


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _line(rec: Mapping[str, Any], command: Optional[str]) -> str:
    if not isinstance(rec, Mapping) or "kind" not in rec:
        raise ValueError(f"a record is a dict with a 'kind': {rec!r:.200}")
    if rec.get("command", command) != command:
        raise ValueError(f"record {rec['kind']!r} names another command: {rec['command']!r}")
    stamped = {"kind": rec["kind"], "command": command, **fields(rec)}
    return json.dumps(_finite(stamped), separators=(",", ":"), allow_nan=False)


def _text(records: Iterable[Mapping[str, Any]], command: Optional[str]) -> str:
    return "".join(_line(rec, command) + "\n" for rec in records)


def _write_atomically(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_records(path: str, records: Iterable[Mapping[str, Any]], command: Optional[str]) -> None:
    """Writes ``records`` to ``path`` as JSON Lines, each stamped with ``command``, atomically.

    Each record needs a ``"kind"``; a ``"command"`` in it must equal ``command``. NaN and
    infinities become null. The parent directory is created if missing. Everything is
    serialised before the file is opened: a record that is not JSON leaves nothing behind.
    """
    _write_atomically(path, _text(records, command).encode())


def write_document(path: str, document: Mapping[str, Any], command: Optional[str],
                   lists: Mapping[str, str] = ROWS) -> None:
    """:func:`write_records` of :func:`split_document` (a header, one record per listed element)."""
    write_records(path, split_document(document, lists), command)


def _read_bytes(path: str) -> bytes:
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as handle:
        return handle.read()


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a result file (gzip if ``path`` ends in ``.gz``: a trace); an old
    single-document file reads as ``[document]``. A summary's trace is not joined: see
    :func:`read_with_trace`."""
    return _parse(_read_bytes(path).decode(), path)


def _parse(text: str, path: str) -> list[dict[str, Any]]:
    records = []
    try:
        for line in text.splitlines():
            if line.strip():
                records.append(json.loads(line))
    except json.JSONDecodeError:
        records = [json.loads(text)]         # the legacy format: one (pretty-printed) document
    bad = [type(rec).__name__ for rec in records if not isinstance(rec, dict)]
    if bad:
        raise ValueError(f"{path}: every record must be a JSON object, found {bad[0]}")
    return records


def is_legacy(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``records`` came from an old single-document file (no ``kind``)."""
    return len(records) == 1 and "kind" not in records[0]


def fields(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A record's data: everything but its ``kind`` and ``command``."""
    return {key: value for key, value in rec.items() if key not in _STAMP}


def of_kind(records: Iterable[Mapping[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The data (:func:`fields`) of the records of one kind, in file order."""
    return [fields(rec) for rec in records if rec.get("kind") == kind]


def header(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's header: the ``"run"`` record's data plus its ``command``; KeyError if none."""
    for rec in records:
        if rec.get("kind") == RUN:
            return {"command": rec.get("command"), **fields(rec)}
    raise KeyError("no 'run' record (is this a result file?)")


def split_document(document: Mapping[str, Any], lists: Mapping[str, str]) -> list[dict[str, Any]]:
    """A document as records: a ``run`` header of its fields but ``command`` and the lists, then
    for ``lists = {key: kind}`` one record of that kind per element of ``document[key]``."""
    head = {key: value for key, value in document.items() if key != "command" and key not in lists}
    return [record(RUN, head)] + [record(kind, row) for key, kind in lists.items()
                                  for row in document.get(key, ())]


def join_document(records: Sequence[Mapping[str, Any]], lists: Mapping[str, str]) -> dict[str, Any]:
    """The inverse of :func:`split_document`: the header's fields (``command`` included) plus
    ``{key: of_kind(records, kind)}``. An old single-document file gives its document as it is."""
    if is_legacy(records):
        return dict(records[0])
    return {**header(records), **{key: of_kind(records, kind) for key, kind in lists.items()}}


def trace_path(path: str) -> str:
    """Where the trace of the summary ``DIR/NAME.json`` goes: ``DIR/traces/NAME.jsonl.gz``."""
    directory, name = os.path.split(path)
    stem = name[:-len(".json")] if name.endswith(".json") else name
    return os.path.join(directory, TRACES_DIR, f"{stem}.jsonl.gz")


def split_trace(records: Iterable[Mapping[str, Any]],
                kinds: Collection[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(summary, trace)``: the records of the ``kinds`` (per round, per step, time series)
    and the rest, each in its order."""
    summary: list[dict[str, Any]] = []
    trace: list[dict[str, Any]] = []
    for rec in records:
        (trace if rec.get("kind") in kinds else summary).append(rec)
    return summary, trace


def _key(rec: Mapping[str, Any], key: Sequence[str]) -> str:
    return json.dumps([rec.get(name) for name in key])


def join_trace(summary: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
               key: Sequence[str]) -> list[dict[str, Any]]:
    """The inverse of :func:`split_trace`: each trace record, in trace order, right after the
    first summary record with the same ``key`` fields (a record without them: the header).
    ValueError if a trace record has no such summary record: it would be lost."""
    owned: dict[str, list[Mapping[str, Any]]] = {}
    for rec in trace:
        owned.setdefault(_key(rec, key), []).append(rec)
    joined: list[dict[str, Any]] = []
    for rec in summary:
        joined.append(rec)
        joined += owned.pop(_key(rec, key), [])
    if owned:
        orphans = sum(len(recs) for recs in owned.values())
        raise ValueError(f"{orphans} trace record(s) belong to no summary record: "
                         f"{key} = {', '.join(sorted(owned))}")
    return joined


def write_with_trace(path: str, records: Sequence[Mapping[str, Any]], command: Optional[str],
                     kinds: Collection[str], key: Sequence[str]) -> None:
    """:func:`write_records` of the summary to ``path`` and of the records of the ``kinds``, gzip,
    to :func:`trace_path`; the header (the ``run`` record) gets a ``"trace"`` field that names the
    trace file, ``kinds``, ``key``, the number of trace records and their text's SHA-256.

    Each trace record must follow the summary record it belongs to (the one with the same
    ``key`` fields; the header for one without them), so that :func:`read_with_trace` gives
    ``records`` back in their order: ValueError otherwise, before anything is written. Without
    trace records the summary is written alone, and an earlier trace at that path removed.
    """
    records = list(records)
    summary, trace = split_trace(records, kinds)
    joined = join_trace(summary, trace, key)
    if any(a is not b for a, b in zip(joined, records)):
        raise ValueError(f"{path}: a trace record does not follow the summary record with its "
                         f"key {list(key)}; reading the files back would reorder them")
    where = trace_path(path)
    if trace:
        heads = [i for i, rec in enumerate(summary) if rec.get("kind") == RUN]
        if not heads or TRACE in summary[heads[0]]:
            raise ValueError(f"{path}: a trace needs a {RUN!r} record without a {TRACE!r} field")
        data = _text(trace, command).encode()
        # mtime 0 and no file name in the gzip header: the same records give the same bytes
        _write_atomically(where, gzip.compress(data, compresslevel=9, mtime=0))
        summary[heads[0]] = {**summary[heads[0]], TRACE: {
            "file": os.path.relpath(where, os.path.dirname(path) or "."), "kinds": sorted(kinds),
            "key": list(key), "records": len(trace),
            "sha256": hashlib.sha256(data).hexdigest()}}
    write_records(path, summary, command)
    if not trace and os.path.exists(where):
        os.unlink(where)


def read_with_trace(path: str) -> list[dict[str, Any]]:
    """The records of a result file joined with its trace (:func:`write_with_trace`), without
    the header's ``"trace"`` field: what the writer wrote. A file without a trace reads as
    :func:`read_records`. ValueError if the trace is not the one the summary names."""
    summary = read_records(path)
    heads = [i for i, rec in enumerate(summary) if rec.get("kind") == RUN and TRACE in rec]
    if not heads:
        return summary
    head = dict(summary[heads[0]])
    about = head.pop(TRACE)
    where = os.path.join(os.path.dirname(path), about["file"])
    data = _read_bytes(where)
    if hashlib.sha256(data).hexdigest() != about["sha256"]:
        raise ValueError(f"{path}: its trace {where} is not the one it was written with "
                         f"(SHA-256 differs): a summary and a trace of different runs")
    summary[heads[0]] = head
    return join_trace(summary, _parse(data.decode(), where), about["key"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or any("=" not in arg for arg in argv[1:]):
        print("usage: python -m hetcomm.bench.records FILE.json [KEY=KIND ...]", file=sys.stderr)
        return 2
    lists = dict(arg.split("=", 1) for arg in argv[1:])
    try:
        json.dump(join_document(read_with_trace(argv[0]), lists), sys.stdout, indent=1)
    except (OSError, ValueError, KeyError) as error:
        print(f"hetcomm.bench.records: {error}", file=sys.stderr)
        return 2
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
