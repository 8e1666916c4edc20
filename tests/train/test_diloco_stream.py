"""Staggered fragments (`hetcomm.train.diloco.stream`).

* Exactness: 3 ranks with unequal, scripted step counts per round and unequal batches train a
  float64 model with ``fragments=F`` staggered and ``overlap_steps`` = τ (a schedule that does
  not depend on timing). A single-process float64 reference runs the same schedule written out
  from its definition: fragment f fires after step max(1, ⌊f·H/F⌋) of each rank's round (H: its
  steps), its window's pseudo-gradients are weighted by the window's samples and steps, the
  replica's fragment jumps to one outer step of a copy, and moves onto the landed update τ steps
  later (or drops the move at its next trigger). The ranks are run in lockstep by events, each
  update applied once every rank has fired it. After `finish` every rank's global parameters
  equal the reference's and are bit-identical across ranks.
* Triggers: `stagger_triggers` by hand; the policies' planned steps.
* The run reaches the same loss as the fragments together (at equal samples) and the jobs queue
  one fragment at a time (on the simulator: benchmarks/diloco_sim.py).
"""
from __future__ import annotations

import concurrent.futures
import copy

import pytest
import torch
import torch.nn as nn

from harness import run_ranks
from test_diloco import INNER_LR, OUTER, SCRIPT, batch, make_model, reference, scripted_policy

pytestmark = pytest.mark.usefixtures("backend_importable")

ROUNDS = 4


def fragments_of(sizes: list[int], F: int) -> list[tuple[int, int]]:
    from hetcomm.train.diloco.schedule import fragment_bounds
    return [(i, j) for i, j, _, _ in fragment_bounds(sizes, F)]


def stagger_reference(world: int, F: int, tau: int, beta: float, outer_name: str = "nesterov") -> list[torch.Tensor]:
    """The final global parameters of the staggered schedule (see the module doc), float64."""
    frags = fragments_of([p.numel() for p in make_model().parameters()], F)
    glob = [nn.Parameter(p.detach().clone()) for p in make_model().parameters()]
    outer = OUTER[outer_name](glob)
    applied = {f: -1 for f in range(len(frags))}          # the last event applied, per fragment
    fired: dict[tuple[int, int], dict[int, tuple]] = {}

    def outer_step_on_a_copy(f: int, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        i, j = frags[f]
        params = [nn.Parameter(g.detach().clone()) for g in glob]
        scratch = OUTER[outer_name](params)
        scratch.load_state_dict(copy.deepcopy(outer.state_dict()))
        for p, d in zip(params[i:j], delta):
            p.grad = d.clone()
        scratch.step()
        return [p.detach().clone() for p in params[i:j]]

    def rank(r: int):
        net = make_model()
        inner = torch.optim.SGD(net.parameters(), lr=INNER_LR)
        params = list(net.parameters())
        start = [p.detach().clone() for p in params]
        seen, at = [0, 0], [[0, 0] for _ in frags]
        events = [0] * len(frags)                 # fires so far, per fragment
        flight: dict[int, list] = {}              # f -> [event, steps since its fire]

        def fire(f: int):
            i, j = frags[f]
            e = events[f]
            if f in flight:                       # its previous update: waited for, move dropped
                yield ("need", f, flight.pop(f)[0])
            if e > 0:
                yield ("need", f, e - 1)          # the estimate starts from θ_f after event e − 1
            delta = [s - p.detach() for s, p in zip(start[i:j], params[i:j])]
            window = (seen[0] - at[f][0], seen[1] - at[f][1])
            at[f] = list(seen)
            est = outer_step_on_a_copy(f, delta)
            with torch.no_grad():
                for x, v in zip(range(i, j), est):
                    start[x] = v.clone()
                    params[x].copy_(v)
            flight[f] = [e, 0]
            events[f] += 1
            yield ("fire", f, e, delta, window)   # (then event e may be applied)

        def move(f: int):
            i, j = frags[f]
            e = flight.pop(f)[0]
            yield ("need", f, e)
            with torch.no_grad():
                for x in range(i, j):
                    params[x].copy_(glob[x] + beta * (params[x] - start[x]))
                    start[x] = glob[x].detach().clone()

        for k in range(ROUNDS + 1):               # the last: the drain's boundary, no steps
            H = SCRIPT[k % 3][r] if k < ROUNDS else 0
            trig = {f: max(1, f * H // F) for f in range(1, len(frags))}
            done = set()
            for s in range(1, H + 1):
                x, y = batch(r, k, s - 1)
                nn.functional.mse_loss(net(x), y).backward()
                inner.step()
                inner.zero_grad()
                seen[0] += 1
                seen[1] += len(x)
                for job in flight.values():
                    job[1] += 1
                for f in sorted((f for f in flight if f > 0 and flight[f][1] >= tau), key=lambda f: flight[f][0]):
                    yield from move(f)
                if s < H:
                    for f in range(1, len(frags)):
                        if f not in done and s >= trig[f]:
                            done.add(f)
                            yield from fire(f)
                if s < H and 0 in flight and s >= tau:
                    yield from move(0)
            # the boundary: fragment 0's previous update waited for (move dropped), the rest fired
            if 0 in flight:
                yield ("need", 0, flight.pop(0)[0])
            for f in range(1, len(frags)):
                if f not in done:
                    yield from fire(f)
            yield from fire(0)
        for f in list(flight):                    # the drain's last, synchronous round
            yield ("need", f, flight.pop(f)[0])

    def apply(f: int, e: int) -> None:
        got = fired.pop((f, e))
        steps = [got[r][1][0] for r in range(world)]
        samples = [got[r][1][1] for r in range(world)]
        if sum(steps) == 0:
            applied[f] = e
            return
        # ∝ the window's mean batch; a rank without steps in it (its fragment fired at its
        # round's boundary, just before the last one) contributes nothing
        b = [n / t if t > 0 else 0.0 for n, t in zip(samples, steps)]
        w = [x / sum(b) for x in b]
        i, j = frags[f]
        for x in range(i, j):
            glob[x].grad = sum(w[r] * got[r][0][x - i] for r in range(world))
        outer.step()
        outer.zero_grad(set_to_none=True)
        applied[f] = e

    procs = [rank(r) for r in range(world)]
    waiting: list = [None] * world                # the "need" each rank is blocked on
    alive = set(range(world))
    while alive:
        progressed = False
        for r in sorted(alive):
            need = waiting[r]
            if need is not None and applied[need[1]] < need[2]:
                continue
            waiting[r] = None
            try:
                while True:
                    msg = next(procs[r])
                    progressed = True
                    if msg[0] == "fire":
                        _, f, e, delta, window = msg
                        fired.setdefault((f, e), {})[r] = (delta, window)
                        if len(fired[(f, e)]) == world and applied[f] == e - 1:
                            apply(f, e)
                    elif applied[msg[1]] < msg[2]:
                        waiting[r] = msg
                        break
            except StopIteration:
                alive.discard(r)
                progressed = True
        for (f, e) in sorted(fired):
            if len(fired[(f, e)]) == world and applied[f] == e - 1:
                apply(f, e)
                progressed = True
        assert progressed, f"the reference deadlocked: {waiting}"
    return [g.detach().clone() for g in glob]


def train_staggered(rank: int, world: int, F: int, tau: int, beta: float, outer_name: str, pace=None) -> dict:
    import hetcomm

    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=INNER_LR)
    diloco = hetcomm.DiLoCo(net, opt, local_steps=scripted_policy(), weighting="batch", overlap=True,
                            overlap_steps=tau, fragments=F, early_weight=beta, outer_optimizer=OUTER[outer_name],
                            pace=pace)
    for k in range(ROUNDS):
        steps = SCRIPT[k % 3][rank]
        for i in range(steps):
            x, y = batch(rank, k, i)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert diloco.step(samples=len(x)) == (i == steps - 1)
    diloco.finish()
    pacer = diloco._pacer
    return {"global": [g.clone() for g in diloco.global_parameters()], "history": diloco.history,
            "model": [p.detach().clone() for p in net.parameters()],
            "paced": None if pacer is None else (pacer.paced_jobs, pacer.refused_links)}


@pytest.mark.parametrize("F,tau,beta,outer_name", [(2, 1, 0.5, "nesterov"), (3, 2, 0.25, "nesterov"),
                                                   (4, 1, 1.0, "nesterov"), (2, 1, 0.5, "adam")])
def test_staggered_fragments_equal_the_float64_reference(F, tau, beta, outer_name):
    world = 3
    want = stagger_reference(world, F, tau, beta, outer_name)
    per_rank = run_ranks(world, train_staggered, F, tau, beta, outer_name)
    for r, res in enumerate(per_rank):
        for g, w in zip(res["global"], want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m: f"rank {r}: {m}")
        for g0, g in zip(per_rank[0]["global"], res["global"]):
            assert torch.equal(g0, g), f"rank {r}'s global parameters differ from rank 0's"
        for g, p in zip(res["global"], res["model"]):
            assert torch.equal(g, p), "after finish() the model holds the global parameters"
        assert res["history"] == per_rank[0]["history"]
    # and the schedule matters: the fragments together (all at the boundary) end elsewhere
    together = reference("batch", world, True, tau, outer_name, beta)[-1]
    assert not all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(together, want))
    # while the reference with one fragment is exactly test_diloco's reference of the overlap
    one = stagger_reference(world, 1, tau, beta, outer_name)
    assert all(torch.equal(a, b) for a, b in zip(together, one))


def test_stagger_triggers_and_planned_steps():
    from hetcomm.train.diloco.stream import stagger_triggers
    from hetcomm.train.local_steps import FixedSteps, SpeedSteps, StepTimes, TimeSteps

    assert stagger_triggers(8, 4) == [2, 4, 6]
    assert stagger_triggers(10, 4) == [2, 5, 7]
    assert stagger_triggers(2, 4) == [1, 1, 1]          # never before the round's first step
    assert stagger_triggers(None, 3) == [float("inf")] * 2
    times = StepTimes(2)
    fixed = FixedSteps(12)
    fixed.bind(1, 2)
    assert fixed.planned_steps(times) == 12
    speed = SpeedSteps(10)
    speed.bind(1, 2)
    times.update([1.0, 0.5], [2, 2])
    times.update([1.0, 0.5], [2, 2])
    speed.agreed(times)
    assert speed.planned_steps(times) == 20              # twice as fast: twice the steps
    time_policy = TimeSteps(10, round_seconds=3.0)
    time_policy.bind(1, 2)
    assert time_policy.planned_steps(times) == 12        # 3 s at 0.25 s a step


def train_workers_staggered(rank: int, world: int, pace=None) -> dict:
    """Workers of two ranks, ``time`` on a declared clock (worker 1 four times faster, so its
    triggers fall at other steps), int8, three staggered fragments moved as soon as they land
    (the worker's ranks agree on it)."""
    import hetcomm
    from clock import DeclaredClock

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps="time", steps=6, workers=[0, 0, 1, 1], overlap=True, fragments=3,
                            compress="int8", clock=clock, pace=pace)
    g = torch.Generator().manual_seed(rank // 2)        # a worker's ranks step on the same batches
    data = iter(lambda: (torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)), None)
    for x, y in diloco.loop(data, max_rounds=8):
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        clock.compute(0.04 if rank < 2 else 0.01)
        diloco.step(samples=len(x))
    return {"history": diloco.history, "global": [t.clone() for t in diloco.global_parameters()],
            "model": [p.detach().clone() for p in net.parameters()], "moves": diloco._stream_moves,
            "paced": None if diloco._pacer is None else diloco._pacer.paced_jobs, "sharded": diloco._layout is not None}


def test_staggered_fragments_compose_with_workers_time_and_int8():
    per_rank = run_ranks(4, train_workers_staggered, timeout=240)
    for res in per_rank:
        assert res["history"] == per_rank[0]["history"]
        for a, b, p in zip(per_rank[0]["global"], res["global"], res["model"]):
            assert torch.equal(a, b) and torch.equal(a, p)
    hist = per_rank[0]["history"]
    assert len(hist) == 8
    # ``time`` gives the faster worker more steps. Not asserted round by round: without a SlowLink
    # (which models one synchronisation a round, not staggered fragments) the landings come in real
    # time, and a round that waits for one lets a worker race steps in no declared time (a
    # fresh-clone run had [30, 24] in the first planned round, then [6, 24] in each).
    late = [h["steps"] for h in hist[3:]]
    assert sum(s[1] for s in late) > sum(s[0] for s in late), late
    assert sum(s[1] > s[0] for s in late) * 2 > len(late), late
    # the staggered fragments (not only fragment 0) moved onto their updates
    assert all(r["moves"] > 0 for r in per_rank), [r["moves"] for r in per_rank]


def train_failing_stream(rank: int, world: int) -> dict:
    """Workers [0, 1] and [2, 3], fixed 4 steps, 2 staggered fragments (fragment 1 fires after
    step 2). Only rank 0's job of fragment 1 fails, after its communication: rank 1 must raise at
    the same step as rank 0, and the other worker must not raise."""
    import hetcomm

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=4, overlap=True, fragments=2,
                            workers=["a", "a", "b", "b"])
    if rank == 0:
        original = diloco._workers.reduce_range

        def failing(*args, **kwargs):
            original(*args, **kwargs)
            raise RuntimeError("injected failure in fragment 1")

        diloco._workers.reduce_range = failing
    for step in range(1, 4):
        torch.manual_seed(rank // 2)
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        try:
            diloco.step()
        except RuntimeError as e:
            diloco.close()
            return {"error": str(e), "step": step}
        if step == 2:                            # fragment 1 fired: let its job end everywhere
            job = diloco._flight.get(1)
            if job is not None:
                concurrent.futures.wait([job["future"]], timeout=60)
    diloco.close()
    return {"error": None, "step": None}


def test_a_fragment_that_fails_on_one_rank_of_a_worker_raises_on_all_its_ranks_at_once():
    res = run_ranks(4, train_failing_stream, timeout=180)
    assert "injected failure in fragment 1" in (res[0]["error"] or ""), res[0]
    assert "another rank of this worker failed" in (res[1]["error"] or ""), res[1]
    assert res[0]["step"] == res[1]["step"], res[:2]
    assert res[2]["error"] is None and res[3]["error"] is None, res[2:]
