"""Elastic store fuzzer: elastic DiLoCo runs while a rogue store client overwrites their records.

Usage::

    python benchmarks/elastic_store_fuzz.py --trials 100 [--secret] [--deletes] [--seed 1] [--out FILE]

Each trial is a run of its own (job ``fuzz<trial>`` on one store): three workers, alternately
`hetcomm.ElasticDiLoCo` and `hetcomm.DiLoCo(membership=hetcomm.Elastic(...))` (the same run since
the first is a constructor of the second; before, a class of its own), 4 rounds of 3
steps of a small model. Meanwhile the fuzzer, a plain client of the store and never a worker,
lists the run's keys and overwrites some (1 to 6, at random moments of its life, the first
while it starts): random bytes, an empty value, 1 MiB, JSON of the wrong types, deep nesting,
another key's value, an older value of the same key (a replay), and with ``--deletes``
deletion. Each worker's outcome per trial:

* ``ok``: it finished every round;
* ``error``: an exception; *clear* if it says ``hetcomm`` (the product's errors all do);
* ``hang``: no answer within ``--limit`` seconds (the workers are killed and started again);
* ``crash``: its process died.

A trial *diverged* when workers that finished report different final parameters (never
acceptable); it was *disturbed* when all finished but the membership changed (a worker dropped
and joined again, or was dropped and not back in when the run ended: it stops with fewer rounds
and ``stop_reason`` "the run ended ..."). Targets (issue 43): 0 hangs, 0 crashes, 0 divergence, every error clear;
with ``--secret`` (HETCOMM_SECRET on every worker) and without ``--deletes`` every trial ok and
undisturbed: overwriting a sealed record is never acted on. The workers are long-lived processes
(one run after another, started again after a trial that was not ok). ``--out`` writes the
summary and a record per trial (JSON Lines, hetcomm.bench.records).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import threading
import time

from fuzz_common import Processes, write_results

SECRET = "elastic store fuzz secret, 0123456789abcdef"
WORKERS = 3
ROUNDS = 4


# --- the workers ----------------------------------------------------------------------------------

def _worker(index: int, control_port: int, data_port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    control = dist.TCPStore("127.0.0.1", control_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    control.set(f"up/{index}", str(os.getpid()))
    while True:
        control.wait([f"go/{index}"], datetime.timedelta(days=1))
        trial = int(control.get(f"go/{index}"))
        control.delete_key(f"go/{index}")
        if trial < 0:
            return
        control.set(f"result/{trial}/{index}", json.dumps(_trial(index, trial, data_port)))


def _trial(index: int, trial: int, data_port: int) -> dict:
    import torch

    import hetcomm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    common = dict(store=f"127.0.0.1:{data_port}", worker_id=f"w{index}", job=f"fuzz{trial}", min_workers=WORKERS,
                  heartbeat=0.5, timeout=3.0, late_timeout=10.0, collective_timeout=10.0, verbose=False)
    mode = "elastic" if trial % 2 == 0 else "generations"
    g = torch.Generator().manual_seed(index)
    try:
        if mode == "elastic":
            diloco = hetcomm.ElasticDiLoCo(model, opt, steps=3, **common)
        else:
            diloco = hetcomm.DiLoCo(model, opt, membership=hetcomm.Elastic(**common), steps=3)

        def batches():
            while True:
                yield torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)

        for x, y in diloco.loop(batches(), max_rounds=ROUNDS):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)
            diloco.step(samples=len(x), loss=loss.item())
        changes = [e for e in diloco.membership if e.get("round", 0) > 0]
        return {"status": "ok", "mode": mode, "rounds": diloco.rounds, "fingerprint": diloco.fingerprint(),
                "changes": len(changes), "stopped": diloco.stop_reason,
                "dropped": any(e.get("worker") == f"w{index}" and "dropped" in e for e in diloco.membership)}
    except Exception as e:  # noqa: BLE001 - the outcome is the record
        return {"status": "error", "mode": mode, "type": type(e).__name__, "message": str(e)[:600]}


# --- the fuzzer -----------------------------------------------------------------------------------

_ABSENT = b"elastic store fuzz: no such key"


def _junk(rng: random.Random, key: str, keys: list[str], store, seen: dict, deletes: bool) -> bytes | None:
    """A value to write over ``key`` (None: delete it)."""
    kinds = ["random", "empty", "huge", "json", "nested", "moved", "replay"] + (["delete"] if deletes else [])
    kind = rng.choice(kinds)
    if kind == "random":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
    if kind == "empty":
        return b""
    if kind == "huge":
        return b"7" * (1 << 20)
    if kind == "json":
        return rng.choice([b"[]", b"{}", b'"x"', b"1e999", b"null", b"-1", b"true", b'{"members": "w0"}',
                           b'{"epoch": 1, "gen": "x"}', b'{"bytes": 1e18, "shards": 1}', b'{"round": -5}'])
    if kind == "nested":
        return b"[" * 100_000
    if kind in ("moved", "replay"):
        pool = [k for k in keys if k != key] if kind == "moved" else [key]
        olds = [v for k in pool for v in seen.get(k, [])]
        return rng.choice(olds) if olds else b""
    return None


def _fuzz(store, trial: int, rng: random.Random, stop: threading.Event, deletes: bool, log: list) -> None:
    prefix, seen = f"hetcomm/ft/fuzz{trial}/", {}
    for k in range(rng.randint(1, 6)):
        if stop.wait(rng.uniform(0.05, 0.6) if k == 0 else rng.uniform(0.0, 0.8)):
            return
        key = "?"
        try:
            keys = [k for k in store.list_keys() if k.startswith(prefix) and "/g" not in k.removeprefix(prefix)[:8]]
            for name in keys:                      # what the replays and moves draw from
                got = store.compare_set(name, _ABSENT, _ABSENT)
                if got != _ABSENT and len(got) < 100_000:
                    seen.setdefault(name, []).append(got)
            if not keys:
                continue
            key = rng.choice(keys)
            value = _junk(rng, key, keys, store, seen, deletes)
            if value is None:
                store.delete_key(key)
            else:
                store.set(key, value)
            log.append({"key": key.removeprefix(prefix), "value": "deleted" if value is None else
                        f"{len(value)} bytes" if len(value) > 60 else repr(value)[:60]})
        except Exception as e:  # noqa: BLE001 - the key went meanwhile
            log.append({"key": key, "fuzzer_error": str(e)[:100]})


def _verdict(outcomes: list[dict]) -> str:
    if any(o["status"] in ("hang", "crash") for o in outcomes):
        return "hang" if any(o["status"] == "hang" for o in outcomes) else "crash"
    done = [o for o in outcomes if o["status"] == "ok"]
    last = max((o["rounds"] for o in done), default=0)
    # A worker dropped (or never admitted) that was not back in when the run ended stops with
    # fewer rounds, told so: left out, not diverged. Any other difference is divergence.
    left_out = [o for o in done if o["rounds"] < last and (o.get("stopped") or "").startswith("the run ended")
                and (o["rounds"] == 0 or o.get("dropped"))]
    members = [o for o in done if o not in left_out]
    if len({(o["rounds"], o["fingerprint"]) for o in members}) > 1:
        return "diverged"
    if len(done) < len(outcomes):
        return "error"
    return "disturbed" if left_out or any(o["changes"] for o in done) else "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--secret", action="store_true", help="an out-of-band secret on every worker (HETCOMM_SECRET)")
    ap.add_argument("--deletes", action="store_true", help="the fuzzer also deletes records")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=float, default=120.0, help="seconds a trial may take before it counts as a hang")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    control = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    data = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    fuzz_client = dist.TCPStore("127.0.0.1", data.port, is_master=False, timeout=timeout)
    workers = Processes(__file__, WORKERS, [str(control.port), str(data.port)], SECRET if args.secret else None,
                        "elastic", 180)
    workers.start(control)
    rng = random.Random(args.seed)
    records, start = [], time.monotonic()
    for trial in range(args.trials):
        stop, log = threading.Event(), []
        fuzzer = threading.Thread(target=_fuzz, args=(fuzz_client, trial, random.Random(rng.random()), stop,
                                                      args.deletes, log), daemon=True)
        for r in range(WORKERS):
            control.set(f"go/{r}", str(trial))
        fuzzer.start()
        ordered = workers.outcomes(control, trial, args.limit, 0.05)
        stop.set()
        fuzzer.join()
        verdict = _verdict(ordered)
        if verdict != "ok":                       # a fresh start: no state of a disturbed run carries over
            workers.kill()
            workers.start(control)
        records.append({"trial": trial, "verdict": verdict, "mutations": log, "workers": ordered})
        print(f"trial {trial} ({ordered[0].get('mode', '?')}): {verdict} {[o['status'] for o in ordered]} after "
              f"{[m.get('key') + ': ' + str(m.get('value', ''))[:24] for m in log]}", flush=True)
    workers.stop(control)
    flat = [o for rec in records for o in rec["workers"]]
    summary = {
        "command": "python benchmarks/elastic_store_fuzz.py " + " ".join(sys.argv[1:]),
        "trials": args.trials, "secret": args.secret, "deletes": args.deletes,
        "seconds": round(time.monotonic() - start, 1),
        "verdicts": {v: sum(rec["verdict"] == v for rec in records)
                     for v in ("ok", "disturbed", "error", "diverged", "hang", "crash")},
        "worker_outcomes": {s: sum(o["status"] == s for o in flat) for s in ("ok", "error", "hang", "crash")},
        "unclear_errors": [o["message"] for o in flat if o["status"] == "error" and not o["clear"]][:20],
        "errors": sorted({o["message"][:160] for o in flat if o["status"] == "error"})[:20],
        "logs": workers.logs,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        write_results(args.out, summary, records, "workers")
    v = summary["verdicts"]
    bad = v["diverged"] + v["hang"] + v["crash"] + len(summary["unclear_errors"])
    if args.secret and not args.deletes:
        bad += args.trials - v["ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*(int(a) for a in sys.argv[2:5]))
    else:
        sys.exit(main())
