"""The c10d store is not trusted: a rogue with access to it, acted out by this test's process
(a store client and a socket of its own, never a member of the group), against two ranks.

Each scenario runs twice: with an out-of-band secret (``HETCOMM_SECRET``), where the attack must
fail, and without one, where it succeeds -- the control that shows the test can see the attack.
What the rogue reads from the store it checks with its own implementation of the seal format
(Python's hmac; the format is in csrc/transport/group_secret.h), not with hetcomm's code.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import secrets
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from marks import hetcomm_only

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("attacks hetcomm's own store records and handshake")]

SECRET = "a test secret, long enough: 0123456789"
MODES = {"out_of_band": SECRET, "in_store": None}
WAIT_S = 60.0          # a guard against a hang, never the thing measured


# --- what the rogue knows: the documented formats, implemented here --------------------------

def _master(secret: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), b"hetcomm out-of-band secret v1", 100000)


def _transcript(scope: str, job_ranks: list[int], nonces: list[bytes]) -> bytes:
    return (struct.pack("<I", len(scope.encode())) + scope.encode() + struct.pack("<I", len(job_ranks))
            + b"".join(struct.pack("<q", g) for g in job_ranks) + b"".join(nonces))


def _open_record(secret: str, record_key: str, job_ranks: list[int], record: bytes) -> bytes | None:
    """The seal key of a group record, if its MAC is right for this group: its ranks, and the prefix
    its keys lie under in the store (``record_key`` is the record's full name there)."""
    n = len(job_ranks)
    nonces = [record[16 * r:16 * (r + 1)] for r in range(n)]
    t = _transcript(record_key[:-len("hetcomm/record")], job_ranks, nonces)
    master = _master(secret)
    want = hmac.new(master, b"hetcomm record v2\0" + t, hashlib.sha256).digest()
    if len(record) != 16 * n + 32 or not hmac.compare_digest(want, record[16 * n:]):
        return None
    return hmac.new(master, b"hetcomm seal v2\0" + t, hashlib.sha256).digest()


def _opens(seal_key: bytes, key: str, sealed: bytes) -> bytes | None:
    value, tag = sealed[:-32], sealed[-32:]
    k = key.encode()
    want = hmac.new(seal_key, b"hetcomm store v1\0" + struct.pack("<I", len(k)) + k + value, hashlib.sha256).digest()
    return value if len(sealed) >= 32 and hmac.compare_digest(want, tag) else None


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=WAIT_S))


def _await(store, key: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key!r} did not appear within {WAIT_S} s")
        time.sleep(0.02)


def _find(store, pattern: str, skip: frozenset = frozenset()) -> str:
    """The full name (under torch's group prefixes) of the first key that ends matching ``pattern``
    (a regular expression; ``INC`` stands for a group's incarnation)."""
    regex = re.compile(pattern.replace("INC", "[0-9a-f]{16}") + "$")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for key in store.list_keys():
            if regex.search(key) and key not in skip:
                return key
        time.sleep(0.005)
    raise TimeoutError(f"no key matching {pattern!r} within {WAIT_S} s")


def _own_log() -> str:
    """What this rank wrote to its stderr so far (the harness sends it to a file)."""
    with open(os.readlink("/proc/self/fd/2")) as f:
        return f.read()


def _join(rank: int, world_size: int, port: int, timeout_s: float = 30) -> dist.TCPStore:
    store = _client(port)
    dist.init_process_group("hetcomm", store=dist.PrefixStore("job", store), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return store


def _exact_allreduce(rank: int) -> None:
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), 3.0)), "allreduce gave wrong numbers"


class Rogue(threading.Thread):
    """Runs ``act(store)`` on its own store client beside the ranks; keeps what it returns or raises."""

    def __init__(self, port: int, act) -> None:
        super().__init__(daemon=True)
        self.port, self.act, self.result, self.error = port, act, None, None

    def run(self) -> None:
        try:
            self.result = self.act(_client(self.port))
        except BaseException as e:  # noqa: BLE001 - raised by finish() in the test
            self.error = e

    def finish(self):
        self.join(WAIT_S)
        assert not self.is_alive(), "the rogue did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def _attack(mode: str, ranks_fn, act, *args, env: dict | None = None):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))
    rogue = Rogue(server.port, act)
    rogue.start()
    results = run_ranks(2, ranks_fn, server.port, *args, init=None, timeout=120,
                        env={"HETCOMM_SECRET": MODES[mode], **(env or {})})
    return results, rogue.finish()


# --- a store reader ------------------------------------------------------------------------------

def formed_then_inspected(rank: int, world_size: int, port: int) -> str:
    import hetcomm

    store = _join(rank, world_size, port)
    _exact_allreduce(rank)
    # The inner level of the host formed through the sealed records too.
    assert hetcomm.backend_of().inner_levels() == [os.environ.get("HETCOMM_LOCAL", "shm")], \
        hetcomm.backend_of().inner_levels()
    if rank == 0 and os.environ.get("HETCOMM_LOCAL", "shm") == "shm":
        _planted_marker_reads_as_forged(store, hetcomm.backend_of().sealed_store())
    store.set(f"formed/{rank}", "1")
    _await(store, "inspected")
    _exact_allreduce(rank)
    return hetcomm.listen_address()


# The bytes a sealed store's atomic read expected, to mean "no value", before they were made random
# per process: planted under a key, they read as absent, and a wait for that key then lasted the
# store's timeout rather than the patience with a value that does not open.
_OLD_ABSENT_MARK = b"hetcomm: no value \x01\x02\x03 (a read that found none)"


def _planted_marker_reads_as_forged(raw, sealed) -> None:
    sealed.set("locate-me", b"x")
    (full,) = [k for k in raw.list_keys() if k.endswith("locate-me")]
    raw.set(full[:-len("locate-me")] + "planted", _OLD_ABSENT_MARK)
    before = sealed.timeout
    sealed.set_timeout(datetime.timedelta(seconds=1))
    try:
        with pytest.raises(dist.DistStoreError, match="failed its authentication"):
            sealed.get("planted")
    finally:
        sealed.set_timeout(before)


def read_everything(store) -> dict:
    for r in range(2):
        _await(store, f"formed/{r}")
    keys = store.list_keys()
    found = {"secret_keys": [k for k in keys if k.endswith("hetcomm/secret")], "addresses": {}}
    record_keys = [k for k in keys if k.endswith("hetcomm/record")]
    if record_keys:
        seal = _open_record(SECRET, record_keys[0], [0, 1], store.get(record_keys[0]))
        found["record_ok"] = seal is not None
        for r in range(2):
            full = _find(store, rf"hetcomm/addr/INC/{r}")
            name = "hetcomm/" + full.split("hetcomm/", 1)[1]
            value = _opens(seal, name, store.get(full)) if seal else None
            found["addresses"][r] = value.decode() if value is not None else None
    store.set("inspected", "1")
    return found


@pytest.mark.parametrize("inner", ["shm", "gloo"])
def test_a_store_reader_finds_no_secret_and_only_sealed_values(inner: str) -> None:
    """With Gloo as the host's inner level, its rendezvous goes through the sealed store."""
    addresses, found = _attack("out_of_band", formed_then_inspected, read_everything, env={"HETCOMM_LOCAL": inner})
    assert found["secret_keys"] == [], f"a secret was published: {found}"
    assert found.get("record_ok"), f"rank 0's group record does not verify: {found}"
    assert found["addresses"] == {0: addresses[0], 1: addresses[1]}, \
        f"the published addresses do not open as sealed values: {found} (ranks listen on {addresses})"


# --- a rogue that claims a member's rank in the handshake ---------------------------------------

def handshake_target(rank: int, world_size: int, port: int) -> int:
    import hetcomm

    store = _join(rank, world_size, port)
    _exact_allreduce(rank)
    if rank == 0:
        store.set("target", hetcomm.listen_address())
    _await(store, "rogue_done")
    _exact_allreduce(rank)
    return hetcomm.backend_of().rejected_connections()


def claim_rank_1(store, world_size: int = 2) -> str:
    """Connects to rank 0 as "rank 1" (a probe), proving the secret it could find in the store."""
    _await(store, "target")
    host, port = store.get("target").decode().rsplit(":", 1)
    stolen = [k for k in store.list_keys() if k.endswith("hetcomm/secret")]
    secret = store.get(stolen[0]) if stolen else secrets.token_bytes(16)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            hello = struct.pack("<IHBBii", 0x4D435448, 2, 3, 0, 1, world_size) + secrets.token_bytes(16)
            s.sendall(hello)
            challenge = _recv(s, 56)
            if len(challenge) < 56:
                return "closed before its challenge"
            proof = hmac.new(secret, b"hetcomm connect\0" + hello + challenge[:24], hashlib.sha256).digest()
            s.sendall(proof)
            ack = _recv(s, 8)
            if len(ack) == 8 and struct.unpack("<Ii", ack) == (0x4D435448, 0):
                return "accepted as rank 1"
            return f"refused ({ack!r})"
    finally:
        store.set("rogue_done", "1")


def _recv(s: socket.socket, n: int) -> bytes:
    data = b""
    try:
        while len(data) < n:
            chunk = s.recv(n - len(data))
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return data


@pytest.mark.parametrize("mode", list(MODES))
def test_a_store_reader_cannot_take_a_ranks_place(mode: str) -> None:
    rejected, outcome = _attack(mode, handshake_target, claim_rank_1)
    if mode == "out_of_band":
        assert outcome == "refused (b'')", f"the rogue without the secret got: {outcome}"
        assert rejected[0] >= 1, "rank 0 did not count the rogue's connection as rejected"
    else:
        assert outcome == "accepted as rank 1", f"control: with the secret in the store the rogue got: {outcome}"


# --- a store writer that redirects a rank's connections -------------------------------------------

def first_message_after_forgery(rank: int, world_size: int, port: int) -> str:
    """Rank 0's first point-to-point message to rank 1 opens a new connection, which looks rank
    1's address up again: after the rogue replaced it."""
    # Rank 1 looks at its records seldom, so that rank 0 meets the forged address before it is put back.
    os.environ["HETCOMM_FAILURE_POLL_MS"] = "2000" if rank == 1 else "50"
    store = _join(rank, world_size, port, timeout_s=10)
    _exact_allreduce(rank)
    store.set(f"ready/{rank}", "1")
    _await(store, "forged")
    try:
        if rank == 0:
            dist.send(torch.arange(10.0), dst=1)
            outcome = "sent"
        else:
            t = torch.zeros(10)
            dist.recv(t, src=0)
            outcome = "received" if torch.equal(t, torch.arange(10.0)) else f"wrong: {t}"
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        outcome = f"{type(e).__name__}: {e}"
    finally:
        store.set(f"done/{rank}", "1")
    log = _own_log()
    return {"outcome": outcome, "ignored": "ignored the store's value of 'hetcomm/addr/" in log,
            "put_back": "put its record 'hetcomm/addr/" in log}


def replace_rank_1s_address(store) -> dict:
    for r in range(2):
        _await(store, f"ready/{r}")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    store.set(_find(store, "hetcomm/addr/INC/1"), f"127.0.0.1:{listener.getsockname()[1]}")
    store.set("forged", "1")
    return {"connections": _count_connections(store, listener)}


def _count_connections(store, listener: socket.socket) -> int:
    """Accepts (and closes) connections to the rogue's socket until both ranks are done."""
    connections = 0
    while not (store.check(["done/0"]) and store.check(["done/1"])):
        try:
            conn, _ = listener.accept()
            connections += 1
            conn.close()
        except socket.timeout:
            pass
    listener.close()
    return connections


@pytest.mark.parametrize("mode", list(MODES))
def test_a_replaced_address_is_put_back_before_anyone_follows_it(mode: str) -> None:
    """With the secret, rank 0 ignores the forged address and rank 1 puts its own back (its failure
    watcher looks every HETCOMM_FAILURE_POLL_MS): the message arrives over a link to rank 1."""
    ranks, rogue = _attack(mode, first_message_after_forgery, replace_rank_1s_address)
    if mode == "out_of_band":
        assert [r["outcome"] for r in ranks] == ["sent", "received"] and rogue["connections"] == 0, (ranks, rogue)
        # Not vacuous: rank 0 met the forged address, and rank 1 put its own back.
        assert ranks[0]["ignored"] and ranks[1]["put_back"], ranks
    else:
        assert rogue["connections"] >= 1, f"control: nobody followed the forged address: {ranks}"


# --- a store writer that fails the group ---------------------------------------------------------

def busy_while_forged(rank: int, world_size: int, port: int) -> str:
    import hetcomm

    store = _join(rank, world_size, port)
    _exact_allreduce(rank)
    if rank == 0:
        store.set("incarnation", hetcomm.backend_of().incarnation())
    # Busy (a receive pending) until the failure watcher has acted on the forged record: the group
    # failed (the receive ends with the error), or it logged that it ignored it.
    t = torch.zeros(4)
    work = dist.irecv(t, src=1 - rank, tag=7)
    log = os.readlink("/proc/self/fd/2")
    deadline, outcome = time.monotonic() + WAIT_S, "still waiting"
    while time.monotonic() < deadline:
        if work.is_completed():
            try:
                work.wait()
                outcome = "completed?"
            except Exception as e:  # noqa: BLE001
                outcome = f"failed: {e}"
            break
        with open(log) as f:
            if "ignored the store's value of 'hetcomm/failed'" in f.read():
                outcome = "ignored"
                break
        time.sleep(0.02)
    store.set(f"seen/{rank}", outcome)
    if outcome != "ignored":
        return outcome
    _await(store, f"seen/{1 - rank}")
    dist.send(torch.full((4,), float(rank)), dst=1 - rank, tag=7)
    work.wait()
    assert torch.equal(t, torch.full((4,), float(1 - rank))), "the pending receive got wrong numbers"
    _exact_allreduce(rank)
    return outcome


def forge_a_failure(store) -> None:
    _await(store, "incarnation")
    incarnation = store.get("incarnation").decode()
    address = _find(store, "hetcomm/addr/INC/0")
    key = address[:address.index("hetcomm/addr/")] + "hetcomm/failed"
    store.set(key, f"{incarnation}|rank 1: forged by the rogue")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_store_writer_cannot_fail_the_group(mode: str) -> None:
    outcomes, _ = _attack(mode, busy_while_forged, forge_a_failure, env={"HETCOMM_FAILURE_POLL_MS": "50"})
    if mode == "out_of_band":
        assert outcomes == ["ignored", "ignored"], outcomes
    else:
        assert all(o.startswith("failed") and "forged by the rogue" in o for o in outcomes), outcomes


# --- a store writer that forges the others' leaving --------------------------------------------------

def leaves_first_or_last(rank: int, world_size: int, port: int) -> str:
    """Rank 0 leaves the group while rank 1 is still in it; the last to leave removes the group's
    keys, the addresses among them: a forged mark that rank 1 left must not make rank 0 the last."""
    store = _join(rank, world_size, port)
    _exact_allreduce(rank)
    store.set(f"ready/{rank}", "1")
    _await(store, "forged")
    if rank == 0:
        dist.destroy_process_group()
        store.set("left/0", "1")
        return "left"
    _await(store, "checked")
    dist.destroy_process_group()
    return "left"


def forge_rank_1s_leaving(store) -> dict:
    for r in range(2):
        _await(store, f"ready/{r}")
    address = _find(store, "hetcomm/addr/INC/1")
    store.set(address.replace("hetcomm/addr/", "hetcomm/left/"), b"\x01")   # as a rank marks it (unsealed)
    store.set("forged", "1")
    _await(store, "left/0")
    kept = store.check([address])
    store.set("checked", "1")
    return {"address_kept": kept}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_forged_mark_that_a_rank_left_does_not_make_another_remove_the_groups_keys(mode: str) -> None:
    """With the secret the marks must open: rank 0, leaving first, does not take itself for the
    last and leaves rank 1's address (and the failure record, the site labels) in place. Without
    it (the control) the forged mark makes rank 0 remove them while rank 1 still runs."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))
    rogue = Rogue(server.port, forge_rank_1s_leaving)
    rogue.start()
    outcomes = run_ranks(2, leaves_first_or_last, server.port, init=None, timeout=120, destroy=False,
                         env={"HETCOMM_SECRET": MODES[mode]})
    found = rogue.finish()
    assert outcomes == ["left", "left"], outcomes
    assert found["address_kept"] is (mode == "out_of_band"), (mode, found)


# --- the same group made again under the same prefix ---------------------------------------------

def _say_when_rewritten(port: int, pattern: str, flag: str) -> None:
    """Sets ``flag`` once a key matching ``pattern`` gets a value it did not have when called (on a
    thread and a store connection of its own)."""
    store = _client(port)
    absent = b"\0absent"
    regex = re.compile(pattern)

    def values() -> dict:
        now = {k: store.compare_set(k, absent, absent) for k in store.list_keys() if regex.search(k)}
        return {k: v for k, v in now.items() if v != absent}

    before = values()

    def watch() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if any(before.get(k) != v for k, v in values().items()):
                store.set(flag, "1")
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def made_again(rank: int, world_size: int, port: int) -> list[str]:
    """Rank 0 leaves first and makes the group again while rank 1, the last to leave the old one,
    is still in it: rank 1's clean-up of the old group must leave the new one's records alone."""
    store = _client(port)
    outcomes = []
    for generation in range(3):
        dist.init_process_group("hetcomm", store=dist.PrefixStore("again", store), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=20))
        _exact_allreduce(rank)
        store.set(f"used/{generation}/{rank}", "1")
        _await(store, f"used/{generation}/{1 - rank}")
        last = generation == 2
        if rank == 1 and not last:
            _await(store, f"made/{generation}")       # rank 0 is making the next group already
        if rank == 0 and not last:
            # The next group's first record (its secret, or the mark before the nonces) is
            # written while rank 1, the last to leave this one, has not cleaned it up yet.
            _say_when_rewritten(port, r"^again.*hetcomm/(secret|sealed)$", f"made/{generation}")
        dist.destroy_process_group()
        outcomes.append("ok")
    return outcomes


@pytest.mark.parametrize("mode", list(MODES))
def test_a_group_made_again_under_the_same_prefix_survives_the_old_ones_clean_up(mode: str) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))
    outcomes = run_ranks(2, made_again, server.port, init=None, timeout=120, env={"HETCOMM_SECRET": MODES[mode]})
    assert outcomes == [["ok"] * 3] * 2, outcomes


# --- a store writer and the rendezvous of a host's Gloo group ------------------------------------

def gloo_rendezvous_attacked(rank: int, world_size: int, port: int, store_timeout_s: float,
                             group_timeout_s: float) -> str:
    """The ranks form a group whose hosts' inner level is Gloo (HETCOMM_LOCAL=gloo); rank 1 starts
    the Gloo rendezvous only once the rogue has overwritten (or deleted) rank 0's record in it.
    The store's timeout may be longer than the group's (torchrun's is)."""
    import hetcomm
    import hetcomm.hosts

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=store_timeout_s))
    if rank == 1:
        original = hetcomm.hosts._torch_group

        def after_the_attack(*args, **kwargs):
            _await(store, "attacked")
            return original(*args, **kwargs)

        hetcomm.hosts._torch_group = after_the_attack
    try:
        dist.init_process_group("hetcomm", store=dist.PrefixStore("job", store), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {e}"
    _exact_allreduce(rank)
    inner = hetcomm.backend_of().inner_levels()
    dist.destroy_process_group()
    return f"formed, inner levels {inner}"


def _gloo_attack(how: str):
    def act(store) -> None:
        key = _find(store, "hetcomm/inner/INC/gloo/0//0/0")
        if how == "garbage":
            # No seal, and to Gloo's parser a length of 2**64 - 1: it raises MemoryError
            # (std::bad_alloc). (A one-byte value crashes Gloo's parser outright: docs/security.md
            # says so for groups without a secret.)
            store.set(key, b"\x02" + b"\0" * 7 + b"\xff" * 8 + b"\0" * 48)
        else:
            store.delete_key(key)
        store.set("attacked", "1")
    return act


@pytest.mark.parametrize("mode,how", [("out_of_band", "garbage"), ("out_of_band", "delete"), ("in_store", "garbage")])
def test_an_attacked_gloo_rendezvous_fails_the_group_with_a_secret_and_is_named(mode: str, how: str) -> None:
    # A deleted record is waited for until the store's timeout: 12 s here, less than the group's
    # (20 s: a forged one must be given up on first, after 10 s). Rank 0's Gloo retries its
    # connection to rank 1 for about five times its connection timeout (5 s here, hosts.py).
    store_timeout_s = 12 if how == "delete" else WAIT_S
    group_timeout_s = 20
    outcomes, _ = _attack(mode, gloo_rendezvous_attacked, _gloo_attack(how), store_timeout_s, group_timeout_s,
                          env={"HETCOMM_LOCAL": "gloo"})
    if mode == "out_of_band":
        # Every rank fails (a store writer must not push the hosts onto TCP), and rank 1, which
        # read the record, says why: a forged one after 10 s of failing its seal, not at the
        # store's timeout (60 s, past the group's 20 s: before, both ranks timed out in the
        # exchange of outcomes, naming nothing); a deleted one when Gloo's wait for it ends.
        assert all(o.startswith("failed: ") for o in outcomes), outcomes
        why = "failed its authentication for 10 s" if how == "garbage" else "gloo: DistStoreError"
        assert why in outcomes[1] and "could not" in outcomes[1], outcomes
    else:
        # Without a secret a store writer can push the hosts onto TCP (docs/security.md): the
        # group forms all the same and adds exactly, or fails on every rank, rank 1 naming what
        # Gloo raised (before, rank 1's MemoryError escaped, and rank 0 timed out).
        assert (outcomes == ["formed, inner levels []"] * 2
                or (all(o.startswith("failed: ") for o in outcomes) and "gloo: MemoryError" in outcomes[1])), outcomes
