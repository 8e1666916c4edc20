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
import torch

from elastic_job import Run, check_agreement, final, wait_for
from harness import run_ranks
from test_elastic_run import FEATURES, assert_linear_reference

pytestmark = pytest.mark.usefixtures("backend_importable")


@pytest.mark.parametrize("features,where", [("fixed-fp32", "local"), ("time-int8-overlap-staggered", "local"),
                                            ("time-int8-overlap-staggered", "reduce")])
def test_shares_move_when_a_rank_of_a_worker_dies_and_comes_back(run, features, where):
    """``reduce``: b1 dies inside a staggered fragment's reduction (the background thread); worker
    a's reductions that the death failed go on with its round, carried on its shares, and nobody
    waits for a collective timeout."""
    rounds = 10
    ranks = {"a0": "a", "a1": "a", "b0": "b", "b1": "b"}
    common = ["--run", "--shard-state", "--rounds", str(rounds), "--steps", "4", "--step-seconds", "0.15",
              *FEATURES[features]]
    if where == "reduce":
        # A survivor that cancelled a queued job when the generation failed once waited for it
        # until collective_timeout + 10 s (a cancelled future never counts as done for
        # concurrent.futures.wait), and its peers in that job's collective until theirs: with a
        # timeout longer than the job's deadline, such a wait fails the test as a hang.
        common += ["--collective-timeout", "300"]
    procs = {r: run.start(r, *common, "--worker", w, "--min-workers", "4",
                          *(["--die", f"2:{where}"] if r == "b1" else ["--slow-until", f"{run.out / 'b1.joined'}:5"]))
             for r, w in ranks.items()}
    wait_for(procs["b1"], run)
    assert procs["b1"].returncode == -9, run.logs()
    for marker in ("b1.joined", "b1.started"):
        (run.out / marker).unlink()
    # (once the others have recorded round 3 without it: a generation of a worker of one rank; they
    # hold from round 5 on until it has started, so that the run does not end before it is back)
    run.start("b1", *common, "--worker", "b", "--wait-for", f"{run.out / 'a0.jsonl'}:3")
    codes = run.wait_all()
    assert all(c[-1] == 0 for c in codes.values()), f"{codes}\n{run.logs()}"
    prints = check_agreement(run, list(ranks), rounds)
    for r in ranks:
        assert final(run, r)["final"] == prints[rounds], (r, final(run, r))
    generations = final(run, "a0")["stats"]["generations"]
    assert generations[-1]["workers"] == [[0, 1], [2, 3]], generations
    # (a generation that failed before its first synchronisation agreed no stats: no "workers")
    assert any(g.get("workers") == [[0, 1], [2]] for g in generations), [g.get("workers") for g in generations]
    assert any(rec["round"] > 2 for rec in run.records("b1") if "round" in rec), run.records("b1")
    recorded = sum(r["steps"][r["members"].index("a")] for r in run.records("a0") if "round" in r)
    assert recorded == final(run, "a0")["steps_taken"], (run.records("a0"), run.logs())
    if "--linear" in FEATURES[features]:
        assert_linear_reference(run, "a0")
        # 8 parameters: a share of 4 keeps 4 global parameters, start point and pseudo-gradient
        # (12 bytes each) and the exchange's buffers (3 x 4 elements); the whole state 12 x 8.
        seen = {r["round"]: r["state_bytes"] for r in run.records("a0") if "round" in r}
        assert seen[1] == 12 * 4 + 4 * 3 * 4 and seen[rounds - 1] == seen[1], seen


def load_adam(rank: int, world: int) -> list[dict]:
    """`sharded.load` on 4 ranks: the holders' shares of the global parameters and of Adam's
    state (exp_avg, exp_avg_sq per element, step per tensor: a value of its own in each) and their
    hyperparameters, laid out for one worker of four (or, second case, held by ranks 2 and 3 only,
    as two shares), move to a generation of two workers of two ranks; compared with the whole
    vectors they were cut from."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import hetcomm
    from hetcomm.train import flat
    from hetcomm.train.elastic import sharded
    from hetcomm.train.elastic.reshard import Share

    checked, real_check = [], sharded._check

    def check(inner, news, total):
        checked.append(total)
        return real_check(inner, news, total)
    sharded._check = check

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    n = sum(p.numel() for p in net.parameters())
    whole = torch.linspace(-2.0, 3.0, n)
    out = []
    for old_of, holders in (({r: (4, r) for r in range(4)}, [0, 1, 2, 3]), ({2: (2, 0), 3: (2, 1)}, [2, 3])):
        inner = hetcomm.DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), local_steps="fixed", steps=2,
                               workers=[0, 0, 1, 1], shard_state=True, overlap=True, fragments=2,
                               outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1, betas=(0.8, 0.95)))
        fragments = list(inner._layout.whole)
        starts = [0]
        for p in net.parameters():
            starts.append(starts[-1] + p.numel())
        pieces, opt = [], None
        if rank in old_of:
            # the share's pieces as a layout cuts them (each in one tensor), Adam's step a value
            # per tensor (5 + the tensor's index), as a run with a tensor added later would have
            share = Share(fragments, *old_of[rank])
            cuts = [(max(lo, a), min(hi, b), t) for lo, hi in share.ranges
                    for t, (a, b) in enumerate(zip(starts, starts[1:])) if max(lo, a) < min(hi, b)]
            pieces = [torch.nn.Parameter(whole[lo:hi].clone()) for lo, hi, _ in cuts]
            opt = torch.optim.Adam(pieces, lr=0.05, betas=(0.5, 0.6))
            for p, (lo, hi, t) in zip(pieces, cuts):
                opt.state[p] = {"step": torch.tensor(5.0 + t), "exp_avg": 2 * whole[lo:hi],
                                "exp_avg_sq": whole[lo:hi] ** 2}
        run = SimpleNamespace(_global=pieces, outer_optimizer=opt, _share=old_of.get(rank), _carry=None, _history=[],
                              _whole=fragments)
        sharded.load(run, inner, {"members": ["m0", "m1", "m2", "m3"], "holders": [f"m{r}" for r in holders],
                                  "round": 0})
        ok = True
        for q, start, (t, _, _) in zip(inner._global, inner._piece_starts(), inner._layout.pieces):
            want = whole[start:start + q.numel()]
            state = inner.outer_optimizer.state.get(q, {})
            ok &= torch.equal(q.detach(), want)
            if q.numel():
                ok &= (torch.equal(state["exp_avg"], 2 * want) and torch.equal(state["exp_avg_sq"], want ** 2)
                       and state["step"].dtype == torch.float32 and float(state["step"]) == 5.0 + t)
        # the start point and the share's hash, made as the chunks landed, are those of what landed
        ok &= torch.equal(inner._start, inner._flatten_global())
        ok &= checked[-1] == flat.additive_print(inner._global, inner._piece_starts())
        group = inner.outer_optimizer.param_groups[0]
        out.append({"ok": bool(ok), "lr": group["lr"], "betas": group["betas"], "held": inner._layout.size})
        # Shares cut from other fragments (a checkpoint of a run with other options): refused on
        # every rank, not mapped onto the wrong elements.
        run._whole = [(0, len(fragments) and fragments[-1][1], 0, n)]
        try:
            sharded.load(run, inner, {"members": ["m0", "m1", "m2", "m3"], "holders": [f"m{r}" for r in holders],
                                      "round": 0})
            out.append({"refused": None})
        except ValueError as e:
            out.append({"refused": str(e)})
        if len(holders) == 4:
            # A member that adds to another's cells of the per-tensor exchange (a SUM of columns):
            # rank 3 adds 1 to rank 0's presence of tensor 0; every rank raises.
            run._whole = fragments
            cells = len(list(net.parameters())) * 2          # presence and Adam's step, per tensor
            real = sharded.exchange_columns

            def tampering(values, *, group=None):
                world, me = dist.get_world_size(group), dist.get_rank(group)
                table = torch.zeros(len(values), world, dtype=torch.float64)
                table[:, me] = torch.tensor([float(v) for v in values], dtype=torch.float64)
                if me == 3 and len(values) == cells:
                    table[0, 0] += 1.0
                dist.all_reduce(table, group=group)
                return table.tolist()
            sharded.exchange_columns = tampering
            try:
                sharded.load(run, inner, {"members": ["m0", "m1", "m2", "m3"], "holders": [f"m{r}" for r in holders],
                                          "round": 0})
                out.append({"tampered": None})
            except ValueError as e:
                out.append({"tampered": str(e)})
            finally:
                sharded.exchange_columns = real
        inner.close()
    return out


def test_the_outer_optimizers_state_moves_with_the_shares():
    for rank, cases in enumerate(run_ranks(4, load_adam, timeout=120)):
        for case in cases:
            if "refused" in case:
                assert "other fragments" in (case["refused"] or ""), (rank, case)
                continue
            if "tampered" in case:
                # every rank refuses the move; rank 0 because its column came back altered (the
                # others: they saw the holders disagree, or that another rank found a problem)
                assert "the run's outer optimizer state did not move between shares" in (case["tampered"] or ""), \
                    (rank, case)
                assert rank != 0 or "did not carry this rank's as it sent them" in case["tampered"], case
                continue
            assert case["ok"] and case["lr"] == 0.05 and case["betas"] == (0.5, 0.6), (rank, case)
            assert case["held"] > 0, (rank, case)


@pytest.mark.parametrize("features,shape", [("fixed-fp32", "pairs"), ("time-int8-overlap-staggered", "pairs"),
                                            ("time-int8-overlap-staggered", "mixed")])
def test_a_whole_job_resumes_its_shares_from_checkpoints(tmp_path, features, shape):
    """Two workers of two ranks save their shares at every round boundary and stop after round 3;
    started again with their checkpoints on the same store and job, they start a new era, the
    shares move from the checkpoints' holders, and they run to round 8. ``fixed`` without overlap:
    the final parameters are bit for bit the uninterrupted run's (and the float64 reference's).
    Otherwise every report of a round carries one hash and the workers end alike. ``mixed``: a
    worker of one rank beside one of two, so every rank keeps the whole state (and the outer
    optimizer's momentum in the parameters' shapes) and saves it whole."""
    rounds = 8
    ranks = {"a0": "a", "a1": "a", "b0": "b", "b1": "b"} if shape == "pairs" else {"a0": "a", "a1": "a", "b0": "b"}
    common = ["--run", "--shard-state", "--rounds", str(rounds), "--steps", "4", "--min-workers", str(len(ranks)),
              *FEATURES[features]]
    if "--overlap" not in FEATURES[features]:
        # at each boundary the whole global parameters are gathered from the shares and hashed
        # whole: the rounds' hash, summed from the shares, must be theirs
        common.append("--gather-check")
    target = None
    if features == "fixed-fp32":
        (tmp_path / "whole").mkdir()
        whole = Run(tmp_path / "whole", "whole")
        try:
            for r, w in ranks.items():
                whole.start(r, *common, "--worker", w)
            assert all(c == [0] for c in whole.wait_all().values()), whole.logs()
            target = check_agreement(whole, list(ranks), rounds)[rounds]
        finally:
            whole.close()
    (tmp_path / "parts").mkdir()
    parts = Run(tmp_path / "parts", "parts")
    try:
        ckpt = {r: str(tmp_path / f"{r}.pt") for r in ranks}
        for r, w in ranks.items():
            parts.start(r, *common, "--worker", w, "--save", ckpt[r], "--stop-after", "3")
        assert all(c == [0] for c in parts.wait_all().values()), parts.logs()
        states = {r: torch.load(ckpt[r], weights_only=False) for r in ranks}
        saved = {r: st["round"] for r, st in states.items()}
        assert all(x >= 3 for x in saved.values()), saved
        want = {(2, 0), (2, 1)} if shape == "pairs" else {(1, 0)}
        assert {tuple(st["share"]) for st in states.values()} == want, {r: st["share"] for r, st in states.items()}
        for r, w in ranks.items():
            parts.start(r, *common, "--worker", w, "--load", ckpt[r])
        assert all(c[-1] == 0 for c in parts.wait_all().values()), parts.logs()
        missing = set() if target is not None else set(range(4, max(saved.values()) + 1))
        prints = check_agreement(parts, list(ranks), rounds, missing=missing)
        ends = {final(parts, r)["final"] for r in ranks}
        assert ends == {prints[rounds]}, (ends, parts.logs())
        if target is not None:
            assert ends == {target}, f"resumed {ends}, uninterrupted {target}\n{parts.logs()}"
            assert_linear_reference(parts, "a0")
        assert "starts or joins era 2" in parts.logs(), parts.logs()
        checked = [(rec["gathered"], rec["fp"]) for r in ranks for rec in parts.records(r)
                   if rec.get("gathered") is not None]
        if "--gather-check" in common:
            assert len(checked) >= rounds and all(g == fp for g, fp in checked), checked
    finally:
        parts.close()
