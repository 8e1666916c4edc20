"""The join records of an elastic run against a store writer (issue 43): the `joins` counter
cannot be sealed, and a store writer may delete any record or decision. A joiner must always
write its request where the members read, and the members must read it, whatever the counter
says. Each case acts on `JoinRecords` (the join side of an elastic run, alone) over a real
TCPStore, with a plain client beside it as the store writer; each fails on the code before its fix.
"""
from __future__ import annotations

import datetime
import itertools
import threading
import time

import pytest
import torch.distributed as dist

from hetcomm.train.elastic.common import _next_decided, _read_decision, _start_epoch
from hetcomm.train.elastic.epochs import Epochs
from hetcomm.train.elastic.joins import JoinRecords
from hetcomm.train import membership
from hetcomm.train.membership import Keys, SecretMismatch
from hetcomm.train.pulse import Pulse

pytestmark = pytest.mark.usefixtures("backend_importable")

_jobs = itertools.count()


class _Joiner(JoinRecords):
    """The join-record side of a worker, alone: what `ElasticBase` mixes in."""

    def __init__(self, keys: Keys, me: str, timeout: float = 0.0) -> None:
        self._keys, self._me, self._gaps, self._timeout = keys, me, {}, timeout

    def _request(self) -> dict:
        return {"who": self._me, "holds": False, "round": 0, "config": {}}


@pytest.fixture(scope="module")
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    yield store


@pytest.fixture(params=[False, True], ids=["plain", "sealed"])
def job(server, request):
    """(keys of a fresh job, the raw root for the store writer)."""
    root = f"hetcomm/ft/joins{next(_jobs)}/"
    return Keys(server, "test", root, seal=b"j" * 32 if request.param else None), root


def decide(keys: Keys, epoch: int, admitted_upto: int) -> None:
    w0 = "w0#0000000a"
    keys.set(f"e{epoch}/decision", {"epoch": epoch, "gen": 1, "round": 0, "admitted_upto": admitted_upto,
                                     "members": [w0], "holders": [w0], "joined": [w0], "left": {}, "refused": {}})
    keys.set("latest", epoch)


def members_read(keys: Keys, start: int) -> list[str]:
    requests, _ = _Joiner(keys, "w0#0000000a")._registrations(keys, start, wait=False)
    return [r["who"] for _, r in requests]


def test_a_joiner_next_to_a_gap_the_members_passed_over_is_read(job):
    """Index 0 was taken by a worker that died before it wrote its request, and the members
    passed over it (the newest decision admitted up to index 2). Index 2 is taken by a joiner
    that has not written yet when the next one takes 3 from the counter: that one must write
    where the members read, from 2 on (before: it took the first free index, 0, below where the
    members read, and was never admitted)."""
    keys, _ = job
    keys.set("join/1", _Joiner(keys, "w1#0000000a")._request())
    decide(keys, 1, 2)
    assert keys.add("joins", 3) == 3                 # 0: died, 1: admitted, 2: being written
    late = _Joiner(keys, "w2#0000000b")
    assert late._register() == 3
    assert members_read(keys, 2) == ["w2#0000000b"]


def test_a_counter_set_back_below_a_missing_record_is_put_back_by_the_joiner_past_it(job, server):
    """Index 3 was taken by a worker that died; a joiner writes at 4; then a store writer sets
    the counter back to 0 (or garbage). The members' scans end at the first missing record past
    the counter, so the waiting joiner puts the counter back past its index (before: every scan
    stopped at 3, for ever)."""
    keys, root = job
    for i in range(3):
        keys.set(f"join/{i}", _Joiner(keys, f"m{i}#a")._request())
    decide(keys, 1, 3)
    assert keys.add("joins", 4) == 4                 # 3: died before writing
    joiner = _Joiner(keys, "w4#0000000b")
    index = joiner._register()
    assert index == 4
    for setback in (b"0", b"\x00 not a counter"):
        server.set(root + "joins", setback)
        joiner._keep_request(index)                  # what it does every heartbeat while it waits
        assert members_read(keys, 3) == ["w4#0000000b"]


def test_members_far_past_a_deleted_counter_still_read(job, server):
    """The members read from index 5000 (admitted_upto) when a store writer deletes the counter:
    a scan bounded by the counter alone (0 + 4096) read nothing there (before), while the joiner
    wrote at 5000."""
    keys, root = job
    decide(keys, 1, 5000)
    server.delete_key(root + "joins")
    joiner = _Joiner(keys, "w9#0000000b")
    assert joiner._register() == 5000
    assert members_read(keys, 5000) == ["w9#0000000b"]


def test_a_run_of_missing_records_times_out_together(job):
    """Ten indices were taken and never written (a store writer inflated the counter, or ten
    registrants died): the members skip them after one `timeout`, not one `timeout` each (before:
    the second scan skipped one)."""
    keys, _ = job
    assert keys.add("joins", 11) == 11
    keys.set("join/10", _Joiner(keys, "w10#0000000b")._request())
    member = _Joiner(keys, "w0#0000000a", timeout=0.2)
    assert member._registrations(keys, 0)[0] == []   # the first look times the run
    time.sleep(0.3)
    requests, upto = member._registrations(keys, 0)
    assert [r["who"] for _, r in requests] == ["w10#0000000b"] and upto == 11


def test_the_floor_skips_a_newest_decision_a_store_writer_deleted(job, server):
    """The newest decision (admitted up to 5) is deleted: the floor is the one before it (3),
    not 0, below which every index is one the members passed over long ago."""
    keys, root = job
    decide(keys, 1, 3)
    decide(keys, 2, 5)
    server.delete_key(root + "e2/decision")
    assert _Joiner(keys, "w5#0000000b")._join_floor() == 3


def test_garbage_where_a_refusal_goes_stops_no_member(job, server):
    """A store writer puts garbage under refused/<who> before a member refuses that joiner: the
    member goes on (the decision carries the refusal too); before, `first` raised out of step()."""
    keys, root = job
    server.set(root + "refused/evil#00000001", b"\x00 garbage")
    Epochs._refuse(None, keys, "evil#00000001", "its model differs")
    Epochs._refuse(None, keys, "other#00000002", "its model differs")
    assert keys.peek("refused/other#00000002") == "its model differs"


@pytest.mark.parametrize("counter", ["set-back", "inflated", "garbage-at-index"])
def test_a_joiner_writes_at_the_floor_whatever_the_counter_says(job, server, counter):
    """Records 0 and 1 were admitted (floor 2). A store writer sets the counter back to 0 (its
    index would be below the floor), inflates it past 65 missing records, or puts garbage at the
    index the counter hands out: the joiner writes at 2 (at 3 past the garbage without the
    secret; with it, garbage is no value and is replaced). Before, the garbage raised out of
    `_register` in a job without the secret, and the counter's index was kept."""
    keys, root = job
    for i in range(2):
        keys.set(f"join/{i}", _Joiner(keys, f"m{i}#a")._request())
    decide(keys, 1, 2)
    if counter == "set-back":
        server.set(root + "joins", b"0")
    elif counter == "inflated":
        server.set(root + "joins", b"100")
    else:
        server.set(root + "joins", b"2")
        server.set(root + "join/2", b"\x00 not a request")
    joiner = _Joiner(keys, "w2#0000000b")
    assert joiner._register() == (3 if counter == "garbage-at-index" and not keys.sealed else 2)
    assert members_read(keys, 2) == ["w2#0000000b"]


def test_no_fixed_bytes_read_as_absent(job, server):
    """A read is a compare_set told to expect a marker, which the store answers when the key has
    no value. Marker bytes a store writer puts under a key must read as what they are (not a
    counter), not as absent: before, the fixed marker under `joins` read as 0, and a waiting
    joiner's compare_set from absent never replaced it."""
    keys, root = job
    server.set(root + "joins", b"\0hetcomm: no value\0")
    assert keys.count("joins") is None
    keys.at_least("joins", 5)
    assert keys.count("joins") == 5


def test_a_value_that_looks_sealed_is_garbage_once_the_job_is_known_plain(server, capsys, monkeypatch):
    """Without the secret, a value that looks sealed means "this worker lacks the job's secret"
    only until it read a plain decision of the job (its own write read back is none):
    afterwards a store writer's sealed-looking bytes (JSON and 32 bytes) are garbage, and a
    member that refuses a joiner goes on (before, it stopped with a false SecretMismatch)."""
    monkeypatch.setattr(membership, "_LOGGED", set())   # (what was logged once in this process)
    root = f"hetcomm/ft/joins{next(_jobs)}/"
    keys = Keys(server, "test", root)
    looks_sealed = b'"x"' + bytes(range(32))
    server.set(root + "refused/evil#00000001", looks_sealed)
    with pytest.raises(SecretMismatch):             # nothing plain read yet: it may be the worker's fault
        keys.peek("refused/evil#00000001")
    assert keys.first("era", 1) == 1                 # its own write, read back, is no evidence
    with pytest.raises(SecretMismatch):
        keys.peek("refused/evil#00000001")
    decide(keys, 1, 0)
    assert _read_decision(keys, 1)["epoch"] == 1     # a plain decision of the job: it is not sealed
    Epochs._refuse(None, keys, "evil#00000001", "its model differs")
    server.set(root + "e2/decision", looks_sealed)
    assert _read_decision(keys.clone(), 2) is None
    # The plain decision may be a store writer's too: the worker says what else it can be.
    assert f"{root}e2/decision: it looks sealed" in capsys.readouterr().err


@pytest.mark.parametrize("deleted", ["two", "two-and-latest"])
def test_a_waiting_worker_reads_past_deleted_decisions(job, server, deleted):
    """A joiner waits for decision 2; a store writer deletes decisions 2 and 3 (and `latest`):
    the joiner reads on to decision 4 (before, it looked one epoch ahead at most, and not at all
    as an early joiner)."""
    keys, root = job
    for epoch in range(1, 5):
        decide(keys, epoch, 0)
    for gone in ("e2/decision", "e3/decision") + (("latest",) if deleted == "two-and-latest" else ()):
        server.delete_key(root + gone)
    assert _next_decided(keys, 2) == 4
    assert _next_decided(keys, 4) == 4


def test_a_counter_past_a_long_run_of_missing_records_is_not_taken(job, server):
    """Records 0 and 1 admitted (floor 2); a store writer sets the counter to 202 and writes a
    request-shaped record at 201: the index the counter hands out (202) follows a record, but
    the members' scans stop at the run of missing records from 2 and never get there. The joiner
    takes 2 (before: 202, and it waited for ever). With the secret the record at 201 is no
    record, and the run alone sends the joiner to 2 as well."""
    keys, root = job
    for i in range(2):
        keys.set(f"join/{i}", _Joiner(keys, f"m{i}#a")._request())
    decide(keys, 1, 2)
    server.set(root + "joins", b"202")
    server.set(root + "join/201", b'{"who": "ghost#00000001", "holds": false, "round": 0}')
    joiner = _Joiner(keys, "w2#0000000b")
    assert joiner._register() == 2
    assert "w2#0000000b" in members_read(keys, 2)


def test_a_joiner_starts_at_a_decision_whatever_latest_says(job, server):
    """`latest` names where a joiner starts reading. A store writer forges one far past every
    decision (without the secret), deletes it, or deletes the decision it names: the joiner
    starts at the newest decision there is, or at the epoch after the last it read (before:
    at the forged epoch, which no decision would reach, for ever)."""
    keys, root = job
    for epoch in range(1, 4):
        decide(keys, epoch, 0)
    assert _start_epoch(keys) == 3
    server.delete_key(root + "e3/decision")
    assert _start_epoch(keys) == 2
    server.delete_key(root + "latest")
    assert _start_epoch(keys) == 1 and _start_epoch(keys, 3) == 3
    if not keys.sealed:
        server.set(root + "latest", b"99999999")
        assert _start_epoch(keys, 2) == 2


def test_a_worker_far_behind_deleted_decisions_jumps_to_latest(job, server):
    """Decisions 2 to 80 were deleted (past epochs nobody reads again): a worker waiting at 2
    reads on at `latest`'s decision, 81, not only 64 epochs ahead (before: for ever at 2)."""
    keys, root = job
    for epoch in (1, 81):
        decide(keys, epoch, 0)
    assert _next_decided(keys, 2) == 81


class _EraReader(Epochs):
    """The era lookup of a worker without a checkpoint, alone."""

    def __init__(self, job_keys: Keys) -> None:
        self._job_keys, self._checkpoint = job_keys, False


@pytest.mark.parametrize("attack", ["deleted", "old-value-back"])
def test_a_joiner_finds_the_era_whatever_the_era_key_says(job, server, attack):
    """The job is in era 2 (its first decision written); a store writer deletes the `era` key
    (the next joiner then writes 1) or puts back the value it copied in era 1 (sealed, it still
    opens). A joiner must go to era 2, not to the dead era 1 (before: it joined era 1, waited
    for its silent members and stopped with a RuntimeError)."""
    keys, root = job
    assert keys.first("era", 1) == 1
    old = server.get(root + "era")
    keys.at_least("era", 2, sealed=True)
    assert keys.peek("era") == 2
    decide(keys.under("era2"), 1, 1)
    if attack == "deleted":
        server.delete_key(root + "era")
    else:
        server.set(root + "era", old)
    assert _EraReader(keys)._era() == 2
    # An era whose first worker has asked to join, with no decision yet, has begun too.
    keys.under("era3").set("join/0", _Joiner(keys, "w3#0000000c")._request())
    server.set(root + "era", old)
    assert _EraReader(keys)._era() == 3
    # A record there that does not open, or is not JSON, is no sign of a later era (without the
    # secret, well-formed plain records there would be: a store writer may steer a plain run).
    server.set(root + "era4/join/0", b'{"who": "evil#00000001"}' + bytes(32))
    server.set(root + "era4/e1/decision", b"not a decision")
    assert _EraReader(keys)._era() == 3


def test_a_workers_heartbeat_puts_a_set_back_era_key_back(job, server):
    """Every worker holds the `era` key at its era (`Pulse.hold`): deleted, or set back to an
    old value, it is put back within a beat, so that the evidence `_newest_era` reads on from
    need not be all there is."""
    keys, root = job
    assert keys.first("era", 1) == 1
    old = server.get(root + "era")
    keys.at_least("era", 2, sealed=True)
    pulse = Pulse(keys.clone(), "w0#0000000a", 0.02)
    try:
        pulse.hold("era", 2)
        for attack in ("delete", "old", "garbage"):
            if attack == "delete":
                server.delete_key(root + "era")
            else:
                server.set(root + "era", old if attack == "old" else b"\xff" * 40)
            deadline = time.monotonic() + 5
            while keys.peek_bytes("era") != b"2" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert keys.peek("era") == 2, attack
            pulse.check()
    finally:
        pulse.stop()


class _Restarter(Epochs):
    """The era lookup of a worker restarted from a checkpoint, alone, with its heartbeat."""

    def __init__(self, job_keys: Keys, timeout: float = 0.6, heartbeat: float = 0.05) -> None:
        self._job_keys, self._checkpoint, self._round, self.job = job_keys, True, 7, "test"
        self._timeout, self._heartbeat, self._verbose = timeout, heartbeat, False
        self._pulse = Pulse(job_keys.clone(), "r#00000001", heartbeat)

    def era(self) -> int:
        try:
            return self._era()
        finally:
            self._pulse.stop()


def _decide_era(keys: Keys, epoch: int, members: list[str]) -> None:
    keys.set(f"e{epoch}/decision", {"epoch": epoch, "gen": 1, "round": epoch, "admitted_upto": 0,
                                     "members": members, "holders": members, "joined": members, "left": {},
                                     "refused": {}})


def test_a_restarted_worker_judges_the_era_by_its_newest_decision_past_a_gap(job, server):
    """Era 1 decided epochs 1 to 3; epoch 3's member lives (its heartbeat echoes, no liveness
    port). A store writer puts `latest` back to 1 and deletes decision 2: the restarted worker
    must still find decision 3 and join era 1 (before: it judged the era by epoch 1's members,
    long gone, waited for the deleted decision 2 and started era 2 while era 1 lived)."""
    keys, root = job
    assert keys.first("era", 1) == 1
    era1 = keys.under("era1")
    _decide_era(era1, 1, ["old#00000001"])
    era1.set("latest", 1)
    old_latest = server.get(root + "era1/latest")
    _decide_era(era1, 2, ["old#00000001", "m#00000001"])
    _decide_era(era1, 3, ["m#00000001"])
    era1.set("latest", 3)
    member = Pulse(keys.clone(), "m#00000001", 0.05)          # alive; it publishes no reachable address
    member.member_of(1)
    try:
        server.set(root + "era1/latest", old_latest)
        server.delete_key(root + "era1/e2/decision")
        assert _Restarter(keys).era() == 1
    finally:
        member.stop()
    # Its member gone for good (the heartbeat stops), the era is dead: the next one starts.
    assert _Restarter(keys).era() == 2 and keys.peek("era") == 2


def test_replayed_heartbeats_neither_fork_the_era_nor_hold_a_restarted_worker(job, server):
    """The era's only member is dead; a store writer replays its heartbeat values (sealed, in
    order: each reads as a move). The restarted worker must neither start a new era (the member
    may be alive) nor wait for ever: it stops with an error that says why (before: it waited as
    long as there were values to replay)."""
    keys, root = job
    assert keys.first("era", 1) == 1
    era1 = keys.under("era1")
    _decide_era(era1, 1, ["m#00000001"])
    era1.set("latest", 1)
    recorded = []
    for beat in range(1, 200):
        keys.set("hb/m#00000001", beat)
        recorded.append(server.get(root + "hb/m#00000001"))
    server.set(root + "hb/m#00000001", recorded[0])
    stop = threading.Event()

    def replay() -> None:
        for value in recorded[1:]:
            if stop.wait(0.05):
                return
            server.set(root + "hb/m#00000001", value)

    rogue = threading.Thread(target=replay, daemon=True)
    rogue.start()
    try:
        with pytest.raises(RuntimeError, match="replaying their heartbeats"):
            _Restarter(keys).era()
    finally:
        stop.set()
        rogue.join()
    assert keys.peek("era") == 1


def test_a_live_member_no_decision_found_names_still_keeps_its_era(job, server):
    """The decisions that name the live member (epochs 2 to 70) and `latest` are deleted: the
    newest decision a restarted worker finds names only a long-gone incarnation. The era is still
    alive: its member answers the probe whoever it is (before: the worker checked only the gone
    one's heartbeat and echo, and started era 2 beside the live era 1)."""
    keys, root = job
    assert keys.first("era", 1) == 1
    era1 = keys.under("era1")
    _decide_era(era1, 1, ["old#00000001"])
    _decide_era(era1, 71, ["m#00000001"])
    member = Pulse(keys.clone(), "m#00000001", 0.05)
    member.member_of(1)
    try:
        assert _Restarter(keys).era() == 1
    finally:
        member.stop()


def test_a_member_keeps_its_era_marked_begun_and_echoes_probes(job, server):
    """A member's heartbeat keeps `era<n>/echo` there (no worker writes the first decision of
    an era that has it: a store writer who deletes the era's decisions and `latest` must not
    make a joiner start it again), and copies a fresh `probe` into it."""
    keys, root = job
    member = Pulse(keys.clone(), "m#00000001", 0.02)
    try:
        member.member_of(3)

        def until(check) -> None:
            deadline = time.monotonic() + 30
            while not check():
                assert time.monotonic() < deadline, "not within 30 s (a hang)"
                time.sleep(0.01)

        until(lambda: keys.peek_bytes("era3/echo") is not None)
        server.delete_key(root + "era3/echo")
        until(lambda: keys.peek_bytes("era3/echo") is not None)
        keys.set_bytes("probe/2", b"n" * 32)
        until(lambda: keys.peek_bytes("era3/echo/2") == b"n" * 32)
        assert keys.peek_bytes("era3/echo") is not None
        member.check()
    finally:
        member.stop()


class _Stop(Exception):
    pass


class _WaitingJoiner(Epochs):
    """A fresh joiner's wait for admission (`_admit_in_era`), alone: its heartbeat is a stand-in
    that ends the wait after ``looks`` turns; `_bootstrap` records that it was called."""

    class _Heart:
        def __init__(self, looks: int) -> None:
            self.looks = looks

        def check(self) -> None:
            self.looks -= 1
            if self.looks < 0:
                raise _Stop()

        def watch(self, names) -> None:
            pass

        keep = watch

        def silent(self, name) -> float:
            return 0.0

    def __init__(self, keys: Keys, looks: int) -> None:
        self._keys, self._me, self._gaps, self._timeout, self._heartbeat = keys, "j#00000001", {}, 1.0, 0.01
        self._dropped_at, self.job, self._era_number, self._checkpoint = 0, "test", 1, False
        self._job_keys = keys                     # (the job's keys: here the era's own)
        self._pulse, self.bootstrapped = self._Heart(looks), False

    def _request(self) -> dict:
        return {"who": self._me, "holds": False, "round": 0, "config": {}}

    def _bootstrap(self, keys: Keys) -> None:
        self.bootstrapped = True
        raise _Stop()

    def _count(self, *_) -> None:
        pass


@pytest.mark.parametrize("marked", [False, True], ids=["fresh-era", "begun-era"])
def test_a_joiner_does_not_start_an_era_a_member_marked_begun(job, marked):
    """A store writer deleted every decision of the era and `latest`: a joiner must not write
    its first decision again while a member's heartbeat keeps `echo` there (before: it did,
    a fork of the live era); in a fresh era it does."""
    keys, _ = job
    if marked:
        keys.set_bytes("echo", b"member")
    joiner = _WaitingJoiner(keys, looks=50)
    with pytest.raises(_Stop):
        joiner._admit_in_era(None)
    assert joiner.bootstrapped is not marked


def test_a_joiner_waiting_in_an_era_that_has_not_begun_moves_to_a_later_one_that_has(job, server):
    """A whole job restarted from checkpoints on a new store: a worker without a checkpoint found
    the `era` key missing and wrote 1; one with a checkpoint of era 4 then started era 5 (its
    era's records are gone with the old store) and asked to join there. The first, still waiting
    for era 1 to begin, moves to era 5 once it reads the key (before: it waited in era 1 for ever,
    or began it alone). The controls: a key of 1, and a key of 5 while nobody began era 5 (a
    store writer's replay of an earlier run's value), move nobody."""
    keys, root = job
    moved = []

    def joiner() -> _WaitingJoiner:
        j = _WaitingJoiner(keys, looks=50)
        j._newest_era = lambda era: era
        j._new_incarnation = lambda: moved.append(j._era_number)
        j._pulse.hold = lambda key, n: None
        return j

    keys.first("era", 1)
    keys.at_least("era", 1, sealed=True)
    for era in (1, 5):
        keys.at_least("era", era, sealed=True)
        with pytest.raises(_Stop):               # (it waits, and would begin era 1: here it stops)
            joiner()._admit_in_era(None)
        assert moved == []
    keys.under("era5").set("join/0", {"who": "r#00000001", "holds": True, "round": 7, "config": {}})
    j = joiner()
    assert j._admit_in_era(None) is True and j._era_number == 5 and moved == [5]


def test_a_worker_left_out_raises_when_the_members_that_went_on_are_all_gone(job):
    """A worker left out of epoch 3 (late) asks to join again; the members that went on without
    it all die before any decision admits it. It raises, naming them (before: it waited for a
    decision nobody would write, with nothing to watch)."""
    keys, _ = job
    decide(keys, 3, 0)                            # (members: w0#0000000a)
    joiner = _WaitingJoiner(keys, looks=200)
    joiner._dropped_at, joiner._left_by = 3, ["w0#0000000a"]
    joiner._pulse.quiet = lambda name, seconds: name == "w0#0000000a"     # (dead)
    joiner._newest_era = lambda era: era
    joiner._new_incarnation = lambda: None
    with pytest.raises(RuntimeError, match="every member of epoch 3 .w0. is gone"):
        joiner._admit_in_era(None)
