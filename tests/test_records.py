"""Result files as records (hetcomm.bench.records): JSON Lines, one record per line, each with
its command; the old single-document files still read; every file in benchmarks/results is in
the new format."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import types

import pytest

from hetcomm.bench import records as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = "python benchmarks/x.py --json out.json"


def sample() -> list[dict]:
    return [R.record(R.RUN, config={"sizes": [8, 1024]}, host="h"),
            R.record(R.RESULT, backend="hetcomm", size_bytes=8, time_us=1.5),
            R.record(R.RESULT, backend="gloo", size_bytes=8, time_us=2.5, rank_time_us=[2.5, 2.0])]


def test_round_trip_stamps_every_record_with_the_command(tmp_path):
    path = str(tmp_path / "r.json")
    R.write_records(path, sample(), COMMAND)
    got = R.read_records(path)
    assert got == [{"kind": rec["kind"], "command": COMMAND, **R.fields(rec)} for rec in sample()]
    assert R.header(got) == {"command": COMMAND, "config": {"sizes": [8, 1024]}, "host": "h"}
    assert R.of_kind(got, R.RESULT)[1] == {"backend": "gloo", "size_bytes": 8, "time_us": 2.5,
                                            "rank_time_us": [2.5, 2.0]}
    assert not R.is_legacy(got)


def test_every_line_is_one_compact_object_with_kind_and_command(tmp_path):
    path = tmp_path / "r.json"
    R.write_records(str(path), sample(), COMMAND)
    text = path.read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == len(sample())
    for line in lines:
        rec = json.loads(line)
        assert isinstance(rec, dict) and list(rec)[:2] == ["kind", "command"]
        assert rec["command"] == COMMAND
        assert ": " not in line and ", " not in line      # compact


def test_legacy_document_reads_as_one_record(tmp_path):
    document = {"command": "python old.py", "rows": [{"size_bytes": 8}, {"size_bytes": 16}],
                "nested": {"a": [1, 2]}}
    path = str(tmp_path / "old.json")
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)
    got = R.read_records(path)
    assert got == [document] and R.is_legacy(got)
    assert R.join_document(got, R.ROWS) == document


def test_nan_and_infinity_become_null(tmp_path):
    path = tmp_path / "r.json"
    R.write_records(str(path), [R.record(R.RESULT, ratio=math.nan, bound=math.inf,
                                         each=[1.0, -math.inf], nested={"x": (math.nan, 2.0)})],
                    COMMAND)
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    rec = json.loads(line)
    assert rec["ratio"] is None and rec["bound"] is None
    assert rec["each"] == [1.0, None] and rec["nested"] == {"x": [None, 2.0]}


def test_atomic_write_leaves_no_temporary_file_and_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "r.json"
    R.write_records(str(path), sample(), COMMAND)
    assert os.listdir(tmp_path) == ["r.json"]
    before = path.read_bytes()
    with pytest.raises(TypeError):
        R.write_records(str(path), [R.record(R.RESULT, value=object())], COMMAND)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["r.json"]


def test_a_failed_replace_removes_the_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    R.write_records(str(path), sample(), COMMAND)
    before = path.read_bytes()

    def fail(src, dst):
        assert os.path.exists(src) and os.path.dirname(src) == str(tmp_path)   # beside the file
        raise OSError("disk full")
    monkeypatch.setattr(R.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        R.write_records(str(path), sample()[:1], COMMAND)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["r.json"]


def test_missing_directory_is_created(tmp_path):
    R.write_records(str(tmp_path / "sub" / "r.json"), sample(), None)
    assert os.listdir(tmp_path / "sub") == ["r.json"]


def test_records_are_checked():
    with pytest.raises(ValueError, match="kind"):
        R.record(R.RESULT, {"kind": "hetcomm"})            # a plan's own kind: nest it
    with pytest.raises(ValueError, match="command"):
        R.record(R.RUN, command="x")
    with pytest.raises(ValueError, match="kind"):
        R.write_records("/nonexistent/never.json", [{"size_bytes": 8}], COMMAND)
    with pytest.raises(ValueError, match="another command"):
        R.write_records("/nonexistent/never.json", [{"kind": R.RUN, "command": "other"}], COMMAND)
    assert not os.path.exists("/nonexistent")


def test_read_rejects_lines_that_are_not_objects(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"kind":"run","command":null}\n[1,2]\n')
    with pytest.raises(ValueError, match="JSON object"):
        R.read_records(str(path))


def test_split_and_join_document_are_inverse(tmp_path):
    document = {"group_timeout_s": 10.0, "rows": [{"backend": "gloo", "op_s": 1.0},
                                                  {"backend": "hetcomm", "op_s": 0.1}]}
    path = str(tmp_path / "r.json")
    R.write_document(path, document, COMMAND)
    got = R.read_records(path)
    assert [rec["kind"] for rec in got] == [R.RUN, R.RESULT, R.RESULT]
    assert R.join_document(got, R.ROWS) == {"command": COMMAND, **document}


def test_records_command_line_prints_one_document(tmp_path, capsys):
    path = str(tmp_path / "r.json")
    R.write_document(path, {"x": 1, "benchmarks": [{"name": "a"}]}, COMMAND,
                     {"benchmarks": "result"})
    assert R.main([path, "benchmarks=result"]) == 0
    assert json.loads(capsys.readouterr().out) == {"command": COMMAND, "x": 1,
                                                   "benchmarks": [{"name": "a"}]}
    assert R.main([]) == 2 and R.main([path, "nokind"]) == 2
    assert R.main([str(tmp_path / "missing.json")]) == 2


def test_pytest_benchmark_file_is_rewritten_as_records(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_conftest",
                                                  os.path.join(ROOT, "benchmarks", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    path = tmp_path / "kernels.json"
    document = {"machine_info": {"cpu": "x"}, "benchmarks": [{"name": "a", "stats": {"data": [1.0]}},
                                                             {"name": "b", "stats": {"data": [2.0]}}]}
    path.write_text(json.dumps(document, indent=4))      # as pytest-benchmark writes it
    options = {"benchmark_json": types.SimpleNamespace(name=str(path))}
    config = types.SimpleNamespace(getoption=options.get,
                                   invocation_params=types.SimpleNamespace(args=("benchmarks",)))
    conftest.pytest_sessionfinish(types.SimpleNamespace(config=config))
    got = R.read_records(str(path))
    assert [rec["kind"] for rec in got] == [R.RUN, R.RESULT, R.RESULT]
    assert got[0]["command"].endswith("-m pytest benchmarks")
    assert R.join_document(got, conftest.BENCHMARKS) == {"command": got[0]["command"], **document}
    path.write_text("")                                  # no benchmark ran: left alone
    conftest.pytest_sessionfinish(types.SimpleNamespace(config=config))
    assert path.read_text() == ""


RESULT_FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))


@pytest.mark.parametrize("path", RESULT_FILES, ids=os.path.basename)
def test_every_result_file_is_records(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(isinstance(rec, dict) and "kind" in rec and "command" in rec for rec in records)
    assert records[0]["kind"] == R.RUN and [rec["kind"] for rec in records].count(R.RUN) == 1
    assert len({rec["command"] for rec in records}) == 1
    if records[0]["command"] is None:
        assert records[0]["note"] == R.NOT_RECORDED
