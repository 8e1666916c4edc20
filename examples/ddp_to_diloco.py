"""A data-parallel training script turned into DiLoCo: the lines marked ``# DiLoCo`` are the change.

The script is the usual one (a model, an optimizer, a loader, forward / backward / step), here on
a small regression so that it runs anywhere in seconds. To train across sites instead, every
worker (a site, or a rank) takes local steps and the workers average every round:

    torchrun --nproc-per-node 4 examples/ddp_to_diloco.py                  # DiLoCo over hetcomm
    torchrun --nproc-per-node 4 examples/ddp_to_diloco.py --workers 0,0,1,1  # 2 workers of 2 ranks (DDP inside)
    torchrun --nproc-per-node 2 examples/ddp_to_diloco.py --plain          # the script as it was (DDP)

With ``--workers``, the ranks of a worker train one replica with DDP over ``diloco.worker_group``
(``inner_sync=False``), as a multi-GPU site would; by default hetcomm's sites are the workers.
The fault-tolerant variant (workers that die and come back, one process per worker, a store
outside them) is `hetcomm.ElasticDiLoCo`: ``examples/train_elastic.py``.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm


def batches(rank: int, batch: int, seed: int = 0):
    """This rank's endless stream of (x, y) for y = tanh(x W) + noise (its own shard)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    while True:
        x = torch.randn(batch, 16, generator=g)
        yield x, torch.tanh(x @ w) + 0.05 * torch.randn(batch, 4, generator=g)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", action="store_true", help="the data-parallel script without DiLoCo")
    p.add_argument("--workers", default="sites", help="sites, ranks, or one label per rank (a,b,...)")
    p.add_argument("--steps", type=int, default=20, help="H: inner steps per round")
    p.add_argument("--local-steps", default="time", choices=["time", "fixed"],
                   help="time: each worker's steps from its measured speed (default); fixed: H steps each")
    p.add_argument("--samples", type=int, default=20000, help="stop after this many samples (all ranks)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--backend", default="hetcomm")
    args = p.parse_args(argv)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(rank, args.batch)
    loss_fn = nn.MSELoss()

    if args.plain:                                       # the script as it was: DDP over every rank
        ddp, seen = DDP(model), 0
        for x, y in data:
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen += len(x) * world
            if seen >= args.samples:
                break
    else:
        labels = args.workers.split(",") if "," in args.workers else args.workers
        diloco = hetcomm.DiLoCo(model, opt, local_steps=args.local_steps, steps=args.steps,  # DiLoCo
                                compress="int8", overlap=True, fragments=2,                # DiLoCo
                                workers=labels, inner_sync=False)                          # DiLoCo
        net = model if diloco.worker_group is None else DDP(model, process_group=diloco.worker_group)  # DiLoCo
        for x, y in diloco.loop(data, max_samples=args.samples):                           # DiLoCo
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            diloco.step(samples=len(x), loss=loss.item())                                  # DiLoCo
        if rank == 0:
            h = diloco.history[-1]
            print(f"DiLoCo: {diloco.rounds} rounds, workers {diloco.workers}, last round steps {h['steps']}, "
                  f"stopped: {diloco.stop_reason}", flush=True)

    x, y = next(batches(world + 7, 1024, seed=0))        # held out: a stream no rank trained on
    with torch.no_grad():
        held_out = loss_fn(model(x), y).item()
    if rank == 0:
        print(f"held-out loss {held_out:.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
