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


def _transplant(C, client_one, client_two, rogue_one, rogue_two, between=None) -> tuple:
    """Group one's rank 1 waits for its record; the rogue gives its nonce to group two's rank 0 and
    moves group two's record to group one's key. ``between()`` runs once group one's rank 1 has
    published its nonce (and so read its settings). Returns what the two creations came to."""
    made: dict = {}

    def make(name: str, client, rank: int, timeout_ms: int) -> None:
        try:
            made[name] = C.ProcessGroupHetcomm(client(), rank, 2, timeout_ms, "127.0.0.1", [0, 1])
        except Exception as e:  # noqa: BLE001 - what the creation came to is the result
            made[name] = e

    def read(store, key: str):
        # (a creation deletes the nonces it read: one can go between the check and the get, which
        # then waits for the store's timeout; the rogues' is short, and such a key reads as gone)
        try:
            return store.get(key) if store.check([key]) else None
        except dist.DistStoreError:
            return None

    def until(condition) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < deadline, "not within the guard's time"
            time.sleep(0.005)

    victim = threading.Thread(target=make, args=("one", client_one, 1, 4000))
    victim.start()
    until(lambda: read(rogue_one, "hetcomm/nonce/1") is not None)
    nonce = read(rogue_one, "hetcomm/nonce/1")
    if between is not None:
        between()
    stop = threading.Event()

    def keep_the_nonce() -> None:
        while not stop.is_set():
            if read(rogue_two, "hetcomm/nonce/1") != nonce:
                rogue_two.set("hetcomm/nonce/1", nonce)
            time.sleep(0.002)

    keeper = threading.Thread(target=keep_the_nonce, daemon=True)
    keeper.start()
    maker = threading.Thread(target=make, args=("two", client_two, 0, 20000))
    maker.start()
    until(lambda: read(rogue_two, "hetcomm/record") is not None)
    stop.set()
    keeper.join()
    rogue_one.set("hetcomm/record", read(rogue_two, "hetcomm/record"))
    victim.join(WAIT_S)
    maker.join(WAIT_S)
    assert not victim.is_alive() and not maker.is_alive()
    assert not isinstance(made["two"], Exception), made["two"]
    return made["one"], made["two"]


def _server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=WAIT_S))


def _client(port: int, prefix: str, timeout: float = WAIT_S):
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False,
                                                  timeout=datetime.timedelta(seconds=timeout)))


ROGUE_S = 1.0            # the rogue's reads: a key deleted under it costs this, not WAIT_S


def test_a_record_moved_from_another_group_of_the_same_ranks_is_not_taken(monkeypatch):
    """Two groups of one job (one store, two prefixes)."""
    from hetcomm import _engine

    monkeypatch.setenv("HETCOMM_SECRET", SECRET)
    monkeypatch.delenv("HETCOMM_JOB_ID", raising=False)
    server = _server()
    one, two = _transplant(_engine.extension(), lambda: _client(server.port, "one"), lambda: _client(server.port, "two"),
                           _client(server.port, "one", ROGUE_S), _client(server.port, "two", ROGUE_S))
    # Not group two's keys: the moved record did not open for group one's prefix (the rank met
    # it: its error says so).
    assert isinstance(one, Exception), f"group one's rank 1 took group two's record ({one.incarnation()})"
    assert "does not open" in str(one), one


@pytest.mark.parametrize("job_ids", [("a", "b"), None], ids=["HETCOMM_JOB_ID", "same-prefixes"])
def test_two_jobs_with_one_secret_are_told_apart_by_their_job_ids(monkeypatch, job_ids):
    """Two jobs, each with its own store, share a secret, and torch gives both the same prefixes:
    the record binds ``HETCOMM_JOB_ID``, and a rank of one refuses the other's record. Without job
    ids (the control) nothing in the record tells the jobs apart and the rank takes it: hence the
    rule, one secret per job or a job id each (docs/security.md)."""
    from hetcomm import _engine

    monkeypatch.setenv("HETCOMM_SECRET", SECRET)
    if job_ids:
        monkeypatch.setenv("HETCOMM_JOB_ID", job_ids[0])
    else:
        monkeypatch.delenv("HETCOMM_JOB_ID", raising=False)
    job_one, job_two = _server(), _server()
    one, two = _transplant(_engine.extension(), lambda: _client(job_one.port, "default_pg"),
                           lambda: _client(job_two.port, "default_pg"), _client(job_one.port, "default_pg", ROGUE_S),
                           _client(job_two.port, "default_pg", ROGUE_S),
                           between=(lambda: monkeypatch.setenv("HETCOMM_JOB_ID", job_ids[1])) if job_ids else None)
    if job_ids:
        assert isinstance(one, Exception), f"job one's rank 1 took job two's record ({one.incarnation()})"
        assert "does not open" in str(one), one
    else:
        assert not isinstance(one, Exception) and one.incarnation() == two.incarnation(), (one, two)
