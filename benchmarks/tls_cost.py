"""What TLS costs: hetcomm's allreduce with HETCOMM_TLS beside cleartext, in the same run.

    python benchmarks/tls_cost.py [--runs 5] [--size 16M] [--json benchmarks/results/tls_cost.json]

Two configurations (issue 22), each run ``--runs`` times, cleartext and TLS alternating so that
both see the same machine:

* ``sites``: the simulator, 4 ranks in two sites (``--sim-sites 0,0,1,1 --sim-wan-mbit 100``),
  ``HETCOMM_TLS=inter-site`` (``HETCOMM_SITES=0,0,1,1`` names the sites): only the WAN links are
  encrypted. Target: TLS busbw >= 90% of cleartext.
* ``loopback``: 4 ranks on this machine over TCP (``HETCOMM_LOCAL=tcp``), ``HETCOMM_TLS=all``:
  every byte is encrypted and decrypted on the two cores the ranks share. Reported as a ratio.

Each measurement is one ``python -m hetcomm.bench`` (hetcomm only, one size); the ratio of a run
is TLS busbw over the cleartext busbw measured just before it. Certificates: throwaway ones from
``hetcomm.tls_certs``. The JSON file holds one record per line (hetcomm.bench.records).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from hetcomm import tls_certs
from hetcomm.bench.records import command_line, write_document

CONFIGS = {
    "sites": (["--sim-sites", "0,0,1,1", "--sim-wan-mbit", "100"], "inter-site", {"HETCOMM_SITES": "0,0,1,1"}),
    "loopback": (["--nprocs", "4"], "all", {"HETCOMM_LOCAL": "tcp"}),
}


def busbw(args: list[str], env: dict[str, str], size: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "hetcomm.bench", "--backends", "hetcomm", "--sizes", size, "--json", path, *args]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    os.unlink(path)
    results = [r for r in rows if r.get("kind") == "result"]
    if not results or any(r.get("wrong", 0) for r in results):
        raise RuntimeError(f"{' '.join(cmd)}: no result, or wrong numbers: {results}")
    return float(results[0]["busbw_gbps"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", default="16M")
    ap.add_argument("--configs", default="sites,loopback")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    certs = tempfile.mkdtemp(prefix="hetcomm-tls-cost-")
    tls_certs.make(certs, ["node"])
    rows = []
    for name in args.configs.split(","):
        bench_args, mode, env = CONFIGS[name]
        tls_env = {**env, **tls_certs.env_for(certs, "node", mode)}
        ratios, clear, tls = [], [], []
        for run in range(args.runs):
            c = busbw(bench_args, env, args.size)
            t = busbw(bench_args, tls_env, args.size)
            clear.append(c)
            tls.append(t)
            ratios.append(t / c)
            print(f"{name} run {run + 1}/{args.runs}: cleartext {c:.4f} GB/s, TLS ({mode}) {t:.4f} GB/s, "
                  f"ratio {t / c:.3f}", flush=True)
        row = {"config": name, "tls_mode": mode, "bench_args": bench_args, "env": env, "size": args.size,
               "cleartext_busbw_gbps": clear, "tls_busbw_gbps": tls, "ratios": [round(r, 4) for r in ratios],
               "median_ratio": round(statistics.median(ratios), 4), "min_ratio": round(min(ratios), 4),
               "max_ratio": round(max(ratios), 4)}
        print(f"{name}: TLS/cleartext busbw median {row['median_ratio']:.3f} "
              f"({row['min_ratio']:.3f}-{row['max_ratio']:.3f}) over {args.runs} runs", flush=True)
        rows.append(row)
    if args.json:
        write_document(args.json, {"rows": rows}, command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
