"""Point-to-point links through a ring in shared memory (csrc/transport/shm/ring_link.h) between
ranks of one host: exact data across many wraps of a small ring, messages claimed out of order,
both ranks sending at once, a peer that dies with the ring full or half read, the setting, and
nothing left in /dev/shm.

Elapsed-time assertions are bounds that only waiting for the operation timeout (30 s here) can
break, never performance claims; benchmarks/p2p_local.py measures the rates.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import default_store, die, run_ranks, run_ranks_outcomes, wait_for_key, wait_until_gone
from marks import hetcomm_only
from values import assert_same, pattern

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("hetcomm's own point-to-point links")]

RING = 64 << 10            # the smallest ring: every message below wraps it many times
PG_TIMEOUT_S = 30.0
HANG_BOUND_S = 15.0        # well under PG_TIMEOUT_S: only waiting for the timeout can exceed it


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hetcomm-p2p-")}


def exchange(rank: int, world_size: int) -> dict:
    import hetcomm

    peer = 1 - rank
    sizes = {5: 0, 6: 1, 7: 1000, 8: RING // 4, 9: 3 * (1 << 20) // 4 + 3}   # tag -> float32 elements
    if rank == 0:
        for tag, n in sizes.items():
            dist.send(pattern(n, torch.float32, 0, salt=tag), dst=1, tag=tag)
        dist.send(pattern(12345, torch.float64, 0, salt=1), dst=1, tag=10)
        dist.send(pattern(777, torch.int8, 0, salt=2), dst=1, tag=11)
    else:
        # Claimed in reverse order: every message but the last waits, read whole, for its receive.
        for tag, n in sorted(sizes.items(), reverse=True):
            got = torch.full((n,), -1.0)
            dist.recv(got, src=0, tag=tag)
            assert_same(got, pattern(n, torch.float32, 0, salt=tag), f"tag {tag}, {n} floats")
        got64 = torch.zeros(12345, dtype=torch.float64)
        dist.recv(got64, src=0, tag=10)
        assert_same(got64, pattern(12345, torch.float64, 0, salt=1), "float64")
        got8 = torch.zeros(777, dtype=torch.int8)
        dist.recv(got8, src=0, tag=11)
        assert_same(got8, pattern(777, torch.int8, 0, salt=2), "int8")
    # Both send 8 MB at once, then receive: neither may wait for the other's receive.
    mine = pattern(2 << 20, torch.float32, rank, salt=3)
    work = dist.isend(mine, dst=peer, tag=12)
    theirs = torch.zeros(2 << 20)
    dist.recv(theirs, src=peer, tag=12)
    work.wait()
    assert_same(theirs, pattern(2 << 20, torch.float32, peer, salt=3), "both at once")
    dist.barrier()
    return hetcomm.stats()["p2p_links"]


@pytest.mark.parametrize("ring", [RING, 0])
def test_messages_arrive_exact_through_the_ring_or_tcp(ring: int) -> None:
    before = _segments()
    links = run_ranks(2, exchange, env={"HETCOMM_P2P_SHM_BYTES": str(ring)}, pg_timeout=PG_TIMEOUT_S, timeout=180)
    for rank, kinds in enumerate(links):
        if ring:
            assert kinds["shm"] >= 1 and kinds["tcp"] == 0, (rank, kinds)
        else:
            assert kinds["shm"] == 0 and kinds["tcp"] >= 1, (rank, kinds)
    assert _segments() <= before, f"left in /dev/shm: {_segments() - before}"


BIG = 16 << 20             # bytes: far more than the ring holds


def _timed(op) -> dict:
    start = time.monotonic()
    try:
        op()
    except RuntimeError as e:
        return {"raised": True, "message": str(e), "op_s": time.monotonic() - start}
    return {"raised": False, "message": "", "op_s": time.monotonic() - start}


def peer_dies_mid_message(rank: int, world_size: int, who: str) -> dict | None:
    """``who`` ("sender" or "receiver") dies while a 16 MB message is half way through the ring."""
    import hetcomm

    big = pattern(BIG // 4, torch.float32, 0)
    dist.send(torch.ones(1), dst=1) if rank == 0 else dist.recv(torch.ones(1), src=0)   # the ring link is up
    assert hetcomm.stats()["p2p_links"]["shm"] >= 1
    work = dist.isend(big, dst=1, tag=3) if rank == 0 else None
    if (rank == 0) == (who == "sender"):
        # The sender has filled the ring and waits for room; the receive below takes part of it.
        time.sleep(0.3)
        default_store().set("exiting", str(os.getpid()))
        die()
    wait_for_key("exiting")
    wait_until_gone(int(default_store().get("exiting")))
    if rank == 0:
        return _timed(work.wait)
    return _timed(lambda: dist.recv(torch.zeros(BIG // 4), src=0, tag=3))


@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_a_peer_that_dies_mid_message_fails_the_other_side_fast(who: str) -> None:
    before = _segments()
    dead = 0 if who == "sender" else 1
    # Unclaimed messages are not read ahead (the budget is far below BIG): the message stays in the
    # ring, which fills, until the receive is posted.
    env = {"HETCOMM_P2P_SHM_BYTES": str(RING), "HETCOMM_P2P_UNEXPECTED_BYTES": "4096"}
    results = run_ranks(2, peer_dies_mid_message, who, expect_dead={dead}, env=env, pg_timeout=PG_TIMEOUT_S,
                        timeout=120)
    res = results[1 - dead]
    assert res["raised"], f"the {who} died, yet the other side's operation succeeded: {res}"
    assert f"rank {dead}" in res["message"], res
    assert res["op_s"] < HANG_BOUND_S, f"raised only after {res['op_s']:.1f} s: {res}"
    assert _segments() <= before, f"left in /dev/shm: {_segments() - before}"


def create_only(rank: int, world_size: int) -> None:
    return None


def test_a_bad_ring_size_is_refused_with_its_name() -> None:
    outcomes = run_ranks_outcomes(2, create_only, env={"HETCOMM_P2P_SHM_BYTES": "4M"}, pg_timeout=PG_TIMEOUT_S,
                                  timeout=120)
    for o in outcomes:
        assert o.status == "raised", o.describe()
        assert "HETCOMM_P2P_SHM_BYTES=4M" in o.message, o.describe()
