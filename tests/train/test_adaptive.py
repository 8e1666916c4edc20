"""hetcomm.AdaptiveDataParallel: the wiring of sampler, partitioner, weighted hook and DDP.

* Exactness: ranks of unequal speed (one sleeps in every step) train a float64 model with a
  partition that changes under them; the parameters must equal a single-process SGD run over the
  same global batches (the sampler's global batch k is the same indices whatever the split), on
  the backend under test and on gloo.
* The partition moves away from the slow rank (a 50 ms sleep against ~1 ms of compute: a margin
  no scheduler noise closes), and the statistics account for every sample.
* On the simulated cluster (root): the example trained with one rank at a quarter of a core ends
  with the partition shifted away from that rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks
from marks import needs_netns

pytestmark = pytest.mark.usefixtures("backend_importable")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLOBAL_BATCH = 24
DATASET = 120          # 5 global steps per epoch
EPOCHS = 3
LR = 0.1
SLOW_RANK_SLEEP_S = 0.05


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(DATASET, 6, generator=g, dtype=torch.float64)
    y = torch.randn(DATASET, 2, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def reference_parameters() -> list[torch.Tensor]:
    """Single-process SGD over the sampler's global batches: epoch e is randperm(seed + e)."""
    data, net = dataset(), model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(epoch)).tolist()
        for start in range(0, DATASET, GLOBAL_BATCH):
            x, y = data[order[start:start + GLOBAL_BATCH]]
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in net.parameters()]


def train_unequal(rank: int, world_size: int) -> dict:
    import hetcomm

    results = {}
    for name, group in (("default", None), ("gloo", dist.new_group(backend="gloo"))):
        adp = hetcomm.AdaptiveDataParallel(model(), dataset(), GLOBAL_BATCH, group=group, interval=2,
                                           threshold=0.05)
        opt = torch.optim.SGD(adp.module.parameters(), lr=LR)
        sizes_seen = []
        for epoch in range(EPOCHS):
            for x, y in adp.batches(epoch):
                sizes_seen.append(adp.sizes)
                nn.functional.mse_loss(adp.module(x), y).backward()
                opt.step()
                opt.zero_grad()
                if rank == world_size - 1:
                    time.sleep(SLOW_RANK_SLEEP_S)       # the slow rank: counted as compute
        results[name] = {"params": [p.detach().clone() for p in adp.module.parameters()],
                         "stats": adp.stats(), "sizes_seen": sizes_seen}
    return results


def test_exact_full_batch_updates_while_the_partition_moves_away_from_the_slow_rank():
    world_size = 2
    reference = reference_parameters()
    per_rank = run_ranks(world_size, train_unequal)
    for name in ("default", "gloo"):
        for rank, result in enumerate(per_rank):
            for got, want in zip(result[name]["params"], reference):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{name} group, rank {rank}: {m}")
        stats = per_rank[0][name]["stats"]
        assert per_rank[1][name]["stats"] == stats, "the ranks' statistics are agreed, hence identical"
        assert per_rank[0][name]["sizes_seen"] == per_rank[1][name]["sizes_seen"], "ranks disagreed on a partition"
        assert sum(stats["samples"]) == EPOCHS * DATASET
        assert stats["repartitions"] >= 1, stats
        slow = world_size - 1
        assert stats["sizes"][slow] < stats["sizes"][0], stats
        # The slow rank's compute includes its sleeps; the fast one waited for it.
        assert stats["compute_seconds"][slow] > stats["compute_seconds"][0], stats
        assert stats["idle_seconds"][0] > stats["idle_seconds"][slow], stats
        assert stats["throughput"] > 0 and stats["ideal_throughput"] > 0


def test_bad_arguments_fail_before_any_collective():
    import hetcomm

    with pytest.raises(ValueError, match="partition must be 'adaptive' or 'equal'"):
        hetcomm.AdaptiveDataParallel(model(), dataset(), 8, partition="fastest")
    with pytest.raises(ValueError, match="compression must be"):
        hetcomm.AdaptiveDataParallel(model(), dataset(), 8, compression="int4")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            hetcomm.AdaptiveDataParallel(model(), dataset(), 8)


@needs_netns
def test_example_on_the_simulator_shifts_the_partition_away_from_the_throttled_rank(tmp_path):
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "hetcomm.sim", "--nprocs", "2", "--cpu-quota", "1,0.25", "-q", "--",
           sys.executable, os.path.join(ROOT, "examples", "train_hetero.py"), "--partition", "adaptive",
           "--samples", "1600", "--global-batch", "32", "--block", "64", "--interval", "3", "--log-every", "10",
           "--corpus-chars", "200000", "--json", str(summary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(summary.read_text())
    assert got["samples_seen"] == 1600
    assert got["repartitions"] >= 1, got
    assert got["batch_sizes"][0] > got["batch_sizes"][1], got
    assert sum(got["batch_sizes"]) == 32


def last_step_leaves_ranks_empty(rank: int, world_size: int) -> dict:
    """7 samples, global batch 6 on 3 ranks: the epoch's last step has 1 sample, so two ranks get
    an empty batch (on purpose: the sampler gives no rank a sample twice). They must still run
    forward and backward, and the gradient must be the one sample's."""
    import hetcomm

    g = torch.Generator().manual_seed(11)
    data = torch.utils.data.TensorDataset(torch.randn(7, 6, generator=g, dtype=torch.float64),
                                          torch.randn(7, 2, generator=g, dtype=torch.float64))
    adp = hetcomm.AdaptiveDataParallel(model(), data, 6, partition="equal", shuffle=False)
    opt = torch.optim.SGD(adp.module.parameters(), lr=LR)
    batch_sizes = []
    for x, y in adp.batches(0):
        batch_sizes.append(len(x))
        assert x.shape[1:] == (6,) and y.shape[1:] == (2,), (x.shape, y.shape)
        loss = nn.functional.mse_loss(adp.module(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"batch_sizes": batch_sizes, "params": [p.detach().clone() for p in adp.module.parameters()]}


def test_an_epoch_whose_last_step_leaves_ranks_without_samples() -> None:
    results = run_ranks(3, last_step_leaves_ranks_empty, timeout=120)
    assert [r["batch_sizes"] for r in results] == [[2, 1], [2, 0], [2, 0]], results
    # Single-process reference: the same two global batches (samples 0-5, then 6).
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(7, 6, generator=g, dtype=torch.float64), torch.randn(7, 2, generator=g, dtype=torch.float64)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for batch in (slice(0, 6), slice(6, 7)):
        nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        for got, want in zip(r["params"], net.parameters()):
            assert torch.allclose(got, want.detach(), rtol=1e-10, atol=1e-12), (got - want).abs().max()
