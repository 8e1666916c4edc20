"""examples/train_elastic.py, as a user runs it: two workers around a store, as `ElasticDiLoCo` (its
thin constructor) and as `DiLoCo(membership=Elastic(...))` with every DiLoCo option and a
checkpoint; both end at the same round with the same global parameters and write the records
`benchmarks/elastic_sim.py` reads."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from harness import BACKEND
from stores import start_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_elastic.py")
SMALL = ["--d-model", "32", "--layers", "1", "--heads", "2", "--block", "8", "--corpus-chars", "20000",
         "--batch", "4", "--steps", "3", "--rounds", "3", "--min-workers", "2"]
MODES = {
    "elastic": [],
    "generations": ["--local-steps", "time", "--compress", "int8", "--overlap", "--fragments", "2",
                    "--progress-seconds", "0.2"],
}

pytestmark = pytest.mark.usefixtures("backend_importable")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_elastic_example_runs_two_workers_to_the_same_parameters(tmp_path, mode):
    store, port = start_store(str(tmp_path))
    procs = {}
    try:
        for w in ("w0", "w1"):
            extra = ["--checkpoint", str(tmp_path / f"{w}.pt")] if mode == "generations" else []
            procs[w] = subprocess.Popen(
                [sys.executable, EXAMPLE, "--store", f"127.0.0.1:{port}", "--id", w, "--job", mode,
                 "--backend", BACKEND, "--jsonl", str(tmp_path / f"{w}.jsonl"), *SMALL, *MODES[mode], *extra],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                env=dict(os.environ, OMP_NUM_THREADS="1", HETCOMM_PROBE="0"), start_new_session=True)
        outs = {}
        for w, p in procs.items():
            try:
                outs[w] = p.communicate(timeout=180)[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"{w} still running after 180 s")
        assert all(p.returncode == 0 for p in procs.values()), outs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        store.kill()
    recs = {w: [json.loads(x) for x in (tmp_path / f"{w}.jsonl").read_text().splitlines()] for w in procs}
    rounds = {w: {r["round"]: r["fp"] for r in rs if "round" in r} for w, rs in recs.items()}
    assert sorted(rounds["w0"]) == [1, 2, 3] and rounds["w0"] == rounds["w1"], (rounds, outs)
    finals = {w: [r for r in rs if "final" in r][-1] for w, rs in recs.items()}
    assert len({f["final"] for f in finals.values()}) == 1, finals
    assert all(math.isfinite(f["loss"]) for f in finals.values()), finals
    if mode == "generations":
        assert all("plan" in r for rs in recs.values() for r in rs if "round" in r), recs
        assert any("progress" in r for r in recs["w0"]), recs["w0"]
        saved = torch.load(tmp_path / "w0.pt", weights_only=False)
        assert saved["round"] == 3 and len(saved["history"]) == 3, {k: saved[k] for k in ("round", "applied")}


def test_a_checkpoint_of_another_class_or_version_is_refused_naming_it():
    import functools
    from types import SimpleNamespace

    from hetcomm.train.elastic import checkpoint
    from hetcomm.train.elastic.loop import ElasticBase

    before_join = SimpleNamespace(_joined=False)
    before_join._load_checkpoint = functools.partial(ElasticBase._load_checkpoint, before_join)
    # (one of ElasticDiLoCo before it ran in generations: no kind)
    with pytest.raises(ValueError, match="not a checkpoint of DiLoCo in generations .no kind"):
        checkpoint.load(before_join, {"version": 1, "global": [], "round": 3})
    with pytest.raises(ValueError, match="checkpoint version 2"):
        checkpoint.load(before_join, {"kind": checkpoint.KIND, "version": 2})


def test_a_checkpoint_never_goes_back_to_the_generation_start():
    """Where no round boundary's state can be read (staggered fragments landed mid-round; the
    synchronisation in flight failed), `save` holds the state the generation started from only if
    the generation applied no outer step yet, else raises: that start may be many rounds old, and
    the run keeps no copy of it (its state is the generation's)."""
    import concurrent.futures
    import threading
    import time
    from types import SimpleNamespace

    from hetcomm.train.elastic import checkpoint

    def run_with(inner):
        return SimpleNamespace(_holds=True, _inner=inner, _global=[torch.zeros(2)], job="j", _round=7,
                               outer_optimizer=torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0),
                               _applied_total=7, _samples_total=70, _history=[{"round": r} for r in range(1, 8)],
                               _events=[], _step_times={}, _policy_state=None, model=torch.nn.Linear(2, 2),
                               inner_optimizer=None, _collective_timeout=1.0, _torn=False)

    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("a peer died"))
    for inner in (SimpleNamespace(_stagger=True, _fired=[False, True], _background_jobs=lambda: []),
                  SimpleNamespace(_stagger=False, _pending=failed, _flight={}, _clock=time.monotonic,
                                  _totals={"idle": 0.0}, _timeline=[], _mark=0.0, _background_jobs=lambda: [failed])):
        # this generation applied a round; or only a staggered fragment's update (no round yet)
        for inner._history, inner._applied in (([{"round": 1}], 2), ([], 1)):
            with pytest.raises(RuntimeError, match="no round boundary's state"):
                checkpoint.save(run_with(inner))
        inner._history, inner._applied = [], 0                 # none: its start is the newest boundary
        state = checkpoint.save(run_with(inner))
        assert state["round"] == 7 and len(state["history"]) == 7, state["round"]
    # A fragment's job still running writes the generation's tensors (the run's state): waited for
    # first, then its outer step counts (raised), never a state torn by it saved as the start.
    running = concurrent.futures.Future()
    inner = SimpleNamespace(_stagger=True, _fired=[False, True], _history=[], _applied=0, _clock=time.monotonic,
                            _totals={"idle": 0.0}, _timeline=[], _mark=0.0, _background_jobs=lambda: [running])

    def lands():
        inner._applied = 1
        running.set_result(None)
    timer = threading.Timer(0.2, lands)
    timer.start()
    with pytest.raises(RuntimeError, match="no round boundary's state"):
        checkpoint.save(run_with(inner))
    timer.join()
    run = run_with(None)
    run._torn = True                    # closed while a synchronisation ran: it may be half applied
    with pytest.raises(RuntimeError, match="half updated"):
        checkpoint.save(run)
