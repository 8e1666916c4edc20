"""DiLoCo checkpoints: `state_dict` / `load_state_dict`.

* A run stopped after 2 rounds and resumed from each rank's state in fresh objects (a model
  initialised differently, a new inner AdamW, int8 with error feedback, a `loop` budget) computes
  bit for bit what the uninterrupted run computes after 4 rounds, with the same history.
* With overlap, saving waits for the synchronisation in flight; the resumed run ends where the
  saving run ends.
* The policies' and step times' state survive the round trip; mismatched checkpoints and calls
  at the wrong moment raise.
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from harness import run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")

STEPS, ROUNDS, SPLIT = 3, 4, 2


def make(seed: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def data(rank: int, round_k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * round_k + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def rounds(net, opt, diloco, rank: int, first: int, last: int) -> None:
    for k in range(first, last):
        for i in range(STEPS):
            x, y = data(rank, k, i)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert diloco.step(samples=len(x)) == (i == STEPS - 1)


def build(seed: int, overlap: bool, fragments: int = 1, tau: int = 1, workers="ranks"):
    import hetcomm

    net = make(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=STEPS, compress="int8", block=16,
                            error_feedback=True, overlap=overlap, overlap_steps=tau if overlap else None,
                            fragments=fragments, workers=workers)
    return net, opt, diloco


def train_interrupted(rank: int, world: int, overlap: bool, fragments: int = 1, tau: int = 1,
                      workers="ranks") -> dict:
    def run(save: bool, resume: bytes | None = None) -> dict:
        net, opt, diloco = build(5 if resume is None else 99, overlap, fragments, tau, workers)    # resumed: another init
        saved = None
        if resume is not None:
            diloco.load_state_dict(torch.load(io.BytesIO(resume), weights_only=False))
            assert diloco.rounds == SPLIT - (1 if overlap else 0)    # with overlap, one is in flight
        else:
            rounds(net, opt, diloco, rank, 0, SPLIT)
            if save:
                buf = io.BytesIO()
                state = diloco.state_dict()
                if fragments > 1 and tau > 1:       # a staggered fragment's update is still to move
                    assert state["streams"]["unmoved"], state["streams"]
                torch.save(state, buf)
                saved = buf.getvalue()
        rounds(net, opt, diloco, rank, SPLIT, ROUNDS)
        diloco.finish()
        return {"global": [g.clone() for g in diloco.global_parameters()], "history": diloco.history,
                "stats": diloco.stats(), "saved": saved}

    whole = run(save=False)              # never saved
    saving = run(save=True)              # saved after SPLIT rounds: saving must change nothing
    resumed = run(save=False, resume=saving["saved"])
    return {"whole": whole, "saving": saving, "resumed": resumed}


def train_from_version_1(rank: int, world: int) -> dict:
    """A checkpoint of the first format (a table of 17 rows in flight, one residual dict, no
    sync duration), taken with overlap, resumes and synchronises."""
    net, opt, diloco = build(5, True)
    rounds(net, opt, diloco, rank, 0, 1)
    state = diloco.state_dict()
    diloco.finish()
    state["version"] = 1
    state["pending"]["table"] = state["pending"]["table"][:17]
    state["feedback"] = state["feedback"][0]
    del state["sync_wall"]
    net, opt, resumed = build(99, True)
    resumed.load_state_dict(state)
    rounds(net, opt, resumed, rank, 1, 3)
    resumed.finish()
    return {"rounds": resumed.rounds, "global": [g.clone() for g in resumed.global_parameters()]}


def test_a_checkpoint_of_the_first_format_resumes():
    per_rank = run_ranks(2, train_from_version_1, timeout=180)
    assert [r["rounds"] for r in per_rank] == [3, 3]
    for a, b in zip(per_rank[0]["global"], per_rank[1]["global"]):
        assert torch.equal(a, b)


def decisions(history: list[dict]) -> list[dict]:
    """The history's agreed decisions and counts (its seconds differ from run to run)."""
    return [{k: h[k] for k in ("round", "plan", "steps", "samples", "weights", "landed_after_steps")}
            for h in history]


@pytest.mark.parametrize("overlap,fragments,tau,workers", [(False, 1, 1, None), (True, 1, 1, None), (True, 3, 1, None),
                                                           (True, 3, 2, None), (True, 3, 2, [0, 0, 1, 1])])
def test_a_resumed_run_computes_what_the_uninterrupted_run_computes(overlap, fragments, tau, workers):
    """(fragments=3: a quantisation residual per fragment goes into the checkpoint; staggered,
    with τ = 2 the last fragment, fired after step 2 of 3, moves in the next round: the checkpoint
    holds its move still to come. Workers of two ranks: each rank's checkpoint holds its share of
    the state.)"""
    per_rank = run_ranks(4 if workers else 2, train_interrupted, overlap, fragments, tau, workers or "ranks",
                         timeout=180)
    for rank, res in enumerate(per_rank):
        whole = res["whole"]
        for name in ("saving", "resumed"):
            other = res[name]
            for a, b in zip(whole["global"], other["global"]):
                assert torch.equal(a, b), f"rank {rank}: the {name} run's parameters differ from the uninterrupted run's"
            assert decisions(other["history"]) == decisions(whole["history"]), name
            assert other["stats"]["rounds"] == whole["stats"]["rounds"] == ROUNDS
            assert other["stats"]["samples"] == whole["stats"]["samples"] == [ROUNDS * STEPS * 4 * (2 if workers else 1)] * 2
        for a, b in zip(per_rank[0]["resumed"]["global"], res["resumed"]["global"]):
            assert torch.equal(a, b), "ranks differ"
    if overlap and fragments == 1:      # the move happened mid-round (overlap_steps=1), in the resumed run too
        assert [h["landed_after_steps"] for h in per_rank[0]["resumed"]["history"]] == [[0, 0]] + [[1, 1]] * 3


def train_budget_resumed(rank: int, world: int, overlap: bool) -> dict:
    """max_samples counts the samples before the checkpoint too (the same loop budget in the
    saving run and in the resumed one: with overlap, the round in flight was agreed with it)."""
    budget = 2 * 4 * STEPS * (SPLIT + 1)

    def train(diloco, net, opt, batches, save_after: int | None = None):
        taken, state = 0, None
        for x, y in diloco.loop(batches, max_samples=budget):
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            taken += 1
            if diloco.step(samples=len(x)) and taken == STEPS * (save_after or 0):
                state = diloco.state_dict()
                break
        return taken, state

    net, opt, diloco = build(5, overlap)
    _, state = train(diloco, net, opt, [data(rank, k, i) for k in range(SPLIT) for i in range(STEPS)],
                     save_after=SPLIT)
    net2, opt2, resumed = build(5, overlap)
    resumed.load_state_dict(state)
    taken, _ = train(resumed, net2, opt2, [data(rank, 50, i) for i in range(100)])
    return {"rounds": resumed.rounds, "reason": resumed.stop_reason, "taken": taken}


@pytest.mark.parametrize("overlap", [False, True])
def test_loop_budgets_count_the_rounds_before_the_checkpoint(overlap):
    per_rank = run_ranks(2, train_budget_resumed, overlap, timeout=180)
    # 2 rounds of 2 x 4 x STEPS samples before the checkpoint: one more round reaches the budget.
    assert [r["taken"] for r in per_rank] == [STEPS] * 2, per_rank
    assert [r["rounds"] for r in per_rank] == [SPLIT + 1] * 2, per_rank
    assert "max_samples" in per_rank[0]["reason"]


def train_misuse(rank: int, world: int) -> dict:
    import hetcomm

    net, opt, diloco = build(5, False)
    errors = {}
    x, y = data(rank, 0, 0)
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    diloco.step(samples=4)
    try:
        diloco.state_dict()
    except RuntimeError as e:
        errors["mid_round"] = str(e)
    for _ in range(STEPS - 1):
        diloco.step(samples=4)
    state = diloco.state_dict()
    try:
        diloco.load_state_dict(state)
    except RuntimeError as e:
        errors["after_steps"] = str(e)
    diloco.finish()
    other = hetcomm.DiLoCo(make(5), None, local_steps="time", steps=STEPS)
    try:
        other.load_state_dict(state)
    except ValueError as e:
        errors["policy"] = str(e)
    other.finish()
    net, opt, staggered = build(5, True, 3)
    rounds(net, opt, staggered, rank, 0, 1)
    state = staggered.state_dict()
    staggered.finish()
    for name, kwargs in (("fragments", dict(fragments=2)), ("stagger", dict(fragments=3, stagger=False))):
        other = hetcomm.DiLoCo(make(5), None, local_steps="fixed", steps=STEPS, overlap=True, **kwargs)
        try:
            other.load_state_dict(state)
        except ValueError as e:
            errors[name] = str(e)
        other.finish()
    return errors


def test_checkpoints_at_the_wrong_moment_or_of_another_run_raise():
    errors = run_ranks(2, train_misuse, timeout=180)[0]
    assert "inside a round" in errors["mid_round"]
    assert "right after constructing" in errors["after_steps"]
    assert "'fixed' policy" in errors["policy"] and "'time'" in errors["policy"]
    assert "fragments" in errors["fragments"] and "differ" in errors["fragments"]
    assert "staggered" in errors["stagger"]


def test_policy_and_step_times_state_round_trip():
    from hetcomm.train.local_steps import SpeedSteps, StepTimes, TimeSteps

    times = StepTimes(3)
    for _ in range(3):
        times.update([1.0, 2.0, 4.0], [10, 10, 10])
    speed, timed = SpeedSteps(5), TimeSteps(5)
    for policy in (speed, timed):
        policy.bind(0, 3)
        policy.agreed(times)
    times2, speed2, timed2 = StepTimes(3), SpeedSteps(5), TimeSteps(5)
    speed2.bind(0, 3)
    timed2.bind(0, 3)
    times2.load_state_dict(times.state_dict())
    speed2.load_state_dict(speed.state_dict())
    timed2.load_state_dict(timed.state_dict())
    assert times2.estimates() == times.estimates() and times2.windows == times.windows
    assert speed2.plan() == speed.plan() == {"policy": "speed", "steps": [20, 10, 5]}
    assert timed2.plan() == timed.plan() and timed2.round_seconds == pytest.approx(2.0)
    with pytest.raises(ValueError, match="workers"):
        StepTimes(2).load_state_dict(times.state_dict())
    given = TimeSteps(5, round_seconds=3.0)          # the resumed run's constructor argument wins
    given.load_state_dict(timed.state_dict())
    assert given.round_seconds == 3.0
