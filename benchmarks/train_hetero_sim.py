"""Equal vs adaptive batch partitioning, side by side, on the simulated cluster (needs root).

Runs ``examples/train_hetero.py`` under ``python -m hetcomm.sim --cpu-quota ...`` once per
partition mode and repeat, alternating the modes so that machine noise hits both alike, and
writes every run's summary plus the ratios the issue asks for::

    python benchmarks/train_hetero_sim.py --json benchmarks/results/train_hetero_sim.json

The JSON file holds one record per line (hetcomm.bench.records), each with the command: a ``run``
header (``cpu_quota``, ``example_args``, ``ratios``, the medians), then one ``result`` per run
(``mode``, ``repeat``, the example's summary).

Ratios (medians over repeats): adaptive samples/s over equal samples/s; adaptive samples/s over
its ideal (the sum of the ranks' measured compute speeds in the same run); total idle seconds at
synchronisation, adaptive over equal; final held-out loss of each mode.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from hetcomm.bench.records import command_line, read_records, write_document

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_hetero.py")


def run_once(mode: str, quotas: str, example_args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "summary.json")
        nprocs = len(quotas.split(","))
        cmd = [sys.executable, "-m", "hetcomm.sim", "--nprocs", str(nprocs), "--cpu-quota", quotas, "-q", "--",
               sys.executable, EXAMPLE, "--partition", mode, "--json", path] + example_args
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"train_hetero_sim: {mode} run failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("[rank 0]") and ("done:" in line or "step" in line):
                print(f"  {mode:8s} {line}", flush=True)
        [summary] = read_records(path)
        summary["run_seconds"] = time.perf_counter() - started
        return summary


def run_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per run: its mode, its repeat (0, 1, ...) and the example's summary."""
    return [{"mode": mode, "repeat": repeat, **summary} for mode, each in runs.items()
            for repeat, summary in enumerate(each)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-quota", default="0.8,0.4,0.2,0.2", help="per-rank CPU quota (cores)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode (alternating)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="write all runs and the ratios here")
    args, example_args = p.parse_known_args(argv)
    if os.geteuid() != 0:
        print("train_hetero_sim: needs root (hetcomm.sim creates network namespaces and cgroups)",
              file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {"equal": [], "adaptive": []}
    for repeat in range(args.repeats):
        for mode in ("equal", "adaptive"):
            print(f"train_hetero_sim: repeat {repeat + 1}/{args.repeats}, partition {mode}", flush=True)
            runs[mode].append(run_once(mode, args.cpu_quota, example_args, args.timeout))

    def median(mode: str, key) -> float:
        return statistics.median(key(r) for r in runs[mode])

    throughput = {m: median(m, lambda r: r["samples_per_second"]) for m in runs}
    ideal = median("adaptive", lambda r: r["ideal_samples_per_second"])
    idle = {m: median(m, lambda r: sum(r["idle_seconds"])) for m in runs}
    losses = {m: [r["final_loss"] for r in runs[m]] for m in runs}
    ratios = {
        "throughput_adaptive_over_equal": throughput["adaptive"] / throughput["equal"],
        "adaptive_fraction_of_ideal": statistics.median(r["samples_per_second"] / r["ideal_samples_per_second"]
                                                        for r in runs["adaptive"]),
        "idle_reduction": 1.0 - idle["adaptive"] / idle["equal"],
        "final_loss": losses,
    }
    print(f"train_hetero_sim: samples/s equal {throughput['equal']:.0f}, adaptive {throughput['adaptive']:.0f} "
          f"({ratios['throughput_adaptive_over_equal']:.2f}x; ideal {ideal:.0f}, adaptive reaches "
          f"{ratios['adaptive_fraction_of_ideal']:.0%}); idle s equal {idle['equal']:.1f}, adaptive "
          f"{idle['adaptive']:.1f} ({ratios['idle_reduction']:.0%} lower); final loss equal {losses['equal']}, "
          f"adaptive {losses['adaptive']}")
    if args.json:
        write_document(args.json, {"cpu_quota": args.cpu_quota, "example_args": example_args, "ratios": ratios,
                                   "median_samples_per_second": throughput, "median_idle_seconds": idle,
                                   "rows": run_rows(runs)}, command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
