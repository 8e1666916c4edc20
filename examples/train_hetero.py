"""Train a small character-level GPT with data parallelism on unequal ranks.

Run under torchrun, or on the simulated cluster with unequal CPU shares (root)::

    python -m hetcomm.sim --nprocs 4 --cpu-quota 0.8,0.4,0.2,0.2 -- \\
        python examples/train_hetero.py --partition adaptive --json adaptive.json
    torchrun --nproc-per-node 2 examples/train_hetero.py --partition equal

``--partition equal`` is plain DDP (every rank the same batch); ``adaptive`` sizes each rank's
batch by its measured speed, with the sample-weighted gradient hook, so the update is the same
full-batch update either way. Rank 0 prints the per-rank batch sizes, idle time at
synchronisation, samples/s and loss as it goes, and ``--json`` writes a summary.

The corpus is generated at run time from a small grammar (no downloads): deterministic for a
seed, varied enough that the loss keeps falling for a few thousand steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hetcomm

# --------------------------------------------------------------------------------------------
# The corpus: sentences from a small grammar
# --------------------------------------------------------------------------------------------

_SUBJECTS = ["the ring", "a packet", "every rank", "the planner", "a slow link", "the fast node",
             "the gradient", "our cluster", "the scheduler", "a bucket", "the old gpu", "the switch"]
_VERBS = ["sends", "waits for", "reduces", "splits", "carries", "measures", "balances", "drops",
          "forwards", "averages", "owns", "delays"]
_OBJECTS = ["the chunk", "a segment", "every byte", "the batch", "its share", "the next peer",
            "a timeout", "the loss", "eight samples", "the bandwidth", "a message", "the model"]
_TAILS = ["", " quickly", " again", " at night", " over the wan", " before the barrier",
          " in order", " without a hang", " twice", " on time"]


def make_corpus(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}"
        s = (s[0].upper() + s[1:] + rng.choice([". ", ". ", "! ", "? "]))
        if rng.random() < 0.1:
            s += "\n"
        out.append(s)
        n += len(s)
    return "".join(out)[:chars]


class CharDataset(torch.utils.data.Dataset):
    """Windows of ``block + 1`` characters at a stride of ``block``: (input, next-char target)."""

    def __init__(self, text: str, vocab: str, block: int) -> None:
        index = {c: i for i, c in enumerate(vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int):
        chunk = self.data[i * self.block:i * self.block + self.block + 1]
        return chunk[:-1], chunk[1:]


# --------------------------------------------------------------------------------------------
# The model: a small GPT
# --------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, block, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, :idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over this rank's samples; 0 (with a graph) for an empty batch."""
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return total / max(1, targets.numel())


@torch.no_grad()
def evaluate(model: nn.Module, data: CharDataset, samples: int) -> float:
    model.eval()
    x = torch.stack([data[i][0] for i in range(samples)])
    y = torch.stack([data[i][1] for i in range(samples)])
    loss = mean_loss(model(x), y).item()
    model.train()
    return loss


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partition", choices=["equal", "adaptive"], default="adaptive")
    p.add_argument("--backend", default="hetcomm", help="process group backend (default hetcomm)")
    p.add_argument("--samples", type=int, default=12800, help="train on this many samples in all")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--block", type=int, default=256, help="characters per sample")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-chars", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
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

    text = make_corpus(args.corpus_chars, args.seed)
    vocab = "".join(sorted(set(text)))
    split = int(len(text) * 0.95)
    train = CharDataset(text[:split], vocab, args.block)
    held_out = CharDataset(text[split:], vocab, args.block)

    torch.manual_seed(args.seed)            # the same initial model on every rank
    model = TinyGPT(len(vocab), args.block, args.d_model, args.layers, args.heads)
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
