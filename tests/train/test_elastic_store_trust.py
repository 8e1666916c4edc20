"""An elastic run's store is not trusted (issue 43): with an out-of-band secret
(HETCOMM_SECRET), every value the workers act on is sealed (`hetcomm.train.membership.Keys`), and
a store writer without the secret can neither steer the membership nor end the run.

The unit cases act on `Keys` over a real TCPStore with a raw client beside it; the job cases run
workers (tests/support/elastic_worker.py) while a rogue thread in the test, a plain store client,
forges what a member would write: the next epoch's decision naming one member, `leave/` records
for the others, a join request (a copy of a real one under another name) with a moving
heartbeat, and garbage in the join counter. Without the secret the same rogue drops members.
"""
from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from elastic_job import check_agreement, events, final
from hetcomm.train.membership import Forged, Keys, SecretMismatch

pytestmark = pytest.mark.usefixtures("backend_importable")

SECRET = "an out-of-band secret of the job's own"


class SyncedClient:
    """A plain store client whose writes have landed when they return: TCPStore's `set` does not
    wait for the server, so a member's next request, on its own connection, could otherwise be
    served first. A read on the same connection afterwards waits for the write."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def set(self, key, value) -> None:
        self.store.set(key, value)
        self.store.check([key])


@pytest.fixture(scope="module")
def stores():
    """A TCPStore, a member's client and a rogue's (a plain client, no secret)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    rogue = SyncedClient(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5)))
    yield server, rogue


def test_a_sealed_value_written_moved_or_replayed_by_a_store_writer_is_never_acted_on(stores):
    store, rogue = stores
    keys = Keys(store, "test", "hetcomm/ft/unit/", seal=bytes(range(32)))
    other_job = Keys(store, "test", "hetcomm/ft/other/", seal=bytes(range(32)))
    keys.set("e1/decision", {"members": ["a#00000000", "b#00000000"]})
    assert keys.get("e1/decision") == {"members": ["a#00000000", "b#00000000"]}
    sealed = rogue.get("hetcomm/ft/unit/e1/decision")
    assert json.loads(sealed[:-32]) == {"members": ["a#00000000", "b#00000000"]}   # readable, not writable

    # a value of the rogue's own: not there for has, Forged for get, replaced by first
    rogue.set("hetcomm/ft/unit/e2/decision", json.dumps({"members": ["a#00000000"]}))
    assert not keys.has("e2/decision")
    with pytest.raises(Forged, match="e2/decision"):
        keys.get("e2/decision")
    assert keys.first("e2/decision", {"members": ["b#00000000"]}) == {"members": ["b#00000000"]}
    assert keys.first("e2/decision", {"members": ["x#00000000"]}) == {"members": ["b#00000000"]}  # first wins

    # an authentic value moved to another key, or into another job, does not open there
    rogue.set("hetcomm/ft/unit/leave/a#00000000", sealed)
    rogue.set("hetcomm/ft/other/e1/decision", sealed)
    assert not keys.has("leave/a#00000000") and not other_job.has("e1/decision")

    # heartbeats: a forged counter reads as garbage (-2), an authentic one as its number
    keys.set("hb/a#00000000", 7)
    rogue.set("hetcomm/ft/unit/hb/b#00000000", "9")
    assert keys.counters(["hb/a#00000000", "hb/b#00000000"]) == [7, -2]

    # a counter the rogue replaced with garbage: a ValueError naming it, and the member's
    # connection still works (the store's own add would have failed and closed it)
    assert keys.add("joins", 1) == 1
    rogue.set("hetcomm/ft/unit/joins", b"\x00garbage")
    with pytest.raises(ValueError, match="joins is not a counter"):
        keys.add("joins", 1)
    assert keys.get("e1/decision") == {"members": ["a#00000000", "b#00000000"]}

    # without a seal, the same keys take whatever is there (today's behaviour, documented)
    rogue.set("hetcomm/ft/unit/ended", json.dumps({"round": 1}))
    plain = Keys(store, "test", "hetcomm/ft/unit/")
    assert plain.has("ended") and plain.get("ended") == {"round": 1} and not keys.has("ended")


def test_a_worker_without_the_secret_in_a_sealed_job_says_so(stores):
    """Not an attack but a mistake: a worker started without HETCOMM_SECRET in a job whose
    workers have it stops with an error that says what to do, instead of waiting forever."""
    from hetcomm.train.elastic.common import _read_decision

    store, _ = stores
    sealed = Keys(store, "test", "hetcomm/ft/mixed/", seal=b"s" * 32)
    sealed.set("e1/decision", {"epoch": 1})
    sealed.first("era", 1)
    plain = Keys(store, "test", "hetcomm/ft/mixed/")
    for read in (lambda: plain.first("era", 1), lambda: _read_decision(plain, 1), lambda: plain.peek("era")):
        with pytest.raises(SecretMismatch, match="start every worker with the same secret"):
            read()


def test_a_counter_made_garbage_right_after_a_worker_read_it_does_not_cut_the_worker_off(stores):
    """The store's own `add` on a value that is not a decimal closes the client's connection
    (torch's libuv store): a writer that puts one there right after the worker read the counter
    gets a ValueError naming the key, and the worker's connection goes on working."""
    store, rogue = stores
    keys = Keys(store, "test", "hetcomm/ft/race/", seal=b"r" * 32)
    assert keys.add("joins", 1) == 1
    real = keys.store

    class Tampering:
        def __getattr__(self, name):
            return getattr(real, name)

        def compare_set(self, key, expected, desired):
            out = real.compare_set(key, expected, desired)
            if expected == desired:                 # a read: the rogue writes right after it
                rogue.set(key, b"\x00garbage")
            return out

    keys.store = Tampering()
    try:
        with pytest.raises(ValueError, match="joins is not a counter"):
            keys.add("joins", 1)
    finally:
        keys.store = real
    rogue.set("hetcomm/ft/race/joins", "5")
    assert keys.add("joins", 2) == 7


def test_first_over_a_forged_value_that_is_deleted_meanwhile(stores):
    """torch's compare_set answers `expected` when the key is gone: `first` then starts over."""
    store, rogue = stores
    keys = Keys(store, "test", "hetcomm/ft/gone/", seal=b"k" * 32)
    rogue.set("hetcomm/ft/gone/ended", "{}")
    real = keys.store

    class Deleting:
        def __getattr__(self, name):
            return getattr(real, name)

        def compare_set(self, key, expected, desired):
            if expected:                       # the second try: the rogue's value is gone
                rogue.delete_key(key)
            return real.compare_set(key, expected, desired)

    keys.store = Deleting()
    assert keys.first("ended", {"round": 3}) == {"round": 3}
    keys.store = real
    assert keys.get("ended") == {"round": 3}


class Rogue(threading.Thread):
    """A store writer without the secret, acting on a running job until stopped."""

    FAKE = "w9#0123abcd"

    def __init__(self, port: int, job: str, attacks: set[str]) -> None:
        super().__init__(daemon=True)
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        self.root, self.attacks, self.stop, self.acted = f"hetcomm/ft/{job}/era1/", attacks, threading.Event(), set()
        self.job_root = f"hetcomm/ft/{job}/"           # (heartbeats and addresses: not per era)
        self.started: float | None = None

    def read(self, key: str):
        if not self.store.check([self.root + key]):
            return None
        raw = self.store.get(self.root + key)
        for candidate in (raw, raw[:-32]):           # sealed values are readable: value || tag
            try:
                return json.loads(candidate)
            except ValueError:
                pass
        return None

    def run(self) -> None:
        beats = 0
        while not self.stop.is_set():
            latest = self.read("latest")
            decision = self.read(f"e{latest}/decision") if isinstance(latest, int) else None
            if isinstance(decision, dict):
                members = decision["members"]
                if "decision" in self.attacks:       # the next epoch: the first member alone
                    forged = dict(decision, epoch=latest + 1, gen=decision["gen"] + 1, members=members[:1],
                                  holders=members[:1], left={m: "rogue" for m in members[1:]}, joined=[])
                    self.store.compare_set(self.root + f"e{latest + 1}/decision", "", json.dumps(forged))
                    self.acted.add("decision")
                if "leave" in self.attacks:
                    for m in members:
                        self.store.set(self.root + f"leave/{m}", json.dumps({"round": 0, "why": "rogue"}))
                    self.acted.add("leave")
            if "join" in self.attacks:
                real = self.read("join/0")
                if isinstance(real, dict) and "join" not in self.acted:
                    index = self.store.add(self.root + "joins", 1) - 1
                    self.store.set(self.root + f"join/{index}", json.dumps(dict(real, who=self.FAKE)))
                    self.store.set(self.job_root + f"addr/{self.FAKE}", '""')
                    self.acted.add("join")
                beats += 1
                self.store.set(self.job_root + f"hb/{self.FAKE}", str(beats))
            if decision is not None and self.started is None:
                self.started = time.monotonic()        # the run is under way (its first decision)
            if "counter" in self.attacks and "counter" not in self.acted and "join" in self.acted \
                    and self.started is not None and time.monotonic() - self.started > 1.0:
                self.store.set(self.root + "joins", b"\x00not a counter")   # (members then admit no one)
                self.acted.add("counter")
            time.sleep(0.05)


def rogue_run(run, attacks: set[str], secret: bool) -> tuple[Rogue, dict]:
    env = {"HETCOMM_SECRET": SECRET} if secret else {}
    common = ["--rounds", "6", "--steps", "4", "--step-seconds", "0.1", "--min-workers", "3"]
    for w in ("w0", "w1", "w2"):
        run.start(w, *common, env=env)
    rogue = Rogue(run.port, run.job, attacks)
    rogue.start()
    try:
        codes = run.wait_all()
    finally:
        rogue.stop.set()
        rogue.join()
    return rogue, codes


def test_a_store_writer_without_the_secret_cannot_steer_the_membership(run):
    rogue, codes = rogue_run(run, {"decision", "leave", "join", "counter"}, True)
    assert codes == {"w0": [0], "w1": [0], "w2": [0]}, f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ["w0", "w1", "w2"], 6)
    for w in ("w0", "w1", "w2"):
        left, joined = events(final(run, w))
        assert not left and not joined, (w, final(run, w)["membership"])
        assert final(run, w)["final"] == prints[6]
    assert rogue.acted >= {"decision", "join", "leave", "counter"}, rogue.acted
    assert "ignored the store value" in run.logs()        # its values were read, and refused


def test_without_the_secret_the_same_store_writer_drops_members(run):
    """The control: what the seal stops does happen without it. A forged join request (a fake
    worker whose heartbeat moves) makes the members end their generation for an epoch, in which
    forged leave records and a forged decision drop members."""
    rogue, codes = rogue_run(run, {"decision", "leave", "join"}, False)
    dropped = {w for w in ("w0", "w1", "w2") for rec in run.records(w) if "final" in rec
               for e in rec["membership"] for m, why in e.get("left", {}).items() if "rogue" in why}
    assert dropped or any(c != [0] for c in codes.values()), f"{codes}\n{run.logs()}"


def two_ask_then_tamper(run, tamper) -> None:
    """w0 and w1 ask to join (min_workers 3), ``tamper(rogue, root)`` acts on the store, w2
    asks; every worker must finish every round with the same parameters."""
    common = ["--rounds", "3", "--steps", "2", "--min-workers", "3"]
    for w in ("w0", "w1"):
        run.start(w, *common)
    rogue = dist.TCPStore("127.0.0.1", run.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    root = f"hetcomm/ft/{run.job}/era1/"
    deadline = time.monotonic() + 120
    while not rogue.check([root + "join/0", root + "join/1"]):
        assert time.monotonic() < deadline, run.logs()
        time.sleep(0.02)
    tamper(rogue, root)
    run.start("w2", *common)
    codes = run.wait_all()
    assert codes == {"w0": [0], "w1": [0], "w2": [0]}, f"{codes}\n{run.logs()}"
    check_agreement(run, ["w0", "w1", "w2"], 3)


def test_a_join_request_a_store_writer_overwrites_is_written_again(run):
    """A store writer overwrites w0's and w1's requests before w2 asks. Each worker writes its
    request again while it waits (before: the first decision never came)."""
    two_ask_then_tamper(run, lambda rogue, root: [rogue.set(root + f"join/{i}", b"\x00 not a request")
                                                  for i in (0, 1)])


@pytest.mark.parametrize("counter", [b"\x00 not a counter", b"0", b"99999999999999999"],
                         ids=["garbage", "set-back", "huge"])
def test_a_join_counter_a_store_writer_replaced_stops_no_one(run, counter):
    """The counter only hands out join indices: a store writer replaces it (garbage, set back to
    0, or a number far past the records) between the first requests and the last. Indices are
    claimed with compare_set, the members read the records past the counter (before: nobody was
    ever admitted) and stop at a run of missing ones, and a joiner whose index from the counter
    follows a missing record takes the first free one instead (before, with the huge counter:
    the members read every index up to it, for ever)."""
    two_ask_then_tamper(run, lambda rogue, root: rogue.set(root + "joins", counter))


def test_a_store_writer_holding_a_members_heartbeat_back_drops_no_one_while_its_link_answers(run):
    """With the secret, a store writer puts w2's heartbeat back to an old sealed value as fast as it
    can, so that to the others its counter never moves (timeout 3 s). w2's liveness connection
    answers their pings, sealed, so neither the generation's watchdog nor the epoch that admits w3
    takes it for silent: no generation is aborted and nobody is dropped. (Before, every epoch with
    w2 in it aborted on "gone during the synchronisation", until the run gave up.)"""
    env = {"HETCOMM_SECRET": SECRET}
    common = ["--run", "--rounds", "40", "--steps", "4", "--step-seconds", "0.1", "--timeout", "3"]
    for w in ("w0", "w1", "w2"):
        run.start(w, *common, "--min-workers", "3", env=env)
    store = dist.TCPStore("127.0.0.1", run.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    root, stop = f"hetcomm/ft/{run.job}/era1/", threading.Event()
    deadline = time.monotonic() + 120
    while not store.check([root + "latest"]):
        assert time.monotonic() < deadline, run.logs()
        time.sleep(0.02)
    latest = json.loads(store.get(root + "latest")[:-32])       # (sealed: value || tag)
    members = json.loads(store.get(root + f"e{latest}/decision")[:-32])["members"]
    key = f"hetcomm/ft/{run.job}/hb/" + next(m for m in members if m.startswith("w2#"))    # (the job's, not the era's)
    old = store.get(key)

    def hold():
        while not stop.is_set():
            store.set(key, old)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        time.sleep(5.0)                                        # past the timeout: the store says w2 is silent
        run.start("w3", *common, env=env)                      # an epoch, with w2 in it
        codes = run.wait_all()
    finally:
        stop.set()
        holder.join()
    assert codes == {"w0": [0], "w1": [0], "w2": [0], "w3": [0]}, f"{codes}\n{run.logs()}"
    prints = check_agreement(run, ["w0", "w1", "w2", "w3"], 40)
    left, joined = events(final(run, "w0"))
    assert not left and joined == {"w3"}, final(run, "w0")["membership"]
    assert not any("aborted" in e for e in final(run, "w0")["membership"]), final(run, "w0")["membership"]
    assert final(run, "w2")["final"] == prints[40]
