"""Fault-tolerant DiLoCo (`hetcomm.ElasticDiLoCo`): workers are separate processes (tests/support/elastic_worker.py)
around a store of its own (`python -m hetcomm.store`); they are killed with SIGKILL mid-round, inside
the synchronisation and while another joins, restarted, and the store itself is killed.

What is asserted every time: no process hangs (each has a deadline), every worker that reports a
round reports the same fingerprint of the global parameters for it (restarted incarnations
included), the survivors reach the last round, and the membership records say who left and joined.

Workers and the store are forked (tests/support/forked.py): a restart trains within a fraction of
a second instead of the seconds a new interpreter took. A worker's heartbeat timeout is 10 s
(elastic_worker.py --timeout): deaths close its liveness connection and are known at once, and a
starved worker is no longer dropped at 3 s; only the frozen-worker test sets 3 s.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from marks import hetcomm_only
from elastic_job import DEADLINE, Run, check_agreement, events, final, wait_for

pytestmark = pytest.mark.usefixtures("backend_importable")

IDS = ["w0", "w1", "w2", "w3"]


@pytest.mark.slow
@pytest.mark.parametrize("victim,where", [("w0", "local"), ("w1", "reduce")],
                         ids=["first-member-mid-round", "inside-the-all-reduce"])
def test_a_killed_worker_is_dropped_and_its_restart_rejoins(run, victim, where):
    """(A kill mid-round of another member than the first was a case of its own; it took the same
    path as the first member's and was dropped as a duplicate.)"""
    # ~1 s rounds: the restarted worker finds the run going on, and its admission (a round or
    # two) leaves it rounds to contribute to (with 0.5 s rounds it sometimes came after the end)
    rounds = 10
    procs = {w: run.start(w, "--rounds", str(rounds), "--min-workers", "4", "--step-seconds", "0.25",
                          *(["--die", f"2:{where}"] if w == victim else
                            ["--slow-until", f"{run.out / (victim + '.joined')}:4"])) for w in IDS}
    wait_for(procs[victim], run)
    assert procs[victim].returncode == -9, run.logs()
    for marker in (".joined", ".started"):           # (its first incarnation's)
        (run.out / (victim + marker)).unlink(missing_ok=True)
    time.sleep(1.0)
    run.start(victim, "--rounds", str(rounds), "--step-seconds", "0.25")
    codes = run.wait_all()
    assert all(c[-1] == 0 for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, IDS, rounds)
    for w in IDS:
        end = final(run, w)
        assert end["rounds"] == rounds and end["final"] == prints[rounds], (w, end)
    left, joined = events(final(run, "w0" if victim != "w0" else "w1"))
    assert victim in left and victim in joined, final(run, "w1")
    # the restarted incarnation contributed steps to at least one round after joining
    late = [rec for rec in run.records(victim) if "round" in rec and rec["round"] > 2]
    assert any(rec["steps"][rec["members"].index(victim)] > 0 for rec in late), run.records(victim)


def test_two_killed_at_once(run):
    rounds = 6
    procs = {w: run.start(w, "--rounds", str(rounds), "--min-workers", "4",
                          *(["--die", "2:local"] if w in ("w1", "w2") else [])) for w in IDS}
    for w in ("w1", "w2"):
        wait_for(procs[w], run)
    codes = run.wait_all()
    assert codes["w0"] == [0] and codes["w3"] == [0], f"{codes}\n{run.logs()}"
    prints = check_agreement(run, IDS, rounds)
    assert final(run, "w0")["final"] == final(run, "w3")["final"] == prints[rounds]
    left, _ = events(final(run, "w0"))
    assert left == {"w1", "w2"}
    after = [rec for rec in run.records("w0") if "round" in rec and rec["round"] > 3]
    assert all(rec["members"] == ["w0", "w3"] for rec in after), after


@pytest.mark.slow
def test_a_holder_killed_while_another_joins(run):
    """w1 dies and restarts; w2 dies in the middle of sending w1 the state: the admission is
    redone from the remaining holders and everyone still agrees."""
    rounds = 10
    procs = {w: run.start(w, "--rounds", str(rounds), "--min-workers", "4", "--step-seconds", "0.25",
                          *({"w1": ["--die", "2:local"], "w2": ["--die", "2:transfer"]}.get(w, []))) for w in IDS}
    wait_for(procs["w1"], run)
    run.start("w1", "--rounds", str(rounds), "--step-seconds", "0.25")
    wait_for(procs["w2"], run)
    assert procs["w2"].returncode == -9, run.logs()
    codes = run.wait_all()
    assert codes["w0"] == [0] and codes["w3"] == [0] and codes["w1"][-1] == 0, f"{codes}\n{run.logs()}"
    prints = check_agreement(run, IDS, rounds)
    assert final(run, "w1")["final"] == prints[rounds]
    aborted = [e for e in final(run, "w0")["membership"] if "aborted" in e]
    assert aborted, final(run, "w0")["membership"]


@pytest.mark.slow
def test_checkpoints_resume_a_whole_job_to_the_uninterrupted_parameters(tmp_path):
    rounds = 6
    (tmp_path / "whole").mkdir()
    whole = Run(tmp_path / "whole", "whole")
    try:
        for w in IDS:
            whole.start(w, "--rounds", str(rounds), "--min-workers", "4")
        assert all(c == [0] for c in whole.wait_all().values()), whole.logs()
        target = check_agreement(whole, IDS, rounds)[rounds]
    finally:
        whole.close()
    (tmp_path / "parts").mkdir()
    parts = Run(tmp_path / "parts", "parts")
    try:
        ckpt = {w: str(tmp_path / f"{w}.pt") for w in IDS}
        for w in IDS:
            parts.start(w, "--rounds", str(rounds), "--min-workers", "4", "--save", ckpt[w], "--stop-after", "3")
        assert all(c == [0] for c in parts.wait_all().values()), parts.logs()
        for w in IDS:           # the same job on the same store: the dead era is replaced by a new one
            parts.start(w, "--rounds", str(rounds), "--min-workers", "4", "--load", ckpt[w])
        assert all(c[-1] == 0 for c in parts.wait_all().values()), parts.logs()
        ends = {final(parts, w)["final"] for w in IDS}
        assert ends == {target}, f"resumed {ends}, uninterrupted {target}\n{parts.logs()}"
    finally:
        parts.close()


def test_the_store_dying_raises_on_every_worker_naming_it(run):
    procs = {w: run.start(w, "--rounds", "10000", "--steps", "50", "--min-workers", "3") for w in IDS[:3]}
    deadline = time.monotonic() + DEADLINE
    while not all(any("round" in r for r in run.records(w)) for w in procs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), run.logs()
        time.sleep(0.2)
    killed = time.monotonic()
    run.store.kill()
    run.store.wait()
    for w, proc in procs.items():
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.close()
            pytest.fail(f"{w} did not notice the store's death within 60 s\n{run.logs()}")
        assert proc.returncode != 0
        errors = [r["error"] for r in run.records(w) if "error" in r]
        assert errors and "StoreUnreachable" in errors[-1] and f"127.0.0.1:{run.port}" in errors[-1], \
            (w, errors, run.logs())
    # generous: the heartbeat (0.5 s) notices at once; the rest is the processes' exit
    assert time.monotonic() - killed < 30


@pytest.mark.slow
def test_a_frozen_worker_is_dropped_by_its_heartbeat_and_rejoins_when_it_thaws(run):
    """SIGSTOP closes no connection: the heartbeat timeout (3 s here) drops the worker; thawed, it
    finds the run gone on without it, discards its round and joins again."""
    import signal

    rounds = 10
    procs = {w: run.start(w, "--rounds", str(rounds), "--min-workers", "4", "--step-seconds", "0.25",
                          "--timeout", "3") for w in IDS}
    deadline = time.monotonic() + DEADLINE
    while not any(r.get("round", 0) >= 2 for r in run.records("w3")):
        assert time.monotonic() < deadline and procs["w3"].poll() is None, run.logs()
        time.sleep(0.1)
    procs["w3"].send_signal(signal.SIGSTOP)
    time.sleep(6.0)
    procs["w3"].send_signal(signal.SIGCONT)
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, IDS, rounds)
    assert final(run, "w3")["final"] == prints[rounds]
    left = [e["left"] for e in final(run, "w0")["membership"] if e.get("left")]
    assert any("no heartbeat" in why for e in left for w, why in e.items() if w == "w3"), left
    assert "dropped" in (run.out / "w3.3.log").read_text(), run.logs()


@pytest.mark.slow
def test_a_new_worker_joins_a_running_job(run):
    """Elastic growth: w2 was never part of the job; it is admitted at a boundary, receives the
    state from both holders and contributes from the next round."""
    rounds = 10
    for w in ("w0", "w1"):
        run.start(w, "--rounds", str(rounds), "--min-workers", "2", "--step-seconds", "0.25")
    deadline = time.monotonic() + DEADLINE
    while not any(r.get("round", 0) >= 2 for r in run.records("w0")):
        assert time.monotonic() < deadline, run.logs()
        time.sleep(0.1)
    run.start("w2", "--rounds", str(rounds), "--step-seconds", "0.25")
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ["w0", "w1", "w2"], rounds)
    assert final(run, "w2")["final"] == prints[rounds]
    joined = [r for r in run.records("w0") if "round" in r and "w2" in r["members"]]
    assert joined and joined[-1]["members"] == ["w0", "w1", "w2"], run.records("w0")


@pytest.mark.slow
def test_a_worker_that_joined_once_sends_the_state_in_the_founders_dtypes(run):
    """The outer optimizer keeps an int32 count per parameter, which a joiner's load_state_dict
    casts to the parameters' float32. w2 joins at round 2; w3 joins at round 5 and receives the
    state from w0, w1 and w2, in the dtypes the first holder names: every report of every round
    agrees, and the counts scale the steps alike (a count read from float32 bits would not)."""
    rounds = 12                     # rounds of about 1.2 s: a worker starts in 3-4 s
    common = ("--rounds", str(rounds), "--step-seconds", "0.3", "--counting-outer")
    for w in ("w0", "w1"):
        run.start(w, *common, "--min-workers", "2")
    for w, after in (("w2", 2), ("w3", 5)):
        deadline = time.monotonic() + DEADLINE
        while not any(r.get("round", 0) >= after for r in run.records("w0")):
            assert time.monotonic() < deadline, run.logs()
            time.sleep(0.1)
        run.start(w, *common)
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ["w0", "w1", "w2", "w3"], rounds)
    assert {final(run, w)["final"] for w in ("w0", "w1", "w2", "w3")} == {prints[rounds]}
    assert any("w3" in r.get("members", []) for r in run.records("w0")), run.records("w0")


def test_the_state_a_joiner_receives_is_never_unpickled(tmp_path):
    """What the holders announce to a joiner travels as JSON: an outer optimizer's state layout
    (integer keys, tuples) comes back as torch made it; a pickle that would run code, garbage,
    deep nesting and wrong types are refused with a ValueError and run nothing."""
    import json
    import pickle
    from types import SimpleNamespace

    import torch

    from hetcomm.train.elastic import common, generation

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tensors: list = []
    skeleton = generation.Generation._skeleton(opt.state_dict(), tensors)
    meta = {"skeleton": skeleton, "round": 3, "samples_total": 96, "history": [], "membership": []}
    back = generation._decode_meta(json.dumps(common._to_json(meta)).encode())
    assert back == meta and back["skeleton"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert set(back["skeleton"]["state"]) == {0, 1}                   # integer keys, as torch's

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for raw in (pickle.dumps(Payload()), b"\x80\x04garbage", b"[1, 2]", b'{"__items__": 5}',
                b"[" * 100_000 + b"]" * 100_000, b""):
        with pytest.raises(ValueError, match="cannot join"):
            generation._decode_meta(raw)
    assert not marker.exists()

    joiner = SimpleNamespace(_global=[torch.zeros(2, 3), torch.zeros(2)], _codec_name="fp32")
    good = {"dtypes": ["torch.float32"] * 2, "sizes": [6, 2], "shapes": [[2, 3], [2]], "codec": "fp32",
            "round": 1, "samples_total": 8, "history": [], "membership": [], "skeleton": {}}
    generation.Generation._check_meta(joiner, good)
    for bad in ({"history": "abc"}, {"round": -1}, {"membership": [1]}, {"skeleton": None},
                {"sizes": [6, 2 ** 40]}, {"dtypes": ["torch.float32", "load"]}):
        with pytest.raises(ValueError, match="cannot join"):
            generation.Generation._check_meta(joiner, {**good, **bad})


def announce_a_huge_length(rank: int, world_size: int) -> str:
    """Rank 0 is a peer that announces 2**40 bytes of metadata; rank 1 must refuse before it
    allocates them."""
    import torch
    import torch.distributed as dist

    from hetcomm.train.elastic import generation

    if rank == 0:
        dist.broadcast(torch.tensor([2 ** 40], dtype=torch.int64), src=0)
        return "announced"
    try:
        generation._broadcast_meta(None, 0)
    except ValueError as e:
        return str(e)
    return "took it"


def test_metadata_a_peer_announces_is_bounded_before_it_is_allocated():
    from harness import run_ranks

    outcomes = run_ranks(2, announce_a_huge_length, timeout=60)
    assert "announced 1099511627776 bytes of metadata" in outcomes[1], outcomes


def test_arguments_and_misuse_raise_clearly():
    import torch
    import torch.distributed as dist

    import hetcomm

    store = dist.HashStore()
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="timeout"):
        hetcomm.ElasticDiLoCo(model, store=store, heartbeat=2.0, timeout=5.0)
    with pytest.raises(ValueError, match="steps"):
        hetcomm.ElasticDiLoCo(model, store=store, steps=0)
    with pytest.raises(ValueError, match="job"):
        hetcomm.ElasticDiLoCo(model, store=store, job="a/b")
    with pytest.raises(ValueError, match="store must be"):
        hetcomm.ElasticDiLoCo(model, store="nohostport")
    with pytest.raises(hetcomm.StoreUnreachable, match="127.0.0.1:1"):
        hetcomm.ElasticDiLoCo(model, store="127.0.0.1:1", heartbeat=1.0, timeout=4.0)
    d = hetcomm.ElasticDiLoCo(model, store=store, job="misuse")
    with pytest.raises(RuntimeError, match="before join"):
        d.step()
    with pytest.raises(RuntimeError, match="before this worker was admitted"):
        d.state_dict()
    d.close()


def test_the_constructor_maps_its_arguments_onto_diloco_in_generations():
    """`hetcomm.ElasticDiLoCo` is DiLoCo(membership=Elastic(...)): steps -> fixed, round_seconds ->
    time, the membership arguments to Elastic, any other DiLoCo option through; a worker with
    other steps is refused naming them (the per-round class let each worker keep its own)."""
    import torch
    import torch.distributed as dist

    import hetcomm

    store, model = dist.HashStore(), torch.nn.Linear(2, 1)
    made = []

    def make(**kw):
        made.append(hetcomm.ElasticDiLoCo(model, store=store, job="thin", **kw))
        return made[-1]
    try:
        fixed = make(steps=7, worker="site-a", overlap=True, fragments=2, timeout=12.0)
        assert isinstance(fixed, hetcomm.train.elastic.ElasticRun)
        assert (fixed._options["local_steps"], fixed._options["steps"], fixed._options["overlap"],
                fixed._options["fragments"]) == ("fixed", 7, True, 2)
        assert (fixed._worker, fixed._timeout) == ("site-a", 12.0)
        timed = make(round_seconds=3.0)
        assert (timed._options["local_steps"], timed._options["round_seconds"]) == ("time", 3.0)
        with pytest.warns(FutureWarning, match="early_join=False.* changes nothing"):
            make(early_join=False)
        with pytest.raises(ValueError, match="round_seconds is an option of local_steps='time'"):
            make(local_steps="fixed", round_seconds=3.0)
        why = fixed._refusal(make(steps=50, worker="site-a", overlap=True, fragments=2)._config(), fixed._config())
        assert why == "its DiLoCo's steps is '50', the run's '7'", why
    finally:
        for d in made:
            d.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["registered", "formed", "done"])
def test_a_worker_dead_before_the_first_round_is_left_out(run, where):
    """w0 (the first by name: the one whose fresh model everyone would start from) dies right after
    asking to join (its death may be known before the first decision), as a member of its first
    decision, before forming the group (the others' group formation fails), or at the end of that
    epoch, after counting itself done (the others commit it, and their generation's first
    collective fails): either way no round that commits includes it (a failed group
    formation once left the next group's store keys misnamed on the survivors: they waited on
    each other until the deadline)."""
    # The others' group formation with a dead member fails at the collective timeout: 8 s here,
    # not the 30 s the test waited out before.
    # (rounds of 1 s: at "done" the survivors' generation fails at once, and with instant rounds
    # the run could end before the fourth worker had shown it lives)
    procs = {w: run.start(w, "--rounds", "4", "--min-workers", "3", "--collective-timeout", "8",
                          "--step-seconds", "0.25", *(["--die", f"0:{where}"] if w == "w0" else []))
             for w in IDS}
    wait_for(procs["w0"], run)
    codes = run.wait_all()
    assert codes["w0"] == [-9] and all(codes[w] == [0] for w in IDS[1:]), f"{codes}\n{run.logs()}"
    check_agreement(run, IDS[1:], 4)
    rounds = [rec for rec in run.records("w1") if "round" in rec]
    assert all("w0" not in rec["members"] for rec in rounds), f"{rounds}\n{run.logs()}"
    # the first decision takes the first three to ask: the fourth is admitted a round later; in
    # the end all three survivors take part
    assert sorted(rounds[-1]["members"]) == ["w1", "w2", "w3"], f"{rounds}\n{run.logs()}"


def test_a_worker_whose_data_ends_leaves_and_the_others_go_on(run):
    rounds = 6
    for w in IDS[:3]:
        run.start(w, "--rounds", str(rounds), "--min-workers", "3", *(["--batches", "10"] if w == "w2" else []))
    codes = run.wait_all()
    assert all(c == [0] for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, IDS[:3], rounds)
    assert final(run, "w0")["final"] == final(run, "w1")["final"] == prints[rounds]
    left = [e["left"] for e in final(run, "w0")["membership"] if e.get("left")]
    assert left == [{"w2": "left: its data ended"}], left
    # its last partial round (10 batches = 2 rounds of 4 + 2 steps) was synchronised before it left
    third = [rec for rec in run.records("w0") if rec.get("round") == 3]
    assert third and third[0]["steps"][third[0]["members"].index("w2")] == 2, third


def error(run: Run, wid: str) -> str:
    errors = [rec["error"] for rec in run.records(wid) if "error" in rec]
    assert errors, f"{wid} reported no error\n{run.logs()}"
    return errors[-1]


def test_a_worker_whose_update_is_not_finite_stops_and_the_others_go_on(run):
    rounds = 5
    for w in IDS[:3]:
        run.start(w, "--rounds", str(rounds), "--min-workers", "3", *(["--nan-at", "2"] if w == "w1" else []))
    codes = run.wait_all()
    assert codes == {"w0": [0], "w1": [1], "w2": [0]}, f"{codes}\n{run.logs()}"
    assert "this worker stops: its pseudo-gradient is not finite" in error(run, "w1"), run.logs()
    check_agreement(run, ["w0", "w2"], rounds)
    rounds_w0 = [rec for rec in run.records("w0") if "round" in rec]
    assert all(rec["members"] == ["w0", "w2"] for rec in rounds_w0[2:]), rounds_w0


@pytest.mark.parametrize("differs,expect", [
    ({"args": ["--hidden", "12"]}, "its model is '4 tensors, 121 elements in float32"),
], ids=["model"])
@pytest.mark.slow
def test_a_joiner_with_other_settings_is_refused_and_the_run_goes_on(run, differs, expect):
    """One difference end to end (the refusal reaches the joiner, the run goes on, no round is
    aborted); every other difference (compression, optimizer, weighting, backend, settings) is
    refused by the same function, checked for each in
    test_a_join_request_is_refused_for_each_difference_and_for_a_malformed_one, and a founder with
    another setting in test_a_founder_with_other_settings_is_refused_and_the_others_start_the_run.
    (Compression and a hetcomm setting had an end-to-end run each, which added nothing.)"""
    rounds = 12
    for w in IDS[:2]:
        run.start(w, "--rounds", str(rounds), "--min-workers", "2", "--step-seconds", "0.25")
    deadline = time.monotonic() + DEADLINE
    while len([r for r in run.records("w0") if "round" in r]) < 1:
        if time.monotonic() > deadline or any(p.poll() is not None for _, p in run.procs):
            pytest.fail(f"the run recorded no round\n{run.logs()}")
        time.sleep(0.2)
    run.start("w2", "--rounds", str(rounds), *differs.get("args", []), env=differs.get("env"))
    codes = run.wait_all()
    assert codes == {"w0": [0], "w1": [0], "w2": [1]}, f"{codes}\n{run.logs()}"
    assert "this worker cannot join" in error(run, "w2") and expect in error(run, "w2"), run.logs()
    check_agreement(run, ["w0", "w1"], rounds)
    # refused before any group formed with it: no synchronisation of the run failed for it
    membership = final(run, "w0")["membership"]
    assert any(expect in why for e in membership for why in e.get("refused", {}).values()), membership
    assert not any("aborted" in e for e in membership), membership


@pytest.mark.slow
@hetcomm_only("hetcomm's own settings: other backends ignore them")
def test_a_founder_with_other_settings_is_refused_and_the_others_start_the_run(run):
    rounds = 4
    # w1 (misconfigured) asks first; w0 and w2 make a majority of the three and start the run
    run.start("w1", "--rounds", str(rounds), "--min-workers", "2", env={"HETCOMM_SEGMENT_BYTES": "65536"})
    time.sleep(2.0)
    for w in ("w0", "w2"):
        run.start(w, "--rounds", str(rounds), "--min-workers", "2", "--step-seconds", "0.25")
    codes = run.wait_all()
    assert codes == {"w0": [0], "w1": [1], "w2": [0]}, f"{codes}\n{run.logs()}"
    assert "this worker cannot join" in error(run, "w1"), run.logs()
    assert "HETCOMM_SEGMENT_BYTES='65536'" in error(run, "w1"), run.logs()
    check_agreement(run, ["w0", "w2"], rounds)
    membership = final(run, "w0")["membership"]
    assert not any("aborted" in e for e in membership), membership
    assert any("w1" in e.get("refused", {}) for e in membership), membership


@hetcomm_only("hetcomm's own settings: other backends ignore them")
def test_founders_held_below_min_workers_by_a_misconfigured_one_say_why_they_wait(run):
    for w in IDS[:3]:
        run.start(w, "--rounds", "2", "--min-workers", "3",
                  env={"HETCOMM_SEGMENT_BYTES": "65536"} if w == "w2" else None)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        log = run.out / "w0.0.log"             # the worker's process creates it
        text = log.read_text() if log.exists() else ""
        if "waiting for min_workers=3" in text:
            break
        assert all(proc.poll() is None for _, proc in run.procs), run.logs()
        time.sleep(0.5)
    else:
        pytest.fail(f"w0 never said why it waits\n{run.logs()}")
    assert "w2 differs (it was started with HETCOMM_SEGMENT_BYTES='65536'" in text, run.logs()


def test_a_join_request_is_refused_for_each_difference_and_for_a_malformed_one():
    from hetcomm.train.elastic import ElasticDiLoCo

    ours = {"model": "2 tensors, 3 elements in float32, shapes abc", "outer optimizer": "SGD",
            "weighting": "batch", "compression": "compress='fp32', block=2048", "backend": "hetcomm",
            "settings": {"HETCOMM_TLS": "", "HETCOMM_PROBE": "0"}}
    assert ElasticDiLoCo._refusal(dict(ours), ours) is None
    for key, value, expect in [("outer optimizer", "Adam", "its outer optimizer is 'Adam'"),
                               ("weighting", "equal", "its weighting is 'equal'"),
                               ("backend", "gloo", "its backend is 'gloo'"),
                               ("settings", {"HETCOMM_TLS": "all", "HETCOMM_PROBE": "0"},
                                "it was started with HETCOMM_TLS='all', the run's workers with HETCOMM_TLS=''"),
                               ("settings", {"HETCOMM_TLS": ""}, "HETCOMM_PROBE=''")]:
        why = ElasticDiLoCo._refusal(dict(ours, **{key: value}), ours)
        assert why is not None and expect in why, (key, why)
    for malformed in [None, "x", {"model": ours["model"]}, dict(ours, settings="x")]:
        assert "does not describe its configuration" in ElasticDiLoCo._refusal(malformed, ours)


@pytest.mark.parametrize("name,value", [("HETCOMM_SITES", "0,0,1"), ("HETCOMM_SITES", "0"),
                                        ("HETCOMM_HOST_ID", "a,b"), ("HETCOMM_LINK_MBIT", "800,100"),
                                        ("HETCOMM_LINK_MBIT", "800")])
def test_per_rank_settings_are_refused_because_ranks_change_every_generation(monkeypatch, name, value):
    import torch
    import torch.distributed as dist

    import hetcomm

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}=.*describes the job by rank"):
        hetcomm.ElasticDiLoCo(torch.nn.Linear(2, 1), store=dist.HashStore())


def test_an_exception_in_the_loop_body_leaves_without_synchronising_the_round(run):
    rounds = 5
    for w in IDS[:3]:
        run.start(w, "--rounds", str(rounds), "--min-workers", "3", *(["--raise-at", "2"] if w == "w2" else []))
    codes = run.wait_all()
    assert codes == {"w0": [0], "w1": [0], "w2": [1]}, f"{codes}\n{run.logs()}"
    assert "an exception in the body of the loop" in error(run, "w2"), run.logs()
    check_agreement(run, ["w0", "w1"], rounds)
    left = [e["left"] for e in final(run, "w0")["membership"] if e.get("left")]
    assert left == [{"w2": "left: it stopped inside its loop (its partial round is not synchronised)"}], left
    third = [rec for rec in run.records("w0") if rec.get("round") == 3]
    assert third and third[0]["members"] == ["w0", "w1"], third


@pytest.mark.slow
def test_when_every_holder_dies_while_a_new_worker_joins_it_raises_instead_of_restarting_the_run(run):
    """w1, new, is being sent the state by w0, the only holder, when w0 dies: w1 holds nothing
    the run computed, so it must not carry on from its own fresh model."""
    w0 = run.start("w0", "--rounds", "20", "--step-seconds", "0.25", "--die", "2:transfer")
    while len([r for r in run.records("w0") if "round" in r]) < 2 and w0.poll() is None:
        time.sleep(0.2)
    run.start("w1", "--rounds", "20")
    codes = run.wait_all()
    assert codes == {"w0": [-9], "w1": [1]}, f"{codes}\n{run.logs()}"
    assert "holds the run's state" in error(run, "w1"), run.logs()
    assert not [r for r in run.records("w1") if "round" in r], run.records("w1")
