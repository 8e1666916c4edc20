"""hetcomm.DiLoCo: every rank leaves at the same round boundary -- when the ranks' data ends
unevenly, when a budget of `loop` is reached (rounds, samples; with ``time`` and overlap, near
the sample budget where it is predicted reached), and when the loop is misused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")


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
