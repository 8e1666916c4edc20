"""DiLoCo's per-rank state for workers of 1, 2 and 4 ranks: the bytes a rank keeps, against the
whole state divided over the worker's ranks (issue 42's target: <= 1.3 x state / ranks + a
constant).

Four ranks on this host train a model of ``--width`` x ``--width`` linear layers (``--layers`` of
them) as four workers of one rank, two of two, or one of four, each configuration synchronous
(fp32, Nesterov) and with everything that keeps a buffer (overlap, ``--fragments`` staggered
fragments, int8 with error feedback). Two measures per rank, after ``--rounds`` rounds:

* ``state_bytes``: the distinct storages reachable from the DiLoCo object (`DiLoCo.state_bytes`),
  whatever keeps them;
* ``rss_growth``: the process's resident memory (VmRSS) after the rounds less before DiLoCo was
  constructed (the gradients already allocated): what the process really holds, including
  hetcomm's buffers for DiLoCo's process groups and transients the allocator kept;
  ``rss_beyond_share_mb`` = rss_growth - the whole state / S should not grow with the model
  (run two ``--layers`` to see it).

``ratio`` = a rank's state_bytes / (the one-rank workers' state_bytes / S) for workers of S
ranks; the exchange's buffers ((S + 1) x 256 Ki elements at most) are the constant.

Usage::

    python benchmarks/diloco_memory.py --json benchmarks/results/diloco_memory.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from hetcomm.bench.records import command_line, write_document

SHAPES = {1: [0, 1, 2, 3], 2: [0, 0, 1, 1], 4: [0, 0, 0, 0]}


def _rss(field: str = "VmRSS:") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _rank(rank: int, world: int, port: int, args, S: int, name: str, kwargs: dict, out, store: str) -> None:
    import hetcomm

    torch.set_num_threads(1)
    os.environ["HETCOMM_PROBE"] = "0"
    if args.membership == "fixed":
        dist.init_process_group("hetcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    labels = SHAPES[S]
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(8, args.width)
    nn.functional.mse_loss(net(x), x).backward()        # the gradients exist before the baseline
    opt.zero_grad(set_to_none=False)
    if args.membership == "fixed":
        dist.barrier()
    before = _rss()
    # inner_sync=False: every rank steps on the same batch, so the worker's replicas stay equal
    # without averaging gradients, whose all-reduce buffers are the inner data parallelism's
    # memory (DDP's as much), not DiLoCo's.
    if args.membership == "elastic":
        # The generations form their own groups; the workers meet through the store. A worker of
        # several ranks averages its gradients (inner_sync is not an option there): every rank of
        # it steps on the same batch, so the averaging changes nothing but its buffers.
        membership = hetcomm.Elastic(store=store, worker_id=f"r{rank}", worker=f"w{labels[rank]}",
                                     job=f"{name}-{S}", min_workers=world, verbose=False)
        diloco = hetcomm.DiLoCo(net, opt, membership=membership, local_steps="fixed", steps=2,
                                **({"shard_state": True} if args.shard_state else {}), **kwargs)
        diloco.join()
    else:
        diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=2, workers=labels, inner_sync=False, **kwargs)
    for _ in range(2 * args.rounds):
        nn.functional.mse_loss(net(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        diloco.step(samples=8)
    core = diloco._inner if args.membership == "elastic" else diloco    # (the generation's DiLoCo)
    held = core._layout.size if core._layout is not None else core._start.numel()
    rows.append({"ranks_per_worker": S, "setting": name, "rank": rank, "state_bytes": diloco.state_bytes(),
                 "rss_growth": _rss() - before, "rss_peak_growth": _rss("VmHWM:") - before,
                 "held_elements": held, "elements": sum(p.numel() for p in net.parameters())})
    diloco.finish()
    out.put(rows)
    if args.membership == "fixed":
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--membership", choices=["fixed", "elastic"], default="fixed",
                    help="a fixed group, or DiLoCo in generations over elastic membership (Elastic)")
    ap.add_argument("--shard-state", action="store_true",
                    help="--membership elastic: the state sharded over each worker's ranks (shard_state=True)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    settings = {"sync": {},
                "overlap_f%d_int8" % args.fragments: {"overlap": True, "fragments": args.fragments, "compress": "int8",
                                                      "error_feedback": True, "overlap_steps": 1}}
    ctx = mp.get_context("spawn")
    rows = []
    for S in SHAPES:                                 # a fresh job each: the RSS of nothing before
        for name, kwargs in settings.items():
            out = ctx.Queue()
            port = 20000 + (os.getpid() * 7 + 97 * len(rows)) % 20000
            store = None
            if args.membership == "elastic":            # (the job's store lives here, as torchrun's would)
                server = dist.TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False)
                store = f"127.0.0.1:{server.port}"
            procs = [ctx.Process(target=_rank, args=(r, 4, port, args, S, name, kwargs, out, store)) for r in range(4)]
            for p in procs:
                p.start()
            rows += [row for _ in procs for row in out.get(timeout=3600)]
            for p in procs:
                p.join(timeout=120)
    summary = []
    for name in settings:
        single = statistics.median(r["state_bytes"] for r in rows if r["setting"] == name and r["ranks_per_worker"] == 1)
        single_rss = statistics.median(r["rss_growth"] for r in rows if r["setting"] == name and r["ranks_per_worker"] == 1)
        for S in SHAPES:
            mine = [r for r in rows if r["setting"] == name and r["ranks_per_worker"] == S]
            worst = max(r["state_bytes"] for r in mine)
            worst_rss = max(r["rss_growth"] for r in mine)
            worst_peak = max(r["rss_peak_growth"] for r in mine)
            row = {"setting": name, "ranks_per_worker": S, "state_mb_max": worst / 1e6,
                   "state_mb_single": single / 1e6, "ratio": worst / (single / S),
                   "rss_growth_mb_max": worst_rss / 1e6, "rss_ratio": worst_rss / (single_rss / S),
                   "rss_peak_growth_mb_max": worst_peak / 1e6,
                   # what RSS holds beyond the share of the state: a constant if the target's form holds
                   "rss_beyond_share_mb": (worst_rss - single / S) / 1e6}
            summary.append(row)
            print(f"[diloco_memory] {name}, workers of {S} rank(s): {worst / 1e6:.1f} MB a rank (the whole: "
                  f"{single / 1e6:.1f} MB; ratio to whole/S {row['ratio']:.3f}); RSS growth {worst_rss / 1e6:.1f} MB "
                  f"(ratio {row['rss_ratio']:.3f}), peak RSS growth {worst_peak / 1e6:.1f} MB", flush=True)
    write_document(args.json, {"rows": summary, "per_rank": rows, "width": args.width, "layers": args.layers,
                               "membership": args.membership},
                   command_line(), lists={"rows": "result", "per_rank": "rank"})


if __name__ == "__main__":
    sys.exit(main())
