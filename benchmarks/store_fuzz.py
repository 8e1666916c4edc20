"""Store fuzzer: hetcomm groups while a rogue store client overwrites their keys.

Usage::

    python benchmarks/store_fuzz.py --trials 200 [--ranks 2] [--secret] [--seed 1] [--out FILE]

Each trial creates a group on a fresh prefix of a c10d store, runs collectives whose results are
checked exactly (allreduce, broadcast, send/recv, allgather) for about 1.5 s, and destroys it. Meanwhile the fuzzer,
a plain client of that store and never a member, overwrites or deletes the group's ``hetcomm/``
keys at random moments: random bytes, empty values, a 4 MiB value, JSON of the wrong type, a
plausible address that leads nowhere or to the fuzzer's own socket, another key's value, a
failure record with the group's own incarnation. Each rank's outcome per trial:

* ``ok``: every result exact;
* ``error``: an exception; *clear* if it says ``hetcomm`` (the product's errors all do);
* ``wrong``: a result that differs from the expected one (never acceptable);
* ``hang``: no answer within ``--limit`` seconds (the ranks are killed and started again);
* ``crash``: the rank's process died (a signal or an exit without an answer).

Targets (issue 43): 0 hangs, 0 crashes, 0 wrong results, every error clear; with ``--secret``
(``HETCOMM_SECRET`` on every rank) every trial ok. The ranks are long-lived worker processes
(one group after another), so that a trial costs a group creation, not an interpreter start.
Prints one line per trial; ``--out`` writes the summary and a record per trial (JSON Lines,
hetcomm.bench.records).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import socket
import sys
import threading
import time

from fuzz_common import Processes, write_results

SECRET = "store fuzz secret, 0123456789abcdef"


# --- the ranks ------------------------------------------------------------------------------------

def _worker(rank: int, world: int, control_port: int, data_port: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    import hetcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    control = dist.TCPStore("127.0.0.1", control_port, is_master=False, timeout=timeout)
    data = dist.TCPStore("127.0.0.1", data_port, is_master=False, timeout=timeout)
    control.set(f"up/{rank}", str(os.getpid()))
    while True:
        control.wait([f"go/{rank}"])
        trial = int(control.get(f"go/{rank}"))
        control.delete_key(f"go/{rank}")
        if trial < 0:
            return
        control.set(f"result/{trial}/{rank}", json.dumps(_trial(rank, world, trial, data, control, timeout_s)))


def _trial(rank: int, world: int, trial: int, data, control, timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    outcome = {"status": "ok"}
    try:
        dist.init_process_group("hetcomm", store=dist.PrefixStore(f"t{trial}", data), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        import hetcomm

        control.set(f"incarnation/{trial}", hetcomm.backend_of().incarnation())
        for k in range(4):
            t = torch.arange(4096, dtype=torch.float64) * (rank + 1) + k
            dist.all_reduce(t)
            want = torch.arange(4096, dtype=torch.float64) * (world * (world + 1) / 2) + world * k
            if not torch.equal(t, want):
                return {"status": "wrong", "what": f"allreduce {k}"}
            b = torch.full((1000,), float(rank)) if rank == k % world else torch.zeros(1000)
            dist.broadcast(b, src=k % world)
            if not torch.equal(b, torch.full((1000,), float(k % world))):
                return {"status": "wrong", "what": f"broadcast {k}"}
            time.sleep(0.3)         # room for the fuzzer between operations
        peer = rank ^ 1
        if peer < world:
            out, got = torch.full((100,), float(rank)), torch.zeros(100)
            reqs = [dist.isend(out, peer, tag=3), dist.irecv(got, peer, tag=3)]
            for r in reqs:
                r.wait()
            if not torch.equal(got, torch.full((100,), float(peer))):
                return {"status": "wrong", "what": "send/recv"}
        gathered = [torch.zeros(8) for _ in range(world)]
        dist.all_gather(gathered, torch.full((8,), float(rank)))
        if any(not torch.equal(g, torch.full((8,), float(r))) for r, g in enumerate(gathered)):
            return {"status": "wrong", "what": "allgather"}
    except Exception as e:  # noqa: BLE001 - the outcome is the record
        outcome = {"status": "error", "type": type(e).__name__, "message": str(e)[:600]}
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001
                if outcome["status"] == "ok":
                    outcome = {"status": "error", "type": type(e).__name__, "message": f"destroy: {e}"[:600]}
    return outcome


# --- the fuzzer -----------------------------------------------------------------------------------

def _junk(rng: random.Random, key: str, store, trial: int, control, listener_port: int) -> bytes | None:
    """A value to write over ``key`` (None: delete it)."""
    kind = rng.choice(["random", "empty", "huge", "json", "address", "own_socket", "moved", "failure", "delete"])
    if kind == "random":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
    if kind == "empty":
        return b""
    if kind == "huge":
        return b"A" * (4 << 20)
    if kind == "json":
        return rng.choice([b"[]", b"{}", b'"x"', b"1e999", b"null", b'{"bytes": 1e18}', b"-1"])
    if kind == "address":
        return rng.choice([b"127.0.0.1:1", b"127.0.0.1:70000", b"256.0.0.1:80", b":", b"host"])
    if kind == "own_socket":
        return f"127.0.0.1:{listener_port}".encode()
    if kind == "moved":
        others = [k for k in _group_keys(store, trial) if k != key]
        if not others:
            return b""
        got = store.compare_set(rng.choice(others), _ABSENT, _ABSENT)   # a read that never waits
        return b"" if got == _ABSENT else got
    if kind == "failure":
        inc = control.get(f"incarnation/{trial}").decode() if control.check([f"incarnation/{trial}"]) else "0" * 16
        return f"{inc}|rank 0: planted by the fuzzer".encode()
    return None


_ABSENT = b"store fuzz: no such key"


def _group_keys(store, trial: int) -> list[str]:
    prefix = f"t{trial}/"
    return [k for k in store.list_keys() if k.startswith(prefix) and "hetcomm/" in k]


def _fuzz(store, control, trial: int, rng: random.Random, stop: threading.Event, listener_port: int,
          log: list) -> None:
    for k in range(rng.randint(1, 6)):
        # The first at a moment of the group's creation (its keys appear within ~0.1 s of the
        # start), the others at any moment of its life (about 1.5 s).
        if stop.wait(rng.uniform(0.0, 0.1) if k == 0 else rng.uniform(0.0, 0.5)):
            return
        key = "?"
        try:
            keys = _group_keys(store, trial)
            if not keys:
                continue
            key = rng.choice(keys)
            value = _junk(rng, key, store, trial, control, listener_port)
            if value is None:
                store.delete_key(key)
            else:
                store.set(key, value)
            log.append({"key": key.split("hetcomm/", 1)[1], "value": "deleted" if value is None else
                        f"{len(value)} bytes" if len(value) > 80 else repr(value)[:80]})
        except Exception as e:  # noqa: BLE001 - the key went meanwhile
            log.append({"key": key, "fuzzer_error": str(e)[:100]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--secret", action="store_true", help="an out-of-band secret on every rank (HETCOMM_SECRET)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a trial may take before it counts as a hang")
    ap.add_argument("--timeout", type=float, default=5.0, help="the groups' timeout, seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    control = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    data = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    fuzz_client = dist.TCPStore("127.0.0.1", data.port, is_master=False, timeout=timeout)
    listener = socket.create_server(("127.0.0.1", 0))
    ranks = Processes(__file__, args.ranks, [str(args.ranks), str(control.port), str(data.port), str(args.timeout)],
                      SECRET if args.secret else None, "store", 120)
    ranks.start(control)
    rng = random.Random(args.seed)
    records, start = [], time.monotonic()
    for trial in range(args.trials):
        stop, log = threading.Event(), []
        fuzzer = threading.Thread(target=_fuzz, args=(fuzz_client, control, trial, random.Random(rng.random()), stop,
                                                      listener.getsockname()[1], log), daemon=True)
        for r in range(args.ranks):
            control.set(f"go/{r}", str(trial))
        fuzzer.start()
        outcomes = ranks.outcomes(control, trial, args.limit, 0.02)
        stop.set()
        fuzzer.join()
        if any(o["status"] in ("hang", "crash") for o in outcomes):
            ranks.kill()
            ranks.start(control)
        record = {"trial": trial, "mutations": log, "ranks": outcomes}
        records.append(record)
        print(f"trial {trial}: {[o['status'] for o in record['ranks']]} after "
              f"{[m.get('key') for m in log]}", flush=True)
    ranks.stop(control)
    flat = [o for rec in records for o in rec["ranks"]]
    summary = {
        "command": "python benchmarks/store_fuzz.py " + " ".join(sys.argv[1:]),
        "trials": args.trials, "ranks": args.ranks, "secret": args.secret, "seconds": round(time.monotonic() - start, 1),
        "rank_outcomes": {s: sum(o["status"] == s for o in flat) for s in ("ok", "error", "wrong", "hang", "crash")},
        "unclear_errors": [o["message"] for o in flat if o["status"] == "error" and not o["clear"]][:20],
        "trials_all_ok": sum(all(o["status"] == "ok" for o in rec["ranks"]) for rec in records),
        "logs": ranks.logs,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        write_results(args.out, summary, records, "ranks")
    bad = summary["rank_outcomes"]["wrong"] + summary["rank_outcomes"]["hang"] + summary["rank_outcomes"]["crash"]
    bad += len(summary["unclear_errors"])
    if args.secret:
        bad += args.trials - summary["trials_all_ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*(int(a) for a in sys.argv[2:6]), float(sys.argv[6]))
    else:
        sys.exit(main())
