"""Two groups of the same ranks on one store, with the same out-of-band secret (issue 43): a store
writer who moves records between them must not move a rank from one group into the other.

The group record binds the prefix the group's keys lie under (`storeScope`,
csrc/transport/group_secret.h): the rogue here gives a waiting rank of group one's nonce to
group two's rank 0 (nonces are plain in the store), so that group two's record carries it, and
moves that record under group one's prefix. Before the record bound the prefix, the rank took it,
held group two's keys and summed with group two's rank 0 (wrong numbers). The groups are made
with the extension's backend class directly, on threads of this process (one store, no ranks
to start)."""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from marks import hetcomm_only

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("attacks hetcomm's own group record")]

SECRET = "a test secret, long enough: 0123456789"
WAIT_S = 30.0           # a guard against a hang, never the thing measured


def test_a_record_moved_from_another_group_of_the_same_ranks_is_not_taken(monkeypatch):
    from hetcomm import _engine

    monkeypatch.setenv("HETCOMM_SECRET", SECRET)
    C = _engine.extension()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))

    def client(prefix: str | None = None):
        s = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=WAIT_S))
        return dist.PrefixStore(prefix, s) if prefix else s

    made: dict = {}

    def make(name: str, prefix: str, rank: int, timeout_ms: int) -> None:
        try:
            made[name] = C.ProcessGroupHetcomm(client(prefix), rank, 2, timeout_ms, "127.0.0.1", [0, 1])
        except Exception as e:  # noqa: BLE001 - what the creation came to is the result
            made[name] = e

    rogue = client()

    def read(key: str):
        return rogue.get(key) if rogue.check([key]) else None

    def until(condition) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < deadline, "not within the guard's time"
            time.sleep(0.005)

    # Group one's rank 1 waits for its record (its rank 0 is late); the rogue reads its nonce.
    victim = threading.Thread(target=make, args=("one/1", "one", 1, 4000))
    victim.start()
    until(lambda: read("one/hetcomm/nonce/1") is not None)
    nonce = read("one/hetcomm/nonce/1")
    # Group two's rank 0 makes its record with that nonce in rank 1's slot.
    stop = threading.Event()

    def keep_the_nonce() -> None:
        while not stop.is_set():
            if read("two/hetcomm/nonce/1") != nonce:
                rogue.set("two/hetcomm/nonce/1", nonce)
            time.sleep(0.002)

    keeper = threading.Thread(target=keep_the_nonce, daemon=True)
    keeper.start()
    maker = threading.Thread(target=make, args=("two/0", "two", 0, 20000))
    maker.start()
    until(lambda: read("two/hetcomm/record") is not None)
    stop.set()
    keeper.join()
    rogue.set("one/hetcomm/record", read("two/hetcomm/record"))
    victim.join(WAIT_S)
    maker.join(WAIT_S)
    assert not victim.is_alive() and not maker.is_alive()
    two = made["two/0"]
    assert not isinstance(two, Exception), two
    one = made["one/1"]
    # Not group two's keys: the moved record did not open for group one's prefix.
    assert isinstance(one, Exception), f"group one's rank 1 took group two's record ({one.incarnation()})"
    assert "record" in str(one) or "nonce" in str(one) or "timed out" in str(one).lower(), one
