"""DDP training step on CUDA: hetcomm beside gloo and NCCL, in the same processes, alternating.

    python benchmarks/ddp_step_cuda.py [--nprocs 2] [--params-m 25] [--steps 20] [--rounds 3]
                                       [--backends hetcomm,gloo,nccl]
                                       [--json benchmarks/results/ddp_step_cuda.json]

Backends: hetcomm (its default levels), hetcomm-nccl (NCCL as the inner level of the host,
HETCOMM_LOCAL=nccl), gloo, nccl. Ranks that share a GPU get an NCCL_HOSTID each (unless it is
set), so that NCCL starts: it then connects them as separate machines.

Every rank trains the same MLP (``--params-m`` million fp32 parameters, so that the gradient
allreduce carries 4 x that many MB per step) with DistributedDataParallel's default hook, once on
a group of each backend, ``--rounds`` times in turn so that a drift of the machine affects all
alike. A step is zero_grad, forward, backward (which runs DDP's bucketed
allreduces), optimizer step, and ends when the current stream has finished it. Ranks are placed
on GPU ``rank mod visible GPUs``: with one GPU every rank shares it. The reported time of a
round is the slowest rank's median step; the result is the median over rounds, and the ratios
are each other backend's time / hetcomm's (above 1: hetcomm is faster).

The two runs start from the same parameters and see the same batches, so their final parameters
must agree; the script checks that and fails otherwise (a benchmark of wrong numbers is no
benchmark).

The JSON file holds one record per line (hetcomm.bench.records), each with the command: a ``run``
header (machine, model, medians, ratio, parameter check), then one ``result`` per backend and
round (``backend``, ``round``, ``step_seconds``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetcomm.bench.records import command_line, write_document
from hetcomm.bench.worker import give_ranks_nccl_hosts

WIDTH = 2048


def build_model(params_m: float) -> nn.Module:
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*blocks)


def run_steps(params_m: float, group, device, steps: int, warmup: int, batch: int, seed: int):
    """Trains ``warmup + steps`` steps on ``group``; returns (step seconds, final parameters).

    The model is built from seed 0 every time: both backends start from the same parameters.
    """
    torch.manual_seed(0)
    model = build_model(params_m).to(device)
    ddp = DDP(model, process_group=group, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stream = torch.cuda.current_stream()
    times = []
    for i in range(warmup + steps):
        x = torch.randn(batch, WIDTH, generator=gen).to(device)
        stream.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
        stream.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, [p.detach().clone() for p in model.parameters()]


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    import hetcomm  # noqa: F401  (registers the backend)

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    give_ranks_nccl_hosts(args.backends, rank, world_size)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("hetcomm", timeout=timeout)
    groups = {}
    for name in args.backends:
        if name == "hetcomm":
            groups[name] = dist.group.WORLD
        elif name == "hetcomm-nccl":
            saved = os.environ.get("HETCOMM_LOCAL")
            os.environ["HETCOMM_LOCAL"] = "nccl"     # read when the group is created
            try:
                groups[name] = dist.new_group(backend="hetcomm", timeout=timeout)
            finally:
                if saved is None:
                    del os.environ["HETCOMM_LOCAL"]
                else:
                    os.environ["HETCOMM_LOCAL"] = saved
        else:
            groups[name] = dist.new_group(backend=name, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)  # for the numbers, not measured
    rounds = {name: [] for name in groups}
    finals = {}
    for r in range(args.rounds):
        for name, group in groups.items():
            times, params = run_steps(args.params_m, group, device, args.steps, args.warmup, args.batch,
                                      seed=rank)
            median = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(median, op=dist.ReduceOp.MAX, group=control)
            rounds[name].append(float(median))
            finals[name] = params
            if rank == 0:
                print(f"ddp_step_cuda: round {r + 1}/{args.rounds} {name}: {float(median) * 1e3:.2f} ms "
                      "per step (slowest rank's median)", file=sys.stderr, flush=True)
    worst = max((float((a - b).abs().max()) for name in groups if name != "hetcomm"
                 for a, b in zip(finals["hetcomm"], finals[name])), default=0.0)
    dist.barrier(group=control)
    if rank == 0:
        params = sum(p.numel() for p in finals["hetcomm"])
        result = {
            "world_size": world_size,
            "gpus": torch.cuda.device_count(),
            "gpu_name": torch.cuda.get_device_name(device),
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "hostname": socket.gethostname(),
            "params": params,
            "gradient_bytes": params * 4,
            "batch_per_rank": args.batch,
            "steps_per_round": args.steps,
            "warmup_steps": args.warmup,
            "round_step_seconds": rounds,
            "step_seconds": {name: statistics.median(v) for name, v in rounds.items()},
            "final_params_max_abs_diff": worst,
        }
        for name in groups:
            if name != "hetcomm":
                result[f"speedup_{name}_over_hetcomm"] = result["step_seconds"][name] / result["step_seconds"]["hetcomm"]
        queue.put(result)
    dist.destroy_process_group()


def ddp_document(result: dict) -> dict:
    """``result`` with ``round_step_seconds`` as rows: one per backend and round."""
    rows = [{"backend": name, "round": i, "step_seconds": seconds}
            for name, each in result["round_step_seconds"].items() for i, seconds in enumerate(each)]
    return {**{k: v for k, v in result.items() if k != "round_step_seconds"}, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--params-m", type=float, default=25.0, help="million parameters (default 25)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each backend once (default 3)")
    parser.add_argument("--backends", default="hetcomm,gloo,nccl",
                        help="comma-separated, hetcomm first: hetcomm, hetcomm-nccl, gloo, nccl (default hetcomm,gloo,nccl)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.backends[:1] != ["hetcomm"] or not set(args.backends) <= {"hetcomm", "hetcomm-nccl", "gloo", "nccl"}:
        parser.error(f"--backends {','.join(args.backends)}: hetcomm first, then any of hetcomm-nccl, gloo, nccl")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.nprocs, port, args, queue)) for r in range(args.nprocs)]
    for p in procs:
        p.start()
    result = None
    deadline = time.monotonic() + args.timeout * 4
    while result is None and time.monotonic() < deadline:
        try:
            result = queue.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty; also notice dead ranks
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    if result is None:
        print("ddp_step_cuda: a rank failed (see above)", file=sys.stderr)
        return 2
    result = {"command": command_line(), **result}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        write_document(args.json, ddp_document(result), result["command"])
    ok = result["final_params_max_abs_diff"] <= 1e-4
    if not ok:
        print(f"ddp_step_cuda: hetcomm and another backend ended with different parameters "
              f"(max diff {result['final_params_max_abs_diff']:.3g})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
