"""DiLoCo in generations with the state sharded over each worker's ranks (``shard_state=True``,
`hetcomm.train.elastic.sharded`): the shares move between generations whose layouts differ.

Two workers of two ranks (a, b); rank b1 dies mid-round, so the next generation has a worker of
one rank (every rank then keeps the whole state: the shares are gathered onto each rank from
their holders), and its restart makes b a worker of two again (the whole state cut back into
shares). Asserted: no process hangs, every report of a round carries one hash of the global
parameters on every rank (summed from the shares over each worker), the final parameters agree,
and with ``--linear`` they are the float64 sum of the recorded rounds' moves; worker a's steps of
the round b1 died in went on. And while a generation runs with shares, each rank keeps half the
state (`state_bytes`)."""
from __future__ import annotations

import pytest

from elastic_job import check_agreement, final, wait_for
from test_elastic_run import FEATURES, assert_linear_reference

pytestmark = pytest.mark.usefixtures("backend_importable")


@pytest.mark.parametrize("features", ["fixed-fp32", "time-int8-overlap-staggered"])
def test_shares_move_when_a_rank_of_a_worker_dies_and_comes_back(run, features):
    rounds = 10
    ranks = {"a0": "a", "a1": "a", "b0": "b", "b1": "b"}
    common = ["--run", "--shard-state", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.15",
              *FEATURES[features]]
    procs = {r: run.start(r, *common, "--worker", w, "--min-workers", "4",
                          *(["--die", "2:local"] if r == "b1" else ["--slow-until", f"{run.out / 'b1.joined'}:4"]))
             for r, w in ranks.items()}
    wait_for(procs["b1"], run)
    assert procs["b1"].returncode == -9, run.logs()
    for marker in ("b1.joined", "b1.started"):
        (run.out / marker).unlink()
    # (once the others have recorded round 3 without it: a generation of a worker of one rank)
    run.start("b1", *common, "--worker", "b", "--wait-for", f"{run.out / 'a0.jsonl'}:3")
    codes = run.wait_all()
    assert all(c[-1] == 0 for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, list(ranks), rounds)
    for r in ranks:
        assert final(run, r)["final"] == prints[rounds], (r, final(run, r))
    generations = final(run, "a0")["stats"]["generations"]
    assert generations[-1]["workers"] == [[0, 1], [2, 3]], generations
    assert any(g["workers"] == [[0, 1], [2]] for g in generations), [g["workers"] for g in generations]
    assert any(rec["round"] > 2 for rec in run.records("b1") if "round" in rec), run.records("b1")
    recorded = sum(r["steps"][r["members"].index("a")] for r in run.records("a0") if "round" in r)
    assert recorded == final(run, "a0")["steps_taken"], (run.records("a0"), run.logs())
    if "--linear" in FEATURES[features]:
        assert_linear_reference(run, "a0")
        # 8 parameters: a share of 4 keeps 4 global parameters, start point and pseudo-gradient
        # (12 bytes each) and the exchange's buffers (3 x 4 elements); the whole state 12 x 8.
        seen = {r["round"]: r["state_bytes"] for r in run.records("a0") if "round" in r}
        assert seen[1] == 12 * 4 + 4 * 3 * 4 and seen[rounds - 1] == seen[1], seen
