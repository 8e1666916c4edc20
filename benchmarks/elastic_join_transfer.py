"""How long a worker joining an elastic DiLoCo run takes to receive the run's state, against the
time its link needs for the bytes (issue 42's target: a 1 GB state within 1.5x). Needs root.

``--holders`` workers (default 2) start on the simulated cluster (``hetcomm.sim``: every worker
its own namespace, NICs of ``--nic-mbit`` in each direction) with a model whose global
parameters and outer momentum (fp32) make ``--state-gb`` GB; after their first round a new
worker starts and asks to join. The members end their generation, and in the epoch that
follows the holders send it the state over the new generation's process group, each holder one
shard (not through the store: it carries only the decision). The joiner times `_transfer`; ``ratio`` = that time / (bytes x 8 / NIC rate),
the joiner's link being the bottleneck (the holders' uplinks together are faster). Inner steps
sleep ``--step-seconds`` (rounds long enough for the joiner to start): the figure is the transfer,
not training. Median and spread over ``--repeats``.

The run is ``hetcomm.DiLoCo(membership=hetcomm.Elastic(...))`` (DiLoCo in generations; also what
``hetcomm.ElasticDiLoCo`` runs, and ``--generations`` is accepted for older commands). The
joiner's wait for the state is timed where it moves: the epoch's transfer (as above), with
``--overlap`` the generation's
background transfer while the holders train (`handover.start`, from its start to the state
loaded), with ``--shard-state`` the moves of the shares when the generation starts
(`sharded.load`). ``--ranks-per-worker R``: every worker (the holders and the joiner) is R
processes, each in its own namespace with its own NIC; with ``--shard-state`` each keeps 1/R of
the state, and a joiner's rank receives its share from the holders' ranks of the same share. The
figure is then the joiner's slowest rank against the link time of the largest share any of its
ranks received. ``--holder-nic-mbit``: the holders' NICs, when slower than the joiner's (the
figure stays against the joiner's link: two holders at half its rate can fill it together, one
cannot).

Usage::

    python benchmarks/elastic_join_transfer.py --rounds 4 --repeats 3 --json benchmarks/results/elastic_join_1gb_generations.json
    python benchmarks/elastic_join_transfer.py --shard-state --ranks-per-worker 2 --rounds 4 \
        --repeats 3 --json benchmarks/results/elastic_join_1gb_sharded.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    """One worker (run in a rank's namespace): joins, trains trivially, records its transfer."""
    import torch
    import torch.nn as nn

    import hetcomm
    from hetcomm.train.elastic.generation import Generation

    elements = int(args.state_gb * 1e9 / 8)              # fp32 global parameters + fp32 momentum
    tensors = 8
    model = nn.ParameterList([nn.Parameter(torch.zeros(elements // tensors)) for _ in range(tensors)])
    out = open(args.jsonl, "a")
    original = Generation._transfer

    def timed(self, decision):
        holder = self._me in decision["holders"]
        begin = time.perf_counter()
        original(self, decision)
        seconds = time.perf_counter() - begin
        moved = sum(g.numel() * g.element_size() for g in self._global)
        moved += sum(t.numel() * t.element_size() for s in self.outer_optimizer.state.values()
                     for t in s.values() if isinstance(t, torch.Tensor))
        out.write(json.dumps({"transfer_s": seconds, "holder": holder, "bytes": moved}) + "\n")
        out.flush()

    Generation._transfer = timed
    from hetcomm.train.elastic import handover, run, sharded

    def joiner_timed(real, decision_of):
        def wrapper(elastic, inner, *rest):
            decision = decision_of(elastic, rest)
            joiner = decision is not None and elastic._me not in decision["holders"]
            begin = time.perf_counter()
            parts.clear()
            result = real(elastic, inner, *rest)
            if joiner:
                moved = sum(g.numel() * g.element_size() for g in inner._global)
                moved += sum(t.numel() * t.element_size() for s in inner.outer_optimizer.state.values()
                             for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
                out.write(json.dumps({"transfer_s": time.perf_counter() - begin, "holder": False,
                                      "bytes": moved, "where": real.__name__, "parts": list(parts)}) + "\n")
                out.flush()
            return result
        return wrapper

    # Where a sharded load's time goes: each move of a field, and the check of the shares.
    parts: list = []

    def part(name, real):
        def wrapper(*a, **k):
            begin = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                parts.append([name if name != "move" else f"move {k.get('dtype')}",
                              round(time.perf_counter() - begin, 3)])
        return wrapper
    sharded.move, sharded._check = part("move", sharded.move), part("check", sharded._check)
    sharded.exchange_columns = part("exchange", sharded.exchange_columns)

    # (run.py calls them through their modules: patched there, they are timed)
    handover.start = joiner_timed(handover.start, lambda elastic, rest: elastic._state_deferred)
    sharded.load = joiner_timed(sharded.load, lambda elastic, rest: rest[0])
    assert run.handover is handover and run.sharded is sharded
    membership = hetcomm.Elastic(store=args.store, worker_id=args.id, worker=args.worker_name or None,
                                 job=args.job, min_workers=args.min_workers, collective_timeout=600.0,
                                 verbose=False)
    # (an inner optimizer, which a worker of several ranks needs; the loop never steps it)
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    diloco = hetcomm.DiLoCo(model, inner, membership=membership, local_steps="fixed", steps=2, compress="int8",
                            overlap=args.overlap, shard_state=args.shard_state)
    for _ in diloco.loop(itertools.repeat(None), max_rounds=args.rounds):
        with torch.no_grad():
            model[0][:1000].add_(1e-3)
        time.sleep(args.step_seconds)                 # rounds long enough for the joiner to start
        if diloco.step():
            out.write(json.dumps({"round": diloco.rounds}) + "\n")
            out.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default="")
    ap.add_argument("--id", default="")
    ap.add_argument("--job", default="join")
    ap.add_argument("--jsonl", default="")
    ap.add_argument("--min-workers", type=int, default=1)
    ap.add_argument("--holders", type=int, default=2)
    ap.add_argument("--state-gb", type=float, default=1.0)
    ap.add_argument("--nic-mbit", type=float, default=500.0)
    ap.add_argument("--holder-nic-mbit", type=float, default=0.0,
                    help="the holders' NICs (default --nic-mbit); the joiner's are --nic-mbit, which the figure "
                         "is taken against")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of the run (the joiner joins after the first)")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="seconds an inner step sleeps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--generations", action="store_true", help="(accepted for older commands: every run is)")
    ap.add_argument("--overlap", action="store_true", help="overlap=True (the state in the generation's background)")
    ap.add_argument("--shard-state", action="store_true", help="shard_state=True")
    ap.add_argument("--ranks-per-worker", type=int, default=1, help="processes per worker")
    ap.add_argument("--worker-name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from elastic_sim import Job

    from hetcomm.bench.records import command_line, write_document
    from hetcomm.sim import SimCluster, SimSpec

    R = args.ranks_per_worker

    class JoinJob(Job):
        def start(self, rank: int) -> None:
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--store", self.address,
                    "--id", f"w{rank}", "--job", self.name, "--min-workers", str(args.holders * R),
                    "--state-gb", str(args.state_gb), "--rounds", str(args.rounds),
                    "--step-seconds", str(args.step_seconds),
                    "--jsonl", os.path.join(self.out, f"w{rank}.jsonl")]
            argv += ["--worker-name", f"worker{rank // R}"]
            argv += ["--overlap"] if args.overlap else []
            argv += ["--shard-state"] if args.shard_state else []
            import subprocess
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **self.cluster.rank_env(rank))
            log = open(os.path.join(self.out, f"w{rank}.log"), "a")
            self.procs[rank] = subprocess.Popen(self.cluster.command_for(rank, argv), env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)

    K = (args.holders + 1) * R
    joiner = range(K - R, K)
    rows = []
    nics = [args.holder_nic_mbit or args.nic_mbit] * (K - R) + [args.nic_mbit] * R
    with SimCluster(SimSpec(nic_mbit=nics)) as cluster:
        for repeat in range(args.repeats):
            out = tempfile.mkdtemp(prefix="join_")
            job = JoinJob(cluster, args, f"join{repeat}-{os.getpid()}", out, range(K), seed=0)
            for rank in range(K - R):
                job.start(rank)
            deadline = time.time() + 900
            while job.rounds_seen() < 1 and time.time() < deadline:
                ended = {rank: proc.poll() for rank, proc in job.procs.items() if proc.poll() is not None}
                if ended:
                    logs = open(os.path.join(out, f"w{min(ended)}.log")).read()[-3000:]
                    job.wait(time.time())
                    raise SystemExit(f"elastic_join_transfer: repeat {repeat}: worker(s) {ended} exited before "
                                     f"the first round\n{logs}")
                time.sleep(0.5)
            for rank in joiner:
                job.start(rank)
            hung = job.wait(time.time() + 900)
            joins = [[r for r in job.records(rank) if "transfer_s" in r and not r["holder"]] for rank in joiner]
            if hung or not all(joins):
                logs = open(os.path.join(out, f"w{K - 1}.log")).read()[-3000:]
                raise SystemExit(f"elastic_join_transfer: repeat {repeat}: hung {hung}, joins {joins}\n{logs}")
            firsts = [j[0] for j in joins]            # (each rank's first: a later one is another join)
            seconds, moved = max(j["transfer_s"] for j in firsts), max(j["bytes"] for j in firsts)
            link = moved * 8 / (args.nic_mbit * 1e6)
            rows.append({"repeat": repeat, "transfer_s": seconds, "bytes": moved, "link_s": link,
                         "ratio": seconds / link, "ranks": firsts})
            print(f"[elastic_join_transfer] repeat {repeat}: {moved / 1e9:.2f} GB in {seconds:.1f} s, "
                  f"the link needs {link:.1f} s: {rows[-1]['ratio']:.2f}x", flush=True)
    ratios = [r["ratio"] for r in rows]
    summary = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "holders": args.holders, "nic_mbit": args.nic_mbit,
               "holder_nic_mbit": args.holder_nic_mbit or args.nic_mbit, "state_gb": args.state_gb,
               "generations": True, "overlap": args.overlap, "shard_state": args.shard_state,
               "ranks_per_worker": R}
    print(f"[elastic_join_transfer] median {summary['ratio_median']:.2f}x the link's time "
          f"({summary['ratio_min']:.2f}-{summary['ratio_max']:.2f})", flush=True)
    if args.json:
        write_document(args.json, {"rows": rows, **summary}, command_line())


if __name__ == "__main__":
    main()
