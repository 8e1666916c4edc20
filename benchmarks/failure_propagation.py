"""How fast a failure reaches every operation of a group, on every rank (issue 22: within 3 s of
one rank knowing).

    python benchmarks/failure_propagation.py [--repeats 5] [--json benchmarks/results/failure_propagation.json]

Scenarios, on loopback, the group timeout 20 s (so an implementation that waits for it shows ~20 s):

* ``failed_collective_pending_recv`` (2 ranks, hetcomm and gloo): each rank posts a receive nobody
  answers, then an allreduce whose shapes differ across ranks. Reported: how long after the
  allreduce raised on a rank its pending receive raised, and both times from the allreduce's call
  (gloo's allreduce itself waits for the timeout; a rank that crashes reports nothing, hence
  ``samples`` beside ``expected_samples``).
* ``far_rank`` (3 ranks): ranks 0 and 1 fail on a message-size mismatch; rank 2 shares no
  connection with rank 0 and waits on a receive from rank 1. Reported: how long after rank 0's
  receive raised each other rank's pending receive raised.
* ``killed_rank`` (3 ranks): rank 2 is SIGKILLed while rank 1 waits on a receive from it (rank 2
  never connected to it) and rank 0 waits on a receive from rank 1. Reported: how long after the
  kill each survivor raised.

The JSON file holds one record per line (hetcomm.bench.records), each with the command.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time

from hetcomm.bench.records import command_line, write_document

GROUP_TIMEOUT_S = 20.0


def _init(backend: str, rank: int, world: int, port: int):
    import torch.distributed as dist

    if backend == "hetcomm":
        import hetcomm  # noqa: F401
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return store


def _leave(out) -> None:
    """Exits at once (a failed group may tear down slowly under gloo), once the result is sent."""
    out.close()
    out.join_thread()
    os._exit(0)


def _raised_at(work) -> float:
    try:
        work.wait()
    except RuntimeError:
        pass
    return time.time()


def _failed_collective(rank: int, backend: str, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    _init(backend, rank, 2, port)
    dist.all_reduce(torch.ones(4))
    pending = dist.irecv(torch.empty(8), src=1 - rank, tag=9)
    start = time.time()
    try:
        dist.all_reduce(torch.ones(100 + rank))
    except RuntimeError:
        pass
    failed = time.time()
    out.put({"rank": rank, "after_s": _raised_at(pending) - failed, "allreduce_s": failed - start,
             "from_call_s": time.time() - start})
    _leave(out)


def _far_rank(rank: int, backend: str, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    store = _init(backend, rank, 3, port)
    dist.barrier()
    if rank == 0:
        store.wait(["sent"])
        try:
            dist.recv(torch.empty(20), src=1, tag=1)
        except RuntimeError:
            pass
        store.set("t0", repr(time.time()))
    elif rank == 1:
        dist.send(torch.ones(10), dst=0, tag=1)
        store.set("sent", "1")
        t = _raised_at(dist.irecv(torch.empty(5), src=2, tag=2))
        out.put({"rank": 1, "at": t})
    else:
        t = _raised_at(dist.irecv(torch.empty(5), src=1, tag=3))
        out.put({"rank": 2, "at": t})
    if rank == 0:
        out.put({"rank": 0, "at": float(store.get("t0"))})
    _leave(out)


def _killed_rank(rank: int, backend: str, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    store = _init(backend, rank, 3, port)
    dist.barrier()
    if rank == 2:
        time.sleep(1.0)
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    src = rank + 1
    t = _raised_at(dist.irecv(torch.empty(5), src=src, tag=4))
    out.put({"rank": rank, "at": t})
    _leave(out)


def _run(target, world: int, backend: str) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, backend, store.port, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = []
    deadline = time.monotonic() + 120
    expected = world - (1 if target is _killed_rank else 0)
    while len(got) < expected and time.monotonic() < deadline:
        try:
            got.append(out.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    if target is _killed_rank and store.check(["killed_at"]):
        killed = float(store.get("killed_at"))
        return [{"rank": g["rank"], "after_s": g["at"] - killed} for g in got]
    if target is _far_rank:
        t0 = next((g["at"] for g in got if g["rank"] == 0), None)
        return [{"rank": g["rank"], "after_s": g["at"] - t0} for g in got if g["rank"] != 0 and t0 is not None]
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    scenarios = [("failed_collective_pending_recv", _failed_collective, 2, ["hetcomm", "gloo"]),
                 ("far_rank", _far_rank, 3, ["hetcomm"]), ("killed_rank", _killed_rank, 3, ["hetcomm"])]
    rows = []
    for name, target, world, backends in scenarios:
        for backend in backends:
            got = []
            for _ in range(args.repeats):
                got += _run(target, world, backend)
            delays = [r["after_s"] for r in got]
            row = {"scenario": name, "backend": backend, "ranks": world, "samples": len(delays),
                   "expected_samples": args.repeats * (world - 1 if target is not _failed_collective else world),
                   "median_s": round(statistics.median(delays), 3) if delays else None,
                   "max_s": round(max(delays), 3) if delays else None, "all_s": [round(d, 3) for d in delays]}
            if target is _failed_collective and got:
                # From the call of the failing allreduce: when it raised, and when the receive did.
                row["allreduce_raised_median_s"] = round(statistics.median(r["allreduce_s"] for r in got), 3)
                row["recv_raised_median_s"] = round(statistics.median(r["from_call_s"] for r in got), 3)
            print(row, flush=True)
            rows.append(row)
    if args.json:
        write_document(args.json, {"group_timeout_s": GROUP_TIMEOUT_S, "rows": rows}, command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
