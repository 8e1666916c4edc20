"""DiLoCo with elastic membership (``hetcomm.DiLoCo(membership=hetcomm.Elastic(...))``,
`hetcomm.train.elastic.run`): DiLoCo in generations, each one a DiLoCo over the members of the time.

The matrix of features a real run combines -- {fixed, time} × {fp32, int8} × {no overlap, overlap
with staggered fragments} × {one rank per worker, two-rank workers} -- each with a worker (or one
rank of a worker) killed mid-round and restarted; a worker killed inside the reduction, and a rank
that fails right after a reduction the others applied. Asserted every time: no process hangs (each has a deadline), every report of a round carries one fingerprint of
the global parameters (restarted incarnations included), every survivor reaches the last round
with the same final parameters, the victim's death and its restart are in the membership
records, and the restart contributed steps to a round after it joined. Every step a surviving
worker took is in exactly one round's record (the round a failure or a join interrupted goes on
in the next generation, and with overlap so do the reductions in flight the failure left
unapplied); a joiner contributes to the round it asked to join in.
"""
from __future__ import annotations

import itertools
import json
import re
import time

import pytest
import torch

from elastic_job import DEADLINE, Run, check_agreement, events, final, wait_for
from elastic_worker import linear_pull
from marks import hetcomm_only

pytestmark = pytest.mark.usefixtures("backend_importable")


def _features(policy: str, codec: str, overlap: bool) -> list[str]:
    args = (["--local-steps", "time"] if policy == "time" else []) + (["--compress", codec] if codec != "fp32" else [])
    if overlap:
        return args + ["--overlap", "--fragments", "2"]
    # fp32 without overlap: each step moves the replica by a constant (`assert_linear_reference`)
    return args + (["--linear"] if codec == "fp32" else [])


# {fixed, time} × {fp32, int8} × {no overlap, overlap with staggered fragments}: "fixed-fp32", ...,
# "time-int8-overlap-staggered"
FEATURES = {f"{p}-{c}" + ("-overlap-staggered" if o else ""): _features(p, c, o)
            for p, c, o in itertools.product(["fixed", "time"], ["fp32", "int8"], [False, True])}


def steps_recorded(run: Run, w: str) -> int:
    """The steps of ``w`` in the rounds it reports (its own and those it received)."""
    return sum(r["steps"][r["members"].index(w)] for r in run.records(w) if "round" in r and w in r["members"])


def assert_linear_reference(run: Run, w: str) -> None:
    """``--linear``: each step moves worker v's replica by −0.01·c_v (`linear_pull`), and the outer step (SGD, lr
    1) moves the global parameters by the weighted mean of the workers' moves, so after the run
    they are −0.01 Σ_rounds Σ_v weight·steps·c_v (float64, from the records ``w`` reports)."""
    expected = torch.zeros(8, dtype=torch.float64)
    for r in (r for r in run.records(w) if "round" in r):
        for v, weight, steps in zip(r["members"], r["weights"], r["steps"]):
            expected -= 0.01 * weight * steps * linear_pull(v).double()
    got = torch.tensor(final(run, w)["global"], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected, run.records(w))


def reduced_lineage(run: Run, ids: list[str]) -> list[dict]:
    """``--log-reductions``: the reductions the run's state went through. In each generation
    every worker applied a part of the same sequence, in order (the one that applied most held
    the state the next generation started from; a worker whose job failed may have applied the
    one queued behind it): checked, and that sequence taken."""
    logs = {w: [json.loads(line) for line in (run.out / f"{w}.reductions.jsonl").read_text().splitlines()]
            for w in ids}
    lineage = []
    for gen in sorted({r["gen"] for done in logs.values() for r in done}):
        seqs = {w: [r for r in done if r["gen"] == gen] for w, done in logs.items()}
        longest = max(seqs.values(), key=len)
        for w, seq in seqs.items():
            rest = iter(longest)
            assert all(r in rest for r in seq), (gen, w, seq, longest)      # (a subsequence)
        lineage += longest
    return lineage


def assert_each_step_reduced_once(run: Run, ids: list[str], linear: bool) -> None:
    """``--log-reductions``: in the reductions the state went through (`reduced_lineage`), every
    worker's steps appear exactly once in each fragment's windows: as many as it took. A round or
    window carried on, or taken out, wrongly counts steps twice or never there, whatever the
    rounds' records say. With ``--linear`` (fp32, an outer SGD of lr 1) the final global
    parameters are also the float64 sum of those reductions' moves: −0.01 Σ weight·steps·c_v
    over each one's elements (with overlap, at ``--early-weight 1``: a window's steps are kept
    whole when its update lands)."""
    done = reduced_lineage(run, ids)
    ranges = sorted({tuple(r["elements"]) for r in done})
    assert [b for _, b in ranges][:-1] == [a for a, _ in ranges][1:] and ranges[0][0] == 0, ranges
    for v in ids:
        for span in ranges:
            counted = sum(r["steps"][r["names"].index(v)] for r in done
                          if tuple(r["elements"]) == span and v in r["names"])
            assert counted == final(run, v)["steps_taken"], (v, span, counted, final(run, v), done)
    if linear:
        expected = torch.zeros(ranges[-1][1], dtype=torch.float64)
        for r in done:
            a, b = r["elements"]
            for v, steps, weight in zip(r["names"], r["steps"], r["weights"]):
                expected[a:b] -= 0.01 * weight * steps * linear_pull(v)[a:b].double()
        for w in ids:
            got = torch.tensor(final(run, w)["global"], dtype=torch.float64)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (w, got, expected, done)


def assert_state_counted(run: Run, w: str, rounds: int) -> None:
    """``--linear`` (8 parameters, an outer SGD without momentum): while a generation runs, a rank
    keeps the global parameters, the round's start point and one pseudo-gradient, 12 bytes a
    parameter (`state_bytes`: every storage reachable from the object), through every generation:
    the run keeps no second copy of the generation's state. After the last round: the global
    parameters alone (a flat copy of them stayed there until 12-05, never read)."""
    seen = {r["round"]: r["state_bytes"] for r in run.records(w) if "round" in r}
    assert seen == {r: 12 * 8 if r < rounds else 4 * 8 for r in range(1, rounds + 1)}, (w, seen)


def contributed_after_rejoining(run: Run, victim: str, worker: str, after: int) -> bool:
    late = [rec for rec in run.records(victim) if "round" in rec and rec["round"] > after]
    return any(rec["steps"][rec["members"].index(worker)] > 0 for rec in late if worker in rec["members"])


# ... and the same with the fragments' transfers paced (the caps of hetcomm's links)
FEATURES["time-int8-overlap-staggered-paced"] = FEATURES["time-int8-overlap-staggered"] + ["--pace", "0.5"]
CASES = [(f, "local") for f in FEATURES] + [("fixed-fp32", "reduce"), ("time-int8-overlap-staggered", "reduce")]


@pytest.mark.slow
@pytest.mark.parametrize("features,where", [
    pytest.param(f, w, id=f"{f}-{w}", marks=[hetcomm_only("pace caps hetcomm's links")] if "--pace" in FEATURES[f] else [])
    for f, w in CASES])
def test_a_worker_killed_is_dropped_and_its_restart_rejoins(run, features, where):
    """``local``: halfway through a round's steps; ``reduce``: inside the outer reduction (with
    overlap, on the background thread), where the others may or may not have finished it."""
    # ~0.6 s rounds: the restart finds the run going on, with rounds left to contribute to
    rounds, ids = 10, ["w0", "w1", "w2"]
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.15", *FEATURES[features]]
    # (paced: over TCP links, which pacing caps; shared memory has no rate to cap)
    env = {"HETCOMM_LOCAL": "tcp"} if "--pace" in FEATURES[features] else None
    procs = {w: run.start(w, *common, "--min-workers", "3", *(["--die", f"2:{where}"] if w == "w1" else
                                                               ["--slow-until", f"{run.out / 'w1.joined'}:4"]), env=env)
             for w in ids}
    wait_for(procs["w1"], run)
    assert procs["w1"].returncode == -9, run.logs()
    for marker in ("w1.joined", "w1.started"):          # (its first incarnation's)
        (run.out / marker).unlink()
    run.start("w1", *common, env=env)
    codes = run.wait_all()
    assert all(c[-1] == 0 for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ids, rounds)
    for w in ids:
        end = final(run, w)
        assert end["rounds"] == rounds and end["final"] == prints[rounds], (w, end, run.logs())
    left, joined = events(final(run, "w0"))
    assert "w1" in left and "w1" in joined, final(run, "w0")["membership"]
    assert contributed_after_rejoining(run, "w1", "w1", 2), f"{run.records('w1')}\n{run.logs()}"
    for w in ("w0", "w2"):     # the survivors' steps of the round w1 died in went on (with overlap, so did
        # the reductions in flight its death failed: `carry.Lost`)
        assert steps_recorded(run, w) == final(run, w)["steps_taken"], (w, run.records(w), run.logs())
    if "--linear" in FEATURES[features]:
        assert_linear_reference(run, "w0")
        for w in ("w0", "w2"):
            assert_state_counted(run, w, rounds)
    # The generation w1 came back in: with overlap the survivors did not wait for its state (sent
    # in that generation's background, `handover`: no "state" phase on their side); without, the
    # epoch sent it.
    back = max(e["generation"] for e in final(run, "w0")["membership"] if "w1" in e.get("joined", ()))
    formed = [g["formed"] for g in final(run, "w0")["stats"]["generations"]
              if g["generation"] == back and g.get("formed")]
    assert formed and all(("state" in f) != ("--overlap" in FEATURES[features]) for f in formed), \
        (back, formed, final(run, "w0")["membership"])
    if "--overlap" in FEATURES[features]:
        assert "while the others trained" in run.logs(), run.logs()
    if "--pace" in FEATURES[features]:           # the fragments' jobs were paced, in every worker
        assert all(final(run, w)["paced_jobs"] > 0 for w in ids), [final(run, w)["paced_jobs"] for w in ids]


@pytest.mark.slow
@hetcomm_only("gloo cannot abort a collective in progress: the watchdog needs the hetcomm backend")
def test_a_frozen_worker_is_dropped_by_its_heartbeat_while_the_others_wait_in_a_collective(run):
    """SIGSTOP closes no connection: the others wait in a collective with the frozen worker, which
    would hold them until collective_timeout (60 s here). Its heartbeat's silence (timeout 3 s)
    aborts the generation (`watchdog`): the others go on without it within seconds, and thawed,
    it finds itself dropped and rejoins; every report of a round agrees."""
    import signal

    rounds, ids = 20, ["w0", "w1", "w2"]
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.15", "--timeout", "3",
              "--collective-timeout", "60", "--overlap", "--fragments", "2"]
    procs = {w: run.start(w, *common, "--min-workers", "3") for w in ids}
    deadline = time.monotonic() + DEADLINE
    while not any(r.get("round", 0) >= 2 for r in run.records("w2")):
        assert time.monotonic() < deadline and procs["w2"].poll() is None, run.logs()
        time.sleep(0.05)
    procs["w2"].send_signal(signal.SIGSTOP)
    frozen, without = time.monotonic(), None
    try:
        while without is None and time.monotonic() - frozen < 30:
            without = next((r for r in run.records("w0") if "round" in r and "w2" not in r["members"]), None)
            time.sleep(0.1)
    finally:
        procs["w2"].send_signal(signal.SIGCONT)
    assert without is not None, f"no round without the frozen w2 within 30 s\n{run.logs()}"
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ids, rounds)
    assert all(final(run, w)["final"] == prints[rounds] for w in ids), run.logs()
    left = [why for e in final(run, "w0")["membership"] for w, why in e.get("left", {}).items() if w == "w2"]
    assert any("no heartbeat" in why for why in left), final(run, "w0")["membership"]
    assert "sent no heartbeat for" in run.logs(), run.logs()
    assert contributed_after_rejoining(run, "w2", "w2", without["round"]), f"{run.records('w2')}\n{run.logs()}"


@pytest.mark.slow
def test_a_holder_killed_while_it_sends_a_joiner_the_state_in_the_background(run):
    """With overlap the state goes to a joiner on the generation's background thread while the
    holders train (`handover`). w1 dies and restarts; w2 dies in the middle of sending it the
    state: the generation fails, w1 (which holds nothing yet) is sent the state again by w0 and w3,
    and everyone agrees."""
    rounds, ids = 10, ["w0", "w1", "w2", "w3"]
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.1",
              *FEATURES["fixed-int8-overlap-staggered"]]
    procs = {w: run.start(w, *common, "--min-workers", "4",
                          *({"w1": ["--die", "2:local"], "w2": ["--die", "2:transfer"]}.get(w, []))) for w in ids}
    wait_for(procs["w1"], run)
    for marker in ("w1.joined", "w1.started"):
        (run.out / marker).unlink()
    run.start("w1", *common)
    wait_for(procs["w2"], run)
    assert procs["w2"].returncode == -9, run.logs()
    codes = run.wait_all()
    assert codes["w0"] == [0] and codes["w3"] == [0] and codes["w1"][-1] == 0, f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ["w0", "w1", "w3"], rounds)
    assert final(run, "w1")["final"] == prints[rounds], run.logs()
    assert any("aborted" in e for e in final(run, "w0")["membership"]), final(run, "w0")["membership"]
    assert contributed_after_rejoining(run, "w1", "w1", 2), f"{run.records('w1')}\n{run.logs()}"
    assert "while the others trained" in run.logs(), run.logs()


@pytest.mark.slow
def test_a_worker_restarted_after_a_generation_without_it_is_planned_from_its_step_times(run):
    """``time``: w1 dies after four rounds and comes back only once w0 and w2 recorded a round
    without it. The generation it rejoins re-plans the round length at its first agreement,
    from every worker's step times: w1's, measured before it died, were kept through the
    generation without it. (Lost, w1 counts as unmeasured and the rounds keep the plan carried
    in until it has been measured twice again: the first two plans of that generation equal.)"""
    rounds, ids = 20, ["w0", "w1", "w2"]
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.15", "--local-steps", "time"]
    procs = {w: run.start(w, *common, "--min-workers", "3", *(["--die", "4:local"] if w == "w1" else []))
             for w in ids}
    wait_for(procs["w1"], run)
    deadline = time.monotonic() + DEADLINE
    while not any("round" in r and "w1" not in r["members"] for r in run.records("w0")):
        if time.monotonic() > deadline or any(p.poll() is not None for w, p in procs.items() if w != "w1"):
            pytest.fail(f"no round without w1 was recorded\n{run.logs()}")
        time.sleep(0.05)
    for marker in ("w1.joined", "w1.started"):
        (run.out / marker).unlink()
    run.start("w1", *common)
    codes = run.wait_all()
    assert all(c[-1] == 0 for c in codes.values()), f"{codes}\n{run.logs()}"
    recs = [r for r in run.records("w0") if "round" in r]
    without = min(r["gen"] for r in recs if "w1" not in r["members"])
    back = min((r["gen"] for r in recs if r["gen"] > without and "w1" in r["members"]), default=None)
    assert back is not None, f"w1 never rejoined\n{recs}\n{run.logs()}"
    plans = [r["plan"]["round_seconds"] for r in recs if r["gen"] == back]
    assert len(plans) >= 2 and None not in plans and plans[1] != plans[0], (plans, recs)
    # stats() holds every generation w0 took part in, each with its number
    end = final(run, "w0")
    member_of = sorted({e["generation"] for e in end["membership"] if "w0" in e.get("members", ())})
    # (a generation re-formed with the same members keeps its number)
    assert sorted({g["generation"] for g in end["stats"]["generations"]}) == member_of, (end["stats"],
                                                                                      end["membership"])
    assert sum(g.get("rounds", 0) for g in end["stats"]["generations"]) == rounds, end["stats"]


@pytest.mark.slow
@pytest.mark.parametrize("features", ["fixed-fp32", "time-int8-overlap-staggered"])
def test_a_whole_job_resumes_from_checkpoints(tmp_path, features):
    """Three workers save at every round boundary and stop after round 3; started again with their
    checkpoints on the same store and job, they start a new era and run to round 8. ``fixed``
    without overlap: the final parameters are bit for bit the uninterrupted run's (and the
    float64 reference's). With time, int8, overlap and staggered fragments the round in flight
    is not in a checkpoint: the resumed run goes on from the round saved, every report of a
    round carries one fingerprint, and the workers end alike."""
    rounds, ids = 8, ["w0", "w1", "w2"]
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--min-workers", "3", *FEATURES[features]]
    target = None
    if features == "fixed-fp32":
        (tmp_path / "whole").mkdir()
        whole = Run(tmp_path / "whole", "whole")
        try:
            for w in ids:
                whole.start(w, *common)
            assert all(c == [0] for c in whole.wait_all().values()), whole.logs()
            target = check_agreement(whole, ids, rounds)[rounds]
        finally:
            whole.close()
    (tmp_path / "parts").mkdir()
    parts = Run(tmp_path / "parts", "parts")
    try:
        ckpt = {w: str(tmp_path / f"{w}.pt") for w in ids}
        for w in ids:
            parts.start(w, *common, "--save", ckpt[w], "--stop-after", "3")
        assert all(c == [0] for c in parts.wait_all().values()), parts.logs()
        states = {w: torch.load(ckpt[w], weights_only=False) for w in ids}
        saved = {w: st["round"] for w, st in states.items()}
        assert all(r >= 3 for r in saved.values()), saved
        from hetcomm.train import flat as _flat

        for w, st in states.items():        # the parameters are those of the round it names
            assert len(st["history"]) == st["round"], (w, st["round"], len(st["history"]))
            assert _flat.fingerprint(_flat.flatten(st["global"])) == st["history"][-1]["fingerprint"], w
        for w in ids:                  # the same job on the same store: the dead era is replaced
            parts.start(w, *common, "--load", ckpt[w])
        assert all(c[-1] == 0 for c in parts.wait_all().values()), parts.logs()
        if target is not None:
            prints = check_agreement(parts, ids, rounds)
        else:
            # (a checkpoint holding a round its worker had not reported yet: the resumed
            # incarnations report from the round after it)
            prints = check_agreement(parts, ids, rounds, missing=set(range(4, max(saved.values()) + 1)))
        ends = {final(parts, w)["final"] for w in ids}
        assert ends == {prints[rounds]}, (ends, parts.logs())
        if target is not None:
            assert ends == {target}, f"resumed {ends}, uninterrupted {target}\n{parts.logs()}"
            assert_linear_reference(parts, "w0")
        assert "starts or joins era 2" in parts.logs(), parts.logs()
    finally:
        parts.close()


@pytest.mark.parametrize("features", ["fixed-fp32", "time-int8-overlap-staggered"])
def test_a_rank_that_fails_after_a_reduction_the_others_applied_catches_up_from_them(run, features):
    """w0's reduction raises right after it returned, before w0 applied it: w1 and w2 applied it
    and go on until their next collective fails (w0 left the group). The next epoch must name
    the two that are one outer step ahead as the holders (else the members' rounds or
    fingerprints differ: a ValueError or RuntimeError on every worker) and send their state to w0."""
    run_behind(run, features, "behind", rounds=6, extra=("--log-reductions",))
    linear = "--linear" in FEATURES[features]
    if linear:
        assert_linear_reference(run, "w0")
    assert_each_step_reduced_once(run, ["w0", "w1", "w2"], linear)
    assert any("aborted" in e for e in final(run, "w1")["membership"]), final(run, "w1")["membership"]


def run_behind(run: Run, features: str, where: str, rounds: int, extra: tuple = ()) -> None:
    """w0 runs with ``--die 2:<where>`` (a ``behind`` kind), w1 and w2 without: all end well, on
    the same global parameters, every step counted once (w0's in the update it missed or in the
    round it carried on; the others' round went on after their collective failed), nobody dropped."""
    ids = ["w0", "w1", "w2"]
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--min-workers", "3", *FEATURES[features], *extra]
    for w in ids:
        run.start(w, *common, *(["--die", f"2:{where}"] if w == "w0" else []))
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ids, rounds)
    for w in ids:
        assert final(run, w)["final"] == prints[rounds], (w, final(run, w))
        assert steps_recorded(run, w) == final(run, w)["steps_taken"], (w, run.records(w), run.logs())
    # (w0's own event gave way to the holders' records, which it received: its log says it)
    assert "injected: this rank fails right after the reduction" in run.logs(), run.logs()
    left, _ = events(final(run, "w1"))
    assert not left, final(run, "w1")["membership"]          # nobody was dropped: w0 caught up


@pytest.mark.parametrize("features", ["fixed-fp32-overlap-staggered", "time-int8-overlap-staggered"])
def test_a_round_boundary_that_failed_after_some_of_its_fragments_keeps_the_rest_of_the_round(run, features):
    """w0 fails right after the first reduction of a synchronous round boundary (the last round's
    with overlap): w1 and w2 applied that fragment, then their next reduction fails. No member
    finished the boundary, so no one records the round: each keeps it without the fragment the
    state holds (else its steps are counted nowhere) and the next generation reduces the rest.
    (`test_carry.py` checks what is taken out against hand-computed numbers.)

    The boundary reduces the staggered fragment 1 first, twice: once for the ranks that did not
    fire it in the round (their window; a rank that did sent it in a background job, before its
    boundary began, and that job lines up with this reduction), then once more on every rank (the
    steps since its trigger). w0's first reduction inside its boundary is always one the others
    applied, so w0 always takes fragment 1 out. So does every rank when w0 had fired fragment 1
    (w0 failed after the second). When w0 had not, a rank that had (under load, in CI of 12-06)
    sent its window before its boundary began, and the reduction that failed held only its steps
    since the trigger: it takes nothing out (else those steps' updates are lost)."""
    linear = "fp32" in features             # (int8: the steps alone)
    extra = ("--tell-fired", "--log-reductions",
             *(("--linear", "--linear-parts", "2", "--early-weight", "1") if linear else ()))
    run_behind(run, features, "behind-sync", rounds=4, extra=extra)
    assert_each_step_reduced_once(run, ["w0", "w1", "w2"], linear)
    fired = {}
    for i, w in enumerate(["w0", "w1", "w2"]):
        log = (run.out / f"{w}.{i}.log").read_text()
        before = re.findall(r"fired before the synchronous boundary: \[([\d, ]*)\]", log)
        assert before, run.logs()          # (the first: generation 1's; generation 2 ends the run so again)
        fired[w] = [int(x) for x in before[0].split(",") if x.strip()]
    for i, w in enumerate(["w0", "w1", "w2"]):
        log = (run.out / f"{w}.{i}.log").read_text()
        held = "without fragment(s) 1 of it that the state holds already" in log
        assert held == (w == "w0" or 1 in fired["w0"] or 1 not in fired[w]), (w, fired, run.logs())
        assert re.search(r"round 4 goes on in generation \d+: \d+ steps carried in", log), run.logs()


def test_a_rank_whose_boundary_recorded_the_round_before_its_worker_failed_carries_none(run):
    """Synchronous boundaries (fixed-fp32, ``--linear``): a1, a rank of worker a, dies in round 3's
    boundary after the round was recorded, before its worker's ranks agree on it, so a0 fails
    there. The state holds the round: a0 must carry none of it (else its steps are recorded
    again in the next round and the float64 reference is off). a0 and b0 go on."""
    rounds, ranks = 6, {"a0": "a", "a1": "a", "b0": "b"}
    common = ["--run", "--rounds", str(rounds), "--steps", "4", *FEATURES["fixed-fp32"]]
    for r, w in ranks.items():
        run.start(r, *common, "--worker", w, "--min-workers", "3", *(["--die", "3:agrees"] if r == "a1" else []))
    codes = run.wait_all()
    assert codes == {"a0": [0], "a1": [-9], "b0": [0]}, f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ["a0", "b0"], rounds)
    for r in ("a0", "b0"):
        assert final(run, r)["final"] == prints[rounds], (r, final(run, r))
    recorded = sum(r["steps"][r["members"].index("a")] for r in run.records("a0") if "round" in r)
    assert recorded == final(run, "a0")["steps_taken"], (run.records("a0"), run.logs())
    assert_linear_reference(run, "a0")
    assert "the generation failed" in (run.out / "a0.0.log").read_text(), run.logs()


@pytest.mark.slow
@pytest.mark.parametrize("features", list(FEATURES))
def test_one_rank_of_a_two_rank_worker_killed_and_restarted(run, features):
    """Two workers of two ranks each (a, b): rank b1 dies mid-round; worker b goes on with one
    rank, and b1's restart is a rank of b again."""
    rounds = 10
    ranks = {"a0": "a", "a1": "a", "b0": "b", "b1": "b"}
    common = ["--run", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.15", *FEATURES[features]]
    procs = {r: run.start(r, *common, "--worker", w, "--min-workers", "4",
                          *(["--die", "2:local"] if r == "b1" else ["--slow-until", f"{run.out / 'b1.joined'}:4"]))
             for r, w in ranks.items()}
    wait_for(procs["b1"], run)
    assert procs["b1"].returncode == -9, run.logs()
    for marker in ("b1.joined", "b1.started"):
        (run.out / marker).unlink()
    run.start("b1", *common, "--worker", "b")
    codes = run.wait_all()
    assert all(c[-1] == 0 for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, list(ranks), rounds)
    for r in ranks:
        assert final(run, r)["final"] == prints[rounds], (r, final(run, r))
    assert all(rec["members"] == ["a", "b"] for rec in run.records("a0") if "round" in rec), run.records("a0")
    # b1 is a rank of worker b again: the last generation has two workers of two ranks each
    assert final(run, "a0")["stats"]["generations"][-1]["workers"] == [[0, 1], [2, 3]], final(run, "a0")["stats"]
    assert any(rec["round"] > 2 for rec in run.records("b1") if "round" in rec), run.records("b1")
    # worker a's steps of the round b1 died in went on, with overlap its reductions in flight too (b's: dropped,
    # b1 is new)
    recorded = sum(r["steps"][r["members"].index("a")] for r in run.records("a0") if "round" in r)
    assert recorded == final(run, "a0")["steps_taken"], (run.records("a0"), run.logs())
    if "--linear" in FEATURES[features]:
        assert_linear_reference(run, "a0")
        for r in ("a0", "a1", "b0"):
            assert_state_counted(run, r, rounds)


@pytest.mark.parametrize("features", ["fixed-fp32", "time-int8-overlap-staggered"])
def test_a_worker_whose_update_is_not_finite_stops_and_the_others_go_on(run, features):
    """w1's parameters turn NaN in round 3: no outer update is applied with its pseudo-gradient;
    w1 stops with a ValueError, w0 and w2 go on without it from the same global parameters."""
    rounds, ids = 6, ["w0", "w1", "w2"]
    for w in ids:
        run.start(w, "--run", "--rounds", str(rounds), "--steps", "4", "--min-workers", "3", *FEATURES[features],
                  *(["--nan-at", "2"] if w == "w1" else []))
    codes = run.wait_all()
    assert codes == {"w0": [0], "w1": [1], "w2": [0]}, f"{codes}\n{run.logs()}"
    errors = [rec["error"] for rec in run.records("w1") if "error" in rec]
    assert errors and "this worker stops: its pseudo-gradient is not finite" in errors[-1], run.logs()
    prints = check_agreement(run, ["w0", "w2"], rounds)
    for w in ("w0", "w2"):
        assert final(run, w)["final"] == prints[rounds], (w, final(run, w))
    late = [rec for rec in run.records("w0") if rec.get("round", 0) > 3]
    assert late and all(rec["members"] == ["w0", "w2"] for rec in late), run.records("w0")


def test_a_worker_whose_data_ends_leaves_after_its_last_round_and_the_others_go_on(run):
    rounds, ids = 6, ["w0", "w1", "w2"]
    for w in ids:
        run.start(w, "--run", "--rounds", str(rounds), "--min-workers", "3", *(["--batches", "10"] if w == "w2" else []))
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ids, rounds)
    assert final(run, "w0")["final"] == final(run, "w1")["final"] == prints[rounds]
    left = [e["left"] for e in final(run, "w0")["membership"] if e.get("left")]
    assert left == [{"w2": "left: its data ended"}], left
    # its last partial round (10 batches = 2 rounds of 4 + 2 steps) was synchronised before it left
    third = [rec for rec in run.records("w0") if rec.get("round") == 3]
    assert third and third[0]["steps"][third[0]["members"].index("w2")] == 2, third
    after = [rec for rec in run.records("w0") if rec.get("round", 0) > 3]
    assert after and all(rec["members"] == ["w0", "w1"] for rec in after), after


JOINS = {
    "fixed-fp32": ["--linear"],
    "time-fp32": ["--linear", "--local-steps", "time"],
    "time-int8-overlap-staggered": FEATURES["time-int8-overlap-staggered"],
    # τ: a rank waits for its fragment's job τ steps after firing it, whoever cut the round
    "time-overlap-tau-staggered": ["--local-steps", "time", "--overlap", "--fragments", "3", "--overlap-steps", "2"],
}


@pytest.mark.parametrize("features", list(JOINS))
def test_a_joiner_contributes_to_the_round_it_asked_to_join_in(run, features):
    """w2 asks to join right after w0 reported round 2. The members cut round 3 where they see the
    request, admit w2, and go on with round 3 (their steps in it carried), to which w2 contributes:
    no step of anyone is lost or counted twice. With ``--linear`` (each step moves a worker's
    replica by a constant) the final global parameters equal a float64 sum over the recorded
    rounds' weights and steps."""
    rounds, ids = 8, ["w0", "w1", "w2"]
    # ~1.8 s rounds: the request is seen (store scan, heartbeat) well inside the round it came in
    common = ["--run", "--rounds", str(rounds), "--steps", "6", "--step-seconds", "0.3", *JOINS[features]]
    for w in ids[:2]:
        run.start(w, *common, "--min-workers", "2", "--slow-until", f"{run.out / 'w2.joined'}:4")
    run.start("w2", *common, "--wait-for", f"{run.out / 'w0.jsonl'}:2")
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ids, rounds)
    for w in ids:
        assert final(run, w)["final"] == prints[rounds], (w, final(run, w))
        assert steps_recorded(run, w) == final(run, w)["steps_taken"], (w, run.records(w), final(run, w))
    asked = float((run.out / "w2.started").read_text().split()[0])
    # the round in progress when it asked (with overlap a round is reported a round late)
    current = 1 + max((r["round"] for r in run.records("w0") if "round" in r and r["t"] <= asked), default=0)
    late = 1 if "overlap" in features else 0
    first = min(r["round"] for r in run.records("w2") if "round" in r and r["steps"][r["members"].index("w2")] > 0)
    assert current <= first <= current + late, (current, first, run.records("w0"), run.logs())
    if "--linear" in JOINS[features]:
        assert_linear_reference(run, "w0")
