"""Open MPI's allreduce through mpi4py (numpy buffers, no torch), timed on the sizes given: run
under ``mpirun -n L`` by benchmarks/local_host.py. Prints one JSON line per size from rank 0:
{"size_bytes", "time_us"} (median of the timed repetitions, each the slowest rank's)."""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in sys.argv[1].split(",")]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
    for nbytes in sizes:
        send = np.ones(max(1, nbytes // 4), dtype=np.float32)
        recv = np.empty_like(send)
        for _ in range(3):
            comm.Allreduce(send, recv, op=MPI.SUM)
        times, spent = [], 0.0
        reps = 1 if nbytes >= 1 << 20 else 50
        while spent < seconds or len(times) < 5:
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(send, recv, op=MPI.SUM)
            dt = comm.allreduce((time.perf_counter() - start) / reps, op=MPI.MAX)
            times.append(dt)
            spent += dt * reps
        if comm.rank == 0:
            print(json.dumps({"size_bytes": nbytes, "time_us": statistics.median(times) * 1e6}), flush=True)


if __name__ == "__main__":
    main()
