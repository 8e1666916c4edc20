"""The round a generation ended inside of, carried into the next (`hetcomm.train.elastic.carry`):
which reductions in flight a failure left unapplied (`_lost`), who keeps its round and who adds
them to it (`decide`), and the round with them added (`_with_lost`), against hand-computed
cases. The runs with kills are test_elastic_run.py's."""
from __future__ import annotations

import concurrent.futures
import math
from types import SimpleNamespace

import torch

from hetcomm.train.elastic import carry
from hetcomm.train.elastic.carry import (Lost, Round, _from_bits, _lost, _with_lost, added, decide, job_bits,
                                         resume_round, take_round)


def future(outcome: str) -> concurrent.futures.Future:
    f = concurrent.futures.Future()
    if outcome == "failed":
        f.set_exception(RuntimeError("a peer died"))
    elif outcome == "cancelled":
        f.cancel()
    else:
        f.set_result(None)
    return f


def table(steps, sums, lost, lost_steps, lost_sums, sending=None) -> dict:
    n = len(steps)
    return {"steps": steps, "sum": sums, "lost": lost, "lost_steps": lost_steps, "lost_sum": lost_sums,
            "sending": sending or [-1] * n}


def test_lost_reductions_are_the_failed_and_cancelled_jobs_that_applied_nothing_here():
    progress = torch.tensor([1.0, 2.0, 3.0, 4.0])           # the boundary's pseudo-gradient (fragment 0: 0..2)
    counts = (4, 64, 0.5, 2.0, 64)
    inner = SimpleNamespace(overlap=True, _pending=future("failed"), _landed=0, _pending_round=(progress, counts),
                            _boundary=[(0, 1, 0, 2)], _fragments=[(0, 1, 0, 2), (1, 2, 2, 4), (2, 3, 4, 5)],
                            _stream_base=2, _stream_delta=torch.tensor([5.0, 6.0, 7.0]),
                            _flight={1: {"future": future("cancelled"), "window": [3, 48]},
                                     2: {"future": future("done"), "window": [1, 16]}})
    lost = _lost(inner)
    assert [(a, b, d.tolist()) for a, b, d in lost.parts] == [(0, 2, [1.0, 2.0]), (2, 4, [5.0, 6.0])]
    assert lost.counts == counts and lost.windows == {1: [3, 48]}
    assert lost.total() == 1.0 + 2.0 + 5.0 + 6.0
    progress[0] = 100.0                                      # copies: `_progress` may write the buffer next
    assert lost.parts[0][2][0] == 1.0
    inner._landed = 1                                        # a fragment of the boundary's landed here: not lost
    inner._flight[1]["future"] = future("done")
    assert _lost(inner) is None
    inner._landed, inner._pending = 0, future("done")
    assert _lost(inner) is None
    inner.overlap = False
    assert _lost(inner) is None


def test_a_rank_adds_its_lost_reductions_only_where_no_member_applied_more():
    c = table(steps=[2, 2, 2], sums=[0.5, 0.25, 0.75], lost=[True, True, False], lost_steps=[4, 4, 0],
              lost_sums=[1.5, 1.0, 0.0])
    assert decide(c, applied=[5, 5, 5], labels=[0, 1, 2]) == ([True, True, True], [True, True, False])
    # rank 0 applied fewer outer steps than the others: they applied its lost reduction (their state
    # holds it); it keeps the round it was in, without the lost one
    assert decide(c, applied=[5, 6, 6], labels=[0, 1, 2]) == ([True, True, True], [False, True, False])


def numbered(c: dict, gen: list[int], jobs: list[int], applied: list[set], lost: list[set],
             boundary: list[int]) -> dict:
    """``c`` with each rank's generation, reductions submitted, and those applied and lost there."""
    return {**c, "gen": gen, "jobs": jobs, "applied_bits": [job_bits(a, n) for a, n in zip(applied, jobs)],
            "lost_bits": [job_bits(x, n) for x, n in zip(lost, jobs)], "lost_boundary": boundary}


def test_reductions_as_bits_are_the_latest_fifty():
    assert job_bits({9, 7}, 10) == 0b101 and _from_bits(0b101, 10) == {9, 7}
    assert job_bits({0, 59}, 60) == 1 and _from_bits(1 | 1 << 50, 60) == {59}     # (0 is 60 back: left out)
    assert _from_bits(0b110, 2) == {0}                                            # (none before the first)


def test_a_lost_reduction_queued_behind_one_the_holders_applied_goes_on():
    """Rank 0's fragment job 7 failed after it returned (ranks 1 and 2 applied it), and its round
    boundary's, 8, queued behind it, failed on every rank. The state (ranks 1, 2: one outer step
    more) holds 7 and not 8: rank 0 adds 8 with its steps (4), the others 8 too. Before the
    reductions were numbered, rank 0 dropped both (its steps in 8 were counted nowhere)."""
    c = table(steps=[2, 2, 2], sums=[0.5, 0.25, 0.75], lost=[True] * 3, lost_steps=[4, 4, 4],
              lost_sums=[1.5, 1.0, 2.0])
    early = {0, 1, 2, 3, 4, 5, 6}
    c = numbered(c, gen=[3] * 3, jobs=[9] * 3, applied=[early, early | {7}, early | {7}],
                 lost=[{7, 8}, {8}, {8}], boundary=[8] * 3)
    assert [added(c, [5, 6, 6], r) for r in range(3)] == [{8}, {8}, {8}]
    assert decide(c, applied=[5, 6, 6], labels=[0, 1, 2]) == ([True] * 3, [True] * 3)
    # holders from another generation than rank 0's (their numbers are not its): as before
    other = {**c, "gen": [3, 2, 2]}
    assert [added(other, [5, 6, 6], r) for r in range(3)] == [set(), {8}, {8}]
    # a holder that submitted fewer reductions (its generation failed before it submitted 8) never
    # ran the others: rank 0 adds 8 all the same
    fewer = {**c, "jobs": [9, 8, 9], "applied_bits": [job_bits(early, 9), job_bits(early | {7}, 8),
                                                      job_bits(early | {7}, 9)]}
    assert added(fewer, [5, 6, 6], 0) == {8}
    # a lost reduction not among a holder's latest 50 (more than 50 fragments): as before
    far = numbered(c, gen=[3] * 3, jobs=[9, 60, 60], applied=[early, early | {7}, early | {7}],
                   lost=[{7, 8}, set(), set()], boundary=[8, -1, -1])
    assert added(far, [5, 6, 6], 0) == set() and added(far, [6, 6, 6], 0) is None
    # the boundary's job applied everywhere, the fragment's, before it, nowhere (a hole): rank 0
    # adds the fragment's (7) though every member applied as many outer steps as it did
    hole = numbered(c, gen=[3] * 3, jobs=[9] * 3, applied=[early | {8}] * 3, lost=[{7}] * 3, boundary=[-1] * 3)
    assert [added(hole, [6, 6, 6], r) for r in range(3)] == [{7}] * 3
    # a worker's two ranks (1, 2: the same replica) keep their round if they add the same, else neither
    pair = {**c, "sum": [0.5, 0.25, 0.25], "lost_sum": [1.5, 1.0, 1.0]}
    assert decide(pair, applied=[5, 6, 6], labels=[0, 1, 1])[0] == [True, True, True]
    split = numbered(pair, gen=[3] * 3, jobs=[9, 9, 10], applied=[early, early | {7}, early | {7}],
                     lost=[{7, 8}, {8}, {8, 9}], boundary=[8] * 3)          # (rank 2 submitted one more)
    assert added(split, [5, 6, 6], 1) == {8} and added(split, [5, 6, 6], 2) == {8, 9}
    assert decide(split, applied=[5, 6, 6], labels=[0, 1, 1])[0] == [True, False, False]


def test_the_round_with_some_of_its_lost_reductions_added():
    """`Lost.only`: the boundary's (its counts) or a fragment's (its window) alone."""
    lost = Lost(parts=[(0, 2, torch.tensor([0.5, 0.5])), (2, 4, torch.tensor([1.0, 2.0]))],
                counts=(4, 64, 1.0, 2.0, 64), windows={1: [4, 64]}, orders=[8, 7], boundary=8, jobs={1: 7},
                submitted=9)
    mine = Round(delta=torch.tensor([1.0, 1.0, 1.0, 1.0]), counts=(2, 32, 0.5, 1.0, 32),
                 windows=([10, 160], [[0, 0], [8, 128]], [False, True]), applied=5, sending=None, lost=lost)
    assert mine.summary()[9:] == (0b11, 8)
    delta, counts, windows = _with_lost(mine, lost.only({8}))
    assert delta.tolist() == [1.5, 1.5, 1.0, 1.0] and counts == (6, 96, 1.5, 3.0, 96)
    assert windows == ([10, 160], [[0, 0], [8, 128]], [False, True])           # (fragment 1's: not reopened)
    delta, counts, windows = _with_lost(mine, lost.only({7}))
    assert delta.tolist() == [1.0, 1.0, 2.0, 3.0] and counts == (2, 32, 0.5, 1.0, 32)
    assert windows == ([10, 160], [[0, 0], [4, 64]], [False, True])
    assert lost.only({5}) is None
    # (counted back from the reductions submitted; one of them 50 or more back: unknown)
    assert lost.bits(10) == 0b110 and lost.bits(57) == 1 << 48 | 1 << 49 and lost.bits(58) == 0
    assert Lost(parts=lost.parts[:1], counts=None, windows={}, orders=[-1], submitted=3).bits() == 0   # (unknown)


def test_a_worker_s_ranks_keep_their_round_only_all_together():
    # ranks 0 and 1 are one worker; only rank 0 lost a reduction (rank 1's ended): they differ, both drop
    c = table(steps=[2, 2, 3], sums=[0.5, 0.5, 0.1], lost=[True, False, False], lost_steps=[4, 0, 0],
              lost_sums=[1.5, 0.0, 0.0])
    assert decide(c, applied=[5, 5, 5], labels=[0, 0, 1]) == ([False, False, True], [False, False, False])
    # both lost the same reduction: both keep the round and add it
    c = table(steps=[2, 2, 3], sums=[0.5, 0.5, 0.1], lost=[True, True, False], lost_steps=[4, 4, 0],
              lost_sums=[1.5, 1.5, 0.0])
    assert decide(c, applied=[5, 5, 5], labels=[0, 0, 1]) == ([True, True, True], [True, True, False])


def test_a_round_of_no_steps_goes_on_for_its_lost_reductions_and_what_is_not_finite_is_dropped():
    c = table(steps=[0, 0, -1], sums=[0.0, 0.0, 0.0], lost=[True, False, False], lost_steps=[4, 0, 0],
              lost_sums=[1.5, 0.0, 0.0])
    assert decide(c, applied=[5, 5, 5], labels=[0, 1, 2]) == ([True, False, False], [True, False, False])
    assert decide(c, applied=[4, 5, 5], labels=[0, 1, 2]) == ([False, False, False], [False, False, False])
    c = table(steps=[2, 2], sums=[0.5, 0.5], lost=[True, False], lost_steps=[4, 0], lost_sums=[math.inf, 0.0])
    assert decide(c, applied=[5, 5], labels=[0, 1]) == ([False, True], [False, False])
    # taken inside a reduction that a holder applied since (synchronous): dropped, lost or not
    c = table(steps=[2, 2], sums=[0.5, 0.5], lost=[False, False], lost_steps=[0, 0], lost_sums=[0.0, 0.0],
              sending=[4, -1])
    assert decide(c, applied=[5, 5], labels=[0, 1]) == ([False, True], [False, False])


def test_a_round_whose_boundary_no_member_finished_is_kept_and_one_that_a_member_finished_is_dropped():
    # all three inside the boundary (rank 0 from outer step 5: its job of the round's first fragment
    # had landed before); ranks 1 and 2 applied one more reduction of it, then it failed: no
    # member counts one round more, so each keeps its round (`held_out` takes the parts out)
    c = table(steps=[3, 3, 3], sums=[0.5, 0.25, 0.75], lost=[False] * 3, lost_steps=[0] * 3, lost_sums=[0.0] * 3,
              sending=[5, 4, 4])
    assert decide(c, applied=[5, 6, 6], labels=[0, 1, 2], rounds=[7, 7, 7]) == ([True] * 3, [False] * 3)
    # a member finished the boundary (one round more; it began its next round, not sending): dropped
    done = dict(c, sending=[5, 4, -1])
    assert decide(done, applied=[5, 6, 7], labels=[0, 1, 2], rounds=[7, 7, 8]) == ([False, False, True], [False] * 3)
    # as before where it cannot be told (rounds unknown) or the state is sharded
    assert decide(c, applied=[5, 6, 6], labels=[0, 1, 2]) == ([False, False, False], [False] * 3)
    assert decide(c, applied=[5, 6, 6], labels=[0, 1, 2], sharded=True, rounds=[7, 7, 7]) == ([False] * 3, [False] * 3)


def test_a_rank_whose_boundary_recorded_the_round_before_it_failed_carries_none():
    """Failed after its boundary recorded the round (inside the worker's agreement that follows):
    the round is in the state, whatever the others report; before the record it is carried."""
    inner = SimpleNamespace(overlap=False, _r_steps=3, _sending=5, _sending_from=2, _history=[{}, {}, {}],
                            _progress=lambda: torch.tensor([0.5, 0.25]), _stagger=False, _layout=None,
                            _r_samples=48, _r_compute=0.3, _r_loss=1.5, _r_loss_n=48, _applied=6, _sent={0: 5})
    assert take_round(inner, applied_before=10) is None
    inner._history = [{}, {}]
    mine = take_round(inner, applied_before=10)
    assert mine.delta.tolist() == [0.5, 0.25] and mine.sending == 15 and mine.applied == 16 and mine.sent == {0: 15}


def test_the_round_kept_without_the_fragments_a_member_applied(monkeypatch):
    """`resume_round`: the replica is the new start minus what the rank carries, without the
    fragments whose reduction it sent before the most outer steps a member applied (hand-computed);
    their windows begin afresh; the steps stay whole."""
    monkeypatch.setattr(carry.dist, "get_rank", lambda: 0)
    replica = torch.zeros(6)
    inner = SimpleNamespace(_params=[replica], _split=lambda t: [t], _start=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
                            _fragments=[(0, 1, 0, 2), (1, 2, 2, 4), (2, 3, 4, 6)], _stagger=True, _policy=None,
                            _r_steps=0, _r_samples=0, _r_compute=0.0, _r_loss=0.0, _r_loss_n=0, _seen=None,
                            _at_trigger=None, _fired=None)
    # fragment 2's part left before outer step 10, fragment 1's before 11; fragment 0's never left
    mine = Round(delta=torch.tensor([0.5, 0.25, 1.0, 2.0, 0.5, 0.5]), counts=(3, 48, 0.3, 1.5, 48),
                 windows=([30, 480], [[27, 432], [28, 448], [28, 448]], [False, True, True]), applied=10, sending=10,
                 sent={2: 10, 1: 11})
    c = {**table(steps=[3, 3], sums=[4.75, 4.75], lost=[False] * 2, lost_steps=[0] * 2, lost_sums=[0.0] * 2,
                 sending=[10, 10]), "cut": [False] * 2, "fired": [0, 0], "compute": [0.3, 0.3]}
    start = {"carried": c, "applied": [10, 11], "rounds": [7, 7]}          # a member applied fragment 2's
    with torch.no_grad():
        assert resume_round(inner, mine, start, labels=[0, 1])
    assert replica.tolist() == [0.5, 1.75, 2.0, 2.0, 5.0, 6.0]
    assert inner._r_steps == 3 and mine.held_out == [2]
    assert inner._at_trigger == [[27, 432], [28, 448], [30, 480]]        # (fragment 2's window: from now)
    assert mine.delta.tolist() == [0.5, 0.25, 1.0, 2.0, 0.5, 0.5]         # (a retried build resumes it again)
    assert "without fragment(s) 2" in mine.describe(True)
    # a member applied fragment 1's too: both out; none applied: nothing out
    replica.zero_()
    with torch.no_grad():
        assert resume_round(inner, mine, {**start, "applied": [10, 12]}, labels=[0, 1])
    assert replica.tolist() == [0.5, 1.75, 3.0, 4.0, 5.0, 6.0] and mine.held_out == [1, 2]
    with torch.no_grad():
        assert resume_round(inner, mine, {**start, "applied": [10, 10]}, labels=[0, 1])
    assert replica.tolist() == [0.5, 1.75, 2.0, 2.0, 4.5, 5.5] and mine.held_out == []


def test_the_round_with_its_lost_reductions_added():
    lost = Lost(parts=[(0, 2, torch.tensor([0.5, 0.5])), (2, 4, torch.tensor([1.0, 2.0]))],
                counts=(4, 64, 1.0, 2.0, 64), windows={1: [4, 64]})
    mine = Round(delta=torch.tensor([1.0, 1.0, 1.0, 1.0]), counts=(2, 32, 0.5, 1.0, 32),
                 windows=([10, 160], [[0, 0], [8, 128]], [False, True]), applied=5, sending=None, lost=lost)
    assert mine.summary()[6:9] == (True, 4, 4.0)
    delta, counts, windows = _with_lost(mine)
    assert delta.tolist() == [1.5, 1.5, 2.0, 3.0]
    assert counts == (6, 96, 1.5, 3.0, 96)
    # fragment 1's window reopens where its lost job's began; what was seen and fired stays
    assert windows == ([10, 160], [[0, 0], [4, 64]], [False, True])
    only_fragments = Round(delta=torch.zeros(4), counts=(2, 32, 0.5, 1.0, 32), windows=None, applied=5,
                           sending=None, lost=Lost(parts=[(2, 4, torch.tensor([1.0, 2.0]))], counts=None, windows={}))
    assert only_fragments.summary()[6:9] == (True, 0, 3.0)
    assert _with_lost(only_fragments)[1] == (2, 32, 0.5, 1.0, 32)


def lose_a_reduction(rank: int, world: int) -> list[dict]:
    """A DiLoCo with overlap whose second reduction (the round boundary's, or a staggered
    fragment's) fails after a while, so that a wait sees it fail: what `_lost` keeps, beside what
    the job was given."""
    import time

    import torch.nn as nn

    import hetcomm

    out = []
    for case in ("boundary", "fragment"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        d = hetcomm.DiLoCo(net, opt, overlap=True, steps=4, fragments=2, stagger=case == "fragment",
                           workers="ranks")
        name = "_exchange_and_reduce" if case == "boundary" else "_stream_job"
        job, sent = getattr(d, name), {}

        def failing(*args, _job=job, **kwargs):
            sent["calls"] = sent.get("calls", 0) + 1
            if sent["calls"] == 2:
                sent["args"] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                time.sleep(0.3)              # (still running when the training thread waits for it)
                raise RuntimeError("a peer died")
            return _job(*args, **kwargs)
        setattr(d, name, failing)
        try:
            for _ in range(40):
                nn.functional.mse_loss(net(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
                opt.step()
                opt.zero_grad()
                d.step(samples=3)
            raise AssertionError("the failed reduction was never seen")
        except RuntimeError as e:
            assert "a peer died" in str(e), e
        d.close()
        lost = _lost(d)
        row = {"case": case, "parts": [(a, b, t.tolist()) for a, b, t in lost.parts], "counts": lost.counts,
               "windows": lost.windows, "boundary": [list(x) for x in d._boundary],
               "fragments": [list(x) for x in d._fragments], "orders": lost.orders, "lost_boundary": lost.boundary,
               "jobs": lost.jobs, "submitted": d._jobs, "applied_jobs": sorted(d._applied_jobs)}
        if case == "boundary":
            row["sent"] = sent["args"][1].tolist()           # (column, delta, ...)
        else:
            f, column, delta = sent["args"][0], sent["args"][1], sent["args"][2]
            row.update(sent=delta.tolist(), fragment=f, window_steps=column[1],
                       seen=list(d._seen), trigger=list(d._at_trigger[f]))
        out.append(row)
    return out


def test_a_reduction_that_fails_while_waited_for_is_kept_with_what_it_sent():
    """The two waits that see a failed job (`_wait_pending` at the boundary, `_wait_stream`) keep
    it where `_lost` reads it: its pseudo-gradient as sent, the boundary's counts (H = 4 steps of
    3 samples), a fragment's window start."""
    from harness import run_ranks

    boundary, fragment = run_ranks(1, lose_a_reduction, timeout=120)[0]
    a = boundary["boundary"][-1][3]
    assert [p[:2] for p in boundary["parts"]] == [(x[2], x[3]) for x in boundary["boundary"]]
    assert sum((p[2] for p in boundary["parts"]), []) == boundary["sent"][:a]
    assert boundary["counts"][:2] == (4, 12) and boundary["windows"] == {}
    f = fragment["fragment"]
    _, _, a, b = fragment["fragments"][f]
    assert fragment["parts"] == [(a, b, fragment["sent"])] and fragment["counts"] is None
    # the window reopens where the lost job's began: its steps are counted again at the next trigger
    start = fragment["windows"][f]
    assert fragment["trigger"][0] - start[0] == fragment["window_steps"] and start[1] == 3 * start[0]
    # numbered (`DiLoCo._jobs`): the lost one applied nothing here, every one submitted before it did
    b = boundary["lost_boundary"]
    assert boundary["orders"] == [b] * len(boundary["boundary"]) and boundary["jobs"] == {}
    assert boundary["applied_jobs"] == list(range(b)) and boundary["submitted"] >= b + 1
    o = fragment["jobs"][f]
    assert fragment["orders"] == [o] and fragment["lost_boundary"] == -1
    assert o not in fragment["applied_jobs"] and set(range(o)) <= set(fragment["applied_jobs"])
