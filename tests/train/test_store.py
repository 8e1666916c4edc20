"""``python -m hetcomm.store``: a rendezvous store in a process of its own.

Two ranks form a group through it; the store is then killed (SIGKILL): the formed group keeps
reducing, and a store operation raises a RuntimeError on every rank instead of hanging.
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from harness import BACKEND, run_ranks
from stores import start_store

pytestmark = pytest.mark.usefixtures("backend_importable")


def ranks_through_the_store(rank: int, world: int, port: int) -> dict:
    import hetcomm  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    x = torch.ones(4) * (rank + 1)
    dist.all_reduce(x)
    store.set(f"ready/{rank}", "1")
    # The test kills the store once both ranks are ready; notice it from here.
    error, deadline = None, time.monotonic() + 60
    while error is None and time.monotonic() < deadline:
        try:
            store.check(["ready/0"])
            time.sleep(0.2)
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}"
    y = torch.ones(4) * (rank + 1)
    dist.all_reduce(y)
    return {"before": x.tolist(), "after": y.tolist(), "error": error}


def test_a_store_of_its_own_serves_a_group_and_its_death_raises(tmp_path):
    proc, port = start_store(str(tmp_path))
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        import threading

        def kill_when_ready() -> None:
            client.wait(["ready/0", "ready/1"])
            proc.kill()

        killer = threading.Thread(target=kill_when_ready, daemon=True)
        killer.start()
        results = run_ranks(2, ranks_through_the_store, port, init=None, timeout=120)
        killer.join(5)
    finally:
        proc.kill()
        proc.wait()
    for r in results:
        assert r["before"] == [3.0] * 4 and r["after"] == [3.0] * 4
        assert r["error"] is not None, "a store operation after the store's death did not raise"
