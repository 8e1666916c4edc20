"""Train the small character-level GPT with fault-tolerant DiLoCo: workers may die and come back.

One process per worker, each started on its own (by hand, a container, a per-node torchrun),
around a store that runs where no worker does::

    python -m hetcomm.store --port 29400 &
    for w in w0 w1 w2 w3; do
        python examples/train_elastic.py --store 127.0.0.1:29400 --id $w --job demo --min-workers 4 &
    done
    # kill one (kill -9), start it again with the same command: it rejoins the round in progress

Every worker trains its replica with AdamW on its own random windows of the corpus and
synchronises through ``hetcomm.DiLoCo(membership=hetcomm.Elastic(...))`` (DiLoCo in generations,
docs/elastic.md#diloco-in-generations) every ``--steps`` steps, or every ``--round-seconds``,
with any of ``--local-steps``, ``--compress``, ``--overlap``, ``--fragments``.
Each worker prints one line per round (members, samples, loss) and one per membership change;
``--jsonl PATH`` appends a JSON line per round (time, round, fingerprint of the global
parameters, members, steps, samples) and, at the end, one with the held-out loss, the stats and
this worker's timeline (the epochs' idle and sync, and the membership changes), for
``benchmarks/elastic_sim.py``. ``--checkpoint PATH`` saves the state after every round and
resumes from it when it exists (a whole-job restart).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch

import hetcomm
from char_gpt import add_model_arguments, build, evaluate, mean_loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="host:port of the job's store (python -m hetcomm.store)")
    p.add_argument("--id", default=os.environ.get("HETCOMM_WORKER_ID"), help="this worker's name")
    p.add_argument("--job", default="train-elastic", help="the run's name on the store (new run: new name)")
    p.add_argument("--steps", type=int, default=8, help="inner steps per round")
    p.add_argument("--round-seconds", type=float, default=None, help="rounds of this many seconds instead")
    p.add_argument("--min-workers", type=int, default=1, help="workers the first round waits for")
    p.add_argument("--compress", choices=["fp32", "bf16", "fp16", "int8", "int4"], default="fp32")
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds without a heartbeat before a worker is dropped")
    add_model_arguments(p, block=16, d_model=256, layers=3)
    p.add_argument("--samples", type=int, default=6144, help="stop once the workers processed this many samples")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: by --samples)")
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--jsonl", metavar="PATH", help="append this worker's records here")
    p.add_argument("--progress-seconds", type=float, default=0.0,
                   help="with --jsonl: also append the samples this worker trained so far every this many seconds "
                        "(0: never), and each membership change as it is seen")
    p.add_argument("--checkpoint", metavar="PATH", help="save after every round; resume from it if it exists")
    p.add_argument("--generations", action="store_true", help="(accepted for older commands: every run is in "
                   "generations)")
    p.add_argument("--local-steps", choices=["fixed", "speed", "time"], default=None,
                   help="the local-step policy (default fixed, or time with --round-seconds); --steps is then H")
    p.add_argument("--overlap", action="store_true", help="synchronise in the background")
    p.add_argument("--fragments", type=int, default=1, help="(--overlap) staggered fragments")
    p.add_argument("--save-globals", metavar="DIR",
                   help="save the global parameters after every round as DIR/round<r>.pt (a loss curve, evaluated later)")
    return p.parse_args(argv)


# What DiLoCo in generations records of a round beyond the members, steps and samples: for diagnosis.
DIAGNOSIS = ("plan", "compute_seconds", "idle_seconds_total", "sync_seconds_total", "landed_after_steps")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend != "hetcomm" and args.backend != "gloo":
        raise SystemExit("train_elastic: --backend must be hetcomm or gloo")
    torch.set_num_threads(args.threads)
    train, held_out, model = build(args.corpus_chars, args.seed, args.block, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = lambda ps: torch.optim.SGD(ps, lr=args.outer_lr, momentum=0.9, nesterov=True)  # noqa: E731
    local_steps = args.local_steps or ("fixed" if args.round_seconds is None else "time")
    if args.round_seconds is not None and local_steps != "time":
        raise SystemExit("train_elastic: --round-seconds needs --local-steps time")
    membership = hetcomm.Elastic(store=args.store, worker_id=args.id, job=args.job, min_workers=args.min_workers,
                                 heartbeat=args.heartbeat, timeout=args.timeout, backend=args.backend)
    diloco = hetcomm.DiLoCo(model, opt, membership=membership, local_steps=local_steps, steps=args.steps,
                            round_seconds=args.round_seconds, compress=args.compress,
                            error_feedback=args.compress in ("int8", "int4"), overlap=args.overlap,
                            fragments=args.fragments, outer_optimizer=outer)
    if args.checkpoint and os.path.exists(args.checkpoint):
        diloco.load_state_dict(torch.load(args.checkpoint, weights_only=False))
        print(f"train_elastic [{diloco.worker_id}]: resuming from {args.checkpoint} (round {diloco.rounds})",
              flush=True)
    out = open(args.jsonl, "a") if args.jsonl else None

    def write(rec: dict) -> None:
        if out is not None:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    def windows():
        # This worker's random windows, drawn from the round it joined at (the loop joins before
        # the first batch): the same in every run with the same seed, so that runs compare
        # paired; a restarted worker, joining at a later round, draws new ones.
        rng = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}/{diloco.worker_id}/{diloco.rounds}".encode()))
        while True:
            idx = torch.randint(len(train), (args.batch,), generator=rng).tolist()
            yield torch.stack([train[i][0] for i in idx]), torch.stack([train[i][1] for i in idx])

    started = time.time()
    write({"start": started, "id": diloco.worker_id, "pid": os.getpid()})
    reported = None
    trained, progressed, written = 0, started, list(diloco.membership)
    for x, y in diloco.loop(windows(), max_samples=None if args.rounds else args.samples,
                            max_rounds=args.rounds or None):
        if reported is None:            # the rounds before this worker joined are not its to report
            reported = diloco.history[-1]["round"] if diloco.history else 0
        loss = mean_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if diloco.step(samples=len(x), loss=loss.item()) and args.checkpoint:
            # at the round's boundary (with overlap state_dict waits for the synchronisation in flight)
            try:
                state = diloco.state_dict()
            except RuntimeError as e:              # (the sync in flight failed: keep the last one)
                print(f"train_elastic [{diloco.worker_id}]: checkpoint not saved this round: {e}", flush=True)
            else:
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
        trained += len(x)
        if args.progress_seconds > 0:
            now = time.time()
            # (seen at the step after it: an epoch is inside step; by content: a joiner's list is
            # replaced by the holders' when it receives the state)
            for event in [e for e in diloco.membership if e not in written]:
                write({"t": now, "event": event, "progress": trained, "id": diloco.worker_id, "pid": os.getpid()})
                written.append(event)
            if now - progressed >= args.progress_seconds:
                progressed = now
                write({"t": now, "progress": trained, "id": diloco.worker_id, "pid": os.getpid()})
        for h in [h for h in diloco.history if h["round"] > reported]:   # (with overlap: a round late)
            reported = h["round"]
            members = h.get("members") or h["workers"]
            mine = members.index(diloco.worker_id) if diloco.worker_id in members else None
            print(f"train_elastic [{diloco.worker_id}]: round {h['round']:3d} | members {','.join(members)} | "
                  f"steps {h['steps']} | samples {diloco.stats()['samples_total']} | loss "
                  f"{None if mine is None or h['loss'][mine] is None else round(h['loss'][mine], 3)}", flush=True)
            write({"t": time.time(), "round": h["round"], "fp": h["fingerprint"], "members": members,
                   "steps": h["steps"], "samples": h["samples"], "generation": h["generation"],
                   **{k: h[k] for k in DIAGNOSIS if k in h}, "id": diloco.worker_id, "pid": os.getpid()})
            if args.save_globals:
                torch.save(diloco.global_parameters(), os.path.join(args.save_globals, f"round{h['round']}.pt"))
    stats = diloco.stats()
    final_loss = evaluate(model, held_out, min(len(held_out), 256)) if diloco.rounds else None
    print(f"train_elastic [{diloco.worker_id}]: stopped ({diloco.stop_reason}) after {stats['rounds']} rounds, "
          f"{stats['samples_total']} samples; held-out loss {final_loss}", flush=True)
    write({"final": diloco.fingerprint(), "t": time.time(), "id": diloco.worker_id, "pid": os.getpid(),
           "loss": final_loss, "reason": diloco.stop_reason, "stats": stats, "timeline": diloco.timeline()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
