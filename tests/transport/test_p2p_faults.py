"""Point-to-point against a peer that has exited, against a sender that runs far ahead, and from
any source.

Elapsed-time assertions are bounds that only waiting for the operation timeout (30 s here) can
break, never performance claims; benchmarks/fault_latency.py measures the actual latencies.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import default_store, die, run_ranks, wait_for_key, wait_until_gone
from values import assert_same, pattern

pytestmark = pytest.mark.usefixtures("backend_importable")

PG_TIMEOUT_S = 30.0
HANG_BOUND_S = 15.0  # well under PG_TIMEOUT_S: only waiting for the timeout can exceed it


def peer_exits_then_p2p(rank: int, world_size: int, op: str) -> dict | None:
    """Rank 1 exits once the group works; rank 0 then sends to it or receives from it, then
    destroys the group."""
    dist.all_reduce(torch.ones(10))  # the group works, and a collective connection exists
    if rank == 1:
        default_store().set("exiting", str(os.getpid()))
        die()
    wait_for_key("exiting")
    wait_until_gone(int(default_store().get("exiting")))
    t = torch.ones(1000)
    start = time.monotonic()
    try:
        if op == "send":
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=1)
    except RuntimeError as e:
        message, raised = str(e), True
    else:
        message, raised = "", False
    op_s = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    return {"raised": raised, "message": message, "op_s": op_s, "destroy_s": time.monotonic() - start}


@hetcomm_only("gloo's recv from a dead peer waits for its timeout")
@pytest.mark.parametrize("op", ["send", "recv"])
def test_p2p_with_a_peer_that_has_exited_fails_fast(op: str) -> None:
    res = run_ranks(2, peer_exits_then_p2p, op, expect_dead={1}, pg_timeout=PG_TIMEOUT_S, timeout=120)[0]
    assert res["raised"], f"{op} to a dead peer succeeded: {res}"
    assert "rank 1" in res["message"], res
    assert any(w in res["message"] for w in ("refused", "exited", "closed")), res
    assert res["op_s"] < HANG_BOUND_S, f"{op} raised only after {res['op_s']:.1f} s: {res}"
    assert res["destroy_s"] < HANG_BOUND_S, f"destroy_process_group took {res['destroy_s']:.1f} s: {res}"


BUDGET = 4 << 20           # HETCOMM_P2P_UNEXPECTED_BYTES for the job
BIG = 64 << 20             # bytes sent with tag 7 before anything claims them


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def sender_runs_ahead(rank: int, world_size: int) -> dict | None:
    big = pattern(BIG // 4, torch.float32, 0)
    small = pattern(100, torch.float32, 0, salt=5)
    if rank == 0:
        wait_for_key("receiver_ready")
        # Start late enough that the receiver's stuck receive (posted before "receiver_ready")
        # times out well before these sends would.
        time.sleep(2.0)
        works = [dist.isend(big.clone(), dst=1, tag=7), dist.isend(small.clone(), dst=1, tag=5)]
        for w in works:
            try:
                w.wait()
            except RuntimeError:
                pass  # the receiver's group failed on its stuck receive: so does ours
        return None
    # Receive the small message first. It is sent after the big one, which nothing claims and
    # which does not fit the budget: the receive cannot complete, and its error says why. (It is
    # posted before the sender starts, so that it times out before the sender's big send does.)
    got_small = torch.empty(100)
    stuck_work = dist.irecv(got_small, src=0, tag=5)
    before = _rss_bytes()
    default_store().set("receiver_ready", "1")
    time.sleep(3.5)  # the sender started 2 s in, and has long put on the wire what it could
    grew = _rss_bytes() - before
    try:
        stuck_work.wait()
    except RuntimeError as e:
        stuck = str(e)
    else:
        stuck = ""
    # The timed-out receive failed the group: every later operation fails with that first cause.
    try:
        dist.recv(torch.empty(BIG // 4), src=0, tag=7)
    except RuntimeError as e:
        later = str(e)
    else:
        later = ""
    return {"rss_growth": grew, "stuck": stuck, "later": later}


@hetcomm_only("HETCOMM_P2P_UNEXPECTED_BYTES is hetcomm's")
def test_unclaimed_messages_are_buffered_only_up_to_the_budget() -> None:
    res = run_ranks(2, sender_runs_ahead, pg_timeout=5.0, timeout=120,
                    env={"HETCOMM_P2P_UNEXPECTED_BYTES": str(BUDGET)})[1]
    assert res["rss_growth"] < BIG // 2, f"the receiver buffered {res['rss_growth']} bytes of a {BIG}-byte " \
                                         f"message it had not asked for (budget {BUDGET})"
    assert "HETCOMM_P2P_UNEXPECTED_BYTES" in res["stuck"] and "tag 7" in res["stuck"], res
    assert "earlier failure" in res["later"] and "HETCOMM_P2P_UNEXPECTED_BYTES" in res["later"], res


def any_source(rank: int, world_size: int) -> list | None:
    if rank == 0:
        got = []
        for _ in range(world_size - 1):
            t = torch.empty(50)
            work = dist.irecv(t, tag=3)  # from whichever rank sends first
            work.wait()
            source = work._source_rank()
            assert_same(t, pattern(50, torch.float32, source, salt=3), f"from rank {source}")
            got.append(source)
        return sorted(got)
    dist.send(pattern(50, torch.float32, rank, salt=3), dst=0, tag=3)
    return None


def test_receive_from_any_source() -> None:
    assert run_ranks(3, any_source, timeout=120)[0] == [1, 2]


def monitored(rank: int, world_size: int) -> dict:
    import datetime

    import hetcomm

    timeout = datetime.timedelta(seconds=2)
    hetcomm.monitored_barrier(timeout=timeout)  # everyone arrives
    result = {}
    if rank != world_size - 1:  # the last rank stays away from the second one
        try:
            hetcomm.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        except RuntimeError as e:
            result["error"] = str(e)
    default_store().set(f"monitored_done_{rank}", "1")
    for r in range(world_size):
        wait_for_key(f"monitored_done_{r}")
    return result


@hetcomm_only("hetcomm.monitored_barrier")
def test_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    results = run_ranks(3, monitored, timeout=120)
    assert "rank 2 failed to pass the barrier" in results[0]["error"], results
    assert "rank 0 failed to pass the barrier" in results[1]["error"], results  # never released
    assert results[2] == {}, results


def any_source_in_arrival_order(rank: int, world_size: int) -> list | None:
    """Rank 2's one message arrives first; then rank 1 sends many. Receives from any source
    posted afterwards take them in the order they arrived, not lowest rank first."""
    store = default_store()
    if rank == 2:
        dist.send(torch.full((4,), 2.0), dst=0, tag=8)
        store.set("rank2_sent", "1")
        return None
    if rank == 1:
        wait_for_key("rank2_arrived")
        for i in range(50):
            dist.send(torch.full((4,), 1.0), dst=0, tag=8)
        store.set("rank1_sent", "1")
        return None
    import hetcomm

    def arrived(n: int) -> None:
        # The engine reads point-to-point messages as they come, claimed or not, and counts each
        # one wholly read (hetcomm.stats): waiting on the count, not on a sleep, is what makes
        # "arrived first" true on a loaded machine too.
        deadline = time.monotonic() + 60
        while hetcomm.stats()["p2p_received_messages"] < n:
            assert time.monotonic() < deadline, f"{n} messages never arrived"
            time.sleep(0.001)

    wait_for_key("rank2_sent")
    arrived(1)       # rank 2's message is here, unclaimed
    store.set("rank2_arrived", "1")
    wait_for_key("rank1_sent")
    arrived(51)      # and rank 1's 50 too
    sources = []
    for _ in range(51):
        t = torch.empty(4)
        work = dist.irecv(t, tag=8)
        work.wait()
        sources.append(work._source_rank())
    return sources


@hetcomm_only("the order of receives from any source is hetcomm's")
def test_receives_from_any_source_take_messages_in_arrival_order() -> None:
    """Rank 0 waits for the messages to have arrived by its own counters (hetcomm.stats), not
    for half a second, which a loaded machine could outlast."""
    # Failed before the fix: rank 1's 50 messages were taken first (peer order), rank 2's last.
    sources = run_ranks(3, any_source_in_arrival_order, timeout=120)[0]
    assert sources[0] == 2, sources
    assert sorted(sources) == [1] * 50 + [2], sources



def completion_time(rank: int, world_size: int) -> dict | None:
    """Rank 1 notes the time (time.perf_counter(): both ranks are on this machine, one clock) and
    sends; rank 0 looks at its receive only now and then. The engine notes when the receive
    completed as it completes it: after the send began, and no later than rank 0 first saw it
    completed -- however late rank 0 looks (it sleeps 0.2 s after seeing it before asking)."""
    from hetcomm import _engine

    completed_at = _engine.extension().completed_at
    if rank == 0:
        t = torch.zeros(1000)
        work = dist.irecv(t, src=1)
        before = completed_at(work)
        default_store().set("posted", "1")
        while not work.is_completed():
            time.sleep(0.01)
        seen = time.perf_counter()
        time.sleep(0.2)
        work.wait()
        return {"before": before, "noted": completed_at(work), "seen": seen,
                "sent": float(default_store().get("sent")), "ok": bool((t == 7).all())}
    wait_for_key("posted")
    default_store().set("sent", repr(time.perf_counter()))
    dist.send(torch.full((1000,), 7.0), dst=0)
    return None


@hetcomm_only("hetcomm._C.completed_at notes hetcomm's completions")
def test_the_engine_notes_when_a_receive_completed() -> None:
    res = run_ranks(2, completion_time, timeout=120)[0]
    assert res["ok"], res
    assert res["before"] == 0.0, res
    assert res["sent"] <= res["noted"] <= res["seen"], res
