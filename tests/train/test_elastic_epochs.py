"""An epoch of an elastic run (`hetcomm.train.elastic.epochs`) against a store writer who deletes
and forges records (issue 43), on its own: a member's side of `_decide` and `_outcome_of`, the
checks of decisions and join records, over a real TCPStore with a plain client beside it as the
store writer. Each case fails on the code before its fix."""
from __future__ import annotations

import datetime
import itertools
import math

import pytest
import torch.distributed as dist

from hetcomm.train.elastic.common import _decision_ok
from hetcomm.train.elastic.epochs import Epochs
from hetcomm.train.membership import Keys

pytestmark = pytest.mark.usefixtures("backend_importable")

A, B, C = "a#0000000a", "b#0000000b", "c#0000000c"
_jobs = itertools.count()


@pytest.fixture(scope="module")
def server():
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))


@pytest.fixture(params=[False, True], ids=["plain", "sealed"])
def keys(server, request):
    return Keys(server, "test", f"hetcomm/ft/epochs{next(_jobs)}/", seal=b"e" * 32 if request.param else None)


@pytest.fixture
def sealed_keys(server):
    """Sealed records only (the pong's report is evidence only with the secret)."""
    return Keys(server, "test", f"hetcomm/ft/epochs{next(_jobs)}/", seal=b"e" * 32)


class _Pulse:
    """The heartbeat, as the decider reads it: ``dead`` are quiet, the others alive."""

    def __init__(self, dead=(), reported=0, polls=math.inf) -> None:
        self.dead, self._reported, self._polls = set(dead), reported, polls

    def reported(self, era) -> int:
        return self._reported if era == 1 else 0

    def check(self) -> None:
        self._polls -= 1
        if self._polls < 0:
            raise AssertionError("still waiting (polled too often)")

    def quiet(self, name, timeout) -> bool:
        return name in self.dead

    def silent(self, name) -> float:
        return math.inf if name in self.dead else 0.0

    def confirmed(self, name) -> bool:
        return False

    def watch(self, names) -> None:
        pass

    def linked(self, name) -> bool:
        return False

    def answered_since(self, name, since) -> bool:
        return False

    keep = watch

    def hold(self, key, value) -> None:
        pass

    def decided(self, era, epoch, digest) -> None:
        pass

    def evidence(self, name) -> bool:
        return True                                 # (its link was made once: its silence counts)

    def unanswered_since(self, name, since, grace) -> bool:
        return True


class _Member(Epochs):
    """Member ``A`` of epoch 4 (members ``prev``), arriving at epoch 5."""

    def __init__(self, keys: Keys, prev: list[str], dead=(), late_timeout: float = 600.0, reported=0,
                 polls=math.inf) -> None:
        self._keys, self._me, self.worker_id, self._era_number = keys, A, "a", 1
        self._decision = {"epoch": 4, "gen": 3, "round": 7, "members": prev, "holders": prev, "joined": [],
                          "left": {}, "refused": {}, "admitted_upto": 0, "fresh": False}
        self._pulse, self._outcome, self._gaps = _Pulse(dead, reported, polls), "commit", {}
        self._heartbeat, self._timeout, self._late_timeout, self._collective_timeout = 0.05, 1.0, late_timeout, 2.0

    def _config(self) -> dict:
        return {}

    def arrival(self) -> dict:
        return {"holds": True, "round": 7, "group": 3, "fresh": False}


@pytest.mark.parametrize("evidence", ["latest", "outcome", "pong", "pong-alive", "none"])
def test_an_epoch_decided_before_is_not_decided_again_by_a_member_left_out(keys, evidence):
    """Epoch 5 was decided without A (taken for dead) and a store writer deleted the decision
    and the arrivals: A, back, finds B silent and would decide epoch 5 with itself alone, a fork.
    With sealed records, where `latest` (kept by the members' heartbeats) or an outcome says the
    epoch was decided, A counts itself left out and writes nothing (before: it wrote [A], a
    generation of its own). So also where B, answering A's ping, said it holds epoch 5 decided
    (`Pulse.reported`; the writer deletes `latest` and the outcome as well): B silent in the
    store, or alive and missing from the epoch (its arrival deleted: before, A waited out
    `late_timeout` and decided alone). Without the secret they are a store writer's to forge (a
    forged `latest` would make every member leave an epoch nobody decides): A decides as
    before."""
    if evidence == "latest":
        keys.set("latest", 5)
    elif evidence == "outcome":
        keys.first("e5/outcome", "commit")
    reported = 5 if evidence.startswith("pong") else 0
    alive = evidence == "pong-alive"            # (sealed: it must not wait `late_timeout` out)
    member = _Member(keys, [A, B], dead=[] if alive else [B], reported=reported,
                     late_timeout=600.0 if alive and keys.sealed else 0.0 if alive else 600.0,
                     polls=20 if alive and keys.sealed else math.inf)
    decision = member._decide(5, _Member.arrival(None))
    if evidence == "none" or not keys.sealed:
        assert decision["members"] == [A] and keys.has("e5/decision"), decision
        return
    assert A not in decision["members"] and "decided without it" in decision["left"][A], decision
    assert not keys.has("e5/decision")


def test_a_member_whose_part_failed_does_not_take_the_others_commit(keys):
    """A's group formation failed in epoch 5, whose `commit` the others wrote (a store writer had
    deleted records so that A read another decision): A aborts (before: it read the commit and
    started a generation it had no group for: torch's "Default process group has not been
    initialized")."""
    keys.first("e5/outcome", "commit")
    outcome = _Member(keys, [A, B])._outcome_of({"epoch": 5, "members": [A, B]}, "RuntimeError: no group")
    assert outcome.startswith("abort") and "the others committed" in outcome, outcome
    keys.first("e6/outcome", "abort: b: gone")
    assert _Member(keys, [A, B])._outcome_of({"epoch": 6, "members": [A, B]}, "RuntimeError: x") == "abort: b: gone"


def test_late_timeout_counts_from_progress_which_a_forged_leave_cannot_undo(server):
    """B lives but never arrives; a store writer (without the secret: plain records) puts a
    `leave/` record for C and deletes it, between every two looks of the decider. Each change of
    who is missing restarted `late_timeout` (before: the epoch never decided while it went on);
    now only an arrival, or a member out for the first time, does, and B is dropped once late."""
    keys = Keys(server, "test", f"hetcomm/ft/epochs{next(_jobs)}/")    # (sealed: a forged leave is not read)

    class Toggling(_Pulse):
        looks = 0

        def check(self) -> None:                  # (once per look of the decider)
            self.looks += 1
            if self.looks > 100:
                raise RuntimeError("the epoch did not decide in 100 looks")
            if self.looks % 2:
                server.set(keys.root + f"leave/{C}", '{"why": "forged"}')
            else:
                server.delete_key(keys.root + f"leave/{C}")

    member = _Member(keys, [A, B, C], late_timeout=0.3)
    member._pulse = Toggling()
    decision = member._decide(5, _Member.arrival(None))
    assert "not at the epoch" in decision["left"][B], decision


def test_a_decision_names_incarnations_with_holders_and_joiners_among_its_members():
    ok = {"epoch": 5, "gen": 2, "round": 3, "admitted_upto": 0, "members": [A, B], "holders": [A],
          "joined": [B], "left": {}, "refused": {}}
    assert _decision_ok(ok, 5) and _decision_ok(ok)
    for bad in [{"holders": [C]}, {"joined": [C]}, {"members": [A, A]}, {"members": ["a" * 9000, B]},
                {"members": ["a#1", B]}, {"round": -1}, {"epoch": True}]:
        assert not _decision_ok({**ok, **bad}, 5), bad
    assert not _decision_ok(ok, 6)            # (put back under another epoch's key)


def test_a_join_request_naming_no_incarnation_is_not_read(keys):
    """A name of megabytes (or with no nonce) would be a key the store refuses, closing the
    reader's connection: `hb/<who>`, `refused/<who>`. Such a request is skipped (before: only
    the members' scan in DiLoCo in generations skipped it; the epoch's `_joiners` and the era's
    bootstrap read it)."""
    from hetcomm.train.elastic.joins import JoinRecords

    reader = JoinRecords()
    reader._keys, reader._gaps, reader._timeout = keys, {}, 1.0
    for i, who in enumerate(["x" * 9000 + "#00000000", "ghost", C]):
        keys.set(f"join/{i}", {"who": who, "holds": False, "round": 0, "config": {}})
    keys.at_least("joins", 3)
    regs, upto = reader._registrations(keys, 0, wait=False)
    assert [r["who"] for _, r in regs] == [C] and upto == 3


def test_a_join_request_that_is_json_but_not_a_request_is_not_read(keys):
    """JSON that is not an object (a list, a number, a string, null), or an object whose fields
    have other types: each is skipped, and the request after it read (issue 43: a record that was
    not a JSON object raised outside the handled errors on every member). With the secret a store
    writer cannot write these at all; here they are the store's values as they stand."""
    from hetcomm.train.elastic.joins import JoinRecords

    reader = JoinRecords()
    reader._keys, reader._gaps, reader._timeout = keys, {}, 1.0
    junk = [[C, False, 0], 7, "join me", None, {"who": C, "holds": "yes", "round": 0, "config": {}},
            {"who": C, "holds": False, "round": [0], "config": {}}, {"who": [C], "holds": False, "round": 0}]
    for i, value in enumerate(junk):
        keys.set(f"join/{i}", value)
    keys.set(f"join/{len(junk)}", {"who": C, "holds": False, "round": 0, "config": {}})
    keys.at_least("joins", len(junk) + 1)
    regs, upto = reader._registrations(keys, 0, wait=False)
    assert [(i, r["who"]) for i, r in regs] == [(len(junk), C)] and upto == len(junk) + 1, (regs, upto)


def test_a_refusal_names_what_differs_in_bounded_words():
    ours = {"model": "m", "settings": {"HETCOMM_TLS": ""}}
    why = Epochs._refusal({"model": ["x"] * 1_000_000, "settings": {"HETCOMM_TLS": "y" * 10_000}}, ours)
    assert why.startswith("its model is ['x', ") and "HETCOMM_TLS=" in why and len(why) <= 2003, len(why)


def test_joiners_that_never_beat_do_not_lock_a_real_one_out_of_the_watch(keys):
    """At most 256 joiners are watched between two epochs. A store writer writes 300 requests
    that match the run's configuration and never beat, then C asks: the silent ones leave the
    watch after `timeout`, and a scan that skipped requests at the cap reads on from there
    (before: the scan moved past C, which waited for an epoch some failure would bring)."""
    from hetcomm.train.elastic.run_epochs import _MAX_WAITING, RunEpochs

    class Scanner(RunEpochs, Epochs):
        rounds = 0

        def __init__(self) -> None:
            self._keys, self._gaps, self._timeout, self._heartbeat = keys, {}, 1.0, 0.01
            self._decision = {"members": [A], "admitted_upto": 0}
            self._scanned, self._waiting, self._pulse = (0, -math.inf), set(), _Pulse()

        def _config(self) -> dict:
            return {"model": "m", "settings": {}}

        def _note_waiting(self, line: str) -> None:
            self.noted = line

    forged = [f"f{i}#{i:08x}" for i in range(300)]
    for i, who in enumerate(forged + [C]):
        keys.set(f"join/{i}", {"who": who, "holds": False, "round": 0, "config": {"model": "m", "settings": {}}})
    keys.at_least("joins", len(forged) + 1)
    scanner = Scanner()
    scanner._scan()
    assert len(scanner._waiting) == _MAX_WAITING and C not in scanner._waiting and "at once" in scanner.noted
    scanner._pulse.dead = set(forged)           # (`timeout` later: they never beat)
    scanner._scanned = (scanner._scanned[0], -math.inf)
    scanner._scan()
    assert C in scanner._waiting and not scanner._waiting & set(forged[:_MAX_WAITING]), scanner._waiting


def test_no_class_of_the_elastic_run_hides_a_method_of_another_under_another_signature():
    """The run is one class of several mixins (`ElasticRun`): a method that one defines and a later
    one in the order defines again with other parameters is called with the wrong arguments (an
    `Epochs._left_out` once met `ElasticRun._left_out(inner, error)`: every member counted out of
    an epoch raised TypeError). The tests above drive `Epochs` alone and cannot see that."""
    import inspect

    from hetcomm.train.elastic.run import ElasticRun

    clashes = []
    for base in ElasticRun.__mro__[1:]:
        for name, f in vars(base).items():
            resolved = inspect.getattr_static(ElasticRun, name)
            if name == "__init__" or not inspect.isfunction(f) or resolved is f or not inspect.isfunction(resolved):
                continue
            mine = [p.name for p in inspect.signature(f).parameters.values()]
            theirs = [p.name for p in inspect.signature(resolved).parameters.values()]
            if mine != theirs:
                clashes.append(f"{base.__name__}.{name}{mine} hidden by {resolved.__qualname__}{theirs}")
    assert not clashes, clashes


class _ReportsAfter(_Pulse):
    """The heartbeat's `reported`, as it changes while A decides: from its ``after``-th look on,
    epoch 5 is reported decided; ``decide`` (a store) writes epoch 5's decision, with A, first (a
    member that decided it and then answered A's ping: normal operation)."""

    def __init__(self, after: int, dead=(), decide=None) -> None:
        super().__init__(dead)
        self.looks, self.after, self.decide = 0, after, decide

    def reported(self, era) -> int:
        self.looks += 1
        if self.looks == self.after and self.decide is not None:
            self.decide.first("e5/decision", {"epoch": 5, "gen": 3, "round": 7, "members": [A, B],
                                              "holders": [A, B], "joined": [], "left": {}, "refused": {},
                                              "admitted_upto": 0, "fresh": False})
        return 5 if self.looks >= self.after else 0


def test_a_report_that_overtakes_its_decision_takes_the_decision(sealed_keys):
    """B wrote epoch 5's decision (with A) between A's read of the store and its look at what B's
    pong said: A reads the decision once more and takes it, rather than count itself out."""
    keys = sealed_keys
    member = _Member(keys, [A, B])
    member._pulse = _ReportsAfter(1, decide=keys)
    assert member._decide(5, _Member.arrival(None))["members"] == [A, B]


def test_a_report_that_comes_while_deciding_still_counts_the_member_out(sealed_keys):
    """B (silent to A) said epoch 5 decided only after A's loop ended, and the decision is gone: A,
    about to write its own, counts itself out (`_decided_before` asks the heartbeat too)."""
    keys = sealed_keys
    member = _Member(keys, [A, B], dead=[B])
    member._pulse = _ReportsAfter(2, dead=[B])
    decision = member._decide(5, _Member.arrival(None))
    assert A not in decision["members"] and not keys.has("e5/decision"), decision


class _WokenPulse(_Pulse):
    """A's heartbeat just after A woke from a freeze inside the epoch: B's link is verified, but
    the last answer A has from it is from before the freeze (nothing reported); the answer to
    A's next ping, after ``pings`` looks, says epoch 5 is decided."""

    def __init__(self, pings: int) -> None:
        super().__init__()
        self.looks, self.pings = 0, pings

    def linked(self, name) -> bool:
        return name == B

    def answered_since(self, name, since) -> bool:
        self.looks += 1
        return self.looks >= self.pings

    def unanswered_since(self, name, since, grace) -> bool:
        return self.looks >= 5          # (the newest ping went unanswered for a heartbeat and a second)

    def reported(self, era) -> int:
        return 5 if self.looks >= self.pings else 0


def test_a_member_woken_inside_the_epoch_waits_for_a_fresh_answer_before_deciding_alone(sealed_keys):
    """A was frozen inside epoch 5 for longer than `late_timeout`; B, alive and linked, decided it
    without A meanwhile, and a store writer deleted the decision, `latest` and the outcome. On
    its first look after waking A finds B late and would decide alone: the answer it holds from
    B predates the freeze. It waits for B's answer to a ping sent after it woke, which says
    epoch 5 is decided, and counts itself out (before: a fork)."""
    member = _Member(sealed_keys, [A, B], late_timeout=0.0)
    member._heartbeat = 5.0                          # (the wait's bound: far from what it takes)
    member._pulse = _WokenPulse(pings=3)
    decision = member._decide(5, _Member.arrival(None))
    assert A not in decision["members"] and not sealed_keys.has("e5/decision"), decision
    assert member._pulse.looks >= 3


def test_a_member_that_never_answers_is_waited_for_only_so_long(sealed_keys):
    """B's connection stays open but B answers nothing (frozen itself): A waits out the bound (two
    heartbeats and a second) and decides without it, as before."""
    member = _Member(sealed_keys, [A, B], late_timeout=0.0)
    member._pulse = _WokenPulse(pings=10 ** 9)
    decision = member._decide(5, _Member.arrival(None))
    assert decision["members"] == [A] and sealed_keys.has("e5/decision"), decision
    assert member._pulse.looks >= 2
