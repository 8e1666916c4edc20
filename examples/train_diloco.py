"""Train the small character-level GPT with DiLoCo on unequal ranks.

Run under torchrun, or on the simulated cluster with unequal CPU shares and slow NICs (root)::

    python -m hetcomm.sim --nprocs 4 --cpu-quota 0.8,0.4,0.2,0.2 --nic-mbit 100 -- \\
        python examples/train_diloco.py --local-steps time --compress int8 --overlap --fragments 4 --json run.json
    torchrun --nproc-per-node 2 examples/train_diloco.py --local-steps speed

Every rank trains its replica with AdamW on its own random windows of the corpus and
synchronises every round through `hetcomm.DiLoCo`: ``--local-steps fixed`` (H steps each, the
published recipes), ``speed`` (H_r by measured speed) or ``time`` (an agreed deadline);
``--weighting``, ``--compress`` and ``--overlap`` (``--fragments``) choose the outer update's
weights, the pseudo-gradient's format and background synchronisation (reduced in pieces). Training stops on every rank at the
first round after which the ranks have processed ``--samples`` samples in all (or after
``--rounds`` rounds, or when every rank's ``--batches`` ran out): `hetcomm.DiLoCo.loop` takes
that decision collectively. Rank 0
prints per round each rank's steps, compute and idle seconds, megabytes sent and loss; ``--json``
writes the summary, the agreed per-round history and every rank's timeline (for
``benchmarks/diloco_sim.py``'s plot).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import hetcomm
from hetcomm.bench.nic import NicSampler, peak_rate
from char_gpt import add_model_arguments, build, evaluate, mean_loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-steps", choices=["fixed", "speed", "time"], default="time")
    p.add_argument("--steps", type=int, default=8, help="H: steps per round (the slowest rank's)")
    p.add_argument("--weighting", choices=["batch", "samples", "uniform", "normalized"], default="batch")
    p.add_argument("--compress", choices=["fp32", "bf16", "fp16", "int8", "int4"], default="fp32")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--overlap", action="store_true", help="synchronise in the background while the next round runs")
    p.add_argument("--overlap-steps", type=int, default=None,
                   help="with --overlap: apply the late update after this many steps of the next round "
                        "(default: as soon as it arrives)")
    p.add_argument("--fragments", type=int, default=1,
                   help="with --overlap: reduce the update in this many pieces, each moved onto as it lands; "
                        "fragment f is synchronised at step f*H/F of each round (staggered)")
    p.add_argument("--no-stagger", action="store_true",
                   help="with --fragments: synchronise them all at the round boundary, one after another")
    p.add_argument("--pace", type=float, default=None,
                   help="staggered: spread each fragment's transfer over this share of its slot (0-1]")
    p.add_argument("--workers", default="sites",
                   help="sites (hetcomm's sites as workers, data parallel inside), ranks, or one label per rank (a,b,...)")
    add_model_arguments(p, block=16, d_model=256, layers=3)
    p.add_argument("--samples", type=int, default=6144, help="stop once this many samples were processed")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: by --samples)")
    p.add_argument("--seconds", type=float, default=0,
                   help="also stop at the first round boundary after this many seconds (0: no time budget)")
    p.add_argument("--batches", default="", help="batches per rank (a,b,...): ranks whose data runs out wait "
                                                 "for the others (default: endless data)")
    p.add_argument("--batch", default="8", help="samples per step: one value, or one per rank (a,b,...)")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--early-weight", type=float, default=None,
                   help="with --overlap: share of the steps before the late update landed that a replica keeps "
                        "(default 0.25)")
    # Outer SGD, Nesterov. At steady state a step moves lr / (1 - momentum) times the averaged
    # pseudo-gradient: 1x here, as plain averaging (lr 1, momentum 0); DiLoCo's recipe (lr 0.7,
    # momentum 0.9: 7x) is tuned for hundreds of inner steps a round and ends at about twice the
    # loss of either at 8 (README, "Outer step").
    p.add_argument("--outer-lr", type=float, default=0.5)
    p.add_argument("--outer-momentum", type=float, default=0.5, help="outer Nesterov momentum (0: plain SGD)")
    p.add_argument("--json", metavar="PATH", help="write the summary here (rank 0)")
    p.add_argument("--nic-trace", metavar="PATH", help="on the simulated cluster: write this rank's bytes sent over "
                                                      "time (JSON, [[seconds, bytes], ...]) to PATH.<rank>")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.overlap_steps is not None and not args.overlap:
        raise SystemExit("train_diloco: --overlap-steps needs --overlap")
    if args.early_weight is not None and not args.overlap:
        raise SystemExit("train_diloco: --early-weight needs --overlap")
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    batches = [int(b) for b in args.batch.split(",")]
    if len(batches) == 1:
        batches *= world
    if len(batches) != world:
        raise SystemExit(f"train_diloco: --batch has {len(batches)} values for {world} ranks")
    batch = batches[rank]
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else []
    if args.batches and len(args.batches) != world:
        raise SystemExit(f"train_diloco: --batches has {len(args.batches)} values for {world} ranks")

    train, held_out, model = build(args.corpus_chars, args.seed, args.block, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    diloco = hetcomm.DiLoCo(
        model, opt, local_steps=args.local_steps, steps=args.steps, weighting=args.weighting,
        compress=args.compress, error_feedback=args.error_feedback, overlap=args.overlap,
        overlap_steps=args.overlap_steps, fragments=args.fragments, stagger=not args.no_stagger, pace=args.pace,
        early_weight=args.early_weight,
        workers=args.workers.split(",") if "," in args.workers else args.workers,
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=args.outer_lr, momentum=args.outer_momentum,
                                                   nesterov=args.outer_momentum > 0))
    params = sum(p.numel() for p in model.parameters())
    say(f"train_diloco: {world} ranks on {args.backend}, {params} parameters ({4 * params / 1e6:.1f} MB fp32), "
        f"local steps {args.local_steps} (H={args.steps}), weighting {args.weighting}, {args.compress}"
        f"{', overlap' if args.overlap else ''}, batches {batches}, workers {diloco.workers}")

    rng = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)    # this rank's own windows

    def windows():
        """This rank's random windows of the corpus, batch by batch; endless unless --batches."""
        taken = 0
        while not args.batches or taken < args.batches[rank]:
            idx = torch.randint(len(train), (batch,), generator=rng).tolist()
            yield torch.stack([train[i][0] for i in idx]), torch.stack([train[i][1] for i in idx])
            taken += 1

    # On the simulated cluster: this host's bytes sent over time (its uplink), for the peak rate.
    nic = NicSampler().start() if os.environ.get("HETCOMM_SIM_SPEC") else None
    started = time.perf_counter()
    printed = 0
    boundaries: list[float] = []                    # when this rank's rounds ended (monotonic)

    def print_rounds() -> None:
        nonlocal printed
        history = diloco.history                   # settled rounds: the same on every rank
        for h in history[printed:]:
            losses = [round(v, 3) if v is not None else None for v in h["loss"]]
            sent = h["bytes_sent_total"]
            say(f"round {h['round']:3d} | steps {h['steps']} | compute s {[round(c, 2) for c in h['compute_seconds']]} "
                f"| idle s (total) {[round(i, 2) for i in h['idle_seconds_total']]} | MB sent (total) "
                f"{[None if b is None else round(b / 1e6, 2) for b in sent]} | loss {losses}")
        printed = len(history)

    # The loop ends on every rank at the same round: when the budget is reached, or when every
    # rank's data has run out (a rank out of data waits in the rounds without steps).
    for x, y in diloco.loop(windows(), max_samples=None if args.rounds else args.samples,
                            max_rounds=args.rounds or None, max_seconds=args.seconds or None):
        loss = mean_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if diloco.step(samples=len(x), loss=loss.item()):
            boundaries.append(time.monotonic())
            print_rounds()
    print_rounds()
    say(f"stopped: {diloco.stop_reason}")
    wall = time.perf_counter() - started
    tx = nic.stop() if nic is not None else None
    if tx is not None and args.nic_trace:
        with open(f"{args.nic_trace}.{rank}", "w") as f:
            json.dump({"samples": tx, "boundaries": boundaries}, f)
    peaks = [None] * world
    # ... over the whole run, and in the steady state: from the end of round 4 (the first round
    # planned after `time`'s measurement rounds, whose boundary still fires what they did not
    # reach) to the start of the last round (synchronous, whole)
    steady = (boundaries[3], boundaries[-2]) if len(boundaries) >= 6 else None
    dist.all_gather_object(peaks, None if tx is None else
                           (peak_rate(tx), tx[-1][1], peak_rate(tx, start=steady[0], end=steady[1]) if steady else None))
    stats = diloco.stats()
    timelines = [None] * world
    dist.all_gather_object(timelines, diloco.timeline())
    final_loss = evaluate(model, held_out, min(len(held_out), 256))
    samples = sum(stats["samples"])
    # a worker's compute seconds are each of its ranks' (they step together)
    compute = sum(c * len(m) for c, m in zip(stats["compute_seconds"], stats["workers"]))
    summary = {
        "local_steps": args.local_steps, "steps": args.steps, "weighting": args.weighting,
        "compress": args.compress, "error_feedback": args.error_feedback, "overlap": args.overlap, "overlap_steps": args.overlap_steps,
        "fragments": args.fragments, "stagger": not args.no_stagger, "pace": args.pace,
        # per rank (simulated cluster): the peak rate its host sent at over any 1 s, and its bytes
        "peak_tx_mbit": [None if p is None or p[0] is None else p[0] * 8 / 1e6 for p in peaks],
        "steady_peak_tx_mbit": [None if p is None or p[2] is None else p[2] * 8 / 1e6 for p in peaks],
        "tx_bytes": [None if p is None else p[1] for p in peaks],
        "early_weight": (0.25 if args.early_weight is None else args.early_weight) if args.overlap else None,
        "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
        "backend": args.backend, "world_size": world, "parameters": params, "batches": batches,
        "rounds": stats["rounds"], "samples": samples, "wall_seconds": wall,
        "samples_per_second": samples / wall,
        "compute_seconds": stats["compute_seconds"], "idle_seconds": stats["idle_seconds"],
        "sync_seconds": stats["sync_seconds"], "bytes_sent": stats["bytes_sent"],
        "steps_per_rank": stats["steps"], "samples_per_rank": stats["samples"],
        "workers": stats["workers"], "wan_bytes": stats["wan_bytes"], "wan_bytes_per_round": stats["wan_bytes_per_round"],
        "sync_bytes_per_element": {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}[args.compress],
        "compute_utilisation": compute / (world * wall),
        "final_loss": final_loss,
        "history": diloco.history,
        "timelines": timelines,
        "argv": sys.argv,
        # The simulated cluster this ran on, when it ran under `python -m hetcomm.sim`.
        "sim_spec": json.loads(os.environ["HETCOMM_SIM_SPEC"]) if os.environ.get("HETCOMM_SIM_SPEC") else None,
    }
    say(f"done: {stats['rounds']} rounds, {samples} samples in {wall:.1f} s ({samples / wall:.1f} samples/s), "
        f"idle {sum(stats['idle_seconds']):.1f} s in all, compute utilisation {summary['compute_utilisation']:.1%}, "
        f"held-out loss {final_loss:.3f}")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
