"""Small collectives on the caller's thread (HETCOMM_INLINE_BYTES, docs/environment.md).

Within one host a small collective runs on the calling thread when the group is idle and the
program waited for its previous operation right away. What must hold, checked structurally (the
peer joins only once a store key says the caller got control back, so an operation that held
the caller until the peer came would deadlock, and the test fails on the store's timeout):

* an operation issued with ``async_op=True`` returns before its peer has joined: after
  creation, after a late wait, after the program took a future, and after a loop of
  synchronous calls (the caller runs it only once every local rank has issued it);
* a loop of synchronous calls runs on the caller's thread (``collectives_on_caller_thread``);
* operations keep their order behind one still running on the worker, with the right values;
* a callback on the future of an inline operation may issue another collective;
* above the threshold, or with ``HETCOMM_INLINE_BYTES=0`` (a group created after it is set), the
  worker runs them;
* a forked child that calls a collective on its parent's group gets an error (it used to queue it
  to a worker it does not have).
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import default_store, run_ranks
from marks import hetcomm_only

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("hetcomm's caller-thread operations")]

STORE_WAIT = timedelta(seconds=20)
LOOP = 20


def _on_caller(group=None) -> int:
    import hetcomm

    return hetcomm.stats(group)["collectives_on_caller_thread"]


def _returns_before_the_peer_joins(rank: int, store, key: str, group=None) -> float:
    """Rank 0 issues an async allreduce and says so in the store; rank 1 joins only then. Returns
    the result (3.0 when both took part)."""
    x = torch.full((2,), float(rank + 1))
    if rank == 0:
        work = dist.all_reduce(x, async_op=True, group=group)
        store.set(key, "back")
        work.wait()
    else:
        store.wait([key], STORE_WAIT)
        dist.all_reduce(x, group=group)
    return float(x[0])


def _prompt_loop(group=None) -> list[float]:
    out = []
    for i in range(LOOP):
        x = torch.full((1,), float(dist.get_rank() + i))
        dist.all_reduce(x, group=group)
        out.append(float(x[0]))
    return out


# The window within which a wait counts as right away: wide here, so that a rank preempted
# between a call's return and its wait (two test jobs share two cores) still counts as prompt.
WINDOW_US = 100_000
LATE_S = 0.3  # later than that


def _job(rank: int, world_size: int) -> dict:
    store = default_store()
    res: dict = {}
    # After creation: nothing learnt yet, so the worker runs it.
    res["first_async"] = _returns_before_the_peer_joins(rank, store, "inline/first")
    before = _on_caller()
    res["loop"] = _prompt_loop()
    res["loop_on_caller"] = _on_caller() - before
    # Right after it, an asynchronous operation whose peer first waits for this caller.
    res["after_prompt_loop"] = _returns_before_the_peer_joins(rank, store, "inline/loop")
    # A late wait: the next asynchronous operation keeps its overlap.
    x = torch.ones(2)
    work = dist.all_reduce(x, async_op=True)
    time.sleep(LATE_S)  # the program does something else before it waits
    work.wait()
    res["after_late_wait"] = _returns_before_the_peer_joins(rank, store, "inline/late")
    # A future taken (DDP, comm hooks): the same.
    _prompt_loop()
    x = torch.ones(2)
    dist.all_reduce(x, async_op=True).get_future().wait()
    res["after_future"] = _returns_before_the_peer_joins(rank, store, "inline/future")
    # Order and values behind an operation on the worker: 4 MB asynchronous, then small ones.
    _prompt_loop()
    big = torch.full((1 << 20,), float(rank + 1))
    work = dist.all_reduce(big, async_op=True)
    small = [torch.full((3,), float(rank + 1) * (i + 1)) for i in range(4)]
    for t in small:
        dist.all_reduce(t)
    work.wait()
    res["big"] = [float(big.min()), float(big.max())]
    res["small"] = [float(t[0]) for t in small]
    # A callback on an inline operation's future that issues a collective itself.
    _prompt_loop()
    before = _on_caller()
    x = torch.full((2,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    res["inline_then_callback_ran_inline"] = _on_caller() - before

    def again(fut):
        y = fut.value()[0] * 10
        dist.all_reduce(y)
        return y

    res["callback"] = float(work.get_future().then(again).wait()[0])
    # Above the threshold: the worker, even in a prompt loop.
    _prompt_loop()
    before = _on_caller()
    for _ in range(3):
        dist.all_reduce(torch.ones((2 << 20) // 4 + 1))  # 2 MiB + 4 bytes of float32
    res["large_on_caller"] = _on_caller() - before
    # HETCOMM_INLINE_BYTES=0: read when a group is created.
    os.environ["HETCOMM_INLINE_BYTES"] = "0"
    off = dist.new_group([0, 1])
    del os.environ["HETCOMM_INLINE_BYTES"]
    before = _on_caller(off)
    res["off_loop"] = _prompt_loop(off)
    res["off_on_caller"] = _on_caller(off) - before
    dist.destroy_process_group(off)
    res["forked_child"] = _forked_child_status()
    return res


def _forked_child_status() -> str:
    """What a forked child saw calling a collective on the parent's group: "refused" when it got
    an error naming the fork; the child is given 20 s."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as e:
            code = 0 if "forked child" in str(e) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {0: "refused", 2: "another error", 3: "ran it"}.get(os.waitstatus_to_exitcode(status), "crashed")
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return run_ranks(2, _job, timeout=120, env={"HETCOMM_INLINE_WINDOW_US": str(WINDOW_US)})


def test_an_asynchronous_operation_returns_before_its_peer_joins(job) -> None:
    for r in job:
        assert r["first_async"] == 3.0 and r["after_late_wait"] == 3.0 and r["after_future"] == 3.0, r
        assert r["after_prompt_loop"] == 3.0, r


def test_a_forked_child_cannot_use_the_parents_group(job) -> None:
    assert [r["forked_child"] for r in job] == ["refused", "refused"], job


def test_a_synchronous_loop_runs_on_the_callers_thread(job) -> None:
    # Rank r adds r + i: 2 ranks give 2 i + 1. All but the first call (its wait teaches the
    # pattern) run on the caller's thread.
    for r in job:
        assert r["loop"] == [2.0 * i + 1 for i in range(LOOP)], r
        assert r["loop_on_caller"] >= LOOP - 1, r


def test_operations_keep_their_order_behind_the_worker(job) -> None:
    for r in job:
        assert r["big"] == [3.0, 3.0], r
        assert r["small"] == [3.0 * (i + 1) for i in range(4)], r


def test_a_callback_of_an_inline_operation_may_issue_a_collective(job) -> None:
    for r in job:
        assert r["inline_then_callback_ran_inline"] == 1, r
        assert r["callback"] == 60.0, r  # (1 + 2) * 10 on each rank, summed


def test_large_operations_and_a_group_with_it_off_use_the_worker(job) -> None:
    for r in job:
        assert r["large_on_caller"] == 0, r
        assert r["off_loop"] == [2.0 * i + 1 for i in range(LOOP)] and r["off_on_caller"] == 0, r
