"""How hetcomm behaves when things go wrong: a peer that has exited, and a flood on its port.

    python benchmarks/fault_latency.py [--repeats 3] [--json benchmarks/results/fault_latency.json]

The JSON file holds one record per line (hetcomm.bench.records), each with the command: a ``run``
header (``group_timeout_s``), then one ``result`` per scenario, backend and operation.

Two scenarios, 2 ranks on loopback, hetcomm and gloo side by side in the same run:

* ``dead_peer``: once the group works, rank 1 is killed (SIGKILL); rank 0 then sends to it (or
  receives from it) and destroys the group. Reported: how long the operation took to raise (or
  to return), and how long ``destroy_process_group()`` took. The group timeout is 10 s, so an
  implementation that waits for it shows ~10 s.
* ``flood`` (hetcomm only; gloo has no listening port after group creation): rank 0's descriptor
  limit is 512; rank 1 holds 1500 connections open against rank 0's listening port. Reported:
  rank 0's CPU time per second while idle under the flood, and whether three allreduces after
  the flood started gave exact results.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import resource
import signal
import socket
import statistics
import sys
import time

from hetcomm.bench.records import command_line, write_document

GROUP_TIMEOUT_S = 10.0
FLOOD = 1500
FD_LIMIT = 512
IDLE_S = 5.0


def _init(backend: str, rank: int, port: int) -> object:
    import torch.distributed as dist

    if backend == "hetcomm":
        import hetcomm  # noqa: F401  (registers the backend)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return store


def _wait_key(store, key: str) -> None:
    store.wait([key], datetime.timedelta(seconds=120))


def _dead_peer_rank(rank: int, backend: str, op: str, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    store = _init(backend, rank, port)
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        store.set("exiting", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_key(store, "exiting")
    time.sleep(0.5)
    t = torch.ones(1000)
    start = time.monotonic()
    try:
        if op == "send":
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=1)
        error = ""
    except RuntimeError as e:
        error = str(e).splitlines()[0][:300]
    op_s = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    out.put({"op_s": op_s, "destroy_s": time.monotonic() - start, "raised": bool(error), "error": error})


def _flood_rank(rank: int, backend: str, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    import hetcomm

    store = _init(backend, rank, port)

    def exact() -> bool:
        ok = True
        for k in range(3):
            inputs = [torch.arange(100_000, dtype=torch.float32) * (r + 1) + k for r in range(2)]
            t = inputs[rank].clone()
            dist.all_reduce(t)
            ok &= torch.equal(t, inputs[0] + inputs[1])
        return ok

    exact()
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        store.set("target", hetcomm.listen_address())
        _wait_key(store, "flooded")
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(IDLE_S)
        after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        ok = exact()
        store.set("done", "1")
        out.put({"cpu_per_idle_s": cpu / elapsed, "exact": ok, "fd_limit": FD_LIMIT,
                 "rejected_connections": hetcomm.backend_of().rejected_connections()})
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, FLOOD + 500)), hard))
        _wait_key(store, "target")
        host, p = store.get("target").decode().rsplit(":", 1)
        socks = []
        for _ in range(FLOOD):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(p)))
            socks.append(s)
        time.sleep(0.5)
        store.set("flooded", "1")
        exact()
        _wait_key(store, "done")
        for s in socks:
            s.close()
    dist.destroy_process_group()


def _run(target, *args, expect_dead: int | None = None) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, store.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=180)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        if r != expect_dead and p.exitcode != 0:
            raise RuntimeError(f"rank {r} exited with status {p.exitcode}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for backend in ("hetcomm", "gloo"):
        for op in ("send", "recv"):
            runs = [_run(_dead_peer_rank, backend, op, expect_dead=1) for _ in range(args.repeats)]
            row = {"scenario": "dead_peer", "backend": backend, "op": op,
                   "op_s": statistics.median(r["op_s"] for r in runs),
                   "destroy_s": statistics.median(r["destroy_s"] for r in runs),
                   "raised": all(r["raised"] for r in runs), "runs": runs}
            rows.append(row)
            print(f"dead peer  {backend:8s} {op:4s}: raised={row['raised']} after {row['op_s']:.3f} s, "
                  f"destroy {row['destroy_s']:.3f} s  ({runs[0]['error'][:100]})", flush=True)
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < FLOOD + 500:
        print(f"flood: skipped (hard descriptor limit below {FLOOD + 500})", flush=True)
    else:
        flood = _run(_flood_rank, "hetcomm")
        rows.append({"scenario": "flood", "backend": "hetcomm", "connections": FLOOD, **flood})
        print(f"flood      hetcomm: {flood['cpu_per_idle_s']:.4f} s CPU per idle s, exact={flood['exact']}, "
              f"fd limit {FD_LIMIT}, {flood['rejected_connections']} connections turned away", flush=True)
    if args.json:
        write_document(args.json, {"group_timeout_s": GROUP_TIMEOUT_S, "rows": rows}, command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
