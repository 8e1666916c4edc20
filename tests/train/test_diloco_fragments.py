"""DiLoCo's fragments: their bounds (hand-computed cases and invariants over random sizes), the
options that cannot work with them (an error on every rank), and a fragment's reduction that
fails in the background (it raises at the next step, on every rank of the worker at once)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from harness import run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")


def test_fragment_bounds():
    from hetcomm.train.diloco.schedule import fragment_bounds as _fragment_bounds

    assert _fragment_bounds([10, 10, 10, 10], 2) == [(0, 2, 0, 20), (2, 4, 20, 40)]
    assert _fragment_bounds([10, 10, 10, 10], 1) == [(0, 4, 0, 40)]
    assert _fragment_bounds([1, 2, 3], 5) == [(0, 1, 0, 1), (1, 2, 1, 3), (2, 3, 3, 6)]   # one tensor each
    assert _fragment_bounds([0, 0, 10], 3) == [(0, 3, 0, 10)]                # no empty fragment
    assert _fragment_bounds([3, 0, 0, 3], 2) == [(0, 1, 0, 3), (1, 4, 3, 6)]
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        sizes = [int(x) for x in torch.randint(0, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)]
        f = int(torch.randint(1, 6, (1,), generator=g))
        bounds = _fragment_bounds(sizes, f)
        assert bounds[0][:3:2] == (0, 0) and bounds[-1][1] == len(sizes) and bounds[-1][3] == sum(sizes)
        assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(bounds, bounds[1:]))
        assert all(e - s == sum(sizes[i:j]) for i, j, s, e in bounds)
        assert len(bounds) <= f and (sum(sizes) == 0 or all(e > s for _, _, s, e in bounds))


def build_fragmented(rank: int, world: int, case: str) -> str:
    import hetcomm

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    try:
        if case == "no-overlap":
            hetcomm.DiLoCo(net, opt, fragments=2)
        elif case == "early-no-overlap":
            hetcomm.DiLoCo(net, opt, early_weight=0.5)
        elif case == "early-range":
            hetcomm.DiLoCo(net, opt, overlap=True, early_weight=1.5)
        elif case == "optimizer":
            hetcomm.DiLoCo(net, opt, overlap=True, fragments=2,
                           outer_optimizer=lambda ps: torch.optim.LBFGS(ps))
        else:                                  # "mismatch": the ranks differ
            diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=1, overlap=True, fragments=1 + rank)
            for _ in range(3):
                net(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                diloco.step()
            diloco.finish()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,message", [("no-overlap", "fragments must be"), ("optimizer", "LBFGS"),
                                          ("mismatch", "different numbers of fragments"),
                                          ("early-no-overlap", "early_weight must be"),
                                          ("early-range", "early_weight must be")])
def test_fragments_that_cannot_work_raise_on_every_rank(case, message):
    for got in run_ranks(2, build_fragmented, case, timeout=120):
        assert message in got, got


def train_failing_fragment(rank: int, world: int) -> dict:
    """The background reduction fails at its second fragment (on every rank): the training thread
    must raise at its next step, not only at the round's end."""
    import threading

    import hetcomm
    from hetcomm import compress as _compress_module

    original = _compress_module.weighted_allreduce
    calls = {"n": 0}

    def failing(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure in fragment 2")
        return original(*args, **kwargs)

    _compress_module.weighted_allreduce = failing
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=5, overlap=True, fragments=2, stagger=False)
    steps = 0

    def one_step() -> bool:
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        return diloco.step()

    while not one_step():                      # round 1; its synchronisation goes to the background
        steps += 1
    deadline = time.monotonic() + 60
    while not diloco._pending.done():          # it fails at its second fragment
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        one_step()                             # the first step of round 2
    except RuntimeError as e:
        diloco.close()
        return {"error": str(e)}
    return {"error": None}


def test_a_fragment_that_fails_raises_at_the_next_step():
    for res in run_ranks(2, train_failing_fragment, timeout=120):
        assert res["error"] and "injected failure" in res["error"], res


def train_failing_in_one_rank_of_a_worker(rank: int, world: int, shard_state, tau) -> dict:
    """Workers [0, 1] and [2, 3]. Only rank 0's background reduction fails, at its last fragment
    (after that fragment's communication, so that no other rank is left waiting in it): rank 1,
    whose own reduction succeeded, must raise at the same step as rank 0 (before either moves onto
    a partial update; with sharded state its job fails too, and steps nothing), and the other
    worker must not raise. The state sharded (each rank reduces
    its share: no collective inside the worker would fail with it) or whole; moved on arrival or
    after τ steps."""
    import hetcomm

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=3, overlap=True, fragments=2, stagger=False,
                            workers=["a", "a", "b", "b"], shard_state=shard_state, overlap_steps=tau)
    if rank == 0:
        name = "reduce" if shard_state is False else "reduce_range"
        original, calls = getattr(diloco._workers, name), {"n": 0}

        def failing(*args, **kwargs):
            out = original(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure after fragment 2")
            return out

        setattr(diloco._workers, name, failing)

    def one_step() -> bool:
        torch.manual_seed(rank // 2)                 # a worker's ranks step on the same batch
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        return diloco.step()

    while not one_step():                            # round 1; its synchronisation goes to the background
        pass
    deadline = time.monotonic() + 60
    while not diloco._pending.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    own_failed = diloco._pending.exception() is not None
    try:
        one_step()                                   # the first step of round 2
    except RuntimeError as e:
        diloco.close()
        return {"error": str(e), "own_failed": own_failed}
    diloco.close()                                   # the other worker stops here (no collective)
    return {"error": None, "own_failed": own_failed}


@pytest.mark.parametrize("shard_state,tau", [(None, None), (False, None), (None, 1)])
def test_a_sync_that_fails_on_one_rank_of_a_worker_raises_on_all_its_ranks_at_once(shard_state, tau):
    res = run_ranks(4, train_failing_in_one_rank_of_a_worker, shard_state, tau, timeout=180)
    # With sharded state rank 1's own job fails too: the worker's ranks agree, before stepping their
    # ranges, that every range was reduced (a worker's ranges step all together or not at all).
    assert [r["own_failed"] for r in res] == [True, shard_state is None, False, False], res
    assert "injected failure after fragment 2" in (res[0]["error"] or ""), res[0]
    assert "another rank of this worker failed" in (res[1]["error"] or ""), res[1]
    assert res[2]["error"] is None and res[3]["error"] is None, res[2:]
