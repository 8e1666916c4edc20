"""How long a worker joining an ElasticDiLoCo run takes to receive the run's state, against the
time its link needs for the bytes (issue 42's target: a 1 GB state within 1.5x). Needs root.

``--holders`` workers (default 2) start on the simulated cluster (``hetcomm.sim``: every worker
its own namespace, NICs of ``--nic-mbit`` in each direction) with a model whose global
parameters and outer momentum (fp32) make ``--state-gb`` GB; after their first round a new
worker starts and asks to join. At the next round boundary the holders send it the state over
the generation's process group, each holder one shard (not through the store: it carries only
the decision). The joiner times `_transfer`; ``ratio`` = that time / (bytes x 8 / NIC rate),
the joiner's link being the bottleneck (the holders' uplinks together are faster). Inner steps
sleep ``--step-seconds`` (rounds long enough for the joiner to start): the figure is the transfer,
not training. Median and spread over ``--repeats``.

Usage::

    python benchmarks/elastic_join_transfer.py --repeats 3 --json benchmarks/results/elastic_join_1gb.json
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
    diloco = hetcomm.ElasticDiLoCo(model, None, store=args.store, worker_id=args.id, job=args.job, steps=2,
                                   compress="int8", min_workers=args.min_workers, early_join=False,
                                   collective_timeout=600.0, verbose=False)
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
    ap.add_argument("--rounds", type=int, default=10, help="rounds of the run (the joiner joins after the first)")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="seconds an inner step sleeps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from elastic_sim import Job

    from hetcomm.bench.records import command_line, write_document
    from hetcomm.sim import SimCluster, SimSpec

    class JoinJob(Job):
        def start(self, rank: int) -> None:
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--store", self.address,
                    "--id", f"w{rank}", "--job", self.name, "--min-workers", str(args.holders),
                    "--state-gb", str(args.state_gb), "--rounds", str(args.rounds),
                    "--step-seconds", str(args.step_seconds),
                    "--jsonl", os.path.join(self.out, f"w{rank}.jsonl")]
            import subprocess
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **self.cluster.rank_env(rank))
            log = open(os.path.join(self.out, f"w{rank}.log"), "a")
            self.procs[rank] = subprocess.Popen(self.cluster.command_for(rank, argv), env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)

    K = args.holders + 1
    rows = []
    with SimCluster(SimSpec(nic_mbit=[args.nic_mbit] * K)) as cluster:
        for repeat in range(args.repeats):
            out = tempfile.mkdtemp(prefix="join_")
            job = JoinJob(cluster, args, f"join{repeat}-{os.getpid()}", out, range(K), seed=0)
            for rank in range(args.holders):
                job.start(rank)
            deadline = time.time() + 900
            while job.rounds_seen() < 1 and time.time() < deadline:
                time.sleep(0.5)
            job.start(K - 1)
            hung = job.wait(time.time() + 900)
            joins = [r for r in job.records(K - 1) if "transfer_s" in r and not r["holder"]]
            if hung or not joins:
                logs = open(os.path.join(out, f"w{K - 1}.log")).read()[-3000:]
                raise SystemExit(f"elastic_join_transfer: repeat {repeat}: hung {hung}, joins {joins}\n{logs}")
            join = joins[0]
            link = join["bytes"] * 8 / (args.nic_mbit * 1e6)
            rows.append({"repeat": repeat, "transfer_s": join["transfer_s"], "bytes": join["bytes"],
                         "link_s": link, "ratio": join["transfer_s"] / link})
            print(f"[elastic_join_transfer] repeat {repeat}: {join['bytes'] / 1e9:.2f} GB in {join['transfer_s']:.1f} s, "
                  f"the link needs {link:.1f} s: {rows[-1]['ratio']:.2f}x", flush=True)
    ratios = [r["ratio"] for r in rows]
    summary = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "holders": args.holders, "nic_mbit": args.nic_mbit, "state_gb": args.state_gb}
    print(f"[elastic_join_transfer] median {summary['ratio_median']:.2f}x the link's time "
          f"({summary['ratio_min']:.2f}-{summary['ratio_max']:.2f})", flush=True)
    if args.json:
        write_document(args.json, {"rows": rows, **summary}, command_line())


if __name__ == "__main__":
    main()
