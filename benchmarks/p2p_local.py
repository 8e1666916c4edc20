"""Point-to-point send/recv between two ranks of one host: hetcomm's ring in shared memory (the
default between ranks of a host), hetcomm over loopback TCP (``HETCOMM_P2P_SHM_BYTES=0``) and
gloo, in one run.

A ping-pong: rank 0 sends a float32 tensor, rank 1 receives it and sends it back; the figure is
the one-way time (half a round trip), median over ``--repeats`` timed loops of the mean, and the
rate is bytes / one-way time. Each configuration is launched ``--runs`` times (fresh processes);
the summary gives, per size, the median over launches and the min-max, and hetcomm's shared
memory over its own TCP and over gloo as time ratios (> 1: shared memory faster). Every
received tensor is checked against what was sent.

Usage::

    python benchmarks/p2p_local.py --runs 5 --json benchmarks/results/p2p_local.json
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
from hetcomm.bench.config import parse_size_list

CONFIGS = {"hetcomm-shm": ("hetcomm", {}), "hetcomm-tcp": ("hetcomm", {"HETCOMM_P2P_SHM_BYTES": "0"}),
           "gloo": ("gloo", {})}


def _rank(rank: int, backend: str, env: dict, port: int, sizes: list[int], repeats: int, out) -> None:
    os.environ.update(env)
    if backend == "hetcomm":
        import hetcomm  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = {}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        data = torch.arange(n, dtype=torch.float32)
        got = torch.empty(n, dtype=torch.float32)
        loops = max(3, min(200, (64 << 20) // max(nbytes, 1)))
        times = []
        for rep in range(repeats + 1):                   # the first loop warms up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(loops):
                if rank == 0:
                    dist.send(data, 1)
                    dist.recv(got, 1)
                else:
                    dist.recv(got, 0)
                    dist.send(got, 0)
            if rep:
                times.append((time.perf_counter() - start) / loops / 2)
        if not torch.equal(got, data):
            raise AssertionError(f"{backend} {env}: a {nbytes}-byte message came back different")
        result[nbytes] = statistics.median(times)
    if backend == "hetcomm":
        # The configuration is what it says: rings in shared memory, or none.
        links = hetcomm.stats()["p2p_links"]
        wanted = "tcp" if env.get("HETCOMM_P2P_SHM_BYTES") == "0" else "shm"
        if links[wanted] < 1 or sum(links.values()) != links[wanted]:
            raise AssertionError(f"{backend} {env}: point-to-point links {links}, expected {wanted} only")
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def measure(name: str, sizes: list[int], repeats: int, launch: int) -> dict[int, float]:
    backend, env = CONFIGS[name]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 20000 + (os.getpid() * 7 + launch * 131 + len(name) * 17) % 20000
    procs = [ctx.Process(target=_rank, args=(r, backend, env, port, sizes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        value = out.get(timeout=900)
    except Exception:
        for p in procs:
            p.kill()
        raise RuntimeError(f"p2p_local: {name} gave no result (exit codes {[p.exitcode for p in procs]})") from None
    for p in procs:
        p.join(timeout=120)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,4K,64K,1M,16M,64M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="process launches per configuration (default 3)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    sizes = parse_size_list(args.sizes)
    per: dict[str, list[dict[int, float]]] = {name: [] for name in CONFIGS}
    for launch in range(args.runs):                      # interleaved: the machine's drift hits all alike
        for name in CONFIGS:
            per[name].append(measure(name, sizes, args.repeats, launch))
            print(f"[p2p_local] run {launch + 1}/{args.runs} {name} done", flush=True)
    rows = []
    for nbytes in sizes:
        row = {"size_bytes": nbytes}
        for name in CONFIGS:
            values = [run[nbytes] for run in per[name]]
            row[name] = {"one_way_us_median": statistics.median(values) * 1e6, "min_us": min(values) * 1e6,
                         "max_us": max(values) * 1e6, "gb_per_s_median": nbytes / statistics.median(values) / 1e9,
                         "runs_us": [v * 1e6 for v in values]}
        row["shm_over_tcp"] = row["hetcomm-tcp"]["one_way_us_median"] / row["hetcomm-shm"]["one_way_us_median"]
        row["shm_over_gloo"] = row["gloo"]["one_way_us_median"] / row["hetcomm-shm"]["one_way_us_median"]
        rows.append(row)
        print(f"[p2p_local] {nbytes:>10} B: shm {row['hetcomm-shm']['one_way_us_median']:10.1f} us "
              f"({row['hetcomm-shm']['gb_per_s_median']:.2f} GB/s), tcp {row['hetcomm-tcp']['one_way_us_median']:10.1f}"
              f" us, gloo {row['gloo']['one_way_us_median']:10.1f} us; shm/tcp {row['shm_over_tcp']:.2f}x, "
              f"shm/gloo {row['shm_over_gloo']:.2f}x", flush=True)
    write_document(args.json, {"rows": rows}, command_line())


if __name__ == "__main__":
    sys.exit(main())
