"""One host, CPU: hetcomm (shared memory) beside gloo, and the bound this machine's memory allows.

For each world size (default 2 and 4) the benchmark CLI runs ``--runs`` times (hetcomm and gloo in
the same run, sizes 8 B to 256 MB); the table gives the median busbw ratio hetcomm/gloo per size
with its spread (min–max over the runs).

The memory bound. A shared-memory allreduce must at least read each rank's input once and write
each rank's output once: 2 N bytes of main-memory traffic per rank, for all ranks at once (the
slot writes, the reduction's reads of the peers' slices and the copy-out's reads hit chunks that
were just written, which stay in cache when the slots are small; see
csrc/algorithms/local_collectives.h). A plain copy of N bytes moves the same 2 N (read N, write N),
so the bound is the time of L copies of N bytes run at once by L processes, measured here in the
same run (median of several). ``bound_ratio`` = hetcomm's time / that copy time (1.0 would be
perfect; the algorithm also synchronises per chunk and, for L > cores, shares the cores).

Usage::

    python benchmarks/local_host.py --json benchmarks/results/local_host.json

The JSON file holds one record per line (hetcomm.bench.records), each with the command: a ``run``
header (``runs``), then one ``result`` per world size and size (``world_size``, ``size_bytes``,
medians, spread, copy bound, and every run's figures under ``runs``).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time

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


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", default="2,4", help="world sizes (default 2,4)")
    ap.add_argument("--runs", type=int, default=5, help="benchmark runs per world size (default 5)")
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    out = {"runs": args.runs, "rows": []}
    for L in (int(x) for x in args.nprocs.split(",")):
        per_size: dict[int, dict[str, list[float]]] = {n: {"ratio": [], "hetcomm_us": [], "gloo_us": []} for n in sizes}
        for run in range(args.runs):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, "-m", "hetcomm.bench", "--nprocs", str(L), "--sizes", args.sizes,
                       "--seconds-per-size", "0.3", "--json", f.name]
                print(f"[local_host] {L} ranks, run {run + 1}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                rows = read_report(f.name)["rows"]
            for row in rows:
                d = per_size[row["size_bytes"]]
                d["ratio"].append(row["busbw_ratio_hetcomm_gloo"])
                d["hetcomm_us"].append(row["backends"]["hetcomm"]["time_us"])
                d["gloo_us"].append(row["backends"]["gloo"]["time_us"])
        for n in sizes:
            d = per_size[n]
            entry = {"world_size": L, "size_bytes": n,
                     "ratio_median": statistics.median(d["ratio"]), "ratio_min": min(d["ratio"]),
                     "ratio_max": max(d["ratio"]),
                     "hetcomm_us_median": statistics.median(d["hetcomm_us"]),
                     "gloo_us_median": statistics.median(d["gloo_us"]), "runs": d}
            if n >= 1 << 20:
                bound = copy_bound_seconds(n, L) * 1e6
                entry["copy_bound_us"] = bound
                entry["bound_ratio"] = entry["hetcomm_us_median"] / bound
            out["rows"].append(entry)
            print(f"[local_host] {L} ranks {n:>10} B: hetcomm/gloo busbw median {entry['ratio_median']:.2f}x "
                  f"({entry['ratio_min']:.2f}-{entry['ratio_max']:.2f})"
                  + (f", {entry['bound_ratio']:.2f}x the copy bound ({entry['copy_bound_us']:.0f} us)"
                     if "bound_ratio" in entry else ""), flush=True)
    write_document(args.json, out, command_line())


if __name__ == "__main__":
    main()
