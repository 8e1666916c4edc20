"""How long hetcomm's link probe takes: 4 ranks on unshaped loopback, and at group creation.

Two measurements, written to one JSON::

    python benchmarks/probe_time.py --json benchmarks/results/probe_time.json

* ``loopback``: ranks started here with ``torch.multiprocessing`` on 127.0.0.1. Group creation
  skips the probe there (one host: nothing to measure), so each rank times ``hetcomm.probe()``,
  the same code path, ``--calls`` times; a call's time is the slowest rank's.
* ``sim_creation`` (root only; skipped with the reason otherwise): the same ranks in
  ``hetcomm.sim --nprocs 4`` (a namespace per rank, nothing shaped), where every rank has its own
  address, so ``init_process_group`` probes: it reports the group creation time (probe
  included, and the store rendezvous) and the same ``hetcomm.probe()`` calls.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK_CODE = r'''
import datetime, json, os, sys, time
import torch.distributed as dist
import hetcomm
calls = int(sys.argv[1])
t0 = time.perf_counter()
dist.init_process_group("hetcomm", timeout=datetime.timedelta(seconds=120))
created = time.perf_counter() - t0
probes = []
for _ in range(calls):
    dist.barrier()
    t = time.perf_counter()
    hetcomm.probe()
    probes.append(time.perf_counter() - t)
print("PROBE_TIME " + json.dumps({"rank": dist.get_rank(), "create_s": created, "probe_s": probes}), flush=True)
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        at = line.find("PROBE_TIME ")
        if at >= 0:
            rows.append(json.loads(line[at + len("PROBE_TIME "):]))
    return sorted(rows, key=lambda r: r["rank"])


def _summary(rows: list[dict], nprocs: int, calls: int) -> dict:
    if len(rows) != nprocs:
        raise SystemExit(f"probe_time: expected {nprocs} ranks' results, got {len(rows)}")
    per_call = [max(r["probe_s"][i] for r in rows) for i in range(calls)]
    return {"ranks": rows, "probe_s_per_call": per_call, "probe_s_max": max(per_call),
            "probe_s_median": statistics.median(per_call),
            "create_s_max": max(r["create_s"] for r in rows)}


def loopback(nprocs: int, calls: int, timeout: float) -> dict:
    env_base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                    WORLD_SIZE=str(nprocs))
    env_base.pop("HETCOMM_LINK_MBIT", None)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK_CODE)
        procs = [subprocess.Popen([sys.executable, script, str(calls)], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=dict(env_base, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(nprocs)]
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise SystemExit(f"probe_time: loopback ranks did not finish in {timeout:.0f} s")
            if p.returncode != 0:
                raise SystemExit(f"probe_time: a loopback rank failed ({p.returncode}):\n{err[-3000:]}")
            outs.append(out)
    return _summary(_collect("\n".join(outs)), nprocs, calls)


def sim_creation(nprocs: int, calls: int, timeout: float) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "needs root (hetcomm.sim creates network namespaces)"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK_CODE)
        env = dict(os.environ)
        env.pop("HETCOMM_LINK_MBIT", None)
        cmd = [sys.executable, "-m", "hetcomm.sim", "--nprocs", str(nprocs), "-q", "--",
               sys.executable, script, str(calls)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"probe_time: the simulated run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return _summary(_collect(proc.stdout), nprocs, calls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--calls", type=int, default=3, help="hetcomm.probe() calls per run")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"command": " ".join([os.path.basename(sys.executable), "benchmarks/probe_time.py"]
                                  + (argv if argv is not None else sys.argv[1:])),
              "nprocs": args.nprocs, "calls": args.calls, "started_at": started}
    print(f"probe_time: {args.nprocs} ranks on loopback, {args.calls} hetcomm.probe() calls", flush=True)
    result["loopback"] = loopback(args.nprocs, args.calls, args.timeout)
    lb = result["loopback"]
    print(f"  loopback: probe {', '.join(f'{s:.3f}' for s in lb['probe_s_per_call'])} s "
          f"(slowest rank per call)", flush=True)
    print(f"probe_time: {args.nprocs} ranks in hetcomm.sim (unshaped), {args.calls} calls", flush=True)
    result["sim"] = sim_creation(args.nprocs, args.calls, args.timeout)
    sim = result["sim"]
    if "skipped" in sim:
        print(f"  sim: skipped: {sim['skipped']}", flush=True)
    else:
        print(f"  sim: probe {', '.join(f'{s:.3f}' for s in sim['probe_s_per_call'])} s; group "
              f"creation (probe included) {sim['create_s_max']:.3f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"probe_time: wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
