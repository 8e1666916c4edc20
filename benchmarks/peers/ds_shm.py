"""DeepSpeed's shared-memory allreduce (deepspeed.comm.inference_all_reduce, DS_ACCELERATOR=cpu)
timed on the sizes given: one rank of a job started by benchmarks/local_host.py (env: RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT). Prints one JSON line per size
from rank 0: {"size_bytes", "time_us"} (median of the timed repetitions, each the slowest rank's).

Every rank takes the slowest rank's time of each repetition, so that all stop after the same
repetition (each deciding from its own clock let one rank go on to the next size while another
timed one more: a hang that looked like DeepSpeed's at 2 ranks)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    import deepspeed
    import deepspeed.comm as dscomm
    import torch

    torch.set_num_threads(1)
    sizes = [int(s) for s in sys.argv[1].split(",")]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist
    rank = dscomm.get_rank()
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        for _ in range(3):
            dscomm.inference_all_reduce(t)
        times, spent = [], 0.0
        while spent < seconds or len(times) < 5:
            dscomm.barrier()
            start = time.perf_counter()
            reps = 1 if nbytes >= 1 << 20 else 20
            for _ in range(reps):
                dscomm.inference_all_reduce(t)
            slowest = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dt = float(slowest)
            times.append(dt)
            spent += dt * reps
        if rank == 0:
            print(json.dumps({"size_bytes": nbytes, "time_us": statistics.median(times) * 1e6}), flush=True)
    dist.barrier()  # nobody leaves while another still times


if __name__ == "__main__":
    main()
    # DeepSpeed's process teardown sometimes aborted one rank ("terminate called without an active
    # exception") after every figure was printed; the figures are out, so leave without it.
    sys.stdout.flush()
    os._exit(0)
