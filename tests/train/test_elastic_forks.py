"""What keeps a store writer alone (one who can delete and replay sealed records, not forge them)
from forking an elastic run: two sets of members each deciding an epoch without the other and
training on in a generation of its own, or a restarted worker starting a new era beside a live
one. Each attack runs against the real heartbeats (`Pulse`) and the store, in one process; the
parts of a worker the epochs do not use are left out. docs/security.md names what remains."""
from __future__ import annotations

import datetime
import itertools
import socket
import threading
import time

import pytest
import torch.distributed as dist

from hetcomm.train.elastic.common import _digest
from hetcomm.train.elastic import forks
from hetcomm.train.elastic.epochs import Epochs
from hetcomm.train.membership import Keys
from hetcomm.train.pulse import Pulse
from waiting import until

pytestmark = pytest.mark.usefixtures("backend_importable")

A, B = "a#0000000a", "b#0000000b"
_jobs = itertools.count()
BEAT = 0.05


@pytest.fixture(scope="module")
def server():
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))


class _Stop(BaseException):
    """Raised where the generation would form: the worker went on to train."""


class _Member(Epochs):
    """A member of era 1, epoch 4 (members ``prev``), with a real heartbeat."""

    def __init__(self, keys: Keys, me: str, prev: list[str], timeout: float = 1.0,
                 late_timeout: float = 600.0) -> None:
        self._job_keys, self._keys, self._me, self.worker_id, self._era_number = keys, keys.under("era1"), me, me[0], 1
        self._decision = {"epoch": 4, "gen": 3, "round": 7, "members": prev, "holders": prev, "joined": [],
                          "left": {}, "refused": {}, "admitted_upto": 0, "fresh": False}
        self._outcome, self._gaps, self._scanned, self._verbose, self._gen = "commit", {}, (0, 0.0), False, 3
        self._heartbeat, self._timeout, self._late_timeout, self._collective_timeout = BEAT, timeout, late_timeout, 2.0
        self._pulse = Pulse(keys.clone(), me, BEAT)

    def _config(self) -> dict:
        return {}

    def _note_membership(self, decision: dict) -> None:
        pass

    def _form_group(self, decision: dict) -> None:
        raise _Stop

    def goes_on(self, decision: dict) -> bool:
        """Whether this worker, holding ``decision``, goes on to form its generation (False: it
        stopped with the error that names the rival decision)."""
        try:
            self._attempt(decision, [])
        except _Stop:
            return True
        except RuntimeError as e:
            assert "holds another decision of epoch" in str(e), e
            return False
        raise AssertionError("neither formed a group nor stopped")


def _alone(epoch: int, me: str, other: str) -> dict:
    """A decision of ``epoch`` that ``me`` wrote without ``other`` (taken for late)."""
    return {"epoch": epoch, "gen": 4, "round": 7, "members": [me], "holders": [me], "joined": [],
            "left": {other: "not at the epoch 1 s after the others"}, "refused": {}, "admitted_upto": 0,
            "fresh": False}


@pytest.fixture
def pair(server, monkeypatch, request):
    """A and B, members of epoch 4, each watching the other over a verified liveness link."""
    monkeypatch.setenv("HETCOMM_LISTEN_IP", "127.0.0.1")
    seal = b"f" * 32 if getattr(request, "param", True) else None
    keys = Keys(server, "test", f"hetcomm/ft/forks{next(_jobs)}/", seal=seal)
    a, b = _Member(keys, A, [A, B]), _Member(keys, B, [A, B])
    for m, other in ((a, B), (b, A)):
        m._pulse.member_of(1)
        m._pulse.decided(1, 4, _digest(m._decision))
        m._pulse.watch([other])
    try:
        until(lambda: a._pulse.linked(B) and b._pulse.linked(A))
        yield keys, a, b
    finally:
        a._pulse.stop()
        b._pulse.stop()


def test_of_two_decisions_of_one_epoch_the_later_to_hold_its_own_stops_before_its_generation(pair):
    """A store writer deleted both arrivals at epoch 5 and, between A's write of its decision and
    B's, A's decision: A and B each hold a decision of epoch 5 that leaves the other out (before,
    each formed a generation of its own and trained on: a fork). A holds its own first and goes on
    (B still answers that it holds epoch 4); B, holding its own after, hears from A that A holds
    another decision of epoch 5, and stops with an error before its generation forms."""
    keys, a, b = pair
    until(lambda: b._pulse.holding(A) is not None)
    b._pulse._ping = lambda: None                   # (B's last answer from A says epoch 4 ...)
    assert a.goes_on(_alone(5, A, B))
    announce = b._pulse.decided

    def announced(*args) -> None:
        announce(*args)
        del b._pulse._ping                           # (... until B announced its own: only a fresh one tells)
    b._pulse.decided = announced
    assert b._pulse.holding(A)[1] == 4
    assert not b.goes_on(_alone(5, B, A))


def test_a_left_out_member_that_holds_a_later_epoch_is_a_rival(pair):
    """B, left out of A's decision of epoch 5, says it holds epoch 6 of the era decided: it went on
    without A (its decision of 5 was a rival). A stops."""
    keys, a, b = pair
    b._pulse.decided(1, 6, "0123456789abcdef")
    assert not a.goes_on(_alone(5, A, B))


def test_a_member_left_out_that_took_the_same_decision_stops_no_one(pair):
    """B, left out of A's decision, read that decision (it answers that it holds it): A goes on. So
    does A where B answers that it is a member of no era (left out, it joins again)."""
    keys, a, b = pair
    mine = _alone(5, A, B)
    b._pulse.decided(1, 5, _digest(mine))
    assert a.goes_on(mine)
    b._pulse.member_of(0)
    a._pulse.watch([B])                               # (A's first attempt stopped watching B)
    until(lambda: a._pulse.linked(B))
    assert a.goes_on(mine)


def test_a_left_out_member_that_answers_nothing_is_waited_for_only_so_long(pair):
    """B's process is frozen (both heartbeat threads stopped, its connections open): A, whose
    decision left B out, waits for an answer to a ping sent after it announced, gives up once the
    first such ping went unanswered for a heartbeat and a second, and goes on (what a frozen member
    costs; docs/security.md says what a freeze at that moment still allows)."""
    keys, a, b = pair
    thaw, went_on = threading.Event(), []
    b._pulse._beat = b._pulse._prune = lambda *_: thaw.wait()
    try:
        threading.Thread(target=lambda: went_on.append(a.goes_on(_alone(5, A, B))), daemon=True).start()
        until(lambda: went_on)                       # (a hang fails here)
        assert went_on == [True]
    finally:
        thaw.set()


def test_a_wait_for_fresh_answers_that_this_worker_outlived_still_needs_one(pair, monkeypatch):
    """A's training thread freezes just as it starts to wait for B's fresh answer, for far longer
    than the wait takes (its clock jumps 1000 s). On waking it does not take the time that passed
    for B's silence: it waits for B's answer to a ping sent after it started (before, it went on at
    once with B's answer from before the wait)."""
    keys, a, b = pair
    real = time.monotonic
    since = real()

    class Frozen:                                     # (the forks module's clock, after the first look)
        looks = 0

        @classmethod
        def monotonic(cls) -> float:
            cls.looks += 1
            return real() + (1000.0 if cls.looks > 1 else 0.0)

        sleep = staticmethod(time.sleep)

    monkeypatch.setattr(forks, "time", Frozen)
    returned = []
    threading.Thread(target=lambda: returned.append(a._await_fresh_answers([B])), daemon=True).start()
    until(lambda: returned)
    assert a._pulse.answered_since(B, since)


@pytest.mark.parametrize("pair", [False], indirect=True, ids=["plain"])
def test_without_the_secret_the_answers_are_not_taken_as_evidence(pair):
    """The control: without a secret anyone could give an answer, and none is kept (a store writer
    forges decisions anyway): both go on."""
    keys, a, b = pair
    assert a.goes_on(_alone(5, A, B))
    assert b.goes_on(_alone(5, B, A))


@pytest.mark.parametrize("where", ["deleted", "held", "refused", "linked-once"])
def test_a_member_never_linked_is_not_left_out(server, monkeypatch, where):
    """B looks dead to A (a store writer holds its counter back), and A never had a liveness
    connection to it: the writer keeps B's address deleted ("deleted"), a host of its holds the
    connections to B's port without greeting ("held"), or B's port refuses ("refused": a
    firewall that rejects looks the same as nothing listening). A does not decide epoch 5
    without B, which B, alike cut off from A, would do too (a fork): it waits a while, then
    stops with an error that says why (before: it decided [A]). The control ("linked-once"):
    B's link was verified, then B froze: its silence counts, and A decides without it."""
    monkeypatch.setattr(Pulse, "RETRY", 0.2)         # (the wait: two connection attempts, one greeting)
    monkeypatch.setattr(Pulse, "GREETING", 0.5)
    monkeypatch.setenv("HETCOMM_LISTEN_IP", "127.0.0.1")
    keys = Keys(server, "test", f"hetcomm/ft/forks{next(_jobs)}/", seal=b"f" * 32)
    keys.set(f"hb/{B}", 1)                           # B's counter, held back
    holder = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never greets
    b, thaw = None, threading.Event()
    if where == "linked-once":
        b = Pulse(keys.clone(), B, BEAT)
    elif where != "deleted":
        port = holder.getsockname()[1] if where == "held" else 1
        keys.set(f"addr/{B}", f"127.0.0.1:{port}")
    a = _Member(keys, A, [A, B], timeout=0.3)
    a._pulse.watch([B])
    try:
        if b is not None:
            until(lambda: a._pulse.linked(B))
            b._beat = b._prune = lambda *_: thaw.wait()     # (frozen: its counter and answers stop)
            assert a._decide(5, {"holds": True, "round": 7, "group": 3, "fresh": False})["members"] == [A]
            return
        with pytest.raises(RuntimeError, match="never had a liveness connection to them"):
            a._decide(5, {"holds": True, "round": 7, "group": 3, "fresh": False})
        assert not a._keys.has("e5/decision") and not a._pulse.evidence(B)
    finally:
        thaw.set()
        a._pulse.stop()
        if b is not None:
            b.stop()
        holder.close()


class _Restarter(Epochs):
    """A worker restarted from a checkpoint taken at era 1, epoch ``epoch``, with members
    ``members``, whose generations gave it the addresses ``liveness``."""

    def __init__(self, keys: Keys, epoch: int, members: list[str], liveness: dict[str, bytes]) -> None:
        self._job_keys, self._checkpoint, self._round, self.job, self._verbose = keys, True, 7, "test", False
        self._timeout, self._heartbeat = 0.6, BEAT
        self._position = {"era": 1, "epoch": epoch, "members": members}
        self._liveness = liveness
        self._pulse = Pulse(keys.clone(), "r#00000001", BEAT)
        self._pulse.learn(liveness)

    def era(self) -> int:
        try:
            return self._era()
        finally:
            self._pulse.stop()


def _decide(keys: Keys, epoch: int, members: list[str]) -> None:
    keys.set(f"e{epoch}/decision", {"epoch": epoch, "gen": 1, "round": epoch, "admitted_upto": 0, "members": members,
                                    "holders": members, "joined": members, "left": {}, "refused": {}})


@pytest.mark.parametrize("known", ["position", "liveness"])
def test_a_restarted_worker_is_not_led_to_judge_the_era_by_an_old_decision(server, monkeypatch, known):
    """Era 1 lives: member M answers on its liveness port. A store writer deleted the decisions
    after epoch 3 (whose only member is long dead) and keeps `latest` and the echo deleted: a
    worker restarted from a checkpoint judged the era by epoch 3, found it dead and started era 2
    beside era 1 (a fork). Its checkpoint says it took part in epoch 9 with M ("position"), or
    only knows M's address from a generation ("liveness", the decision it took part in being as
    old as the store shows): it asks M, which answers that it is a member of era 1, and joins
    era 1. The control: M gone, the era is dead and era 2 starts."""
    monkeypatch.setenv("HETCOMM_LISTEN_IP", "127.0.0.1")
    keys = Keys(server, "test", f"hetcomm/ft/forks{next(_jobs)}/", seal=b"f" * 32)
    assert keys.first("era", 1) == 1
    era1 = keys.under("era1")
    old = Pulse(keys.clone(), "old#00000001", BEAT)     # epoch 3's member: its address was published
    old.stop()
    _decide(era1, 3, ["old#00000001"])
    member = Pulse(keys.clone(), "m#00000001", BEAT)
    member.member_of(1)
    member.decided(1, 9, "0123456789abcdef")
    liveness = {"m#00000001": member.address}
    epoch, members = (9, ["m#00000001"]) if known == "position" else (3, ["old#00000001"])
    if known == "position":
        liveness = {}                                # (M is found from the position alone)
    try:
        assert _Restarter(keys, epoch, members, liveness).era() == 1
    finally:
        member.stop()
    assert keys.peek("era") == 1
    assert _Restarter(keys, epoch, members, liveness).era() == 2


def test_a_restarted_worker_does_not_take_an_era_for_dead_on_members_it_never_reached(server, monkeypatch):
    """The store shows no decision as new as the checkpoint's (epoch 9, member M), and M's address
    is deleted (never read, not in the checkpoint): M may live. The worker neither starts era 2 nor
    waits for ever: it stops with an error naming the store (before: M's silence started era 2)."""
    monkeypatch.setattr(Pulse, "RETRY", 0.2)
    keys = Keys(server, "test", f"hetcomm/ft/forks{next(_jobs)}/", seal=b"f" * 32)
    assert keys.first("era", 1) == 1
    with pytest.raises(RuntimeError, match="never read their liveness addresses"):
        _Restarter(keys, 9, ["m#00000001"], {}).era()
    assert keys.peek("era") == 1


@pytest.mark.parametrize("member", [True, False], ids=["member", "not-a-member"])
def test_a_member_of_an_era_stops_once_a_later_era_began(server, member):
    """A worker restarted from a checkpoint took era 1 for dead and started era 2 (it wrote the
    `era` key, sealed), while M, a member of era 1, lives: M's heartbeat reads the key, and M
    stops at its next check with an error that says so, rather than train on beside era 2 (a
    fork). The control: a worker of era 1 that is a member of no era (a joiner, or one left out)
    goes on: it asks in the later era itself."""
    keys = Keys(server, "test", f"hetcomm/ft/forks{next(_jobs)}/", seal=b"f" * 32)
    assert keys.first("era", 1) == 1
    m = Pulse(keys.clone(), "m#00000001", BEAT)
    m.hold("era", 1)
    m.member_of(1 if member else 0)
    try:
        keys.at_least("era", 2, sealed=True)
        start = m._beats
        until(lambda: m._beats >= start + 3)       # (its heartbeat read the key since)
        if member:
            with pytest.raises(RuntimeError, match="era 2 of the job began while this worker is a member of era 1"):
                m.check()
        else:
            m.check()
    finally:
        m.stop()


def test_a_whole_job_restarted_on_a_new_store_without_liveness_addresses_starts_the_next_era(server):
    """The job's workers published no liveness address (a FileStore's or HashStore's run: no
    route to find one), and the job restarts from checkpoints on a new store: no record of era 1
    is left, but the checkpoint says it took part in era 1's epoch 9 with M, whose address its
    generation gave as none. M's silence then counts, and the worker starts era 2 (before this was
    handled, it stopped with an error: M's address never read)."""
    keys = Keys(server, "test", f"hetcomm/ft/forks{next(_jobs)}/", seal=b"f" * 32)
    assert _Restarter(keys, 9, ["m#00000001"], {"m#00000001": b'""'}).era() == 2
    assert keys.peek("era") == 2


class _Churned:
    """A store client of the member's, where a store writer's write to the job's `era` key lands
    between each of the member's reads of it and its compare_set ("churned": garbage, as a writer
    who churns the key as fast as it can does, at worst), or right after each of the member's
    writes ("set-back": the old sealed value put back, the same bytes every time)."""

    def __init__(self, store, key: str, how: str, old: bytes) -> None:
        self._store, self._key, self._how, self._old, self._n = store, key, how, old, 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def clone(self):
        return _Churned(self._store.clone(), self._key, self._how, self._old)

    def compare_set(self, key, expected, desired):
        if key != self._key or desired == expected:
            return self._store.compare_set(key, expected, desired)
        if self._how == "churned":
            self._n += 1
            self._store.set(key, b"churn %d" % self._n)
        there = self._store.compare_set(key, expected, desired)
        if self._how == "set-back":
            self._store.set(key, self._old)
        return there


@pytest.mark.parametrize("how", ["churned", "set-back"])
def test_a_member_stops_where_the_era_key_is_kept_from_it(server, monkeypatch, how):
    """A store writer churns the job's `era` key, or puts its old sealed value back after every
    write, so that the members of one era never read a later one. A member stops with an error
    that says so after a few beats (before: its writes gave up quietly, or were undone, beat after
    beat). The control: a worker that is a member of no era goes on."""
    monkeypatch.setattr(Pulse, "CHURN", 3)
    root = f"hetcomm/ft/forks{next(_jobs)}/"
    seal = b"f" * 32
    assert Keys(server, "test", root, seal=seal).first("era", 1) == 1
    keys = Keys(_Churned(server, root + "era", how, server.get(root + "era")), "test", root, seal=seal)
    m, other = Pulse(keys.clone(), "m#00000001", BEAT), Pulse(keys.clone(), "o#00000001", BEAT)
    for p in (m, other):
        p.hold("era", 2)                             # (a value above the one there: it writes)
    m.member_of(2)
    try:
        def stopped() -> bool:
            try:
                m.check()
            except RuntimeError as e:
                assert "had to be put back, or could not be" in str(e), e
                return True
            return False
        until(stopped)
        other.check()
    finally:
        m.stop()
        other.stop()
