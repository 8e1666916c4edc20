"""One worker of an elastic DiLoCo run, for tests/train/test_elastic.py (a process of its own).

    python tests/support/elastic_worker.py --store 127.0.0.1:PORT --id w0 --job J --out DIR [--die round:where]

A small regression model on data that depends only on (worker id, round, step): a worker that is
restarted, or a whole run resumed from checkpoints, sees the same batches as an uninterrupted one.
Every committed round appends a JSON line to DIR/<id>.jsonl (round, fingerprint, members); the
end writes a line with ``final``. ``--die R:where`` kills this process (SIGKILL) at round R:
``local`` (halfway through the round's steps), ``reduce`` (at the synchronisation, just before
its all-reduce: the others are inside it), ``done`` (in an epoch from round R
on, after counting itself done, before the outcome: the others commit without it),
``transfer`` (the first time, from round R on, that it sends the state to a joining worker:
after the metadata, before the parameters), ``registered`` (R ignored: right after asking to
join, before the first round), ``formed`` (a member of a decision from round R on, just before
forming its group: the others' group formation fails); ``behind`` is no death: from round R on,
once, the reduction raises on this worker right after it returned (the others apply it, this
one does not); ``behind-sync`` the same at the first reduction inside a synchronous round
boundary from round R on (a fragment of it: the others apply it, then fail at the next);
``behind-call`` at the R-th reduction that returned in this process. ``agrees`` (SIGKILL) inside
a synchronous round boundary from round R on, after the round was recorded, before the
worker's ranks agree on it.
``--wait-for FILE:R`` asks to join only once FILE (another worker's JSON lines)
reports round R, right after a round began.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import zlib

import torch


def kill_self() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def linear_pull(worker: str) -> torch.Tensor:
    """``--linear``: the constant gradient c_w of worker ``worker`` (its name: the same on a
    worker's ranks): (1 + crc32(name) mod 4) · linspace(0.5, 1.5, 8)."""
    return (1.0 + zlib.crc32(worker.encode()) % 4) * torch.linspace(0.5, 1.5, 8)


def install_reduction_log(path: str, run) -> None:
    """``--log-reductions``: every outer reduction this process applied, one JSON line each, in the
    order applied: the generation, the flat elements it stepped, the workers' names (``run()``'s
    `_workers_names`: one rank per worker), the steps and weights of its agreed table. The steps
    and weights are taken from the `outer_weights` call right before it, on the same thread."""
    import threading

    from hetcomm.train.diloco import agreement, stream
    from hetcomm.train.diloco.loop import DiLoCo
    seen = threading.local()
    real_weights = agreement.outer_weights

    def noting_weights(weighting, samples, steps):
        weights = real_weights(weighting, samples, steps)
        seen.last = ([float(x) for x in steps], [float(x) for x in weights])
        return weights
    agreement.outer_weights = stream.outer_weights = noting_weights
    real_reduce = DiLoCo._reduce_agreed
    out = open(path, "a")

    def noting_reduce(self, delta, weights, feedback, *, background, fragment):
        part = real_reduce(self, delta, weights, feedback, background=background, fragment=fragment)
        steps, agreed = seen.last
        _, _, a, b = self._fragments[fragment]
        out.write(json.dumps({"gen": run()._base[2], "elements": [a, b], "names": list(run()._workers_names),
                              "steps": steps, "weights": agreed}) + "\n")
        out.flush()
        return part
    DiLoCo._reduce_agreed = noting_reduce


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--die", default="")
    p.add_argument("--save", default="", help="save a checkpoint here after every round")
    p.add_argument("--load", default="", help="resume from this checkpoint")
    p.add_argument("--stop-after", type=int, default=0, help="exit (without a word) after this round")
    p.add_argument("--batches", type=int, default=0, help="this worker's data ends after so many batches")
    p.add_argument("--compress", default="fp32")
    p.add_argument("--hidden", type=int, default=16, help="the model's hidden width (another model: other than 16)")
    p.add_argument("--nan-at", type=int, default=-1, help="make this worker's parameters NaN in this round")
    p.add_argument("--raise-at", type=int, default=-1, help="raise an exception in the loop's body in this round")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in every step (a slow worker)")
    p.add_argument("--backend", default=os.environ.get("HETCOMM_TEST_BACKEND", "hetcomm"))
    p.add_argument("--ballast", type=int, default=0,
                   help="a parameter of this many elements outside the forward pass (a large state to send)")
    p.add_argument("--counting-outer", action="store_true",
                   help="an outer SGD that keeps an int32 step count per parameter and scales its step by it")
    p.add_argument("--wait-for", default="", help="FILE:R: ask to join once FILE reports round R")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="ElasticDiLoCo(timeout=): a worker silent this long is dropped. Deaths close the "
                        "liveness connection and are known at once; only a frozen worker waits this out, so "
                        "the default is long enough that a starved one is not dropped")
    p.add_argument("--collective-timeout", type=float, default=30.0, help="ElasticDiLoCo(collective_timeout=)")
    p.add_argument("--run", action="store_true",
                   help="hetcomm.DiLoCo(membership=hetcomm.Elastic(...)): DiLoCo in generations, with the options below")
    p.add_argument("--shard-state", action="store_true", help="--run: the state sharded over each worker's ranks")
    p.add_argument("--gather-check", action="store_true",
                   help="--shard-state without overlap: at each round boundary, gather the whole global parameters "
                        "over the worker and report their hash beside the round's (summed from the shares)")
    p.add_argument("--worker", default=None, help="--run: the DiLoCo worker this process is a rank of")
    p.add_argument("--local-steps", default="fixed", help="--run: the local-step policy")
    p.add_argument("--overlap", action="store_true", help="--run: overlap=True")
    p.add_argument("--fragments", type=int, default=1, help="--run: fragments (staggered), with --overlap")
    p.add_argument("--overlap-steps", type=int, default=None, help="--run: overlap_steps (τ), with --overlap")
    p.add_argument("--early-weight", type=float, default=None,
                   help="--run: early_weight (β), with --overlap; 1 keeps a window's steps whole (`--linear`)")
    p.add_argument("--pace", type=float, default=None, help="--run: pace (the fragments' transfers paced)")
    p.add_argument("--tell-fired", action="store_true",
                   help="print the staggered fragments fired in the round before each synchronous boundary")
    p.add_argument("--linear", action="store_true",
                   help="a model whose inner steps move it by a constant: p -= 0.01 * c_w each step (c_w per worker: "
                        "the float64 reference of the global parameters), plain SGD inside and out (outer lr 1)")
    p.add_argument("--linear-parts", type=int, default=1,
                   help="--linear: its 8 weights in this many parameters (staggered fragments need several)")
    p.add_argument("--log-reductions", action="store_true",
                   help="append every reduction this process applied to OUT/ID.reductions.jsonl: its elements, "
                        "the workers' names, steps and weights (`reductions_check` in the tests)")
    p.add_argument("--slow-until", default="", help="DIR/ID.joined:R: from round R on, until worker ID has joined (that "
                   "file exists), hold until it has started (DIR/ID.started, at most 60 s), then take steps 0.2 s "
                   "longer: the run does not end before a restarted worker is back, however loaded the machine")
    args = p.parse_args(argv)

    import hetcomm
    from hetcomm import compress as _compress
    from hetcomm.train.elastic.loop import ElasticBase

    if args.log_reductions:
        install_reduction_log(os.path.join(args.out, f"{args.id}.reductions.jsonl"), lambda: diloco)
    if args.tell_fired:
        # (their windows left in background jobs, before the boundary began: a test reads it)
        from hetcomm.train.diloco.loop import DiLoCo
        real_fire_last = DiLoCo._fire_last

        def telling_fire_last(self):
            print(f"fired before the synchronous boundary: {[f for f, x in enumerate(self._fired) if x]}", flush=True)
            return real_fire_last(self)
        DiLoCo._fire_last = telling_fire_last
    die_round, _, where = args.die.partition(":")
    die_round = int(die_round) if die_round else -1
    if where == "reduce":
        real = _compress.weighted_allreduce

        def dying_allreduce(*a, **k):
            if diloco.rounds == die_round:
                kill_self()
            return real(*a, **k)
        _compress.weighted_allreduce = dying_allreduce
    elif where in ("behind", "behind-sync", "behind-call"):
        # Not a death: this worker fails right after a reduction returned, before applying it,
        # once (the others apply it: they are one outer step ahead when the next generation forms);
        # behind-sync: the first such reduction inside a synchronous round boundary; behind-call:
        # the R-th reduction that returned in this process (a sweep: benchmarks/elastic_carry_sweep.py)
        real_reduce, fired, calls = _compress.weighted_allreduce, [], []

        def failing_allreduce(*a, **k):
            out = real_reduce(*a, **k)
            calls.append(1)
            inside = where == "behind" or getattr(getattr(diloco, "_inner", None), "_sending", None) is not None
            due = len(calls) == die_round if where == "behind-call" else diloco.rounds >= die_round and inside
            if due and not fired:
                fired.append(True)
                raise RuntimeError("injected: this rank fails right after the reduction, before applying it")
            return out
        _compress.weighted_allreduce = failing_allreduce
    elif where == "agrees":
        # killed inside a synchronous round boundary from round R on, after it recorded the round
        # and before the worker's ranks agreed on it (its worker's other ranks fail there)
        from hetcomm.train.diloco.loop import DiLoCo
        real_agrees = DiLoCo._worker_agrees

        def dying_agrees(self, error):
            if self._sending is not None and error is None and diloco.rounds >= die_round:   # (recorded)
                kill_self()
            return real_agrees(self, error)
        DiLoCo._worker_agrees = dying_agrees
    elif where == "done":
        real_outcome = ElasticBase._outcome_of

        def dying_outcome(self, decision, failure):
            if self.rounds >= die_round and failure is None:
                self._keys.set(f"e{decision['epoch']}/done/{self._me}", 1)
                kill_self()
            return real_outcome(self, decision, failure)
        ElasticBase._outcome_of = dying_outcome
    elif where == "registered":
        real_register = ElasticBase._register

        def dying_register(self, *args, **kwargs):
            real_register(self, *args, **kwargs)
            kill_self()
        ElasticBase._register = dying_register
    elif where == "formed":
        real_form = ElasticBase._form_group

        def dying_form(self, decision):
            if decision["round"] >= die_round:
                kill_self()
            return real_form(self, decision)
        ElasticBase._form_group = dying_form
    elif where == "transfer":
        from hetcomm.train.elastic import generation
        real_broadcast = generation._broadcast_meta

        def dying_broadcast(meta, src, group=None):
            result = real_broadcast(meta, src, group)
            if diloco.rounds >= die_round and diloco._holds:          # a holder, sending
                kill_self()
            return result
        generation._broadcast_meta = dying_broadcast

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1))
    if args.ballast:
        model.ballast = torch.nn.Parameter(torch.linspace(-1, 1, args.ballast))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    outer = None
    if args.linear:
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(len(n)))
                                        for n in torch.tensor_split(torch.arange(8), args.linear_parts)])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        outer = lambda ps: torch.optim.SGD(ps, lr=1.0)  # noqa: E731
        pull = linear_pull(args.worker or args.id)
    if args.counting_outer:
        class CountingSGD(torch.optim.SGD):
            """State in a dtype other than the parameters' (load_state_dict casts it to theirs)."""

            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    for q in group["params"]:
                        if q.grad is not None:
                            count = self.state[q].setdefault("count", torch.zeros((), dtype=torch.int32))
                            count += 1
                            q.grad.mul_(1.0 / (1.0 + 0.01 * int(count)))
                return super().step(closure)

        outer = lambda ps: CountingSGD(ps, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    if args.run:
        membership = hetcomm.Elastic(store=args.store, worker_id=args.id, worker=args.worker, job=args.job,
                                     min_workers=args.min_workers, heartbeat=0.5, timeout=args.timeout,
                                     collective_timeout=args.collective_timeout, backend=args.backend)
        diloco = hetcomm.DiLoCo(model, opt, membership=membership, outer_optimizer=outer, steps=args.steps,
                                local_steps=args.local_steps, compress=args.compress, overlap=args.overlap,
                                fragments=args.fragments, overlap_steps=args.overlap_steps, pace=args.pace,
                                **({"early_weight": args.early_weight} if args.early_weight is not None else {}),
                                error_feedback=args.compress in ("int8", "int4"),
                                **({"shard_state": True} if args.shard_state else {}))
    else:
        diloco = hetcomm.ElasticDiLoCo(model, opt, store=args.store, worker_id=args.id, job=args.job,
                                       outer_optimizer=outer, steps=args.steps, min_workers=args.min_workers,
                                       heartbeat=0.5, timeout=args.timeout, collective_timeout=args.collective_timeout,
                                       compress=args.compress, backend=args.backend)
    if args.wait_for:
        path, _, wanted = args.wait_for.rpartition(":")
        def reported() -> bool:
            if not os.path.exists(path):
                return False
            lines = [line for line in open(path).read().split("\n")[:-1] if line.strip()]  # whole lines
            return any(json.loads(line).get("round", 0) >= int(wanted) for line in lines)
        while not reported():
            time.sleep(0.02)
    with open(os.path.join(args.out, f"{args.id}.started"), "a") as f:     # (for --slow-until)
        f.write(f"{time.time()}\n")                                       # (it asks to join now)
    if args.load:
        diloco.load_state_dict(torch.load(args.load, weights_only=False))
    truth = torch.linspace(-1, 1, 8)
    out = open(os.path.join(args.out, f"{args.id}.jsonl"), "a")

    def batches():
        step, taken = 0, 0
        while not args.batches or taken < args.batches:
            taken += 1
            g = torch.Generator().manual_seed(zlib.crc32(f"{args.id}/{diloco.rounds}/{step}".encode()))
            x = torch.randn(16, 8, generator=g)
            yield x, (x @ truth).unsqueeze(1) + 0.01 * torch.randn(16, 1, generator=g)
            step = (step + 1) % args.steps

    try:
        step_in_round, reported, taken = 0, None, 0
        paced: dict = {}                  # --pace: the jobs each generation's pacer paced so far
        for x, y in diloco.loop(batches(), max_rounds=args.rounds):
            pacer = getattr(getattr(diloco, "_inner", None), "_pacer", None)
            if pacer is not None:         # (counts, not the pacers: they hold their groups' backends)
                paced[id(pacer)] = pacer.paced_jobs
            if reported is None:          # the rounds before this worker joined are the others' to report
                reported = diloco.history[-1]["round"] if diloco.history else 0
                open(os.path.join(args.out, f"{args.id}.joined"), "a").close()      # (for --slow-until)
            if args.slow_until:
                marker, _, from_round = args.slow_until.rpartition(":")
                if diloco.rounds >= int(from_round) and not os.path.exists(marker):
                    # until the awaited worker has started (it asks to join right after): hold
                    # (at most a minute); then slow steps until it is in
                    started, deadline = marker.removesuffix(".joined") + ".started", time.time() + 60
                    while not os.path.exists(started) and time.time() < deadline:
                        time.sleep(0.05)
                    time.sleep(0.2)
            if diloco.rounds == args.nan_at:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))
            if diloco.rounds == args.raise_at and step_in_round == 1:
                raise RuntimeError("an exception in the body of the loop")
            if args.linear:
                loss = (torch.cat([q.view(-1) for q in model]) * pull).sum()
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.step_seconds)
            step_in_round += 1
            if diloco.rounds == die_round and where == "local" and step_in_round == args.steps // 2:
                kill_self()
            taken += 1
            gathered = None
            if diloco.step(samples=len(x), loss=loss.item()):
                step_in_round = 0
                if args.gather_check:         # (every rank of the worker at this boundary: a collective)
                    from hetcomm.train.elastic import sharded
                    gathered = sharded.fingerprint(diloco.gather_global_parameters())
                if args.save:                  # at the boundary: the state holds every round taken
                    try:
                        torch.save(diloco.state_dict(), args.save)
                    except RuntimeError as e:  # (the sync in flight failed: the last one stays)
                        print(f"checkpoint not saved: {e}", flush=True)
            for rec in [r for r in diloco.history if r["round"] > reported]:   # (with overlap, a round late)
                reported = rec["round"]
                out.write(json.dumps({"round": rec["round"], "fp": rec["fingerprint"],
                                      "members": rec.get("members", rec.get("workers")),
                                      "steps": rec["steps"], "weights": rec["weights"], "gen": rec["generation"],
                                      "plan": rec.get("plan"),
                                      "state_bytes": diloco.state_bytes() if args.run else None,
                                      "gathered": gathered if rec["round"] == diloco.history[-1]["round"] else None,
                                      "pid": os.getpid(), "t": time.time()}) + "\n")
                out.flush()
                if args.stop_after and diloco.rounds >= args.stop_after:
                    diloco.close()
                    try:
                        fp = diloco.fingerprint()
                    except RuntimeError:       # (sharded state: a rank holds only its share)
                        fp = None
                    out.write(json.dumps({"stopped": diloco.rounds, "fp": fp}) + "\n")
                    return 0
        out.write(json.dumps({"final": diloco.fingerprint(), "rounds": diloco.rounds, "steps_taken": taken,
                              "paced_jobs": sum(paced.values()),
                              "global": [float(x) for g in diloco.global_parameters() for x in g.reshape(-1)]
                              if args.linear else None,
                              "reason": diloco.stop_reason, "membership": diloco.membership,
                              "stats": {k: v for k, v in diloco.stats().items() if k != "membership"}}) + "\n")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        raise
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
