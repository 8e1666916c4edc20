"""Group creation with probing on the simulator, and the plan it gives, level probe beside
all-pairs probe.

    python benchmarks/probe_time.py [--hosts 0,0,0,0,1,...] [--nic-mbit 100,...,25] [--runs 5] \
        [--probes levels,pairs,levels+secret] [--json benchmarks/results/probe_time.json]

Default cluster: 32 ranks in 8 hosts of 4 (``--hosts``: one network namespace and one shaped NIC a
host, loopback inside), host NICs of 100 Mbit/s and one of 25 Mbit/s. Needs root.

Each run starts the cluster once per probe (``HETCOMM_PROBE=levels``, the default, and
``HETCOMM_PROBE=pairs``, every pair of ranks in P - 1 rounds) and every rank times its
``init_process_group``. Reported per run and probe:

* ``create_s``: from the moment the last rank entered ``init_process_group`` to the moment the
  last one left it (host detection, shared memory, the probe, planning, the trial, the plan's
  broadcast), with the extension and the creation modules already loaded;
* ``load_s``: what the first group of a process loads before that (the extension, the creation
  modules), from the last rank starting to the last one done: once per process, and on two
  cores shared by 32 starting processes mostly waiting for a core;
* ``probe_log``: rank 0's account of the probe's rounds and their times (``HETCOMM_LOG_LEVEL=2``);
* ``predicted_s``: the planner's predicted time of a 64 MB allreduce under the plan the group
  installed, on the cluster's *physical* model (`hetcomm.bench.analysis.physical_model`: the
  shaped rates), and the physical bound beside it.

The summary gives the median and range over the runs of the creation time per probe, and of the
ratio of the level probe's predicted time to the all-pairs probe's (same run, same cluster).
A probe named with ``+secret`` (``levels+secret``) runs with an out-of-band secret
(``HETCOMM_SECRET_FILE``, a throwaway file): every store value hetcomm later trusts is sealed
and checked; the summary then gives its creation time over the plain probe's, run by run.
On a two-core machine the 32 ranks share two cores, so NIC rates are kept low enough (100 Mbit/s
a host) that the simulated network, not the CPU, is what the probe measures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from hetcomm.bench.records import command_line, write_records  # noqa: E402

NBYTES = 64 << 20

RANK_CODE = r'''
import datetime, json, os, time
# Rank 0 logs the probe (HETCOMM_LOG_LEVEL=2); the others log as a user's ranks do: at level 2
# each would describe the plan, CPU that 32 ranks on 2 cores pay for (about 3.5 s of a creation).
if os.environ.get("RANK", "0") != "0":
    os.environ["HETCOMM_LOG_LEVEL"] = "1"
import torch.distributed as dist
import hetcomm
t_load = time.time()
# What the first group of a process loads (the extension, the creation modules), timed apart:
# 32 processes loading at once on 2 cores is process start-up, not group creation.
hetcomm._engine.extension()
import hetcomm.topology
t_enter = time.time()
dist.init_process_group("hetcomm", timeout=datetime.timedelta(seconds=600))
t_done = time.time()
out = {"rank": dist.get_rank(), "load": t_load, "enter": t_enter, "done": t_done}
if dist.get_rank() == 0:
    plan = hetcomm.get_plan()
    out["plan"] = {"order": list(plan.order), "shares": list(plan.shares), "min_bytes": plan.min_bytes,
                   "sites": None if plan.sites is None else {
                       "sites": [list(s) for s in plan.sites.sites], "blocks": [list(b) for b in plan.sites.blocks],
                       "block_shares": list(plan.sites.block_shares), "site_shares": list(plan.sites.site_shares),
                       "min_bytes": plan.sites.min_bytes, "local_inner": plan.sites.local_inner,
                       "hosts": [list(h) for h in plan.sites.hosts], "holders": [list(b) for b in plan.sites.holders]}}
print("PROBE_RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def run_once(hosts: str, nic: str, probe: str, script: str, secret_file: str) -> dict:
    """One group creation; ``probe``: ``levels`` or ``pairs``, with ``+secret`` the same with the
    out-of-band secret (HETCOMM_SECRET_FILE: every store value hetcomm trusts is sealed)."""
    name, _, extra = probe.partition("+")
    env = dict(os.environ, HETCOMM_PROBE=name, HETCOMM_LOG_LEVEL="2")
    env.pop("HETCOMM_LINK_MBIT", None)
    env.pop("HETCOMM_SECRET", None)
    env.pop("HETCOMM_SECRET_FILE", None)
    if extra == "secret":
        env["HETCOMM_SECRET_FILE"] = secret_file
    elif extra:
        raise SystemExit(f"probe_time: unknown probe variant {probe!r} (levels, pairs, levels+secret, pairs+secret)")
    cmd = [sys.executable, "-m", "hetcomm.sim", "--hosts", hosts, "--nic-mbit", nic, "-q", "--timeout", "600",
           "--", sys.executable, script]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, errors="replace", timeout=900)
    rows, log = [], None
    for line in (proc.stdout + proc.stderr).splitlines():
        if "PROBE_RESULT " in line:
            rows.append(json.loads(line.split("PROBE_RESULT ", 1)[1]))
        if line.startswith("[rank 0]") and "hetcomm probe: measured" in line:
            log = line.split("hetcomm probe: ", 1)[1]
    if proc.returncode != 0 or not rows:
        raise SystemExit(f"probe_time: the {probe} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    plan = next(r["plan"] for r in rows if r["rank"] == 0)
    return {"ranks": len(rows), "create_s": max(r["done"] for r in rows) - max(r["enter"] for r in rows),
            "load_s": max(r["enter"] for r in rows) - max(r["load"] for r in rows),
            "probe_log": log, "plan": plan}


def predicted(spec, plan: dict) -> tuple[float, float]:
    from hetcomm.bench.analysis import _planner_model, bound_seconds, physical_model
    from hetcomm.plan import Plan, SitePlan, predict_allreduce_seconds

    sim = physical_model(spec)
    model = _planner_model(sim)
    sites = plan["sites"]
    site = SitePlan(**sites) if sites else None
    p = Plan(tuple(plan["order"]), tuple(plan["shares"]), min_bytes=plan["min_bytes"], sites=site)
    return predict_allreduce_seconds(p, model, NBYTES), bound_seconds(sim, NBYTES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default=",".join(str(r // 4) for r in range(32)))
    parser.add_argument("--nic-mbit", default="100,100,100,100,100,100,100,25")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--probes", default="levels,pairs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("probe_time: the simulator needs root (network namespaces)")
    from hetcomm.sim.spec import SimSpec

    hosts = [int(h) for h in args.hosts.split(",")]
    nics = [float(v) for v in args.nic_mbit.split(",")]
    spec = SimSpec(hosts=hosts, nic_mbit=nics)
    probes = args.probes.split(",")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK_CODE)
        secret_file = os.path.join(tmp, "secret")
        with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
        for run in range(args.runs):
            for probe in probes:
                row = run_once(args.hosts, args.nic_mbit, probe, script, secret_file)
                row["predicted_s"], row["bound_s"] = predicted(spec, row["plan"])
                row.update(run=run, probe=probe)
                records.append(row)
                print(f"run {run} {probe:>6}: create {row['create_s']:6.2f} s (load before it {row['load_s']:.2f} s) | predicted {row['predicted_s']:.3f} s "
                      f"(bound {row['bound_s']:.3f} s) | {row['probe_log']}", flush=True)
    summary = {"hosts": args.hosts, "nic_mbit": args.nic_mbit, "runs": args.runs, "nbytes": NBYTES}
    for probe in probes:
        created = [r["create_s"] for r in records if r["probe"] == probe]
        summary[f"create_s_{probe}"] = {"median": statistics.median(created), "min": min(created), "max": max(created)}
        loads = [r["load_s"] for r in records if r["probe"] == probe]
        summary[f"load_s_{probe}"] = {"median": statistics.median(loads), "min": min(loads), "max": max(loads)}
    if "levels" in probes and "pairs" in probes:
        ratios = [a["predicted_s"] / b["predicted_s"] for a, b in
                  zip([r for r in records if r["probe"] == "levels"], [r for r in records if r["probe"] == "pairs"])]
        summary["predicted_levels_over_pairs"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                  "max": max(ratios), "all": ratios}
    for probe in probes:
        if probe + "+secret" in probes:   # the cost of sealed store values, run by run
            ratios = [a["create_s"] / b["create_s"] for a, b in
                      zip([r for r in records if r["probe"] == probe + "+secret"],
                          [r for r in records if r["probe"] == probe])]
            summary[f"create_{probe}_secret_over_plain"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                             "max": max(ratios), "all": ratios}
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        write_records(args.json, [{"kind": "run", **summary}] + [{"kind": "result", **r} for r in records],
                      command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
