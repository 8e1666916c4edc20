"""Back-to-back 8-byte allreduces through torch.distributed: the per-call cost of a latency-bound
loop, at 2 ranks on one host and on a one-rank group (torch's dispatch floor, no peer), for
hetcomm and gloo, in one run.

Each configuration runs ``--calls`` allreduces of one float64 after a warm-up, ``--repeats``
times; the figure is the median over the repeats of the mean per call (rank 0's clock, after a
barrier). ``ratio_to_floor`` = hetcomm's 2-rank per-call time / hetcomm's one-rank per-call time
(the issue's target: <= 1.3).

Usage::

    python benchmarks/small_loop.py --json benchmarks/results/small_loop.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcomm.bench.records import command_line, write_document


def _rank(rank: int, world: int, backend: str, port: int, calls: int, repeats: int, out) -> None:
    if backend == "hetcomm":
        import hetcomm  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.ones(1, dtype=torch.float64)
    for _ in range(200):
        dist.all_reduce(t)
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        per_call.append((time.perf_counter() - start) / calls)
    if rank == 0:
        out.put(statistics.median(per_call) * 1e6)
    dist.barrier()
    dist.destroy_process_group()


def measure(backend: str, world: int, calls: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 20000 + (os.getpid() * 7 + world * 131 + len(backend)) % 20000
    procs = [ctx.Process(target=_rank, args=(r, world, backend, port, calls, repeats, out)) for r in range(world)]
    for p in procs:
        p.start()
    value = out.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3, help="process launches per configuration (default 3)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = []
    for backend in ("hetcomm", "gloo"):
        for world in (1, 2):
            runs = [measure(backend, world, args.calls, args.repeats) for _ in range(args.runs)]
            rows.append({"backend": backend, "world_size": world, "us_per_call_median": statistics.median(runs),
                         "us_per_call_min": min(runs), "us_per_call_max": max(runs), "runs": runs})
            print(f"[small_loop] {backend} {world} rank(s): {statistics.median(runs):.1f} us per 8-byte allreduce "
                  f"(runs {min(runs):.1f}-{max(runs):.1f})", flush=True)
    by = {(r["backend"], r["world_size"]): r["us_per_call_median"] for r in rows}
    summary = {"ratio_to_floor_hetcomm": by[("hetcomm", 2)] / by[("hetcomm", 1)],
               "ratio_to_floor_gloo": by[("gloo", 2)] / by[("gloo", 1)]}
    print(f"[small_loop] hetcomm 2 ranks / one-rank floor: {summary['ratio_to_floor_hetcomm']:.2f}x "
          f"(gloo: {summary['ratio_to_floor_gloo']:.2f}x)", flush=True)
    write_document(args.json, {"rows": rows, **summary}, command_line())


if __name__ == "__main__":
    sys.exit(main())
