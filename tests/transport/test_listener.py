"""The listening port under a flood of connections that never say hello, with few descriptors.

Rank 1 opens 1500 connections to rank 0's listening port and holds them; rank 0 runs with its
descriptor limit at 512 (the target's setting), or at only a few more than it has open, so that
accept() runs out of descriptors. The group must keep giving exact results, and rank 0 must stay
idle while nothing happens: its CPU time over two idle seconds is checked against a bound that
only a busy loop can break (a listener that spins on a readable socket burns a whole core).
"""
from __future__ import annotations

import os
import resource
import socket
import time

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import default_store, run_ranks, wait_for_key
from values import assert_same, expected_reduce, pattern

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("floods hetcomm's own listening port")]

FLOOD = 1500
IDLE_S = 2.0
BUSY_LOOP_CPU_PER_S = 0.5  # an idle rank uses ~0; a spinning listener ~1 core




def _exact_allreduces(rank: int, world_size: int) -> None:
    for k in range(3):
        inputs = [pattern(10_000, torch.float32, r, salt=k) for r in range(world_size)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        assert_same(t, expected_reduce(inputs, dist.ReduceOp.SUM), f"allreduce {k} under the flood")


def flooded(rank: int, world_size: int, limit: str) -> dict | None:
    import hetcomm

    _exact_allreduces(rank, world_size)  # connections up before the flood
    store = default_store()
    if rank == 0:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_now = len(os.listdir("/proc/self/fd"))
        soft = 512 if limit == "512" else open_now + 16
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        store.set("flood_target", hetcomm.listen_address())
        wait_for_key("flooded")
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(IDLE_S)
        after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        _exact_allreduces(rank, world_size)
        # Silent connections are turned away once their handshake time (3 s) is up.
        deadline = time.monotonic() + 30
        while hetcomm.backend_of().rejected_connections() == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        store.set("flood_done", "1")
        return {"cpu_per_s": cpu / elapsed, "rejected": hetcomm.backend_of().rejected_connections(),
                "limit": soft}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, FLOOD + 500)), hard))
    wait_for_key("flood_target")
    host, port = store.get("flood_target").decode().rsplit(":", 1)
    sockets = []
    for _ in range(FLOOD):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        sockets.append(s)
    time.sleep(0.5)
    store.set("flooded", "1")
    _exact_allreduces(rank, world_size)
    wait_for_key("flood_done")
    for s in sockets:
        s.close()
    return None


@pytest.mark.parametrize("limit", ["512", "nearly_exhausted"])
def test_the_group_works_and_idles_under_a_connection_flood(limit: str) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < FLOOD + 500:
        pytest.skip(f"needs a hard descriptor limit of at least {FLOOD + 500} to open {FLOOD} "
                    f"connections (it is {resource.getrlimit(resource.RLIMIT_NOFILE)[1]})")
    res = run_ranks(2, flooded, limit, timeout=180)[0]
    assert res["rejected"] > 0, f"the flood never reached the listener: {res}"
    assert res["cpu_per_s"] < BUSY_LOOP_CPU_PER_S, \
        f"rank 0 used {res['cpu_per_s']:.2f} s of CPU per idle second under the flood: {res}"
