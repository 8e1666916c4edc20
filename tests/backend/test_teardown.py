"""Abort and teardown: prompt, callable from any thread, and never leaving a future unfinished.

Each job builds hetcomm backends directly (``hetcomm._C.ProcessGroupHetcomm`` on a prefix of the
job's store), so that a test can set up what a whole group cannot: a peer that never comes, a
backend whose last reference goes from Python. Elapsed-time assertions are bounds that only a
hang can break (the operations' own timeout is 60 s); the harness deadline catches the rest.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import default_store, run_ranks, run_ranks_outcomes

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("builds hetcomm's C++ backend directly")]

OP_TIMEOUT_MS = 60_000
HANG_BOUND_S = 15.0


def _backend(prefix: str, rank: int, size: int, secret: bytes = b""):
    from hetcomm._engine import extension

    _C = extension()

    store = dist.PrefixStore(prefix, default_store())
    if secret:
        store.set("hetcomm/secret", secret)  # what rank 0 would have published
    return _C.ProcessGroupHetcomm(store, rank, size, OP_TIMEOUT_MS)


def abort_while_waiting_for_an_address(rank: int, world_size: int) -> dict:
    # Rank 1 of a pair whose rank 0 never comes: the group secret is there (normally rank 0 puts
    # it), rank 0's address never is, so the worker waits for it in the store.
    backend = _backend("abort_waiting/", 1, 2, secret=bytes(16))
    work = backend.allreduce([torch.ones(100)])
    time.sleep(0.3)  # let the worker reach the store wait (a sleep only makes the test sharper)
    start = time.monotonic()
    backend.abort()
    abort_s = time.monotonic() - start
    try:
        work.wait()
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("an allreduce whose peer never came completed")
    return {"abort_s": abort_s, "total_s": time.monotonic() - start, "message": message}


def test_abort_interrupts_a_worker_waiting_for_a_peer_address() -> None:
    (res,) = run_ranks(1, abort_while_waiting_for_an_address, timeout=60)
    assert res["abort_s"] < HANG_BOUND_S and res["total_s"] < HANG_BOUND_S, res
    assert "abort" in res["message"] or "shut" in res["message"], res


def many_threads_stop_one_backend(rank: int, world_size: int) -> int:
    errors = []
    for round_ in range(20):
        backend = _backend(f"stop_race_{round_}/", 0, 1)
        backend.allreduce([torch.ones(10)]).wait()
        gate = threading.Barrier(6)

        def stop(how: str) -> None:
            gate.wait()
            try:
                getattr(backend, how)()
            except Exception as e:  # noqa: BLE001 - any error is a failure of the test
                errors.append(f"{how}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=stop, args=(how,)) for how in ["abort", "shutdown"] * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        del backend  # and the destructor shuts down once more
    assert not errors, errors
    return 20


def test_abort_and_shutdown_from_many_threads_at_once() -> None:
    """A watchdog's abort racing the destructor's shutdown must not join a thread twice
    (std::terminate) nor raise."""
    assert run_ranks(1, many_threads_stop_one_backend, timeout=120) == [20]


def operation_after_abort(rank: int, world_size: int) -> list:
    backend = _backend("after_abort/", 0, 1)
    backend.abort()
    seen = []
    work = backend.allreduce([torch.ones(10)])
    chained = work.get_future().then(lambda f: seen.append("callback ran") or 1)
    try:
        work.get_future().wait()
    except RuntimeError as e:
        seen.append(f"future raised: {e}")
    try:
        chained.wait()
    except RuntimeError:
        seen.append("chained raised")
    try:
        work.wait()
    except RuntimeError:
        seen.append("wait raised")
    return seen


def test_an_operation_issued_after_abort_completes_its_future_with_an_error() -> None:
    """DDP hooks wait on futures: one that never completes hangs training."""
    (seen,) = run_ranks(1, operation_after_abort, timeout=60)
    raised = [s for s in seen if s.startswith("future raised")]
    assert raised and "shut down" in raised[0], seen
    assert "callback ran" in seen and "wait raised" in seen, seen


def exit_with_a_callback_still_running(rank: int, world_size: int, marker: str) -> str:
    # The future of an operation issued after an abort completes on a thread of its own; its
    # Python callback is still running when the program returns and Python begins to exit.
    backend = _backend("exit_cb/", 0, 1)
    backend.abort()
    started = threading.Event()

    def slow_callback(fut):
        started.set()
        time.sleep(0.5)  # without the GIL; then it needs the GIL back, at exit
        with open(marker, "w") as f:
            f.write("finished")
        return 1

    backend.allreduce([torch.ones(10)]).get_future().then(slow_callback)
    started.wait(10)
    return "returned"


def test_exiting_while_a_callback_of_an_aborted_group_runs_waits_for_it(tmp_path) -> None:
    """A callback thread that needs the GIL after Python began to finalize is made to exit by the
    interpreter, unwinding through C++ frames: std::terminate, SIGABRT after a successful run (it
    happened to a test of this file and to a planning-failure test under load). At exit hetcomm
    shuts down every group it created, registered with torch or not, and waits for such threads."""
    marker = tmp_path / "callback"
    (result,) = run_ranks(1, exit_with_a_callback_still_running, str(marker), timeout=60, fresh=True)
    assert result == "returned"
    assert marker.read_text() == "finished"


def destroy_with_a_callback_running(rank: int, world_size: int) -> str:
    backend = _backend("gil/", 0, 1)
    started = threading.Event()

    def slow_callback(fut):
        started.set()
        time.sleep(0.5)  # without the GIL; then it needs the GIL back to return
        return 0

    future = backend.allreduce([torch.ones(10)]).get_future().then(slow_callback)
    assert started.wait(30), "the callback never started"
    # The last reference goes from Python, with the GIL held: the destructor joins the thread
    # running slow_callback, which needs the GIL to finish. Unless the GIL is released for the
    # destruction, that is a deadlock.
    del backend
    return f"destroyed; callback result {future.wait()}"


def test_destroying_the_backend_from_python_releases_the_gil() -> None:
    (res,) = run_ranks(1, destroy_with_a_callback_running, timeout=60)
    assert res == "destroyed; callback result 0", res


_LATE_RANK = r'''
import sys, time, datetime
import torch.distributed as dist
import hetcomm  # noqa: F401  (registers the backend)
rank, port, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
time.sleep(delay)
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=20))
dist.init_process_group("hetcomm", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=15))
dist.destroy_process_group()
print("ok", flush=True)
'''


@hetcomm_only("the group's store keys")
def test_rank_that_joins_after_rank_0_left_still_joins(tmp_path):
    """Rank 1 starts seconds after rank 0: rank 0 must not remove the group's keys (the secret)
    that rank 1 still has to read, or rank 1 waits for them until its timeout (seen as a
    DistStoreError in tests on a busy machine). Group creation gathers every rank's host identity
    (hetcomm.hosts), so rank 0 now waits for rank 1 there before it can destroy the group; once,
    with HETCOMM_PROBE=0, it could create and destroy it alone."""
    import subprocess
    import sys

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    script = tmp_path / "late.py"
    script.write_text(_LATE_RANK)
    env = {**__import__("os").environ, "HETCOMM_PROBE": "0"}
    first = subprocess.Popen([sys.executable, str(script), "0", str(store.port), "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    late = subprocess.run([sys.executable, str(script), "1", str(store.port), "2"], capture_output=True, text=True,
                          timeout=120, env=env)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "ok" in out, err[-2000:]
    assert late.returncode == 0 and "ok" in late.stdout, late.stderr[-2000:]


def _fail_then_exit_without_destroy(rank: int, world_size: int) -> str:
    import os
    import threading
    x = torch.ones(1 << 20)
    dist.all_reduce(x)
    if rank == 1:
        threading.Timer(0.2, lambda: os.kill(os.getpid(), 9)).start()
    try:
        for _ in range(100_000):
            dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


@hetcomm_only("hetcomm's own threads at interpreter exit")
def test_exit_without_destroy_after_a_failure_does_not_abort() -> None:
    """A rank whose group failed and that exits without destroy_process_group must exit cleanly.
    Its completion threads used to outlive the interpreter's finalization and abort the process
    when one dropped a tensor (it needs the GIL, which a finalizing interpreter does not give):
    SIGABRT in about one exit of three here. hetcomm now shuts its groups down at exit. The
    harness fails the test if a surviving rank exits with a signal."""
    for _ in range(3):
        results = run_ranks(3, _fail_then_exit_without_destroy, expect_dead=[1], pg_timeout=20, destroy=False,
                           fresh=True)
        assert all("rank 1" in results[r] for r in (0, 2)), results


def _leave_an_operation_hanging(rank: int, world_size: int) -> str:
    import os
    store = default_store()
    if rank == 0:
        store.set("teardown/pid0", str(os.getpid()))
        # Never completes: rank 1 is alive and connected but never joins. Not waited for, and the
        # group is not destroyed: rank 0 then exits.
        dist.all_reduce(torch.ones(1000), async_op=True)
        return "left"
    # Rank 1 stays (its connections open) until rank 0's process is gone, at most 90 s.
    pid = int(store.get("teardown/pid0"))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.startswith("State:") and "Z" in line for line in f):
                    break
        except OSError:
            break
        time.sleep(0.05)
    return "left"


@hetcomm_only("hetcomm's own threads at interpreter exit")
def test_exit_with_an_operation_in_flight_does_not_wait_for_its_timeout() -> None:
    """At exit, a group with an operation still queued or running is aborted, not shut down
    gracefully, which would wait for the operation while its peer lives: up to the 60 s timeout
    here (rank 1 waits for rank 0's process to end). Which path the exit took is read from rank
    0's output, not timed."""
    outcomes = run_ranks_outcomes(2, _leave_an_operation_hanging, pg_timeout=60, destroy=False, timeout=150,
                                  fresh=True)
    assert [o.value for o in outcomes] == ["left", "left"] and all(o.exitcode == 0 for o in outcomes), \
        [o.describe() for o in outcomes]
    assert "exiting with operations of this group still queued or running" in outcomes[0].output, \
        outcomes[0].output[-2000:]


def rank_0_leaves_first(rank: int, world_size: int) -> str | None:
    """Three backends on one prefix; rank 0 shuts its own down once all have joined. Ranks 1 and 2
    then talk for the first time: each looks the other's address up in the store only now."""
    store = default_store()
    backend = _backend("early_leaver", rank, world_size)
    store.add("early_leaver_up", 1)
    while store.add("early_leaver_up", 0) < world_size:
        time.sleep(0.02)
    if rank == 0:
        backend.shutdown()
        store.set("rank0_left", "1")
        return None
    store.wait(["rank0_left"])
    peer = 3 - rank
    out = torch.full((16,), float(rank))
    got = torch.empty(16)
    start = time.monotonic()
    send = backend.send([out], peer, 3)
    recv = backend.recv([got], peer, 3)
    send.wait()
    recv.wait()
    assert torch.equal(got, torch.full((16,), float(peer))), got
    elapsed = time.monotonic() - start
    assert elapsed < HANG_BOUND_S, f"the first message took {elapsed:.1f} s"
    backend.shutdown()
    return "ok"


def test_a_rank_that_leaves_first_does_not_remove_addresses_others_still_need() -> None:
    # Failed before the fix: rank 0 deleted every rank's address key when it shut down, and rank 1's
    # first send to rank 2 waited for rank 2's address until the 60 s timeout.
    assert run_ranks(3, rank_0_leaves_first, timeout=120)[1:] == ["ok", "ok"]


EXIT_SCRIPT = r"""
import os, sys, time
import torch, torch.distributed as dist
import hetcomm
from hetcomm._engine import extension
_C = extension()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
backend = _C.ProcessGroupHetcomm(dist.PrefixStore("exit/", store), 0, 1, 60000)
backend.allreduce([torch.ones(10)]).wait()
if sys.argv[1] == "fork":
    pid = os.fork()
    if pid == 0:            # the child has the parent's group, not its threads: it must exit at once
        start = time.monotonic()
        import atexit
        atexit.register(lambda: print(f"child exit hook after {time.monotonic() - start:.2f} s", flush=True))
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"child status {status}", flush=True)
print("done", flush=True)
"""


@pytest.mark.parametrize("how", ["plain", "fork"])
def test_exiting_after_the_last_operation_is_clean(how) -> None:
    """An idle group at exit is shut down quietly (it used to be taken for busy once it had run an
    operation: aborted, with an error in the log and its peers' last operation at risk); a forked
    child, which inherits the group but not its threads, exits at once."""
    import subprocess
    import sys

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done" in proc.stdout and "still queued or running" not in proc.stderr, proc.stdout + proc.stderr
    if how == "fork":
        assert "child status 0" in proc.stdout, proc.stdout + proc.stderr
    assert time.monotonic() - start < HANG_BOUND_S, proc.stdout + proc.stderr


def store_host_leaves_first(rank: int, world_size: int) -> str:
    """init="tcp": rank 0's process serves the store. It leaves at once; the others shut down
    once it has gone (the harness destroys the group after this returns)."""
    import os

    from harness import wait_until_gone

    dist.all_reduce(torch.ones(4))
    pid = torch.tensor([os.getpid()])
    dist.broadcast(pid, src=0)
    if rank != 0:
        wait_until_gone(int(pid))
    return "ok"


def test_a_group_ends_quietly_when_the_rank_that_served_the_store_left_first() -> None:
    """Shutting down touched the store (who leaves last cleans the group's keys): where rank 0's
    process served it and had exited, every other rank logged a TCPStore "recvValue failed"
    warning with a C++ stack trace (32 ranks on the simulator: 31 of them). A store that is gone
    is now left alone, silently: its keys went with it."""
    outcomes = run_ranks_outcomes(3, store_host_leaves_first, init="tcp", timeout=120)
    for o in outcomes:
        assert o.clean and o.value == "ok", o.describe()
    for o in outcomes:                   # rank 0's too: its store saw the others' questions
        assert "recvValue" not in o.output and "TCPStore" not in o.output, o.output[-3000:]
