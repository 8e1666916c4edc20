"""Result files as records (hetcomm.bench.records): JSON Lines, one record per line, each with
its command; the old single-document files still read; a summary and its gzip trace join back
into every record the writer gave, in order; every file in benchmarks/results is in the new
format, small, and its trace (if any) is the one it names."""
from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import math
import os
import types

import pytest

from hetcomm.bench import records as R

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


TRACE_KINDS = ("round", "timeline", "kill")
KEY = ("config", "repeat")


def with_trace() -> list[dict]:
    """A DiLoCo-like run: a header and one kill it owns, figures per configuration, and per
    (config, repeat) a result followed by its rounds and timelines."""
    out = [R.record(R.RUN, cpu_quota="0.8,0.2"), R.record("kill", rank=1, t=3.5),
           R.record("figures", config="fixed", final_loss=1.5),
           R.record("figures", config="time", final_loss=1.4)]
    for config in ("fixed", "time"):
        for repeat in (0, 1):
            which = {"config": config, "repeat": repeat}
            out.append(R.record(R.RESULT, which, final_loss=1.5 - repeat / 10, rounds=2))
            out += [R.record("round", which, round=i, steps=[8, 2]) for i in (1, 2)]
            out += [R.record("timeline", which, rank=r, segments=[["compute", 0.0, 1.0 + r]])
                    for r in (0, 1)]
    return out


def stamped(records: list[dict]) -> list[dict]:
    return [{"kind": rec["kind"], "command": COMMAND, **R.fields(rec)} for rec in records]


def test_split_and_join_trace_give_back_every_record_in_order():
    records = with_trace()
    summary, trace = R.split_trace(records, TRACE_KINDS)
    assert [rec["kind"] for rec in summary] == [R.RUN, "figures", "figures"] + [R.RESULT] * 4
    assert {rec["kind"] for rec in trace} == set(TRACE_KINDS) and len(summary) + len(trace) == len(records)
    assert R.join_trace(summary, trace, KEY) == records
    assert R.join_trace(summary, [], KEY) == summary
    with pytest.raises(ValueError, match="belong to no summary record"):       # its result is gone
        R.join_trace([rec for rec in summary if rec.get("repeat") != 1], trace, KEY)


def test_write_with_trace_keeps_the_summary_and_gzips_the_trace(tmp_path):
    path = str(tmp_path / "diloco.json")
    R.write_with_trace(path, with_trace(), COMMAND, TRACE_KINDS, KEY)
    assert R.trace_path(path) == str(tmp_path / "traces" / "diloco.jsonl.gz")
    assert sorted(os.listdir(tmp_path)) == ["diloco.json", "traces"]
    summary = R.read_records(path)
    assert not {rec["kind"] for rec in summary} & set(TRACE_KINDS)
    about = summary[0][R.TRACE]
    assert about["file"] == "traces/diloco.jsonl.gz" and about["key"] == list(KEY)
    assert about["kinds"] == sorted(TRACE_KINDS) and about["records"] == 17
    trace = R.read_records(R.trace_path(path))
    assert len(trace) == 17 and all(rec["command"] == COMMAND for rec in trace)
    assert R.read_with_trace(path) == stamped(with_trace())          # every record, in order
    before = open(R.trace_path(path), "rb").read()
    R.write_with_trace(path, with_trace(), COMMAND, TRACE_KINDS, KEY)
    assert open(R.trace_path(path), "rb").read() == before            # same records, same bytes


def test_a_trace_of_another_run_or_with_a_record_lost_does_not_join(tmp_path):
    path = str(tmp_path / "r.json")
    R.write_with_trace(path, with_trace(), COMMAND, TRACE_KINDS, KEY)
    lines = gzip.decompress(open(R.trace_path(path), "rb").read()).splitlines(keepends=True)
    with open(R.trace_path(path), "wb") as handle:
        handle.write(gzip.compress(b"".join(lines[:-1])))
    with pytest.raises(ValueError, match="SHA-256"):
        R.read_with_trace(path)
    other = str(tmp_path / "other.json")
    R.write_with_trace(other, with_trace()[:-1], COMMAND, TRACE_KINDS, KEY)
    os.replace(R.trace_path(other), R.trace_path(path))
    with pytest.raises(ValueError, match="SHA-256"):
        R.read_with_trace(path)


def test_a_trace_record_out_of_place_is_refused_before_writing(tmp_path):
    records = with_trace()
    records.insert(2, records.pop(6))        # a round of ("fixed", 0) before the figures
    path = str(tmp_path / "r.json")
    with pytest.raises(ValueError, match="does not follow"):
        R.write_with_trace(path, records, COMMAND, TRACE_KINDS, KEY)
    with pytest.raises(ValueError, match="belong to no summary record"):
        R.write_with_trace(path, [rec for rec in with_trace() if rec["kind"] != R.RESULT],
                           COMMAND, TRACE_KINDS, KEY)
    with pytest.raises(ValueError, match="needs a 'run' record"):
        R.write_with_trace(path, [{**with_trace()[0], "kind": "head"}, *with_trace()[1:]], COMMAND,
                           ["kill"], KEY)
    assert os.listdir(tmp_path) == []


def test_without_trace_records_the_summary_stands_alone(tmp_path):
    path = str(tmp_path / "r.json")
    R.write_with_trace(path, with_trace(), COMMAND, TRACE_KINDS, KEY)
    R.write_with_trace(path, sample(), COMMAND, TRACE_KINDS, KEY)
    assert os.listdir(tmp_path / "traces") == []                      # the old trace is gone
    assert R.read_records(path) == R.read_with_trace(path) == stamped(sample())


def test_records_command_line_prints_one_document(tmp_path, capsys):
    path = str(tmp_path / "r.json")
    R.write_document(path, {"x": 1, "benchmarks": [{"name": "a"}]}, COMMAND,
                     {"benchmarks": "result"})
    assert R.main([path, "benchmarks=result"]) == 0
    assert json.loads(capsys.readouterr().out) == {"command": COMMAND, "x": 1,
                                                   "benchmarks": [{"name": "a"}]}
    assert R.main([]) == 2 and R.main([path, "nokind"]) == 2
    assert R.main([str(tmp_path / "missing.json")]) == 2
    R.write_with_trace(path, with_trace(), COMMAND, TRACE_KINDS, KEY)
    assert R.main([path, "rounds=round"]) == 0                        # trace records included
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["rounds"]) == 8 and R.TRACE not in printed


def test_pytest_benchmark_file_is_rewritten_as_a_summary_and_its_timings(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_conftest",
                                                  os.path.join(ROOT, "benchmarks", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    path = tmp_path / "kernels.json"
    document = {"machine_info": {"cpu": "x"},
                "benchmarks": [{"name": "a", "fullname": "t.py::a", "stats": {"median": 1.0, "data": [1.0, 1.5]}},
                               {"name": "b", "fullname": "t.py::b", "stats": {"median": 2.0, "data": [2.0]}}]}
    path.write_text(json.dumps(document, indent=4))      # as pytest-benchmark writes it
    options = {"benchmark_json": types.SimpleNamespace(name=str(path))}
    config = types.SimpleNamespace(getoption=options.get,
                                   invocation_params=types.SimpleNamespace(args=("benchmarks",)))
    conftest.pytest_sessionfinish(types.SimpleNamespace(config=config))
    summary = R.read_records(str(path))
    assert [rec["kind"] for rec in summary] == [R.RUN, R.RESULT, R.RESULT]
    command = summary[0]["command"]
    assert command.endswith("-m pytest benchmarks")
    assert [rec["stats"] for rec in summary[1:]] == [{"median": 1.0}, {"median": 2.0}]
    timings = R.read_records(R.trace_path(str(path)))
    assert [(rec["kind"], rec["command"], rec["fullname"], rec["data"]) for rec in timings] == \
        [(conftest.TIMINGS, command, "t.py::a", [1.0, 1.5]), (conftest.TIMINGS, command, "t.py::b", [2.0])]
    joined = R.read_with_trace(str(path))
    assert [rec["kind"] for rec in joined] == [R.RUN, R.RESULT, conftest.TIMINGS, R.RESULT, conftest.TIMINGS]
    for result, data in zip(R.of_kind(joined, R.RESULT), R.of_kind(joined, conftest.TIMINGS)):
        result["stats"]["data"] = data["data"]
    assert {**R.header(joined), "benchmarks": R.of_kind(joined, R.RESULT)} == {"command": command, **document}
    path.write_text("")                                  # no benchmark ran: left alone
    conftest.pytest_sessionfinish(types.SimpleNamespace(config=config))
    assert path.read_text() == ""


RESULTS = os.path.join(ROOT, "benchmarks", "results")
RESULT_FILES = sorted(glob.glob(os.path.join(RESULTS, "*.json")))
SUMMARY_MAX_BYTES = 128 * 1024      # a summary reads in a diff; per-round series go to the trace


@pytest.mark.parametrize("path", RESULT_FILES, ids=os.path.basename)
def test_every_result_file_is_a_summary_of_records(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(isinstance(rec, dict) and "kind" in rec and "command" in rec for rec in records)
    assert records[0]["kind"] == R.RUN and [rec["kind"] for rec in records].count(R.RUN) == 1
    assert len({rec["command"] for rec in records}) == 1
    if records[0]["command"] is None:
        assert records[0]["note"] == R.NOT_RECORDED
    assert os.path.getsize(path) <= SUMMARY_MAX_BYTES
    about = records[0].get(R.TRACE)
    if about is None:
        return
    assert R.trace_path(path) == os.path.join(RESULTS, about["file"])
    assert not {rec["kind"] for rec in records} & set(about["kinds"])
    joined = R.read_with_trace(path)                  # the digest: the trace is this run's
    trace = [rec for rec in joined if rec["kind"] in about["kinds"]]
    assert len(trace) == about["records"] == len(joined) - len(records)
    assert all(rec["command"] == records[0]["command"] for rec in trace)


def test_every_trace_belongs_to_a_summary():
    named = {R.trace_path(path) for path in RESULT_FILES if R.TRACE in R.read_records(path)[0]}
    assert sorted(glob.glob(os.path.join(RESULTS, R.TRACES_DIR, "*"))) == sorted(named)
