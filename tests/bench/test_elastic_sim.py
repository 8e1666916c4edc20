"""The figures `benchmarks/elastic_sim.py` derives for a killed and restarted worker, on round
tables made by hand (the arithmetic of the kill benchmark's targets)."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("elastic_sim", os.path.join(ROOT, "benchmarks", "elastic_sim.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(n, t, members, samples):
    return {"round": n, "t": t, "members": members, "samples": samples}


ALL = ["w0", "w1", "w2", "w3"]


def test_a_victim_absent_for_a_round(sim):
    table = [row(1, 10.0, ALL, [4, 2, 1, 1]), row(2, 20.0, ALL, [4, 2, 1, 1]),
             row(3, 30.0, ALL[:3], [40, 20, 10]), row(4, 50.0, ALL, [8, 4, 2, 2])]
    out = sim.victim_figures(table, "w3", restart_t=25.0, asked_t=28.0, first_contribution=4)
    assert out["gone_rounds"] == [3]
    assert out["survivors_samples_per_s"] == pytest.approx(70 / 10.0)      # round 3, from round 2's end
    assert out["rounds_from_restart_to_contribution"] == 2                # round 3 in progress, then 4
    assert out["rounds_from_join_request_to_contribution"] == 2


def test_a_victim_back_inside_the_round_it_died_in(sim):
    table = [row(1, 10.0, ALL, [4, 2, 1, 1]), row(2, 20.0, ALL, [4, 2, 1, 1]),
             row(3, 45.0, ALL, [40, 20, 10, 3])]
    out = sim.victim_figures(table, "w3", restart_t=25.0, asked_t=31.0, first_contribution=3)
    assert out["gone_rounds"] == []
    assert out["survivors_samples_per_s"] == pytest.approx(70 / 25.0)      # its own 3 samples left out
    assert out["rounds_from_restart_to_contribution"] == 1
    assert out["rounds_from_join_request_to_contribution"] == 1


def test_the_first_contribution_is_the_restarted_incarnations(sim):
    lines = [{"start": 100.0, "pid": 1},
             {"round": 1, "pid": 1, "members": ALL, "steps": [1, 1, 1, 1]},
             {"round": 2, "pid": 1, "members": ALL, "steps": [1, 1, 1, 1]},
             {"start": 140.0, "pid": 2},
             {"round": 3, "pid": 2, "members": ALL, "steps": [5, 5, 5, 0]},     # joined after its steps
             {"round": 4, "pid": 2, "members": ALL, "steps": [5, 5, 5, 2]}]
    assert sim.first_contribution(lines, "w3", 139.5) == 4
    assert sim.first_contribution(lines, "w3", 150.0) is None                # no incarnation started then


def test_the_survivors_while_the_victim_is_gone_against_the_same_seconds_of_three(sim):
    # progress lines: [rank, seconds from the run's start, samples so far]
    kill = {"ranks": [0, 1, 2, 3], "kill_t": 10.0, "back_t": 30.0, "progress": [
        [0, 9.0, 100], [0, 12.0, 130], [0, 25.0, 200], [0, 31.0, 260],
        [1, 10.0, 50], [1, 29.5, 90], [2, 5.0, 20], [2, 40.0, 60],     # rank 2: no line in the window
        [3, 9.5, 40], [3, 20.0, 0], [3, 29.0, 16]]}                     # the victim: left out
    three = {"ranks": [0, 1, 2], "progress": [
        [0, 10.0, 100], [0, 30.0, 300], [1, 10.0, 50], [1, 30.0, 150], [2, 0.0, 0], [2, 30.0, 50]]}
    # ours: rank 0 200-100, rank 1 90-50, rank 2 20-20 = 140; theirs: 200 + 100 + 50 = 350
    assert sim.samples_between(kill["progress"], [0, 1, 2], 10.0, 30.0) == 140
    assert sim.samples_between(three["progress"], [0, 1, 2], 10.0, 30.0) == 350
    stub = {"survivors_samples_per_s": None, "survivors_samples_per_s_after_detection": None, "final_loss": None,
            "samples": 1, "rounds_from_restart_to_contribution": None,
            "rounds_from_join_request_to_contribution": None, "samples_per_s": None}
    ratios, summary = sim.summarise({"three": [{**stub, **three}], "kill": [{**stub, **kill}], "four": [stub]})
    assert ratios[0]["survivors_while_gone_vs_three_same_seconds"] == pytest.approx(140 / 350)
    assert ratios[0]["seconds_gone"] == pytest.approx(20.0)
    assert summary["survivors_while_gone_vs_three_same_seconds"]["median"] == pytest.approx(0.4)


def test_the_survivors_stops_are_read_from_the_workers_logs(sim, tmp_path):
    logs = {
        0: ["hetcomm ElasticDiLoCo [w0]: generation 1 started 1.49 s after the decision that admits it (group 1.39 s)",
            "hetcomm ElasticDiLoCo [w0]: generation 2 started 0.37 s after the failure (syncs in flight 0.00 s)",
            "train_elastic [w0]: round   3 | members w0,w1,w2",
            "hetcomm ElasticDiLoCo [w0]: generation 3 started 0.49 s after the agreement to change members (epoch 0.01 s)"],
        1: ["hetcomm ElasticDiLoCo [w1]: generation 2 started 0.42 s after the failure (epoch 0.08 s)",
            "hetcomm ElasticDiLoCo [w1]: generation 3 started 0.53 s after the agreement to change members (epoch 0.00 s)"],
        2: ["hetcomm ElasticDiLoCo [w2]: generation 3 started 2.45 s after the decision that admits it (start 2.21 s)"]}
    for k, lines in logs.items():
        (tmp_path / f"w{k}.log").write_text("\n".join(lines) + "\n")
    changes = sim.generation_changes(str(tmp_path), [0, 1, 2, 3])           # (w3 has no log: none)
    assert len(changes) == 6 and changes[1] == {"rank": 0, "generation": 2, "seconds": 0.37, "after": "failure"}
    kill = {"ranks": [0, 1, 2], "generation_changes": changes}               # the victim: the last rank
    assert sim.survivors_stop(kill, "failure") == 0.42
    assert sim.survivors_stop(kill, "agreement to change members") == 0.53
    assert sim.survivors_stop(kill, "decision that admits it") is None      # generation 1 (the start) left out


def test_the_victim_is_back_when_a_survivor_first_saw_it_joined(sim):
    class Job:
        ranks = [0, 1, 2, 3]

        @staticmethod
        def records(k):
            return {0: [{"t": 105.0, "event": {"joined": ["w0", "w1", "w2", "w3"]}},     # the start: before the restart
                        {"t": 152.0, "event": {"joined": ["w3"]}}],
                    1: [{"t": 151.0, "event": {"joined": ["w3"]}}, {"t": 160.0, "progress": 5}],
                    2: [{"t": 150.5, "event": {"left": {"w3": "gone"}, "joined": []}}],
                    3: [{"t": 149.0, "event": {"joined": ["w3"]}}]}[k]                 # the victim's own: not counted
    assert sim.back_time(Job, 3, restart_abs=140.0, started=100.0) == pytest.approx(51.0)
    assert sim.back_time(Job, 3, restart_abs=155.0, started=100.0) is None
