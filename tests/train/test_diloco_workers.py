"""hetcomm.DiLoCo with workers of several ranks (``workers=``): a worker of two ranks equals two
ranks with its whole batch, its replicas move together when an update lands mid-round, it stops
stepping when one of its ranks runs out, and ranks that diverge or fail raise on every rank;
also `break` out of `loop`, and a non-finite pseudo-gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import BACKEND, run_ranks
from test_diloco import INNER_LR, make_model

pytestmark = pytest.mark.usefixtures("backend_importable")


# ---- workers of several ranks -----------------------------------------------------------------

WORKER_ROUNDS, WORKER_STEPS = 3, 2


def worker_batch(worker: int, part: int, round_k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Half ``part`` of worker ``worker``'s batch (4 samples a half)."""
    g = torch.Generator().manual_seed(10_000 * worker + 1000 * part + 10 * round_k + step)
    return torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)


def train_workers(rank: int, world: int, overlap: bool) -> dict:
    """4 ranks as workers [0,0,1,1], each rank one half of its worker's batch; or (world 2) each
    rank a worker of its own with the whole batch: the same algorithm, the same numbers."""
    import hetcomm

    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=INNER_LR)
    labels = [0, 0, 1, 1] if world == 4 else "ranks"
    # With overlap the late update lands after the first step of a round, in both runs alike (on
    # arrival, it would land wherever the timing puts it).
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=WORKER_STEPS, workers=labels, overlap=overlap,
                            overlap_steps=1 if overlap else None, compress="fp32")
    worker, halves = (rank // 2, [rank % 2]) if world == 4 else (rank, [0, 1])
    for k in range(WORKER_ROUNDS):
        for i in range(WORKER_STEPS):
            parts = [worker_batch(worker, h, k, i) for h in halves]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            diloco.step(samples=len(x))
    diloco.finish()
    return {"global": [t.clone() for t in diloco.global_parameters()], "stats": diloco.stats(),
            "history": diloco.history, "params": sum(p.numel() for p in net.parameters())}


@pytest.mark.parametrize("overlap", [False, True])
def test_workers_of_two_ranks_equal_two_ranks_with_their_whole_batches(overlap):
    env = {"HETCOMM_LOCAL": "tcp"}          # every link on TCP, so that the byte counters see it
    four = run_ranks(4, train_workers, overlap, env=env, timeout=240)
    two = run_ranks(2, train_workers, overlap, env=env, timeout=240)
    for res in four:
        for a, b in zip(four[0]["global"], res["global"]):
            assert torch.equal(a, b), "global parameters differ across the ranks of the workers"
        assert res["history"] == four[0]["history"]
    for a, b in zip(four[0]["global"], two[0]["global"]):
        # mean of two halves' gradients = gradient of the whole batch, to rounding
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    stats = four[0]["stats"]
    assert stats["workers"] == [[0, 1], [2, 3]] and stats["samples"] == [8 * WORKER_STEPS * WORKER_ROUNDS] * 2
    if BACKEND == "hetcomm":
        # Each worker sends one model's worth (fp32) across per round, split over its two ranks,
        # plus the exchange of measurements (a column of 19 float64 per rank, a few collectives)
        # and the messages' headers: about 2 kB a round, which dwarfs this 37-parameter model.
        model_bytes = 4 * four[0]["params"]
        per_worker = [b / stats["rounds"] for b in stats["wan_bytes"]]
        for b in per_worker:
            assert model_bytes <= b <= model_bytes + 2500, (per_worker, model_bytes)


ARRIVAL_STEPS, ARRIVAL_ROUNDS = 12, 4


def train_arrival(rank: int, world: int, fragments: int = 1) -> dict:
    """overlap_steps=None: the replicas move when the update arrives, which a slow link (the
    background synchronisation lands half a round of steps after it left: clock.SlowLink) puts in the middle
    of the next round."""
    import hetcomm
    from clock import DeclaredClock, SlowLink
    from hetcomm.train.diloco import DiLoCo as _DiLoCo

    clock = DeclaredClock()
    gate = SlowLink(clock, ARRIVAL_STEPS // 2 * 0.05)    # half a round of steps
    torch.manual_seed(0)
    net = nn.Linear(6, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=ARRIVAL_STEPS, workers=[0, 0, 1, 1],
                            overlap=True, fragments=fragments, stagger=False, clock=clock)
    gate.wrap(_DiLoCo, "_exchange_and_reduce", diloco)   # off the main thread: the background one
    g = torch.Generator().manual_seed(rank)
    for _ in range(ARRIVAL_STEPS * ARRIVAL_ROUNDS):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        clock.compute(0.05)
        gate.stepped(diloco.step(samples=4))
    gate.open_all()
    diloco.finish()
    return {"history": diloco.history, "global": [t.clone() for t in diloco.global_parameters()],
            "idle": gate.idle}


@pytest.mark.parametrize("fragments", [1, 2])
def test_on_arrival_the_replicas_of_a_worker_move_together_mid_round(fragments):
    """(With fragments the worker's ranks agree on how many have landed before each move.)"""
    per_rank = run_ranks(4, train_arrival, fragments, timeout=240)
    for res in per_rank:
        assert res["history"] == per_rank[0]["history"]
        for a, b in zip(per_rank[0]["global"], res["global"]):
            assert torch.equal(a, b)
    assert [r["idle"] for r in per_rank] == [0] * 4, per_rank
    landed = [h["landed_after_steps"] for h in per_rank[0]["history"]]
    assert landed[0] == [0, 0]                          # nothing in flight in the first round
    # (a worker whose ranks moved at different steps would have raised at the synchronisation);
    # held for half a round of steps, every update lands there and moves the replicas at the
    # next step, mid-round
    assert all(x == ARRIVAL_STEPS // 2 + 1 for row in landed[1:] for x in row), landed


WORKER_BATCHES = [10, 14, 20, 20]   # worker 0's ranks disagree on how much data there is


def train_workers_uneven(rank: int, world: int, policy: str, overlap: bool) -> dict:
    import hetcomm
    from clock import DeclaredClock

    torch.manual_seed(0)
    net = nn.Linear(6, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps=policy, steps=3, workers=[0, 0, 1, 1], overlap=overlap, clock=clock)
    g = torch.Generator().manual_seed(rank)
    loader = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(WORKER_BATCHES[rank])]
    for x, y in diloco.loop(loader):
        clock.compute(0.04 if rank < 2 else 0.01)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        diloco.step(samples=len(x))
    return {"rounds": diloco.rounds, "stats": diloco.stats(), "global": [t.clone() for t in diloco.global_parameters()]}


@pytest.mark.parametrize("policy,overlap", [("time", False), ("speed", True)])
def test_a_worker_stops_stepping_when_one_of_its_ranks_runs_out(policy, overlap):
    per_rank = run_ranks(4, train_workers_uneven, policy, overlap, timeout=240)
    for res in per_rank:
        assert res["rounds"] == per_rank[0]["rounds"]
        for a, b in zip(per_rank[0]["global"], res["global"]):
            assert torch.equal(a, b)
    # worker 0 stepped as long as both its ranks had data: 10 steps of 2 x 4 samples
    assert per_rank[0]["stats"]["samples"] == [10 * 8, 20 * 8], per_rank[0]["stats"]


def break_early(rank: int, world: int) -> dict:
    import hetcomm

    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=2)
    for i, x in enumerate(diloco.loop(torch.randn(12, 2, 3))):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(samples=2)
        if rank == 1 and i == 4:
            break                                   # this rank is done early: the others go on
    second = ""
    try:
        next(iter(diloco.loop([1])))
    except RuntimeError as e:
        second = str(e)
    return {"rounds": diloco.rounds, "global": [t.clone() for t in diloco.global_parameters()],
            "model": [p.detach().clone() for p in net.parameters()], "samples": diloco.stats()["samples"],
            "second": second}


def test_break_counts_as_the_end_of_this_ranks_data_and_a_second_loop_is_refused():
    per_rank = run_ranks(2, break_early)
    assert per_rank[0]["rounds"] == per_rank[1]["rounds"] == 6, per_rank
    assert per_rank[0]["samples"] == [24, 10], per_rank[0]["samples"]
    for res in per_rank:
        for a, b, m in zip(per_rank[0]["global"], res["global"], res["model"]):
            assert torch.equal(a, b) and torch.equal(b, m)
        assert "one loop" in res["second"], res["second"]


def unsynchronised_worker(rank: int, world: int) -> str:
    import hetcomm

    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=1, workers=[0, 0], inner_sync=False)
    net(torch.full((2, 3), float(rank + 1))).sum().backward()      # a different batch on each rank
    opt.step()
    try:
        diloco.step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_worker_whose_ranks_hold_different_replicas_raises_on_every_rank():
    for message in run_ranks(2, unsynchronised_worker):
        assert "worker(s) [0] hold different replicas" in message, message


def nonfinite(rank: int, world: int) -> str:
    import hetcomm

    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=1)
    if rank == 1:
        with torch.no_grad():
            net.weight[0, 0] = float("nan")
    try:
        diloco.step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_nan_pseudo_gradient_raises_on_every_rank():
    for message in run_ranks(2, nonfinite):
        assert "rank(s) [1]" in message and "not finite" in message, message
