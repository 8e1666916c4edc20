"""Train a small character-level GPT with data parallelism on unequal ranks.

Run under torchrun, or on the simulated cluster with unequal CPU shares (root)::

    python -m hetcomm.sim --nprocs 4 --cpu-quota 0.8,0.4,0.2,0.2 -- \\
        python examples/train_hetero.py --partition adaptive --json adaptive.json
    torchrun --nproc-per-node 2 examples/train_hetero.py --partition equal

``--partition equal`` is plain DDP (every rank the same batch); ``adaptive`` sizes each rank's
batch by its measured speed, with the sample-weighted gradient hook, so the update is the same
full-batch update either way. Rank 0 prints the per-rank batch sizes, idle time at
synchronisation, samples/s and loss as it goes, and ``--json`` writes a summary.

The model and corpus live in ``char_gpt.py`` (shared with ``train_diloco.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import hetcomm
from char_gpt import add_model_arguments, build, evaluate, mean_loss

# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partition", choices=["equal", "adaptive"], default="adaptive")
    add_model_arguments(p, block=256, d_model=64, layers=2)
    p.add_argument("--samples", type=int, default=12800, help="train on this many samples in all")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--interval", type=int, default=5, help="steps between partition agreements")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    p.add_argument("--json", metavar="PATH", help="write a summary here (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    # The same initial model on every rank (seeded).
    train, held_out, model = build(args.corpus_chars, args.seed, args.block, args.d_model, args.layers, args.heads)
    adp = hetcomm.AdaptiveDataParallel(model, train, args.global_batch, partition=args.partition,
                                       interval=args.interval, seed=args.seed,
                                       compression=None if args.compression == "none" else args.compression)
    opt = torch.optim.AdamW(adp.module.parameters(), lr=args.lr)
    steps = math.ceil(args.samples / args.global_batch)
    params = sum(p.numel() for p in model.parameters())
    say(f"train_hetero: {world} ranks on {args.backend}, partition {args.partition}, {params} parameters, "
        f"global batch {args.global_batch} x {args.block} chars, {steps} steps")

    step, epoch, last_log = 0, 0, time.perf_counter()
    loss_sum = torch.zeros(2, dtype=torch.float64)         # sample-weighted loss, samples
    while step < steps:
        for x, y in adp.batches(epoch, max_steps=steps - step):
            loss = mean_loss(adp.module(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
            step += 1
            if step % args.log_every == 0 or step == steps:
                stats = adp.partitioner.gather_stats()       # collective: same step everywhere
                dist.all_reduce(loss_sum)
                now = time.perf_counter()
                say(f"step {step:5d}/{steps} | loss {loss_sum[0] / loss_sum[1]:.3f} | "
                    f"sizes {stats['sizes']} | idle s {[round(t, 1) for t in stats['idle_seconds']]} | "
                    f"compute samples/s {[round(s) for s in stats['samples_per_second']]} | "
                    f"{args.log_every * args.global_batch / (now - last_log):.0f} samples/s")
                loss_sum.zero_()
                last_log = now
        epoch += 1

    stats = adp.stats()
    final_loss = evaluate(adp.module.module, held_out, min(len(held_out), 256))
    summary = {
        "partition": args.partition,
        "backend": args.backend,
        "world_size": world,
        "samples_seen": sum(stats["samples"]),
        "steps": steps,
        "global_batch": args.global_batch,
        "samples_per_second": stats["throughput"],
        "ideal_samples_per_second": stats["ideal_throughput"],
        "wall_seconds": stats["wall_seconds"],
        "idle_seconds": stats["idle_seconds"],
        "compute_seconds": stats["compute_seconds"],
        "compute_samples_per_second": stats["samples_per_second"],
        "batch_sizes": stats["sizes"],
        "repartitions": stats["repartitions"],
        "final_loss": final_loss,
        "argv": sys.argv,
        # The simulated cluster this ran on, when it ran under `python -m hetcomm.sim`.
        "sim_spec": json.loads(os.environ["HETCOMM_SIM_SPEC"]) if os.environ.get("HETCOMM_SIM_SPEC") else None,
    }
    say(f"done: {summary['samples_per_second']:.0f} samples/s (ideal {summary['ideal_samples_per_second']:.0f}), "
        f"idle {sum(summary['idle_seconds']):.1f} s in all, held-out loss {final_loss:.3f}, sizes {stats['sizes']}")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
