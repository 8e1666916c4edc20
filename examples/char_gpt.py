"""The char-level GPT and its corpus, shared by the examples (``train_hetero.py``, ``train_diloco.py``).

The corpus is generated at run time from a small grammar (no downloads): deterministic for a
seed, varied enough that the loss keeps falling for a few thousand steps.
"""
from __future__ import annotations

import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["make_corpus", "CharDataset", "TinyGPT", "mean_loss", "evaluate", "build", "add_model_arguments"]

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


def build(corpus_chars: int, seed: int, block: int, d_model: int, layers: int, heads: int):
    """(train set, held-out set, model): the same model on every rank for a seed."""
    text = make_corpus(corpus_chars, seed)
    vocab = "".join(sorted(set(text)))
    split = int(len(text) * 0.95)
    train = CharDataset(text[:split], vocab, block)
    held_out = CharDataset(text[split:], vocab, block)
    torch.manual_seed(seed)
    return train, held_out, TinyGPT(len(vocab), block, d_model, layers, heads)


def add_model_arguments(p: argparse.ArgumentParser, *, block: int, d_model: int, layers: int) -> None:
    """The model, corpus and run options both examples share (defaults per example)."""
    p.add_argument("--backend", default="hetcomm", help="process group backend (default hetcomm)")
    p.add_argument("--block", type=int, default=block, help="characters per sample")
    p.add_argument("--d-model", type=int, default=d_model)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--corpus-chars", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
