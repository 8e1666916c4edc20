"""Result files as data: JSON Lines, one record per line, each with the command that made it.

A result file (``benchmarks/results/*.json``, ``python -m hetcomm.bench --json``) holds one compact
JSON object per line. The first record is the run's header (``"kind": "run"``: configuration,
machine, ...), then one record per measurement (``"kind": "result"``, or a kind the writer names),
so that the diff of a rerun shows which measurement changed. Every record carries ``"kind"`` and
``"command"``, the exact command line that produced the file (``null`` where an old file did
not record it; its header then says so in ``"note"``).

JSON has no NaN or infinity: :func:`write_records` writes them as ``null``, on purpose, so that
every line stays valid JSON for any reader. The file is written atomically (a temporary file
beside it, then ``os.replace``): a reader never sees half a file.

:func:`read_records` also reads the earlier format, one JSON document (pretty-printed): it comes
back as a list of one record, the document itself, which has no ``"kind"``
(:func:`is_legacy`).

No torch import: tools that only read results use this module alone.

Turn a file back into one document (for tools that want one, such as ``pytest-benchmark
compare``)::

    python -m hetcomm.bench.records FILE.json [KEY=KIND ...]

prints the header's fields plus, for each ``KEY=KIND``, the records of that kind as a list
under ``KEY`` (without their ``kind`` and ``command``).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
from typing import Any, Iterable, Mapping, Optional, Sequence

RUN = "run"
RESULT = "result"
ROWS = {"rows": RESULT}     # the common document: a header plus "rows", one "result" record each
NOT_RECORDED = "the command that produced this file was not recorded"
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


def write_records(path: str, records: Iterable[Mapping[str, Any]], command: Optional[str]) -> None:
    """Writes ``records`` to ``path`` as JSON Lines, each stamped with ``command``, atomically.

    Each record needs a ``"kind"``; a ``"command"`` in it must equal ``command``. NaN and
    infinities become null. The parent directory is created if missing. Everything is
    serialised before the file is opened: a record that is not JSON leaves nothing behind.
    """
    text = "".join(_line(rec, command) + "\n" for rec in records)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_document(path: str, document: Mapping[str, Any], command: Optional[str],
                   lists: Mapping[str, str] = ROWS) -> None:
    """:func:`write_records` of :func:`split_document` (a header, one record per listed element)."""
    write_records(path, split_document(document, lists), command)


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a result file; an old single-document file reads as ``[document]``."""
    with open(path) as handle:
        text = handle.read()
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or any("=" not in arg for arg in argv[1:]):
        print("usage: python -m hetcomm.bench.records FILE.json [KEY=KIND ...]", file=sys.stderr)
        return 2
    lists = dict(arg.split("=", 1) for arg in argv[1:])
    try:
        json.dump(join_document(read_records(argv[0]), lists), sys.stdout, indent=1)
    except (OSError, ValueError, KeyError) as error:
        print(f"hetcomm.bench.records: {error}", file=sys.stderr)
        return 2
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
