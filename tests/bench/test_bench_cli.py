"""Tests of the benchmark CLI (``python -m hetcomm.bench``): arguments, sim mode, reports, plot.

Fast: parsing and the report/plot functions run on synthetic results; one tiny end-to-end local
run; one tiny run on a simulated cluster, which needs root (skipped otherwise).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from hetcomm.bench import cli, plot
from hetcomm.bench.analysis import (annotate, cut_bound, effective_plan, physical_model,
                                    predict_seconds, uniform_record)
from hetcomm.bench.config import (SIM_DEFAULT_BACKENDS, declared_link_mbit, parse_size_list,
                                  torch_backend, variant_environment, worker_argv)
from hetcomm.bench.records import read_records
from hetcomm.bench.report import (format_sim_table, format_table, read_report, report_document,
                                  write_json)
from hetcomm.bench.results import BenchReport, SizeResult, allreduce_bus_factor
from hetcomm.sim.spec import SimSpec
from marks import needs_netns

E2E_TIMEOUT_S = 240
SIM_TIMEOUT_S = 300
MB = 1 << 20


def parse(*args: str, env_spec: bool = True):
    """(config, spec) for a command line, as main() builds them."""
    argv = ["hetcomm.bench", *args]
    parsed = cli.build_parser().parse_args(argv[1:])
    spec = cli.sim_spec_from_args(parsed) if cli.sim_requested(parsed) else None
    return cli.config_from_args(parsed, argv, spec), spec


# ============================================================================================
# Arguments
# ============================================================================================

def test_local_defaults_unchanged():
    config, spec = parse()
    assert spec is None
    assert config.backends == ("hetcomm", "gloo")
    assert config.nprocs == 4
    assert config.sizes[0] == 8 and config.sizes[-1] == 64 * MB and len(config.sizes) == 13
    assert (config.warmup, config.min_iters, config.seconds_per_size, config.timeout_s) == \
        (3, 3, 0.3, 120.0)
    assert config.plot_path is None


def test_sim_defaults_and_explicit_values_win():
    config, spec = parse("--sim-nic-mbit", "800,800,800,100")
    assert spec.world_size == 4 and spec.nic_mbit == [800, 800, 800, 100]
    assert config.nprocs == 4
    assert config.backends == SIM_DEFAULT_BACKENDS == ("hetcomm", "hetcomm-uniform", "gloo")
    assert config.sizes == (16 * MB, 64 * MB)
    assert config.min_iters == 3 and config.warmup == 1 and config.seconds_per_size <= 1.0
    # 64 MB uniform ring through 100 Mbit: ~8.5 s; the timeout must be far above that
    assert config.timeout_s >= 300
    config, _ = parse("--sim-nic-mbit", "10,10", "--sizes", "1M", "--backends", "gloo",
                      "--timeout", "50", "--warmup", "2")
    assert (config.backends, config.sizes, config.timeout_s, config.warmup) == \
        (("gloo",), (MB,), 50.0, 2)
    # very slow links get a longer default timeout
    config, _ = parse("--sim-nic-mbit", "10,10,10", "--sizes", "64M")
    assert config.timeout_s > 300


def test_sim_tcp_congestion_control():
    _, spec = parse("--sim-nic-mbit", "100,100")
    assert spec.tcp_cc == "auto"   # cubic, or the best this kernel allows; whatever the host uses
    _, spec = parse("--sim-nic-mbit", "100,100", "--sim-tcp-cc", "bbr")
    assert spec.tcp_cc == "bbr"
    _, spec = parse("--sim-nic-mbit", "100,100", "--sim-tcp-cc", "host")
    assert spec.tcp_cc is None


def test_sim_sites_and_matrix_forms():
    _, spec = parse("--sim-sites", "0,0,1,1", "--sim-intra-mbit", "1000",
                    "--sim-inter-mbit", "100")
    assert spec.world_size == 4 and spec.per_link
    _, spec = parse("--sim-link-mbit", "0,800,100;800,0,100;100,100,0", "--sim-cpu-quota",
                    "0.5,0.5,0.5")
    assert spec.world_size == 3 and spec.cpu_quota == [0.5, 0.5, 0.5]
    # a one-item list with --nprocs is used for every rank, as hetcomm.sim does
    _, spec = parse("--sim-nic-mbit", "100", "--nprocs", "3")
    assert spec.nic_mbit == [100, 100, 100]


@pytest.mark.parametrize("args, message", [
    (["--sim-sites", "0,0,1,1"], "--sim-intra-mbit"),
    (["--sim-nic-mbit", "100,100", "--sim-cpu-quota", "1,1,1"], "inconsistent world sizes"),
    (["--sim-nic-mbit", "100,abc"], "--sim-nic-mbit"),
    (["--sizes", "1M", "--max-bytes", "4M"], "cannot be combined"),
    (["--backends", "hetcomm-declared"], "hetcomm-declared"),
    (["--sim-tcp-cc", "bbr"], "give the cluster too"),
    (["--sim-nic-mbit", "100,100", "--sim-tcp-cc", "BBR;rm"], "not a TCP congestion control"),
])
def test_bad_arguments_exit_2_with_message(args, message, capsys, monkeypatch):
    monkeypatch.delenv("HETCOMM_LINK_MBIT", raising=False)
    monkeypatch.delenv("HETCOMM_SIM", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["hetcomm.bench", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_device_option_parses_and_reaches_the_ranks():
    config, _ = parse()
    assert config.device == "cpu"
    config, _ = parse("--device", "cuda", "--sizes", "1M")
    assert config.device == "cuda"
    again, _ = parse(*worker_argv(config))
    assert again.device == "cuda"
    assert "--device" not in worker_argv(parse()[0])  # the default is not spelled out


def test_device_cuda_without_a_usable_gpu_says_why(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["hetcomm.bench", "--device", "cuda", "--sizes", "1M"])
    assert exit_info.value.code == 2
    assert "no CUDA GPU is usable here" in capsys.readouterr().err


def test_device_cuda_with_a_cpu_only_hetcomm_says_so(capsys, monkeypatch):
    import torch
    import hetcomm
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hetcomm, "supported_devices", lambda: ["cpu"])
    assert "no CUDA support" in cli.check_device("cuda", ("hetcomm", "gloo"))
    assert cli.check_device("cuda", ("gloo",)) is None
    assert cli.check_device("cpu", ("hetcomm",)) is None


def test_sim_needs_root_says_so(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["hetcomm.bench", "--sim-nic-mbit", "400,100", "--sizes", "1M"])
    assert exit_info.value.code == 2
    assert "need root" in capsys.readouterr().err


def test_sim_refused_when_already_a_rank(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cli.main(["hetcomm.bench", "--sim-nic-mbit", "400,100"])
    assert "already one rank" in capsys.readouterr().err


def test_plot_without_matplotlib_names_pip_install(capsys, monkeypatch):
    def missing() -> None:
        raise plot.PlotError(f"--plot needs matplotlib, which is not installed: "
                             f"{plot.INSTALL_HINT}")
    monkeypatch.setattr(plot, "require_matplotlib", missing)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["hetcomm.bench", "--backends", "gloo", "--plot", "/tmp/x.png"])
    assert exit_info.value.code == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_error_names_pip_install_when_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import raises ImportError
    with pytest.raises(plot.PlotError, match="pip install matplotlib"):
        plot.require_matplotlib()


def test_worker_argv_round_trip(tmp_path):
    config, spec = parse("--sim-nic-mbit", "800,100", "--sizes", "8,1M", "--json",
                         str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
                         "--iters", "4", "--dtype", "bf16")
    again, _ = parse(*worker_argv(config))     # as each rank parses it (no --sim-*)
    for field in ("backends", "sizes", "dtype", "warmup", "iters", "min_iters", "max_iters",
                  "seconds_per_size", "timeout_s", "json_path", "plot_path", "device"):
        assert getattr(again, field) == getattr(config, field), field
    assert not any(arg.startswith("--sim") for arg in worker_argv(config))


def test_backend_variants_and_their_environment(monkeypatch):
    assert torch_backend("hetcomm-uniform") == torch_backend("hetcomm-declared") == "hetcomm"
    assert torch_backend("gloo") == "gloo"
    assert variant_environment("hetcomm-uniform", {}) == {"HETCOMM_PROBE": "0",
                                                          "HETCOMM_LINK_MBIT": None}
    assert variant_environment("hetcomm", {}) == variant_environment("gloo", {}) == {}
    sim_nic = {"HETCOMM_SIM": "1", "HETCOMM_SIM_NIC_MBIT": "800,800,800,100",
               "HETCOMM_SIM_LINK_MBIT": "", "HETCOMM_SIM_EFFECTIVE_MBIT": "x"}
    assert declared_link_mbit(sim_nic) == "800,800,800,100"
    sim_links = {"HETCOMM_SIM": "1", "HETCOMM_SIM_NIC_MBIT": "inf,inf",
                 "HETCOMM_SIM_LINK_MBIT": "0,100;inf,0",
                 "HETCOMM_SIM_EFFECTIVE_MBIT": "0,100;inf,0"}
    assert declared_link_mbit(sim_links) == "0,100;80000,0"
    assert declared_link_mbit({"HETCOMM_LINK_MBIT": "100,200"}) == "100,200"
    with pytest.raises(ValueError, match="hetcomm-declared"):
        declared_link_mbit({})
    assert cli.check_backends(["hetcomm-uniform", "gloo"]) is None
    error = cli.check_backends(["nosuch"])
    assert "nosuch" in error and "hetcomm-uniform" in error and "hetcomm-nccl" not in error
    assert "--device cuda" in cli.check_backends(["hetcomm-nccl"])       # NCCL moves CUDA tensors only
    assert "'nccl'" in cli.check_backends(["nccl"])                      # not for CPU tensors
    assert variant_environment("hetcomm-nccl", {}) == {"HETCOMM_LOCAL": "nccl"}
    assert variant_environment("hetcomm-tcp", {}) == {"HETCOMM_LOCAL": "tcp"}
    assert variant_environment("hetcomm-shm-pin", {}) == {"HETCOMM_SHM_PIN": "1"}


# ============================================================================================
# Physical model, bound, predictions (pure)
# ============================================================================================

def test_physical_model_nic_form():
    sim = physical_model(SimSpec(nic_mbit=[800, 800, 800, 100]))
    assert sim["bound_kind"] == "nic" and sim["bound_bytes_per_s"] == 12.5e6
    assert "slowest NIC" in sim["bound_text"] and "rank 3" in sim["bound_text"]
    assert sim["bw_bytes_per_s"][0][3] == 12.5e6 and sim["bw_bytes_per_s"][0][0] is None
    assert sim["spec"]["nic_mbit"] == [800, 800, 800, 100]
    json.dumps(sim, allow_nan=False)    # JSON-clean


def test_cut_bound_sites_and_nics():
    sim = physical_model(SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000, inter_mbit=100))
    # four 100 Mbit/s links cross the site cut each way
    assert sim["bound_kind"] == "cut" and sim["bound_bytes_per_s"] == pytest.approx(50e6)
    assert "{0,1}|{2,3}" in sim["bound_text"]
    # with NICs only the slowest NIC alone is the narrowest cut
    inf = math.inf
    nic = [100.0, 100.0, 12.5]
    bw = [[inf if i == j else min(nic[i], nic[j]) for j in range(3)] for i in range(3)]
    assert cut_bound(nic, bw) == (12.5, (0, 1))
    assert cut_bound([inf, inf], [[inf, inf], [inf, inf]])[0] == inf
    assert physical_model(SimSpec(nprocs=2))["bound_bytes_per_s"] is None


def test_predictions_follow_the_engine_rules():
    sim = physical_model(SimSpec(nic_mbit=[800, 800, 800, 100]))
    gloo = uniform_record("gloo", 4, "modelled")
    weighted = {"backend": "hetcomm", "kind": "hetcomm", "order": [0, 1, 2, 3],
                "shares": [0.0, 0.0, 0.0, 1.0], "min_bytes": 64 * 1024, "segment_bytes": 0}
    n = 16 * MB
    # 2(P-1) message latencies of 100 us, and one 1 MiB segment filling P-1 average hops
    overhead = 6 * 1e-4 + 3 * MB * (2 / 12.5e6 + 2 / 100e6) / 4
    # uniform ring: 1.5 N through the 12.5 MB/s NIC
    assert predict_seconds(sim, gloo, n) == pytest.approx(1.5 * n / 12.5e6 + overhead)
    # the slow rank owns everything: N each way through its NIC
    assert predict_seconds(sim, weighted, n) == pytest.approx(n / 12.5e6 + overhead)
    # below min_bytes the engine uses the uniform plan
    plan = effective_plan(weighted, 32 * 1024 + 4, 4)
    assert plan.is_uniform and plan.segment_bytes == 0
    plan = effective_plan(weighted, n, 4)
    assert plan.shares == (0.0, 0.0, 0.0, 1.0)
    # A plan's segment caps the adaptive one (16 MB over 4 ranks: a quarter of 16 MB / 4, 1 MiB), it
    # does not force it: 64 KB fills with 64 KB, 2 MB with the adaptive 1 MiB.
    for cap, seg in [(64 * 1024, 64 * 1024), (2 * MB, MB)]:
        capped = dict(weighted, segment_bytes=cap)
        fill = 3 * seg * (2 / 12.5e6 + 2 / 100e6) / 4
        assert predict_seconds(sim, capped, n) == pytest.approx(n / 12.5e6 + 6 * 1e-4 + fill)


# ============================================================================================
# Reports on synthetic results
# ============================================================================================

def _result(backend: str, size: int, seconds: float, world: int = 4) -> SizeResult:
    algbw = size / seconds / 1e9
    return SizeResult(backend=backend, size_bytes=size, count=size // 4, dtype="float32",
                      redop="sum", warmup=1, iters=3, time_us=seconds * 1e6, algbw_gbps=algbw,
                      busbw_gbps=algbw * allreduce_bus_factor(world), wrong=0,
                      rank_time_us=(seconds * 1e6,) * world)


def synthetic_report(sim: bool = True) -> BenchReport:
    backends = ["hetcomm", "hetcomm-uniform", "gloo"] if sim else ["hetcomm", "gloo"]
    report = BenchReport(argv=["hetcomm.bench"], command="python -m hetcomm.bench",
                         launch="sim" if sim else "local", world_size=4, backends=backends,
                         dtype="float32", hostname="h", torch_version="t", python_version="p",
                         started_at="s", config={})
    times = {"hetcomm": 1.4, "hetcomm-uniform": 2.1, "gloo": 2.2}
    for size in (16 * MB, 64 * MB):
        for name in backends:
            report.results.append(_result(name, size, times[name] * size / (16 * MB)))
    if sim:
        report.sim = physical_model(SimSpec(nic_mbit=[800, 800, 800, 100]))
        report.plans = {
            "hetcomm": {"backend": "hetcomm", "kind": "hetcomm", "source": "probed",
                        "order": [0, 3, 2, 1], "shares": [0.0, 0.0, 0.0, 1.0],
                        "min_bytes": 65536, "segment_bytes": 32768, "text": "hetcomm plan: x",
                        "model": {"bw_bytes_per_s": [[None, 1e8], [1.2e7, None]]}},
            "hetcomm-uniform": {"backend": "hetcomm-uniform", "kind": "hetcomm",
                                "source": "HETCOMM_PROBE=0", "order": [0, 1, 2, 3],
                                "shares": [0.25] * 4, "min_bytes": 0, "segment_bytes": 0,
                                "text": "hetcomm plan: y", "model": None},
            "gloo": uniform_record("gloo", 4, "modelled"),
        }
        annotate(report)
    return report


def test_sim_table_has_prediction_bound_and_speedups():
    report = synthetic_report()
    text = format_table(report)
    assert text == format_sim_table(report)
    for needle in ("pred(ms)", "meas/pred", "bound(ms)", "meas/bound", "slowest NIC",
                   "ring 0>3>2>1", "1.57x over gloo", "1.50x over hetcomm-uniform",
                   "cluster: 4 ranks; NIC Mbit/s 800,800,800,100", "total #wrong: 0 OK"):
        assert needle in text, needle
    row = next(line for line in text.splitlines() if line.strip().startswith("16777216"))
    cells = row.split()
    assert cells[4] == "hetcomm" and cells[5] == "1400.00"
    assert float(cells[9]) == pytest.approx(1.4 / (16 * MB / 12.5e6), abs=0.01)  # meas/bound


def test_sim_json_records_spec_plans_predictions():
    """The JSON of a simulated run: spec, plans, bounds, and a prediction checked against the
    hand-derived value of the plan (it was checked for being positive)."""
    document = json.loads(json.dumps(synthetic_report().to_json(), allow_nan=False))
    assert document["sim"]["spec"]["nic_mbit"] == [800, 800, 800, 100]
    assert document["plans"]["hetcomm"]["order"] == [0, 3, 2, 1]
    assert "text_physical" in document["plans"]["hetcomm"]
    row = document["rows"][0]
    assert row["bound_s"] == pytest.approx(16 * MB / 12.5e6)
    hc = row["backends"]["hetcomm"]
    # The plan gives the 100 Mbit/s rank all of the buffer: its NIC carries N each way and every
    # other link less (docs/planner.md's worked example), so the prediction is N / 12.5 MB/s plus the
    # pipeline's start-up (well under 1%), computed here by hand rather than only "positive".
    assert hc["predicted_s"] == pytest.approx(16 * MB / 12.5e6, rel=0.01)
    assert hc["pred_ratio"] == pytest.approx(1.4 / hc["predicted_s"])
    assert hc["time_over_bound"] == pytest.approx(1.4 / row["bound_s"])
    assert row["speedup_hetcomm_over_gloo"] == pytest.approx(2.2 / 1.4)
    assert row["speedup_hetcomm_over_uniform"] == pytest.approx(2.1 / 1.4)


@pytest.mark.parametrize("sim", [True, False])
def test_json_file_is_one_record_per_measurement_and_reads_back(tmp_path, capsys, sim):
    report = synthetic_report(sim=sim)
    path = tmp_path / "r.json"
    write_json(report, str(path))
    assert "wrote" in capsys.readouterr().err
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(rec["command"] == "python -m hetcomm.bench" for rec in records)
    kinds = [rec["kind"] for rec in records]
    assert kinds[0] == "run" and kinds.count("run") == 1
    # one result per (size, backend), each naming both
    results = [rec for rec in records if rec["kind"] == "result"]
    assert [(r["size_bytes"], r["backend"]) for r in results] == \
        [(r.size_bytes, r.backend) for r in report.results]
    assert kinds.count("plan") == (3 if sim else 0)
    assert kinds.count("size") == 2     # the busbw ratio (and bound, speedups) per size
    assert "rows" not in records[0] and "plans" not in records[0]
    # the document comes back, as the plot and the scripts read it
    expected = json.loads(json.dumps(report.to_json()))
    assert read_report(str(path)) == expected
    assert report_document(read_records(str(path))) == expected


def test_read_report_reads_the_old_single_document(tmp_path):
    document = json.loads(json.dumps(synthetic_report().to_json()))
    path = tmp_path / "old.json"
    path.write_text(json.dumps(document, indent=2))
    assert read_report(str(path)) == document


def test_local_table_keeps_its_layout():
    report = synthetic_report(sim=False)
    text = format_table(report)
    assert "busbw ratio hetcomm/gloo" in text and "pred(ms)" not in text
    assert "(local launch)" in text
    document = report.to_json()
    assert "sim" not in document and "predicted_s" not in document["rows"][0]["backends"]["gloo"]
    assert document["rows"][0]["busbw_ratio_hetcomm_gloo"] == pytest.approx(2.2 / 1.4)


# ============================================================================================
# Plot
# ============================================================================================

def test_plot_series_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    document = synthetic_report().to_json()
    data = plot.series(document)
    assert [s for s, _ in data["measured"]["gloo"]] == [16 * MB, 64 * MB]
    # bound busbw: the slowest NIC's rate times 2(n-1)/n, at every size
    assert all(b == pytest.approx(12.5e6 * 1.5 / 1e9) for _, b in data["bound"])
    assert plot.plan_label(document["plans"]["hetcomm"]) == \
        "ring 0>3>2>1, shares 0/0/0/100% from 64K"
    path = tmp_path / "sim.png"
    plot.write_plot(document, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    local = tmp_path / "local.png"
    plot.write_plot(synthetic_report(sim=False).to_json(), str(local))
    assert local.stat().st_size > 10_000
    # the standalone form: python -m hetcomm.bench.plot RESULT.json OUT.png, on a file of
    # records (as --json writes it) and on an old single-document file
    saved = tmp_path / "r.json"
    write_json(synthetic_report(), str(saved))
    assert plot.main([str(saved), str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document, indent=2))
    assert plot.main([str(old), str(tmp_path / "old.png")]) == 0


# ============================================================================================
# End to end
# ============================================================================================

def _bench(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetcomm.bench", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_end_to_end_local(tmp_path):
    """A real run on 2 local ranks; its figures checked against their definitions (algbw,
    busbw, the hetcomm/gloo ratio), not merely for being positive as they were."""
    out = tmp_path / "local.json"
    proc = _bench(["--nprocs", "2", "--sizes", "8,64K", "--backends", "hetcomm,gloo",
                   "--json", str(out)], E2E_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {rec["kind"] for rec in records} == {"run", "plan", "result", "size"}
    assert len({rec["command"] for rec in records}) == 1 and "--json" in records[0]["command"]
    document = read_report(str(out))
    assert document["nprocs"] == 2 and document["backends"] == ["hetcomm", "gloo"]
    assert document["launch"] == "local" and document["total_wrong"] == 0
    assert [row["size_bytes"] for row in document["rows"]] == [8, 64 * 1024]
    for row in document["rows"]:
        assert set(row["backends"]) == {"hetcomm", "gloo"}
        # Each figure from its definition (nccl-tests): algbw = bytes / time, busbw = algbw *
        # 2(n-1)/n, the ratio hetcomm's busbw over gloo's; not merely "positive".
        for name, result in row["backends"].items():
            assert result["wrong"] == 0 and result["time_us"] > 0, (name, result)
            algbw = row["size_bytes"] / (result["time_us"] * 1e-6) / 1e9
            assert result["algbw_gbps"] == pytest.approx(algbw, rel=1e-6), (name, result)
            assert result["busbw_gbps"] == pytest.approx(algbw * 2 * (2 - 1) / 2, rel=1e-6), (name, result)
        hc, gl = row["backends"]["hetcomm"], row["backends"]["gloo"]
        assert row["busbw_ratio_hetcomm_gloo"] == pytest.approx(hc["busbw_gbps"] / gl["busbw_gbps"], rel=1e-6)
    assert document["plans"]["hetcomm"]["kind"] == "hetcomm"
    assert "busbw ratio hetcomm/gloo" in proc.stdout


@needs_netns
def test_end_to_end_sim(tmp_path):
    out = tmp_path / "sim.json"
    proc = _bench(["--sim-nic-mbit", "400,100", "--sizes", "1M", "--json", str(out)],
                  SIM_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = read_report(str(out))
    assert document["launch"] == "sim" and document["nprocs"] == 2
    assert document["argv"][1:] == ["--sim-nic-mbit", "400,100", "--sizes", "1M", "--json",
                                    str(out)]
    assert document["backends"] == list(SIM_DEFAULT_BACKENDS)
    assert document["sim"]["spec"]["nic_mbit"] == [400, 100]
    assert set(document["plans"]) == set(SIM_DEFAULT_BACKENDS)
    row = document["rows"][0]
    assert row["bound_s"] == pytest.approx(MB / 12.5e6)
    for name, result in row["backends"].items():
        assert result["wrong"] == 0
        assert result["predicted_s"] > 0, name
        # TCP cannot beat the shaped wire rate by much (token-bucket bursts: a little)
        assert result["time_over_bound"] > 0.8, name
    assert "meas/pred" in proc.stdout and "slowest NIC" in proc.stdout


def test_path_taken_is_the_path_that_grew():
    from hetcomm.bench.measure import _path_taken
    before = {"tcp": 5, "shm": 0, "hierarchical": 2, "nccl": 0}
    assert _path_taken(before, {"tcp": 5, "shm": 0, "hierarchical": 12, "nccl": 0}) == "hierarchical"
    assert _path_taken(before, {"tcp": 9, "shm": 0, "hierarchical": 2, "nccl": 0}) == "tcp"
    assert _path_taken(before, dict(before)) == ""          # nothing ran
    assert _path_taken(None, None) == ""                      # not hetcomm
