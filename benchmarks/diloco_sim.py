"""DiLoCo on unequal ranks, policy against policy, on the simulated cluster (needs root).

Runs ``examples/train_diloco.py`` under ``python -m hetcomm.sim`` (4 ranks, CPU quotas
0.8,0.4,0.2,0.2, NICs 100 Mbit/s by default) once per configuration and repeat, configurations
interleaved so that machine noise hits all alike, every run with the same sample budget; repeat i
uses seed i (model, corpus, data order) in every configuration, so configurations compare paired::

    python benchmarks/diloco_sim.py --json benchmarks/results/diloco_sim.json \\
        --plot benchmarks/results/diloco_timeline.png

Configurations (example flags; the default weighting ``batch`` unless named): ``fixed`` (H steps
everywhere, fp32: the published recipes), ``speed``, ``time``, ``time-int8-overlap``,
``fixed-int8`` (bytes against ``fixed``), and ``speed-samples`` / ``time-samples`` (the outer
update weighted by samples processed); ``--configs`` also knows ``*-uniform`` and ``*-normalized``,
``time-int4``, ``time-int4-overlap-f4`` and ``fixed-int4`` (int4: half int8's bytes), ``sites-*`` / ``flat-*`` (workers from hetcomm's sites against a worker per rank) and
``fixed-overlap-after{4,8,12}`` / ``fixed-overlap-end`` (the late update moves the replicas after
that many steps of the next round, or never mid-round: deterministic), ``fixed-int8-overlap-after4``; ``*-f4``: overlap with the
update reduced in 4 fragments; ``*-b05``: keeping half the early steps (``--early-weight 0.5``)
against the default quarter. Flags after the options go to the example (``--steps 20 --samples
24576``) and apply to every configuration. Reported per
configuration (medians over repeats): samples/s, total idle seconds at synchronisation, compute
utilisation (compute seconds / (ranks x wall seconds)), final held-out loss, bytes sent per round,
and for runs without overlap the fraction of a round spent synchronising. Ratios: idle reduction
of ``speed`` and ``time`` against ``fixed``, samples/s against ``fixed``, fp32/int8 bytes per round.
The PNG shows one timeline per configuration: a row per rank, compute / idle / sync per round.

The JSON file is the summary, one record per line (hetcomm.bench.records), each with the command:
a ``run`` header (``cpu_quota``, ``nic_mbit``, ``example_args``, ``ratios``), one ``figures`` per
configuration (``config``, the medians), then per run (``config``, ``repeat``) one ``result`` (the
example's summary and ``example_command``). The trace, ``traces/NAME.jsonl.gz`` beside it
(hetcomm.bench.records.write_with_trace), holds per run one ``round`` per round of its history and
one ``timeline`` per rank (``rank``, ``segments``: [phase, start, end] in seconds). Draw the PNG
again from a saved file, without running anything::

    python benchmarks/diloco_sim.py --from-json benchmarks/results/diloco_sim.json --plot /tmp/t.png
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from hetcomm.bench.records import (RESULT, RUN, command_line, fields, read_records, read_with_trace, record,
                                   write_with_trace)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_diloco.py")

CONFIGS = {
    "fixed": ["--local-steps", "fixed"],
    "speed": ["--local-steps", "speed"],
    "time": ["--local-steps", "time"],
    "time-int8-overlap": ["--local-steps", "time", "--compress", "int8", "--overlap"],
    "time-int8": ["--local-steps", "time", "--compress", "int8"],
    "time-int8-overlap-f4": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "4"],
    # staggered, each fragment's transfer paced over 0.9 of its slot (hetcomm.train.diloco.pacing)
    "time-int8-overlap-f4-paced": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "4",
                                   "--pace", "0.9"],
    "time-int8-overlap-f4-paced-full": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments",
                                        "4", "--pace", "1.0"],
    # the 4 fragments all at the round boundary (not staggered over the round)
    "time-int8-overlap-f4-together": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "4",
                                      "--no-stagger"],
    "fixed-int8-overlap-f4-together": ["--local-steps", "fixed", "--compress", "int8", "--overlap", "--fragments",
                                       "4", "--no-stagger"],
    "fixed-overlap": ["--local-steps", "fixed", "--overlap"],
    "fixed-int8-overlap": ["--local-steps", "fixed", "--compress", "int8", "--overlap"],
    # overlap whose late update moves the replicas after a set number of steps (deterministic
    # with `fixed`); -end: only at the round's end (the replicas never move mid-round)
    "fixed-overlap-after4": ["--local-steps", "fixed", "--overlap", "--overlap-steps", "4"],
    "fixed-overlap-after8": ["--local-steps", "fixed", "--overlap", "--overlap-steps", "8"],
    "fixed-overlap-after12": ["--local-steps", "fixed", "--overlap", "--overlap-steps", "12"],
    "fixed-overlap-end": ["--local-steps", "fixed", "--overlap", "--overlap-steps", "1000000"],
    "fixed-int8-overlap-after4": ["--local-steps", "fixed", "--compress", "int8", "--overlap", "--overlap-steps", "4"],
    # workers: hetcomm's sites (data parallel inside each) against every rank a worker
    "sites-time-int8-overlap": ["--local-steps", "time", "--compress", "int8", "--overlap", "--workers", "sites"],
    "flat-time-int8-overlap": ["--local-steps", "time", "--compress", "int8", "--overlap", "--workers", "ranks"],
    "sites-time-int8": ["--local-steps", "time", "--compress", "int8", "--workers", "sites"],
    "sites-time-int8-overlap-f4": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "4",
                                   "--workers", "sites"],
    "flat-time-int8-overlap-f4": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "4",
                                  "--workers", "ranks"],
    "fixed-int8-overlap-f4": ["--local-steps", "fixed", "--compress", "int8", "--overlap", "--fragments", "4"],
    "flat-time-int8": ["--local-steps", "time", "--compress", "int8", "--workers", "ranks"],
    "fixed-int8": ["--local-steps", "fixed", "--compress", "int8"],
    # int4: half int8's bytes, for links too slow for int8 to overlap a round
    "time-int4": ["--local-steps", "time", "--compress", "int4"],
    "time-int4-overlap-f4": ["--local-steps", "time", "--compress", "int4", "--overlap", "--fragments", "4"],
    "fixed-int4": ["--local-steps", "fixed", "--compress", "int4"],
    # the share β of the early steps kept at the move (--early-weight), against the default
    "time-int8-overlap-f4-b05": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "4",
                                 "--early-weight", "0.5"],
    "time-int4-overlap-f4-b05": ["--local-steps", "time", "--compress", "int4", "--overlap", "--fragments", "4",
                                 "--early-weight", "0.5"],
    "speed-samples": ["--local-steps", "speed", "--weighting", "samples"],
    "time-samples": ["--local-steps", "time", "--weighting", "samples"],
    "speed-uniform": ["--local-steps", "speed", "--weighting", "uniform"],
    "speed-normalized": ["--local-steps", "speed", "--weighting", "normalized"],
    "time-uniform": ["--local-steps", "time", "--weighting", "uniform"],
    "time-normalized": ["--local-steps", "time", "--weighting", "normalized"],
}
DEFAULT_CONFIGS = ["fixed", "speed", "time", "time-int8-overlap", "fixed-int8", "speed-samples", "time-samples"]
PLOTTED = ["fixed", "fixed-overlap", "fixed-int8", "fixed-int8-overlap", "speed", "time", "time-int8", "time-int8-overlap", "flat-time-int8-overlap",
           "sites-time-int8-overlap"]


def run_once(name: str, args: argparse.Namespace, example_args: list[str], seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "summary.json")
        nprocs = len(args.cpu_quota.split(","))
        sim = ["--nprocs", str(nprocs), "--cpu-quota", args.cpu_quota]
        sim += ["--nic-mbit", args.nic_mbit] if args.nic_mbit else []
        sim += shlex.split(args.sim_args)
        cmd = [sys.executable, "-m", "hetcomm.sim", *sim, "-q", "--", sys.executable, EXAMPLE, "--json", path,
               "--seed", str(seed), *CONFIGS[name], *example_args]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"diloco_sim: {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-4000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("[rank 0]") and ("done:" in line or "train_diloco:" in line):
                print(f"  {name:18s} {line}", flush=True)
        [summary] = read_records(path)
    summary["run_seconds"] = time.perf_counter() - started
    summary["command"] = " ".join(cmd[:cmd.index("--json")] + cmd[cmd.index("--json") + 2:])
    return summary


TRACE_KINDS = ("round", "timeline")     # per round of a run, per rank of a run: the trace
RUN_KEY = ("config", "repeat")          # what ties a trace record to its run's result


def diloco_records(document: dict) -> list[dict]:
    """The records of the whole benchmark (``figures`` and ``runs`` by configuration, as main()
    gathers them); a run's own ``command`` (the example's) becomes ``example_command``."""
    head = {k: v for k, v in document.items() if k not in ("command", "figures", "runs")}
    out = [record(RUN, head)]
    out += [record("figures", {"config": name}, **figures) for name, figures in document["figures"].items()]
    for name, runs in document["runs"].items():
        for repeat, run in enumerate(runs):
            which = {"config": name, "repeat": repeat}
            summary = {k: v for k, v in run.items() if k not in ("command", "history", "timelines")}
            out.append(record(RESULT, which, **summary, example_command=run.get("command")))
            out += [record("round", which, **h) for h in run["history"]]
            out += [record("timeline", which, rank=rank, segments=segments)
                    for rank, segments in enumerate(run["timelines"])]
    return out


def diloco_runs(records: list[dict]) -> dict[str, list[dict]]:
    """The runs by configuration, as main() gathered them, from the records of a file (summary
    and trace: :func:`hetcomm.bench.records.read_with_trace`)."""
    runs: dict[str, list[dict]] = {}
    by_run: dict[tuple, dict] = {}
    for rec in records:
        data = fields(rec)
        which = tuple(data.pop(name, None) for name in RUN_KEY)
        if rec["kind"] == RESULT:
            command = data.pop("example_command")
            run = {**data, "command": command, "history": [], "timelines": []}
            by_run[which] = run
            runs.setdefault(which[0], []).append(run)
        elif rec["kind"] == "round":
            by_run[which]["history"].append(data)
        elif rec["kind"] == "timeline":
            by_run[which]["timelines"].append(data["segments"])
    return runs


def derived(run: dict) -> dict:
    """Per-run figures the issue asks for."""
    rounds = max(1, run["rounds"])
    wall_per_round = run["wall_seconds"] / rounds
    sent = [b for b in run["bytes_sent"] if b is not None]
    return {
        "samples_per_second": run["samples_per_second"],
        "idle_seconds": sum(run["idle_seconds"]),
        "compute_utilisation": run["compute_utilisation"],
        "final_loss": run["final_loss"],
        "samples": run["samples"],
        "rounds": run["rounds"],
        "bytes_sent_per_round": sum(sent) / rounds if sent else None,
        # what each worker sent to the other workers per round, in models' worth of the sync dtype
        "wan_models_per_worker_round": ([b / rounds / (run["parameters"] * run["sync_bytes_per_element"])
                                         for b in run["wan_bytes"]] if run.get("wan_bytes") and
                                        None not in run["wan_bytes"] else None),
        # Without overlap: the mean (over ranks) of sync seconds per round over a round's length.
        "sync_fraction_of_round": (statistics.mean(run["sync_seconds"]) / rounds / wall_per_round
                                   if not run["overlap"] else None),
        "steps_per_round": [s / rounds for s in run["steps_per_rank"]],
        # With overlap: how far into a round (fraction of its steps, mean over workers and the
        # rounds after the first) the previous round's update landed and moved the replica.
        "landed_fraction_of_round": _landed_fraction(run),
        # The highest rate any host sent at over 1 s (its uplink; the simulated cluster's counters).
        "peak_tx_mbit": (max(run["peak_tx_mbit"]) if run.get("peak_tx_mbit") and None not in run["peak_tx_mbit"]
                         else None),
        # ... from the end of round 4 to the start of the last (synchronous) round
        "steady_peak_tx_mbit": (max(run["steady_peak_tx_mbit"]) if run.get("steady_peak_tx_mbit")
                                and None not in run["steady_peak_tx_mbit"] else None),
    }


def _landed_fraction(run: dict) -> float | None:
    fractions = [landed / steps for h in run["history"][1:]
                 for landed, steps in zip(h.get("landed_after_steps", []), h["steps"]) if steps > 0]
    return statistics.mean(fractions) if run["overlap"] and fractions else None


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [n for n in PLOTTED if runs.get(n)]
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.0 + 1.4 * len(names)), squeeze=False)
    colours = {"compute": "#4c9a2a", "idle": "#d62728", "sync": "#1f77b4"}
    for ax, name in zip(axes[:, 0], names):
        run = runs[name][0]
        t0 = min(a for tl in run["timelines"] for _, a, _ in tl)
        horizon = 0.0
        for rank, tl in enumerate(run["timelines"]):
            for kind, a, b in tl:
                # With overlap the sync runs on a background thread: a thin bar under the row.
                if kind == "sync" and run["overlap"]:
                    ax.broken_barh([(a - t0, b - a)], (rank - 0.42, 0.18), color=colours[kind])
                else:
                    ax.broken_barh([(a - t0, b - a)], (rank - 0.2, 0.4), color=colours[kind])
                horizon = max(horizon, b - t0)
        d = derived(run)
        ax.set_title(f"{name}: {d['samples_per_second']:.1f} samples/s, idle {d['idle_seconds']:.1f} s, "
                     f"compute utilisation {d['compute_utilisation']:.0%}, loss {d['final_loss']:.3f}", fontsize=9)
        ax.set_yticks(range(len(run["timelines"])))
        ax.set_yticklabels([f"rank {r}" for r in range(len(run["timelines"]))], fontsize=8)
        ax.set_xlim(0, horizon)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()], loc="upper right", ncol=3)
    quota = runs[names[0]][0].get("sim_spec") or {}
    fig.suptitle(f"DiLoCo on the simulated cluster {json.dumps(quota.get('cpu_quota', ''))} cores", fontsize=10,
                 x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    print(f"diloco_sim: timeline written to {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-quota", default="0.8,0.4,0.2,0.2", help="per-rank CPU quota (cores)")
    p.add_argument("--nic-mbit", default="100", help="per-rank NIC rate (Mbit/s), one value or one per rank "
                                                     "('' for none, e.g. with --sim-args '--sites ...')")
    p.add_argument("--sim-args", default="", help="more arguments of python -m hetcomm.sim, e.g. "
                                                  "'--sites 0,0,1,1 --intra-mbit 1000 --wan-mbit 20'")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration (interleaved)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="write all runs and the ratios here")
    p.add_argument("--plot", metavar="PNG", help="draw the timelines of the first repeat here")
    p.add_argument("--from-json", metavar="PATH", help="run nothing: draw --plot from this saved --json file")
    args, example_args = p.parse_known_args(argv)
    if args.from_json:
        if not args.plot:
            p.error("--from-json draws a PNG: give --plot")
        plot(diloco_runs(read_with_trace(args.from_json)), args.plot)
        return 0
    if os.geteuid() != 0:
        print("diloco_sim: needs root (hetcomm.sim creates network namespaces and cgroups)", file=sys.stderr)
        return 2
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names:
            print(f"diloco_sim: repeat {repeat + 1}/{args.repeats}, {name}", flush=True)
            runs[name].append(run_once(name, args, example_args, seed=repeat))

    def median(values: list):
        """The median of the numbers among ``values`` (a run may lack one: None), else the first."""
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return statistics.median(numbers) if numbers else values[0]

    figures = {n: {k: median([derived(r)[k] for r in runs[n]]) for k in derived(runs[n][0])} for n in names}
    for n in names:
        figures[n]["final_loss_each"] = [r["final_loss"] for r in runs[n]]
        figures[n]["samples_per_second_each"] = [r["samples_per_second"] for r in runs[n]]
        figures[n]["peak_tx_mbit_each"] = [derived(r)["peak_tx_mbit"] for r in runs[n]]
        figures[n]["steady_peak_tx_mbit_each"] = [derived(r)["steady_peak_tx_mbit"] for r in runs[n]]
    ratios = {}
    if "fixed" in figures:
        base = figures["fixed"]
        for n in CONFIGS:
            if n in figures and n not in ("fixed", "fixed-int8"):
                ratios[f"idle_reduction_{n}_vs_fixed"] = 1.0 - figures[n]["idle_seconds"] / base["idle_seconds"]
                ratios[f"samples_per_second_{n}_over_fixed"] = (figures[n]["samples_per_second"]
                                                               / base["samples_per_second"])
        if "fixed-int8" in figures and base["bytes_sent_per_round"] and figures["fixed-int8"]["bytes_sent_per_round"]:
            ratios["bytes_per_round_fp32_over_int8"] = (base["bytes_sent_per_round"]
                                                        / figures["fixed-int8"]["bytes_sent_per_round"])
    # overlap against none, sites against flat workers: mean final loss over the repeats (seeds)
    pairs = [(n, n.split("-overlap")[0]) for n in names if "-overlap" in n]
    pairs += [("sites-time-int8-overlap", "flat-time-int8-overlap"), ("sites-time-int8", "flat-time-int8"),
              ("sites-time-int8-overlap-f4", "flat-time-int8-overlap-f4")]
    for a, b in pairs:
        if a in figures and b in figures:
            ratios[f"mean_final_loss_{a}_over_{b}"] = (statistics.mean(figures[a]["final_loss_each"])
                                                       / statistics.mean(figures[b]["final_loss_each"]))
    # fragments (staggered, or together at the boundary) against the whole update at once: the
    # peak rate a host sends at, and the loss
    for a in names:
        b = re.sub(r"-f4(-together|-paced(-full)?)?$", "", a)
        if a != b and "-f4" in a and b in figures:
            for key in ("peak_tx_mbit", "steady_peak_tx_mbit"):
                if figures[a][key] and figures[b][key]:
                    ratios[f"{key.removesuffix('_mbit')}_{a}_over_{b}"] = figures[a][key] / figures[b][key]
            ratios.setdefault(f"mean_final_loss_{a}_over_{b}", statistics.mean(figures[a]["final_loss_each"])
                              / statistics.mean(figures[b]["final_loss_each"]))
    for n in names:
        f = figures[n]
        sync = "" if f["sync_fraction_of_round"] is None else f", sync {f['sync_fraction_of_round']:.0%} of a round"
        if f.get("landed_fraction_of_round") is not None:
            sync += f", update landed {f['landed_fraction_of_round']:.0%} into a round"
        if f.get("peak_tx_mbit") is not None:
            sync += f", peak {f['peak_tx_mbit']:.1f} Mbit/s over 1 s"
        if f.get("steady_peak_tx_mbit") is not None:
            sync += f" ({f['steady_peak_tx_mbit']:.1f} in the steady state)"
        print(f"diloco_sim: {n:18s} {f['samples_per_second']:6.1f} samples/s, idle {f['idle_seconds']:6.1f} s, "
              f"utilisation {f['compute_utilisation']:.0%}, loss {f['final_loss']:.3f} "
              f"({', '.join(f'{x:.3f}' for x in f['final_loss_each'])}){sync}", flush=True)
    for k, v in ratios.items():
        print(f"diloco_sim: {k} = {v:.3f}", flush=True)
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        write_with_trace(args.json, diloco_records({"cpu_quota": args.cpu_quota, "nic_mbit": args.nic_mbit,
                                                    "sim_args": args.sim_args,
                                                    "example_args": example_args, "ratios": ratios,
                                                    "figures": figures, "runs": runs}),
                         command_line(), TRACE_KINDS, RUN_KEY)
    return 0


if __name__ == "__main__":
    sys.exit(main())
