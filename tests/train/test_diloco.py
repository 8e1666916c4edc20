"""hetcomm.DiLoCo and its local-step policies.

* Exactness: 3 ranks with unequal step counts per round (a scripted policy) and unequal batch
  sizes train a float64 model; after every round the global parameters equal a single-process
  float64 reference of the same algorithm (inner SGD per rank, weights recomputed here from their
  definitions, outer Nesterov SGD), for each weighting, on the backend under test and on gloo,
  and are bit-identical on every rank. With ``overlap=True`` the reference applies each outer
  update one round late, and with ``overlap_steps`` moves each replica onto it after that many
  steps of the next round.
* Policies: ``speed`` and ``time`` decide identically on every rank (the agreed history is equal
  everywhere) and give a rank that sleeps in every step fewer steps; ``time`` never starts a step
  after the deadline.
* Errors: a non-finite pseudo-gradient on one rank raises on every rank, naming it.
* On the simulated cluster (root): the example with one throttled rank gives it fewer steps.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import BACKEND, run_ranks
from marks import hetcomm_only, needs_netns

pytestmark = pytest.mark.usefixtures("backend_importable")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INNER_LR = 0.05
# Steps per round, per rank (round k uses row k % len): unequal, and once a rank with a single step.
SCRIPT = [[3, 1, 2], [2, 4, 1], [1, 1, 5]]
BATCH = [4, 2, 3]                 # per-rank batch sizes: unequal
ROUNDS = 4
# The outer optimizers the exactness tests run: DiLoCo's recipe, and one with per-parameter state
# that is not SGD (its start estimate is a scratch step, not the closed form).
OUTER = {"nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
         "adam": lambda ps: torch.optim.Adam(ps, lr=0.02, betas=(0.8, 0.9))}


def make_model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def batch(rank: int, round_k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 100 * round_k + step)
    n = BATCH[rank]
    return (torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64))


def scripted_policy():
    from hetcomm.train.local_steps import LocalStepPolicy

    class Scripted(LocalStepPolicy):
        """Round k: SCRIPT[k % 3][rank] steps (the same script on every rank)."""
        name = "scripted"

        def __init__(self) -> None:
            super().__init__(1)
            self.round = 0

        def start_round(self, now, start=None):
            self.round += 1

        def round_over(self, steps_done, now, step_estimate):
            return steps_done >= self.planned_steps(None)

        def planned_steps(self, times):          # (staggered fragments space their triggers by it)
            return SCRIPT[(self.round - 1) % len(SCRIPT)][self.rank]

    return Scripted()


def inner_steps(net: nn.Module, opt, rank: int, round_k: int, steps: int, first: int = 0) -> None:
    for i in range(first, first + steps):
        x, y = batch(rank, round_k, i)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()


def reference_weights(weighting: str, n: list[int], tau: list[int]) -> list[float]:
    if weighting == "uniform":
        return [1.0 / len(n)] * len(n)
    if weighting == "batch":                                    # ∝ mean batch n_r / τ_r
        b = [x / t for x, t in zip(n, tau)]
        return [x / sum(b) for x in b]
    p = [x / sum(n) for x in n]
    if weighting == "samples":
        return p
    tau_eff = sum(pi * t for pi, t in zip(p, tau))
    return [pi * tau_eff / t for pi, t in zip(p, tau)]            # normalized (FedNova)


def reference(weighting: str, world: int, overlap: bool, rebase=None,
              outer_name: str = "nesterov", early: float = 0.5) -> list[list[torch.Tensor]]:
    """Global parameters after each applied outer update, float64, one process.

    With overlap (see DiLoCo's doc): round k's update is applied at the end of round k+1, and
    replica r starts round k+1 at one outer step, on a copy of the outer optimizer, from the newest
    global parameters with its own pseudo-gradient. With ``rebase`` = s, a replica that takes more
    than s steps in round k+1 is moved after its s-th step to θ^k + early × (itself − its start), and measures its
    pseudo-gradient from θ^k. ``rebase`` may also list (s, first tensor, end tensor) per
    fragment: each fragment's parameters move after their own step."""
    nparams = len(list(make_model().parameters()))
    moves = [] if rebase is None else [(rebase, 0, nparams)] if isinstance(rebase, int) else list(rebase)
    theta = [p.detach().clone() for p in make_model().parameters()]
    glob = [nn.Parameter(t.clone()) for t in theta]
    outer = OUTER[outer_name](glob)
    replicas = [make_model() for _ in range(world)]
    inner = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in replicas]
    starts = [[t.clone() for t in theta] for _ in range(world)]   # where each replica starts a round
    history, pending = [], None

    def apply(deltas, w):
        for i, g in enumerate(glob):
            g.grad = sum(w[r] * deltas[r][i] for r in range(world))
        outer.step()
        outer.zero_grad()
        history.append([g.detach().clone() for g in glob])

    def one_outer_step_on_a_copy(guess):
        params = [nn.Parameter(g.detach().clone()) for g in glob]
        scratch = OUTER[outer_name](params)
        scratch.load_state_dict(copy.deepcopy(outer.state_dict()))
        for p, d in zip(params, guess):
            p.grad = d.clone()
        scratch.step()
        return [p.detach().clone() for p in params]

    for k in range(ROUNDS):
        tau = [SCRIPT[k % len(SCRIPT)][r] for r in range(world)]
        n = [tau[r] * BATCH[r] for r in range(world)]
        deltas = []
        if rebase is not None and pending is not None:
            apply(*pending)                        # its values do not depend on when it is applied
            pending = None
        landed = [g.detach().clone() for g in glob]
        for r in range(world):
            with torch.no_grad():
                for p, s in zip(replicas[r].parameters(), starts[r]):
                    p.copy_(s)
            done = 0
            for step, i, j in sorted(m for m in moves if k > 0 and m[0] < tau[r]):
                inner_steps(replicas[r], inner[r], r, k, step - done, first=done)
                done = step
                with torch.no_grad():
                    params = list(replicas[r].parameters())
                    for x in range(i, j):
                        params[x].copy_(landed[x] + early * (params[x] - starts[r][x]))
                        starts[r][x] = landed[x].clone()
            inner_steps(replicas[r], inner[r], r, k, tau[r] - done, first=done)
            deltas.append([s - p.detach() for s, p in zip(starts[r], replicas[r].parameters())])
        w = reference_weights(weighting, n, tau)
        if overlap:
            if pending is not None:
                apply(*pending)
            starts = [one_outer_step_on_a_copy(deltas[r]) for r in range(world)]
            pending = (deltas, w)
        else:
            apply(deltas, w)
            starts = [[g.detach().clone() for g in glob] for _ in range(world)]
    if pending is not None:
        apply(*pending)
    return history


def gate_fragments(diloco, moves: list[int], state: dict):
    """Holds fragment f of every background reduction until this rank's training loop has taken
    ``moves[f]`` steps of the round (or ends the round, or ``state['open']``): with
    `release`, the step at which each fragment lands, and so moves, is fixed."""
    import threading

    from hetcomm import compress as _compress_module

    original = _compress_module.weighted_allreduce
    gates = [threading.Event() for _ in moves]
    state.update(calls=0, gates=gates, moves=moves, open=False, original=original)

    def gated(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            f = state["calls"] % len(gates)
            state["calls"] += 1
            if not state["open"]:
                assert gates[f].wait(60), "gate never opened"
                gates[f].clear()
        return original(*args, **kwargs)

    _compress_module.weighted_allreduce = gated


def release(diloco, state: dict, step: int, last: bool) -> None:
    """After this rank's ``step``-th step of a round with an update in flight: opens the gates of
    the fragments due at this step (all of them at the round's last step) and waits until those
    have landed."""
    if diloco._pending is None or diloco._rebased:
        return
    due = [f for f, s in enumerate(state["moves"]) if s == step or (last and s > step)]
    for f in due:
        state["gates"][f].set()
    deadline = time.monotonic() + 60
    while not last and due and diloco._landed < max(due) + 1:
        assert time.monotonic() < deadline, "fragment never landed"
        time.sleep(0.001)


def train_scripted(rank: int, world: int, weighting: str, overlap: bool, rebase=None, fragments: int = 1,
                   moves: list[int] | None = None, outer_name: str = "nesterov", early: float = 0.5) -> dict:
    import hetcomm

    out = {}
    groups = [("default", None)] + ([("gloo", dist.new_group(backend="gloo"))] if BACKEND != "gloo" else [])
    for name, group in groups:
        net = make_model()
        if rank != 0:                               # DiLoCo must broadcast rank 0's parameters
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
        opt = torch.optim.SGD(net.parameters(), lr=INNER_LR)
        diloco = hetcomm.DiLoCo(net, opt, group=group, local_steps=scripted_policy(), weighting=weighting,
                                overlap=overlap, overlap_steps=rebase, fragments=fragments, stagger=False,
                                outer_optimizer=OUTER[outer_name], early_weight=early if overlap else None)
        gate = {}
        if moves is not None:
            gate_fragments(diloco, moves, gate)
        snapshots = []
        for k in range(ROUNDS):
            tau = SCRIPT[k % len(SCRIPT)][rank]
            for i in range(tau):
                x, y = batch(rank, k, i)
                nn.functional.mse_loss(net(x), y).backward()
                opt.step()
                opt.zero_grad()
                if moves is not None:
                    release(diloco, gate, i + 1, i == tau - 1)
                synced = diloco.step(samples=len(x))
                assert synced == (i == tau - 1), (k, i, synced)
            if not overlap:
                snapshots.append([g.clone() for g in diloco.global_parameters()])
        gate["open"] = True
        for g in gate.get("gates", []):
            g.set()
        diloco.finish()
        if moves is not None:
            from hetcomm import compress as _compress_module
            _compress_module.weighted_allreduce = gate["original"]
        snapshots.append([g.clone() for g in diloco.global_parameters()])
        out[name] = {"snapshots": snapshots, "history": diloco.history, "stats": diloco.stats(),
                     "model": [p.detach().clone() for p in net.parameters()]}
    return out


@pytest.mark.parametrize("weighting,overlap,rebase,fragments,outer_name,early", [
    ("batch", False, None, 1, "nesterov", 0.5), ("samples", False, None, 1, "nesterov", 0.5),
    ("uniform", False, None, 1, "nesterov", 0.5), ("normalized", False, None, 1, "nesterov", 0.5),
    ("batch", True, 99, 1, "nesterov", 0.5), ("batch", True, 1, 1, "nesterov", 0.5),
    ("batch", True, 2, 1, "nesterov", 0.5), ("batch", True, 2, 1, "nesterov", 1.0),
    ("batch", True, 2, 1, "nesterov", 0.0), ("batch", True, 2, 2, "nesterov", 0.5),
    ("batch", False, None, 1, "adam", 0.5), ("batch", True, 2, 2, "adam", 0.5)])
def test_outer_update_equals_the_float64_reference(weighting, overlap, rebase, fragments, outer_name, early):
    """(With fragments the outer step is taken fragment by fragment: for an optimizer whose state
    is per parameter, Adam too, the same update. ``early``: the share of the steps before the move
    that the replica keeps.)"""
    world = 3
    want = reference(weighting, world, overlap, rebase, outer_name, early)
    per_rank = run_ranks(world, train_scripted, weighting, overlap, rebase, fragments, None, outer_name, early)
    for name in per_rank[0]:
        results = [r[name] for r in per_rank]
        for rank, res in enumerate(results):
            got = res["snapshots"]
            expect = want if not overlap else want[-1:]
            assert len(got) == len(expect) + (0 if overlap else 1)
            for k, (g_round, w_round) in enumerate(zip(got, expect)):
                for g, w in zip(g_round, w_round):
                    # Pseudo-gradients travel in fp32: relative error ~1e-7 of the update.
                    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{name}, rank {rank}, round {k + 1}: {m}")
            for g, p in zip(res["snapshots"][-1], res["model"]):
                assert torch.equal(g, p), "after finish() the model holds the global parameters"
            for g0, g in zip(results[0]["snapshots"][-1], res["snapshots"][-1]):
                assert torch.equal(g0, g), f"{name}: rank {rank}'s global parameters differ from rank 0's"
            assert res["history"] == results[0]["history"], "the agreed history differs across ranks"
        hist = results[0]["history"]
        assert [h["steps"] for h in hist] == [[SCRIPT[k % 3][r] for r in range(world)] for k in range(ROUNDS)]
        # when the late update moved each replica (its steps: at the round's end; 0: no overlap)
        landed = [[0 if not overlap or k == 0 else min(rebase, SCRIPT[k % 3][r])
                   for r in range(world)] for k in range(ROUNDS)]
        assert [h["landed_after_steps"] for h in hist] == landed
        assert [h["samples"] for h in hist] == [[SCRIPT[k % 3][r] * BATCH[r] for r in range(world)]
                                                for k in range(ROUNDS)]
        stats = results[0]["stats"]
        assert stats["rounds"] == ROUNDS
        assert stats["steps"] == [sum(SCRIPT[k % 3][r] for k in range(ROUNDS)) for r in range(world)]


def test_fragments_move_as_they_land_and_equal_the_float64_reference():
    """fragments=2, moved on arrival: the first fragment is made to land after a round's first
    step, the second after its second. The global parameters equal the reference that moves each
    fragment's parameters after its own step (a rank whose round is shorter never moves it), and
    the history records the steps before the move, averaged over the elements."""
    from hetcomm.train.diloco.schedule import fragment_bounds as _fragment_bounds

    world, moves = 3, [1, 2]
    sizes = [p.numel() for p in make_model().parameters()]
    frags = _fragment_bounds(sizes, 2)
    assert len(frags) == 2 and frags[0][1] < len(sizes)
    want = reference("batch", world, True, [(s, i, j) for s, (i, j, _, _) in zip(moves, frags)])
    per_rank = run_ranks(world, train_scripted, "batch", True, None, 2, moves)
    n = sum(sizes)
    expect = [[0] * world] + [[round(sum((b - a) * min(s, SCRIPT[k % 3][r]) for s, (_, _, a, b) in zip(moves, frags)) / n)
                               for r in range(world)] for k in range(1, ROUNDS)]
    for name in per_rank[0]:
        results = [r[name] for r in per_rank]
        for rank, res in enumerate(results):
            for g, w in zip(res["snapshots"][-1], want[-1]):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}, rank {rank}: {m}")
            assert res["history"] == results[0]["history"]
        assert [h["landed_after_steps"] for h in results[0]["history"]] == expect
    # and it is not the reference of moving everything at once
    whole = reference("batch", world, True, 1)
    assert not all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(whole[-1], want[-1]))


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
    a partial update), and the other worker must not raise. The state sharded (each rank reduces
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
    assert [r["own_failed"] for r in res] == [True, False, False, False], res
    assert "injected failure after fragment 2" in (res[0]["error"] or ""), res[0]
    assert "another rank of this worker failed" in (res[1]["error"] or ""), res[1]
    assert res[2]["error"] is None and res[3]["error"] is None, res[2:]


# ---- policies --------------------------------------------------------------------------------

STEP_S = [0.02, 0.08]             # declared compute per step (clock.DeclaredClock): rank 1 is 4x slower


def train_policy(rank: int, world: int, policy: str, overlap: bool) -> dict:
    import hetcomm
    from clock import DeclaredClock

    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps=policy, steps=4, overlap=overlap, compress="bf16", clock=clock)
    starts = []                   # (step start, step end, deadline in force) for the time policy
    syncs = 0
    while syncs < 6:              # every rank synchronises exactly 6 times, then finishes
        begin = clock()
        deadline = getattr(diloco.policy, "deadline", None)
        x = torch.randn(16, 8)
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        clock.compute(STEP_S[rank])
        end = clock()
        syncs += diloco.step(samples=16)
        starts.append((begin, end, deadline))
    diloco.finish()
    return {"history": diloco.history, "starts": starts, "stats": diloco.stats()}


@pytest.mark.parametrize("policy", ["speed", "time"])
def test_policies_agree_and_give_the_slow_rank_fewer_steps(policy):
    """Step times are declared on a clock that nothing else moves (clock.DeclaredClock: 20 ms
    against 80 ms), not slept: with sleeps of 4 and 16 ms a loaded machine could stretch a fast
    step past a slow one and break "fewer steps every round"."""
    per_rank = run_ranks(2, train_policy, policy, False)
    history = per_rank[0]["history"]
    assert per_rank[1]["history"] == history, "ranks disagreed on the agreed history (decisions)"
    late = history[2:]                      # after the first agreement
    assert late, history
    for h in late:
        assert h["steps"][1] < h["steps"][0], f"{policy}: the slow rank was not given fewer steps: {h}"
    if policy == "speed":
        plans = [h["plan"]["steps"] for h in late]
        assert all(p[1] < p[0] for p in plans), plans
    else:
        assert all(h["plan"]["round_seconds"] > 0 for h in late)
        for rank, res in enumerate(per_rank):
            for begin, end, deadline in res["starts"]:
                if deadline is not None:
                    assert begin <= deadline, (f"rank {rank} started a step {begin - deadline:.4f} s after "
                                               "the deadline")


def test_time_policy_with_overlap_runs_and_agrees():
    per_rank = run_ranks(2, train_policy, "time", True)
    assert per_rank[0]["history"] == per_rank[1]["history"]
    assert any(h["steps"][1] < h["steps"][0] for h in per_rank[0]["history"][3:]), per_rank[0]["history"]


# ---- stopping together ----------------------------------------------------------------------

UNEVEN_BATCHES = [24, 12]          # rank 1 has half the batches of rank 0
UNEVEN_STEP_S = [0.02, 0.08]      # and is slower (declared compute): under speed and time it runs fewer steps a round


def train_uneven(rank: int, world: int, policy: str, overlap: bool, style: str) -> dict:
    import hetcomm
    from clock import DeclaredClock

    torch.manual_seed(0)
    net = nn.Linear(6, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps=policy, steps=3, overlap=overlap, clock=clock)
    g = torch.Generator().manual_seed(rank)
    loader = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(UNEVEN_BATCHES[rank])]

    def one_step(x, y):
        clock.compute(UNEVEN_STEP_S[rank])
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        diloco.step(samples=len(x), loss=loss.item())

    if style == "loop":
        for x, y in diloco.loop(loader):
            one_step(x, y)
    else:                                  # the loop of the old README: finish() makes it safe
        for x, y in loader:
            one_step(x, y)
        diloco.finish()
    return {"rounds": diloco.rounds, "history": diloco.history, "stats": diloco.stats(),
            "reason": diloco.stop_reason, "global": [t.clone() for t in diloco.global_parameters()],
            "model": [p.detach().clone() for p in net.parameters()]}


@pytest.mark.parametrize("policy,overlap,style", [("fixed", False, "loop"), ("speed", False, "loop"),
                                                  ("time", False, "loop"), ("time", True, "loop"),
                                                  ("speed", True, "own loop"), ("fixed", False, "own loop")])
def test_uneven_data_every_rank_leaves_at_the_same_round_with_the_same_parameters(policy, overlap, style):
    per_rank = run_ranks(2, train_uneven, policy, overlap, style, timeout=240)
    first = per_rank[0]
    for res in per_rank:
        assert res["rounds"] == first["rounds"] and res["history"] == first["history"], "the ranks left apart"
        assert res["reason"] == first["reason"] and "out of data" in res["reason"], res["reason"]
        for a, b, m in zip(first["global"], res["global"], res["model"]):
            assert torch.equal(a, b), "global parameters differ across ranks"
            assert torch.equal(b, m), "the model does not hold the global parameters"
    # Every batch of every rank was stepped and synchronised.
    assert first["stats"]["samples"] == [4 * n for n in UNEVEN_BATCHES], first["stats"]
    assert first["stats"]["steps"] == UNEVEN_BATCHES, first["stats"]


def train_budget(rank: int, world: int, overlap: bool, budgets: dict) -> dict:
    import hetcomm

    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=2 + rank, overlap=overlap)
    forever = iter(lambda: torch.randn(2, 3), None)          # never runs out
    try:
        for x in diloco.loop(forever, **budgets[rank]):
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step(samples=len(x))
    except ValueError as e:
        return {"error": str(e)}
    return {"rounds": diloco.rounds, "reason": diloco.stop_reason, "samples": sum(diloco.stats()["samples"])}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_budget_of_the_run_stops_every_rank_at_the_same_round(overlap):
    per_rank = run_ranks(2, train_budget, overlap, [{"max_samples": 30}] * 2)
    assert per_rank[0] == per_rank[1], per_rank
    # 2 + 3 steps of 2 samples a round: 10 samples a round, so 3 rounds reach 30 (with overlap,
    # which learns a round's totals one round later, from the previous round's: a fixed schedule).
    assert per_rank[0]["rounds"] == 3, per_rank
    assert per_rank[0]["reason"].startswith("max_samples"), per_rank
    for rounds in (2, 1):       # (with overlap, 1 ran 2 rounds: no agreement lands before the first ends)
        per_rank = run_ranks(2, train_budget, overlap, [{"max_rounds": rounds}] * 2)
        assert per_rank[0] == per_rank[1] and per_rank[0]["rounds"] == rounds, per_rank
        assert per_rank[0]["samples"] == 10 * rounds, per_rank


ROUND_S, TIMED_STEP_S = 2.5, 0.05     # declared compute: 50 steps a round, 2 samples each, on each of 2 ranks
LANDS_AFTER = 45                      # a slow link: an update lands 0.9 of a round after it left


def train_timed_rounds(rank: int, world: int, budgets: dict, slow_reduction: bool = False) -> dict:
    import hetcomm
    from clock import DeclaredClock, SlowLink
    from hetcomm import compress as _compress_module

    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps="time", round_seconds=ROUND_S, overlap=True, clock=clock)
    gate = SlowLink(clock, LANDS_AFTER * TIMED_STEP_S if slow_reduction else 0.0)   # 0: lands at the next step
    gate.wrap(_compress_module, "weighted_allreduce", diloco)
    forever = iter(lambda: torch.randn(2, 3), None)
    for x in diloco.loop(forever, **budgets):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        clock.compute(TIMED_STEP_S)
        gate.stepped(diloco.step(samples=len(x)))
    return {"reason": diloco.stop_reason, "samples": sum(sum(rec["samples"]) for rec in diloco.history),
            "steps": [rec["steps"] for rec in diloco.history], "idle": gate.idle,
            "diloco_idle": diloco.stats()["idle_seconds"]}


def test_with_time_and_overlap_the_last_round_ends_near_the_sample_budget():
    """The last round is decided on one round late; with ``time`` it ends where the sample
    budget is predicted to be reached: rounds of 200 samples here (50 steps of 2 samples on 2
    ranks), so a budget of 440 is reached a fifth into the third round, which ran whole before
    (600 samples). A round budget keeps the last round whole. Step times are declared on a clock
    nothing else moves (clock.DeclaredClock), not slept: a loaded machine no longer changes the
    rate the prediction is made from, which sleeps of 20 ms let it do; the counts are exact."""
    budget = 440
    per_rank = run_ranks(2, train_timed_rounds, {"max_samples": budget})
    assert per_rank[0] == per_rank[1], per_rank
    assert per_rank[0]["reason"].startswith("max_samples"), per_rank
    # 400 samples in two rounds, then 10 steps of 2 ranks x 2 samples: the budget to the sample
    assert per_rank[0]["steps"] == [[50, 50], [50, 50], [10, 10]] and per_rank[0]["samples"] == budget, per_rank
    per_rank = run_ranks(2, train_timed_rounds, {"max_rounds": 3})
    assert per_rank[0] == per_rank[1] and per_rank[0]["reason"].startswith("max_rounds"), per_rank
    assert per_rank[0]["steps"] == [[50, 50]] * 3, per_rank


def test_a_shortened_last_round_trains_until_the_update_in_flight_lands():
    """A slow link: each update lands 0.9 of a round after it left (clock.SlowLink: 45 steps of
    the 50 a round has), after the point where the budget is reached (a fifth into the third
    round). Ending the round there would wait for the landing before the final synchronisation
    (the run ends no sooner): the round trains until it lands instead, short of its whole length.
    On the simulated clock the idle time is exact: a rank that stopped training to wait for the
    landing would idle the rest of its way to it (clock.SlowLink counts it, and so does DiLoCo's
    own ``stats()["idle"]``); the old test bounded idle seconds against sleeps of a loaded
    machine."""
    budget = 440
    per_rank = run_ranks(2, train_timed_rounds, {"max_samples": budget}, True)
    assert per_rank[0] == per_rank[1], per_rank
    first = per_rank[0]
    assert first["reason"].startswith("max_samples"), per_rank
    assert first["idle"] == 0 and first["diloco_idle"] == [0.0, 0.0], \
        f"a rank waited for the update in flight instead of training: {per_rank}"
    # the last round trained until the landing (after 45 steps; the 46th moves onto it), not the
    # 10 steps the budget needed
    assert first["steps"] == [[50, 50], [50, 50], [LANDS_AFTER + 1] * 2], per_rank
    assert first["samples"] == 400 + 4 * (LANDS_AFTER + 1), per_rank


def train_link_bound(rank: int, world: int, slow_steps: int) -> dict:
    import warnings

    import hetcomm
    from clock import DeclaredClock, SlowLink
    from hetcomm import compress as _compress_module

    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps="time", steps=5, overlap=True, compress="int8", clock=clock)
    gate = SlowLink(clock, slow_steps * 0.02)
    gate.wrap(_compress_module, "weighted_allreduce", diloco)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rounds = 0
        while rounds < 6:
            x = torch.randn(2, 3)
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            clock.compute(0.02)
            synced = diloco.step(samples=len(x))
            gate.stepped(synced)
            rounds += synced
        diloco.finish()
    return {"warnings": [str(w.message) for w in caught if "sets the pace" in str(w.message)],
            "stretch": diloco.policy.stretch}


def test_rounds_stretched_by_the_link_are_reported_once():
    """With overlap, `time`'s rounds last at least the synchronisation in flight; when that is
    what sets their length (an update lands 25 steps after it left, against 5 steps a round)
    the replicas average less often per sample, and group rank 0 says so, once, naming int4. A
    link that keeps up (no delay) is not reported. On the simulated clock (clock.py) a round's
    compute and the link's delay are counts of steps: with 20 ms sleeps, an unloaded link had
    to synchronise within ~110 ms of real time not to be reported, which a loaded machine does
    not promise; here real time does not count."""
    per_rank = run_ranks(2, train_link_bound, 25)
    # The synchronisation takes 25 steps of 20 ms from its agreement (at the round's end) to its
    # landing; a round is 5 steps; the policy's margin over the link is 1.1: 1.1 * 25 / 5.
    assert per_rank[0]["stretch"] == pytest.approx(5.5) and per_rank[1]["stretch"] == pytest.approx(5.5), per_rank
    assert len(per_rank[0]["warnings"]) == 1 and per_rank[1]["warnings"] == [], per_rank
    assert "less often per sample" in per_rank[0]["warnings"][0] and "int4" in per_rank[0]["warnings"][0]
    per_rank = run_ranks(2, train_link_bound, 0)       # lands at the step after it left
    assert per_rank[0]["warnings"] == [] and per_rank[0]["stretch"] == 1.0, per_rank


def test_last_round_seconds_predicts_where_a_budget_is_reached():
    from hetcomm.train.diloco import table as d

    def table(max_samples=0.0, max_seconds=0.0):
        t = [[0.0, 0.0] for _ in range(d._ROWS)]
        # The last agreed round: 200 samples in 2 s of compute (the slowest rank), ending at 10 s.
        t[d._SAMPLES], t[d._COMPUTE], t[d._ELAPSED] = [120.0, 80.0], [2.0, 1.5], [10.0, 9.0]
        t[d._MAX_SAMPLES], t[d._MAX_SECONDS] = [max_samples] * 2, [max_seconds] * 2
        return t

    # 400 samples agreed before: a budget of 500 is 100 samples, 1 s of computing, into the next round.
    assert d.last_round_seconds(table(max_samples=500), 400) == pytest.approx(1.0)
    assert d.last_round_seconds(table(max_samples=500, max_seconds=10.5), 400) == pytest.approx(1.0)
    assert d.last_round_seconds(table(max_samples=700), 400) is None         # not reached
    assert d.last_round_seconds(table(max_samples=300), 400) == 0.0          # already past
    assert d.last_round_seconds(table(max_seconds=10.5), 400) is None        # a time budget: the round stays whole
    assert d.last_round_seconds(table(), 400) is None                        # a round budget
    empty = table(max_samples=500)
    empty[d._SAMPLES] = [0.0, 0.0]
    assert d.last_round_seconds(empty, 400) is None                          # no rate to predict by


def test_the_rounds_near_the_sample_budget_end_where_it_is_predicted_reached():
    """With time and overlap, a stop decided from a measurement round's table (no deadline yet:
    the round would end whenever the synchronisation in flight lands) gives the last round the
    deadline where the sample budget is predicted to be reached. Without it, a synchronisation
    that landed early ended a run at 7,296 of its 12,000 samples. A planned round that does not
    end the run ends there too if that is sooner (one ran 990 steps, 124,480 samples of 12,000)."""
    import types

    from hetcomm.train.diloco import table as d
    from hetcomm.train.diloco.schedule import Overlap
    from hetcomm.train.local_steps import TimeSteps

    t = [[0.0, 0.0] for _ in range(d._ROWS)]
    # The previous round: 6,336 samples in 4 s of compute (the slowest rank); 128 before it.
    t[d._SAMPLES], t[d._COMPUTE], t[d._MAX_SAMPLES] = [5888.0, 448.0], [4.0, 3.5], [12000.0, 12000.0]
    policy = TimeSteps(20)
    policy.start_round(100.0)
    assert policy.deadline is None                      # a measurement round
    fake = types.SimpleNamespace(_policy=policy, _history=[{"samples": [64, 64]}], _clock=lambda: 100.0,
                                 _r_compute=0.5, _until_landed=False,
                                 _stop_decision=lambda table, ahead, settled, samples: d.stop_decision(
                                     table, ahead=ahead, rounds=settled, samples=samples, last_elapsed=0.0))
    Overlap._shorten_last_round(fake, 2, t)
    # 12,000 - 6,464 = 5,536 samples at 6,336 per 4 s: 3.495 s of computing, 0.5 s of it done.
    assert fake._policy.deadline == pytest.approx(100.0 + 5536 * 4.0 / 6336 - 0.5)
    assert fake._until_landed
    # A planned round keeps the sooner of its own deadline and the budget's.
    policy.deadline = 101.0
    Overlap._shorten_last_round(fake, 2, t)
    assert policy.deadline == 101.0
    # No stop decided (a larger budget): a measurement round is left alone...
    t[d._MAX_SAMPLES] = [50000.0, 50000.0]
    policy.deadline = None
    Overlap._shorten_last_round(fake, 2, t)
    assert policy.deadline is None
    # ...and a planned round only where it would train past the budget: 50,000 - 6,464 samples
    # at 6,336 per 4 s is 27.48 s of computing, 0.5 s of it done.
    policy.deadline, fake._until_landed = 200.0, False
    Overlap._shorten_last_round(fake, 2, t)
    assert policy.deadline == pytest.approx(100.0 + 43536 * 4.0 / 6336 - 0.5) and fake._until_landed
    policy.deadline, fake._until_landed = 110.0, False
    Overlap._shorten_last_round(fake, 2, t)
    assert policy.deadline == 110.0 and not fake._until_landed


def test_a_sample_budget_reached_by_a_prediction_says_so():
    from hetcomm.train.diloco import table as d

    t = [[0.0, 0.0] for _ in range(d._ROWS)]
    t[d._SAMPLES], t[d._MAX_SAMPLES], t[d._ELAPSED] = [300.0, 200.0], [1000.0, 1000.0], [5.0, 5.0]
    assert d.stop_decision(t, ahead=False, rounds=3, samples=1000, last_elapsed=4.0) == "max_samples: 1000 samples"
    # With overlap the round now ending counts as the last agreed one: 600 + 500 samples.
    assert d.stop_decision(t, ahead=True, rounds=3, samples=600, last_elapsed=4.0) == (
        "max_samples: 1100 samples predicted (the last round as the one before it)")
    assert d.stop_decision(t, ahead=True, rounds=3, samples=400, last_elapsed=4.0) is None


def test_budgets_that_differ_across_ranks_raise_on_every_rank():
    per_rank = run_ranks(2, train_budget, False, [{"max_rounds": 2}, {"max_rounds": 3}])
    for res in per_rank:
        assert "different max_rounds" in res.get("error", ""), res


def test_loop_insists_on_one_step_per_batch():
    per_rank = run_ranks(1, forgetful_loop)
    assert "exactly once" in per_rank[0], per_rank


def forgetful_loop(rank: int, world: int) -> str:
    import hetcomm

    net = nn.Linear(2, 1)
    diloco = hetcomm.DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), steps=2)
    try:
        for _ in diloco.loop(range(5)):
            pass                                            # forgot diloco.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


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


def test_bad_arguments():
    import hetcomm
    from hetcomm.train.local_steps import make_policy

    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest", 4)
    with pytest.raises(ValueError, match="steps must be an integer"):
        make_policy("fixed", 0)
    with pytest.raises(ValueError, match="round_seconds"):
        make_policy("time", 4, round_seconds=-1.0)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            hetcomm.DiLoCo(nn.Linear(2, 2), None)


# ---- the simulated cluster -------------------------------------------------------------------

@hetcomm_only("the simulator run uses the hetcomm backend")
@needs_netns
def test_throttled_rank_gets_fewer_local_steps_on_the_simulator(tmp_path):
    summary = tmp_path / "diloco.json"
    cmd = [sys.executable, "-m", "hetcomm.sim", "--nprocs", "2", "--cpu-quota", "1.0,0.25", "-q", "--",
           sys.executable, os.path.join(ROOT, "examples", "train_diloco.py"), "--local-steps", "speed",
           "--steps", "4", "--rounds", "6", "--d-model", "64", "--layers", "2", "--block", "64",
           # Steps long enough (~25 ms of a core) that the 0.25 quota throttles every one of them,
           # not only the ones that outlast the cgroup's burst.
           "--batch", "16", "--json", str(summary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    # After three rounds: the counts of round 3 come from round 2, where each rank timed a single
    # step, and one step of the throttled rank can fit in its cgroup's fresh 25 ms budget and run
    # unthrottled (seen in CI: [4, 5] in round 3, then [6, 4], [9, 4], [11, 4]). From round 4 on
    # the estimates cover several steps, which the quota must slow.
    # Judged over those rounds together (and most of them one by one), not each alone: on a
    # machine shared with other work the unthrottled rank loses cores too, and a single round's
    # counts may tie (seen once beside a second test run and a training job on 2 cores).
    late = result["history"][3:]
    assert late, result["history"]
    counts = [h["steps"] for h in result["history"]]
    assert sum(h["steps"][1] for h in late) < sum(h["steps"][0] for h in late), counts
    assert sum(h["steps"][1] < h["steps"][0] for h in late) > len(late) / 2, counts


@hetcomm_only("the simulator run uses the hetcomm backend")
@needs_netns
def test_sites_as_workers_send_one_model_across_the_wan_per_round_on_the_simulator(tmp_path):
    """Two sites of two ranks, WAN shared per site: DiLoCo makes each site a worker (workers from
    hetcomm's sites, declared here so that no probe decides) and each site's two ranks carry half
    the pseudo-gradient each across the WAN: one model's worth per site and round, from stats()."""
    summary = tmp_path / "diloco.json"
    cmd = [sys.executable, "-m", "hetcomm.sim", "--sites", "0,0,1,1", "--intra-mbit", "1000", "--wan-mbit", "20",
           "-q", "--", sys.executable, os.path.join(ROOT, "examples", "train_diloco.py"), "--local-steps", "fixed",
           "--steps", "2", "--rounds", "3", "--d-model", "64", "--layers", "2", "--block", "32", "--batch", "4",
           "--json", str(summary)]
    env = {**os.environ, "HETCOMM_SITES": "0,0,1,1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["workers"] == [[0, 1], [2, 3]], result["workers"]
    model = 4 * result["parameters"]                       # fp32
    per_round = [b / result["rounds"] for b in result["wan_bytes"]]
    for b in per_round:
        assert model <= b <= 1.05 * model, (per_round, model)
    assert len(result["history"][0]["steps"]) == 2, "the history counts workers"


def test_an_outer_step_computed_aside_equals_a_real_one_and_changes_nothing():
    """`outer.estimate_step`: the closed-form SGD step, the per-parameter scratch step and the
    whole-state scratch step against a real step of a copy, for SGD settings (momentum, Nesterov,
    dampening, weight decay, maximize) and Adam, before and after a first step (no momentum
    buffer yet), on some parameters only and on all; the optimizer and parameters are left as
    they were."""
    from hetcomm.train.diloco import outer

    settings = [(torch.optim.SGD, dict(lr=0.7, momentum=0.9, nesterov=True)),
                (torch.optim.SGD, dict(lr=0.5, momentum=0.8, dampening=0.3)),
                (torch.optim.SGD, dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01)),
                (torch.optim.SGD, dict(lr=0.2)), (torch.optim.SGD, dict(lr=0.4, momentum=0.5, maximize=True)),
                (torch.optim.Adam, dict(lr=0.02, betas=(0.8, 0.9)))]
    g = torch.Generator().manual_seed(7)
    for cls, cfg in settings:
        params = [nn.Parameter(torch.randn(3, 2, generator=g, dtype=torch.float64)),
                  nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))]
        opt = cls(params, **cfg)
        for _ in range(2):                    # the first step has no momentum buffer yet
            grads = [torch.randn(p.numel(), generator=g, dtype=torch.float64) for p in params]
            twin = [nn.Parameter(p.detach().clone()) for p in params]
            twin_opt = cls(twin, **cfg)
            twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            for t, d in zip(twin, grads):
                t.grad = d.view(t.shape).clone()
            twin_opt.step()
            want = [t.detach().reshape(-1) for t in twin]
            before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
            for name, fn, subset in [("closed", outer._sgd_step, [0, 1]), ("closed", outer._sgd_step, [1]),
                                     ("scratch", outer._scratch_step, [0, 1]), ("scratch", outer._scratch_step, [1]),
                                     ("whole", outer._whole_step, [0, 1])]:
                if name == "closed" and cls is not torch.optim.SGD:
                    continue
                outs = [torch.empty(params[i].numel(), dtype=torch.float64) for i in subset]
                fn(opt, [params[i] for i in subset], [grads[i] for i in subset], outs)
                for i, o in zip(subset, outs):
                    torch.testing.assert_close(o, want[i], rtol=1e-12, atol=1e-12,
                                               msg=lambda m: f"{cls.__name__} {cfg} {name} {subset}: {m}")
                assert all(torch.equal(p, q) for p, q in zip(params, before[0])), "the parameters changed"
                assert str(opt.state_dict()) == str(before[1]), "the optimizer's state changed"
            for p, d in zip(params, grads):            # a real step, so that the buffers exist
                p.grad = d.view(p.shape).clone()
            opt.step()
            opt.zero_grad()
        with pytest.raises(ValueError, match="treats each"):
            outer._whole_step(opt, params[:1], grads[:1], [torch.empty(6, dtype=torch.float64)])


def train_one_rank_drains(rank: int, world: int) -> list:
    import itertools

    import hetcomm
    from clock import DeclaredClock

    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    clock = DeclaredClock()
    diloco = hetcomm.DiLoCo(net, opt, local_steps="time", round_seconds=0.5, overlap=True, clock=clock)
    data = iter(lambda: torch.randn(2, 3), None)
    if rank == 1:
        data = itertools.islice(data, 5)                 # out of data early: it drains, never steps again
    for x in diloco.loop(data, max_samples=300):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        clock.compute(0.02)
        diloco.step(samples=len(x))
    return [{k: rec[k] for k in ("round", "plan", "steps", "samples", "weights")} for rec in diloco.history]


def test_a_rank_that_drains_records_the_same_history_through_a_shortened_last_round():
    """The last round is shortened to the sample budget on the ranks still stepping; the rank out
    of data takes no steps and must still agree on every record (found in review: a plan that
    named the shortening only where a rank stepped)."""
    per_rank = run_ranks(2, train_one_rank_drains)
    assert per_rank[0] == per_rank[1], per_rank
    assert len(per_rank[0]) >= 3 and per_rank[0][-1]["steps"][1] == 0, per_rank
