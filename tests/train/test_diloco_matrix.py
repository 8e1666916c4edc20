"""DiLoCo's features together, one job for the whole matrix: {fixed, time} × {fp32, int8} ×
{no overlap, overlap with staggered fragments} × {one rank per worker, workers of two ranks}, on
4 ranks with unequal declared step times (a clock that only the steps move).

For every configuration: every rank holds the same global parameters after every round (a hash
of them, gathered), the agreed history is the same everywhere, the replicas equal the global
parameters after `finish`, and the run trains (the loss of the global parameters on held-out data
falls below the untrained model's). The arithmetic of each feature is held to float64 references
elsewhere (test_diloco.py, test_diloco_stream.py); the membership axis (elastic) is
test_elastic.py's.
"""
from __future__ import annotations

import hashlib
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")

MATRIX = list(itertools.product(["fixed", "time"], ["fp32", "int8"], [False, True], ["ranks", "pairs"]))
STEP_S = [0.01, 0.02, 0.04, 0.04]          # declared seconds per step, per rank
ROUNDS = 5


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


W = torch.linspace(-1.0, 1.0, 6).reshape(6, 1)     # the target: y = x W


def held_out(net: nn.Module) -> float:
    g = torch.Generator().manual_seed(999)
    x = torch.randn(256, 6, generator=g)
    with torch.no_grad():
        return nn.functional.mse_loss(net(x), x @ W).item()


def run_matrix(rank: int, world: int) -> list[dict]:
    import hetcomm
    from clock import DeclaredClock

    out = []
    for policy, codec, overlap, workers in MATRIX:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        untrained = held_out(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        clock = DeclaredClock()
        labels = [0, 1, 2, 3] if workers == "ranks" else [0, 0, 1, 1]
        diloco = hetcomm.DiLoCo(net, opt, local_steps=policy, steps=6, compress=codec, overlap=overlap,
                                fragments=3 if overlap else 1, workers=labels, clock=clock,
                                outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.5, nesterov=True))
        g = torch.Generator().manual_seed(labels[rank])        # a worker's ranks step on the same batches
        prints = []

        def data():
            while True:
                x = torch.randn(8, 6, generator=g)
                yield x, x @ W

        for x, y in diloco.loop(data(), max_rounds=ROUNDS):
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            clock.compute(STEP_S[rank])
            if diloco.step(samples=len(x)):
                prints.append(digest(diloco.gather_global_parameters()))   # (sharded: from the worker's ranks)
        seen = [None] * world
        dist.all_gather_object(seen, prints)
        out.append({"config": (policy, codec, overlap, workers), "prints": seen, "history": diloco.history,
                    "final": digest(diloco.global_parameters()),
                    "model_is_global": all(torch.equal(p.detach(), g) for p, g in
                                           zip(net.parameters(), diloco.global_parameters())),
                    "untrained": untrained, "trained": held_out(net)})
    return out


def test_every_combination_keeps_the_ranks_equal_and_trains():
    per_rank = run_ranks(4, run_matrix, timeout=600)
    for i, config in enumerate(MATRIX):
        results = [r[i] for r in per_rank]
        assert all(r["config"] == config for r in results)
        for res in results:
            prints = res["prints"]
            # after every round this rank saw, the global parameters hash the same on every rank
            assert all(p == prints[0] for p in prints), (config, prints)
            assert res["history"] == results[0]["history"], config
            assert res["final"] == results[0]["final"], config
            assert res["model_is_global"], config
        assert len(results[0]["history"]) == ROUNDS, (config, len(results[0]["history"]))
        assert results[0]["trained"] < 0.85 * results[0]["untrained"], (config, results[0]["trained"],
                                                                          results[0]["untrained"])
