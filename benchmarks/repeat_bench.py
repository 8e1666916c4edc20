"""Runs one `python -m hetcomm.bench` command several times and reports medians and spreads.

Single runs on these shared 2-core machines spread widely, so a figure worth quoting is the
median of several runs, with min–max beside it. Every argument after ``--`` goes to the
benchmark CLI unchanged (each run gets its own ``--json``); per size this writes the runs' time of
every backend, hetcomm's speedup over gloo and over hetcomm-uniform (time ratios, when run) and
hetcomm's time over the physical bound (simulated clusters), with medians; and every run's plan,
the path each size took, and what the trial at group creation timed and kept.

Usage::

    python benchmarks/repeat_bench.py --runs 5 --json benchmarks/results/hosts_0011_nic1000_x5.json -- \\
        --sim-hosts 0,0,1,1 --sim-nic-mbit 1000,1000 --backends hetcomm,gloo

The JSON file holds one record per line (hetcomm.bench.records), each with the command: a ``run``
header (``bench_args``, ``runs``, ``plans_last_run``), then one ``result`` per size
(``size_bytes``; per figure ``median``, ``min``, ``max`` and every run's value).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from hetcomm.bench.records import command_line, write_document
from hetcomm.bench.report import read_report


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _run_keeping_trial_lines(cmd: list[str]) -> list[str]:
    """Runs one benchmark (its stdout dropped, its stderr passed on) and returns the distinct
    "hetcomm plan trial" lines it logged (HETCOMM_LOG_LEVEL=2 is set for it): what the trial at
    group creation timed and kept, once per group."""
    env = dict(os.environ, HETCOMM_LOG_LEVEL=os.environ.get("HETCOMM_LOG_LEVEL") or "2")
    seen: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) as p:
        for line in p.stderr:
            at = line.find("hetcomm plan trial:")
            if at < 0:
                if "[hetcomm INFO]" not in line:
                    sys.stderr.write(line)
                continue
            # Every rank logs the same line but its own elapsed time ("; the trial took ..."):
            # one line per group.
            text = line[at:].rstrip().split("; the trial took")[0]
            if text not in seen:
                seen.append(text)
                sys.stderr.write(f"[repeat_bench] {text}\n")
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m hetcomm.bench")
    args = ap.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    per_size: dict[int, dict[str, list[float]]] = {}
    plans, plans_per_run, paths_per_run, trials_per_run = None, [], [], []
    for run in range(args.runs):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "hetcomm.bench", *bench_args, "--json", f.name]
            print(f"[repeat_bench] run {run + 1}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
            trials_per_run.append(_run_keeping_trial_lines(cmd))
            data = read_report(f.name)
        plans = data.get("plans")
        # Without the model (a P x P matrix): plans_last_run keeps one, and a summary stays small.
        plans_per_run.append({k: v for k, v in ((plans or {}).get("hetcomm") or {}).items() if k != "model"})
        paths_per_run.append({row["size_bytes"]: {name: b.get("path") for name, b in row["backends"].items()}
                              for row in data["rows"]})
        for row in data["rows"]:
            d = per_size.setdefault(row["size_bytes"], {})
            for name, b in row["backends"].items():
                d.setdefault(f"{name}_s", []).append(b["time_us"] * 1e-6)
            h = row["backends"].get("hetcomm")
            if h is not None and "gloo" in row["backends"]:
                d.setdefault("speedup_over_gloo", []).append(row["backends"]["gloo"]["time_us"] / h["time_us"])
            if h is not None and "hetcomm-uniform" in row["backends"]:
                d.setdefault("speedup_over_uniform", []).append(
                    row["backends"]["hetcomm-uniform"]["time_us"] / h["time_us"])
            if h is not None and h.get("time_over_bound"):
                d.setdefault("hetcomm_over_bound", []).append(h["time_over_bound"])
    out = {"bench_args": bench_args, "runs": args.runs, "plans_last_run": plans,
           "hetcomm_plan_per_run": plans_per_run, "paths_per_run": paths_per_run, "trial_per_run": trials_per_run,
           "rows": [{"size_bytes": n, **{k: summarise(v) for k, v in d.items()}} for n, d in sorted(per_size.items())]}
    for n, d in sorted(per_size.items()):
        parts = [f"{k} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                 for k, v in d.items() if k in ("speedup_over_gloo", "speedup_over_uniform", "hetcomm_over_bound")]
        print(f"[repeat_bench] {n:>10} B: " + ", ".join(parts), flush=True)
    write_document(args.json, out, command_line())


if __name__ == "__main__":
    main()
