"""The membership protocol of an elastic run: incarnations, join requests, the era's bootstrap,
admission, and each change of generation (an epoch: arrive, decide, form the group, send the
state to the members without it, commit or abort) with its events. Protocol: docs/elastic-protocol.md#an-epoch-step-by-step."""
from __future__ import annotations

import hashlib
import math
import time
import uuid
from collections.abc import Sequence

from hetcomm import hosts as _hosts
from hetcomm.train.elastic.common import (_PREFIX, _MAX_ABORTS, _Poll, _decision_ok, _digest, _next_decided,
                                          _read_decision, _read_ended, _read_int, _start_epoch)
from hetcomm.train.elastic.eras import Eras
from hetcomm.train.elastic.forks import ForkGuards
from hetcomm.train.elastic.joins import JoinRecords
from hetcomm.train.membership import Keys, SecretMismatch, StoreUnreachable
from hetcomm.train.pulse import Pulse


def _checked_decision(keys: Keys, epoch: int, proposal: dict) -> dict:
    """The epoch's decision: ours if we are the first to write one, else the one there. One
    that is malformed (a store writer's, without an out-of-band secret) raises, naming the key."""
    decision = keys.first(f"e{epoch}/decision", proposal)
    if not _decision_ok(decision, epoch):
        raise ValueError(f"{_PREFIX}: the store value {keys.root}e{epoch}/decision is not a decision (someone "
                         "else wrote it; HETCOMM_SECRET seals the run's records)")
    return decision


def _first_outcome(keys: Keys, epoch: int, outcome: str) -> str:
    result = keys.first(f"e{epoch}/outcome", outcome)
    if not isinstance(result, str):
        raise ValueError(f"{_PREFIX}: the store value {keys.root}e{epoch}/outcome is not an outcome (someone else "
                         "wrote it; HETCOMM_SECRET seals the run's records)")
    return result

class _Rewrite:
    """Writes a worker's own record now, and again every ``every`` seconds while it waits (a
    store writer may delete it; every poll would cost a store round trip each time)."""

    def __init__(self, keys: Keys, key: str, value, every: float) -> None:
        self.keys, self.key, self.value, self.every, self.last = keys, key, value, every, -math.inf

    def __call__(self) -> None:
        if time.monotonic() - self.last >= self.every:
            self.keys.set(self.key, self.value)
            self.last = time.monotonic()

class Epochs(JoinRecords, Eras, ForkGuards):
    """Admission and the epochs between generations."""

    _left_by: list[str] | None = None     # the members of the epoch that left this worker out

    # ---- membership --------------------------------------------------------------------------

    def _new_incarnation(self) -> None:
        """A dropped worker joins again as a new incarnation: the others may have marked the old
        one dead, and must not mistake it for a member."""
        self._pulse.stop()
        self._me = f"{self.worker_id}#{uuid.uuid4().hex[:8]}"
        self._pulse = Pulse(self._job_keys.clone(), self._me, self._heartbeat, memory=self._pulse.memory())
        self._pulse.hold("era", self._era_number)

    def _admit(self, resume: tuple[int, int] | None = None) -> None:
        """Asks to join (or, with ``resume``, goes on waiting on the request it made: its join
        index and the next epoch to read) and waits for a decision that admits this worker; then
        takes part in epochs until one commits (this worker then holds the global state). Asks
        again in a later era when its era's members are all gone and a later era began."""
        while self._admit_in_era(resume):
            resume = None

    def _admit_in_era(self, resume: tuple[int, int] | None) -> bool:
        """`_admit` in this worker's era: True when it moved to a later era (ask there)."""
        keys = self._keys
        begin = time.perf_counter()
        if resume is None:
            index = self._register()
            epoch = _start_epoch(keys, self._dropped_at + 1)
        else:
            index, epoch = resume
        # The era's first decision is written by a waiting worker only while nothing says the
        # era started (a store writer who deleted its first decisions must not fork it).
        # (nor where this worker's checkpoint was taken in the era: its records are then gone)
        started = resume is not None or self._dropped_at > 0 or _read_decision(keys, epoch) is not None \
            or (self._checkpoint and getattr(self, "_position", {}).get("era") == self._era_number)
        # A worker left out of an epoch watches the members that went on without it until a
        # decision names others: if they all die before one admits it, the run's state is gone,
        # and it raises (below) instead of waiting for a decision nobody will write.
        watched, self._left_by = (self._left_by or None) if resume is None else None, None
        if watched:
            self._pulse.watch(watched)
        poll, kept, looked = _Poll(), -math.inf, -math.inf
        while True:
            self._pulse.check()
            self._raise_if_refused(keys)
            if time.monotonic() - kept >= self._heartbeat:
                self._keep_request(index)
                kept = time.monotonic()
            ended = _read_ended(keys)
            if ended is not None:
                self._stopped, self._stop_reason = True, f"the run ended at round {ended['round']} ({ended['reason']})"
                self._joined = True
                self._count("idle", begin)
                return False
            decision = _read_decision(keys, epoch)
            if decision is not None:
                started = True
                if self._me in decision.get("refused", {}):
                    raise ValueError(f"{_PREFIX}: this worker cannot join run {self.job!r}: "
                                     f"{str(decision['refused'][self._me])[:2000]}")
                self._pulse.watch(decision["members"])
                if self._me in decision["members"]:
                    self._count("idle", begin)
                    self._phases.begin("decision that admits it")
                    if self._synchronise(admitted=decision):
                        return False
                    self._event({"round": decision["round"], "worker": self.worker_id,
                                 "dropped": f"while being admitted: {self._dropped_why}"},
                                f"dropped while being admitted ({self._dropped_why}): asking again")
                    self._holds = False            # (a decision named it: it holds nothing now)
                    self._destroy_group()
                    self._new_incarnation()
                    index, begin = self._register(), time.perf_counter()
                    epoch = _start_epoch(keys, epoch)
                    continue
                if decision["admitted_upto"] > index:
                    # passed over (thought dead when the decision was taken), or refused in an
                    # earlier decision than this one: ask again unless refused
                    self._raise_if_refused(keys)
                    self._new_incarnation()
                    index = self._register(decision["admitted_upto"])
                epoch += 1
                watched = decision["members"]
                self._pulse.watch(watched)
                self._pulse.keep(watched)
                continue
            if time.monotonic() - looked >= self._heartbeat:
                looked = time.monotonic()
                later = _next_decided(keys, epoch)
                if later != epoch:
                    epoch = later                # decisions deleted (a store writer): read on
                    continue
                there = None if started else _read_int(self._job_keys, "era")
                if there is not None and there > self._era_number and self._begun(there):
                    # A later era began while this worker waited in one that has not (a worker
                    # restarted from a checkpoint started it: on a new store, the key said 1 first;
                    # not a later era a store writer put back from an earlier run: none began it).
                    self._move_to_era(self._newest_era(there))
                    return True
            if epoch == 1 and not started and keys.peek_bytes("echo") is None:
                # (a member's heartbeat keeps `echo` in an era that began: a store writer who
                # deleted its decisions and `latest` must not make this worker start it again)
                self._bootstrap(keys)
            elif watched and all(self._pulse.quiet(m, self._timeout) for m in watched):
                if self._newest_era(self._era_number) > self._era_number:
                    # A later era began (a store writer had set the `era` key back): ask there.
                    self._move_to_era(self._newest_era(self._era_number))
                    return True
                raise RuntimeError(f"{_PREFIX}: every member of epoch {epoch - 1} ({self._names(watched)}) is gone, "
                                   "and the run's state with them: restart the job from checkpoints (load_state_dict)")
            poll()

    def _move_to_era(self, era: int) -> None:
        """Leaves this worker's era for ``era`` (a later one), as a new incarnation."""
        self._era_number = era
        self._pulse.hold("era", self._era_number)
        self._keys = self._job_keys.under(f"era{self._era_number}")
        self._dropped_at = 0                             # (an epoch of the other era)
        self._new_incarnation()

    def _config(self) -> dict:
        """What a worker must share with the run to be admitted: the model's layout, the outer
        optimizer, the weighting, the compression, the backend and (for hetcomm) the settings
        every rank of a group must agree on."""
        # (the model's: a run with sharded state keeps pieces of its tensors)
        shapes = ";".join(",".join(map(str, p.shape)) for p in self._params)
        return {"model": f"{len(self._params)} tensors, {sum(p.numel() for p in self._params)} elements in "
                         f"{str(self._master).removeprefix('torch.')}, shapes "
                         f"{hashlib.sha256(shapes.encode()).hexdigest()[:12]}",
                "outer optimizer": type(self.outer_optimizer).__name__, "weighting": self.weighting,
                "compression": self._codec_name, "backend": self._backend,
                # how the state travels to a joiner (generation._transfer): raw bytes per dtype; the
                # rows of the epoch's table (2: since the epochs of DiLoCo in generations only);
                # the liveness answers (3: with the era, the epoch held decided and its decision's digest, 12-06)
                "state transfer": 2, "epoch table": 2, "liveness answers": 3,
                "settings": _hosts.environment_settings() if "hetcomm" in str(self._backend) else {}}

    @staticmethod
    def _refusal(theirs, ours: dict) -> str | None:
        """Why a worker that registered ``theirs`` (its `_config`) cannot be admitted into a run
        whose members have ``ours`` (None: it can)."""
        if not isinstance(theirs, dict) or not all(k in theirs for k in ours) or \
                not isinstance(theirs["settings"], dict):
            return "its join request does not describe its configuration (another version of hetcomm?)"
        if set(theirs) - set(ours):
            extra = [str(k)[:64] for k in sorted(set(theirs) - set(ours))[:8]]
            return f"its join request describes settings this run does not have ({extra}): another version of hetcomm?"
        def short(value) -> str:         # (a join request is a store writer's to forge: bounded)
            text = repr(value)
            return text if len(text) <= 200 else text[:200] + "..."
        problems = [f"its {k} is {short(theirs[k])}, the run's {short(ours[k])}" for k in ours
                    if k != "settings" and theirs[k] != ours[k]]
        for name in sorted(set(ours["settings"]) | set(theirs["settings"]))[:64]:
            value, other = ours["settings"].get(name, ""), theirs["settings"].get(name, "")
            if other != value:
                problems.append(f"it was started with {str(name)[:64]}={short(other)}, the run's workers with "
                                f"{str(name)[:64]}={short(value)}")
        why = "; ".join(problems)
        return (why if len(why) <= 2000 else why[:1997] + "...") or None

    def _refuse(self, keys: Keys, who: str, why: str) -> None:
        """Tells a joiner at once that it is refused (it also reads it in the next decision)."""
        try:
            keys.first(f"refused/{who}", why)
        except SecretMismatch:
            raise
        except ValueError:                       # a store writer's value there: the decision tells
            pass

    def _note_waiting(self, line: str) -> None:
        if line != getattr(self, "_last_wait_note", None):
            self._last_wait_note = line
            self._log(line)

    def _raise_if_refused(self, keys: Keys) -> None:
        try:
            why = keys.peek(f"refused/{self._me}")
        except ValueError:
            return
        if why is not None:
            raise ValueError(f"{_PREFIX}: this worker cannot join run {self.job!r}: {str(why)[:2000]}")

    def _bootstrap(self, keys: Keys) -> None:
        """The first decision of an era: once ``min_workers`` asked to join, they are its members
        (sorted by worker id: a deterministic order of ranks), the holders of the latest
        checkpoint its holders (else the first of them, whose fresh model everyone starts from).
        The run's configuration is the holders' (else the one most of them share, ties to the
        first): one whose configuration differs is refused."""
        # (Gaps are not waited for: a store writer adding to the counter must not hold the start
        # forever. A worker whose request lands after this decision is passed over: it asks again.)
        found, count = self._registrations(keys, 0, wait=False)
        self._pulse.watch([r["who"] for _, r in found])
        regs = []
        for _, r in found:
            if self._pulse.confirmed(r["who"]):
                regs.append(r)
            elif self._pulse.silent(r["who"]) <= self._timeout:
                return                               # not known to live yet (nor to be dead): wait
        regs.sort(key=lambda r: r["who"])
        latest = max((r["round"] for r in regs if r["holds"]), default=None)
        refused: dict[str, str] = {}
        if regs:
            configs = [r.get("config") for r in regs]
            held = next((r.get("config") for r in regs if r["holds"] and r["round"] == latest), None)
            reference = held or max(configs, key=lambda c: (configs.count(c), -configs.index(c)))
            if isinstance(reference, dict) and isinstance(reference.get("settings"), dict):
                refused = {r["who"]: why for r in regs if (why := self._refusal(r.get("config"), reference))}
            regs = [r for r in regs if r["who"] not in refused]
        if len(regs) < self._min_workers:
            if refused:                              # refusals bind only with the decision: say why it waits
                self._note_waiting(f"waiting for min_workers={self._min_workers} workers whose configuration "
                                   f"agrees: {len(regs)} so far; " + "; ".join(
                                       f"{self._names([w])} differs ({why})" for w, why in refused.items()))
            return
        members = [r["who"] for r in regs]
        holders = [r["who"] for r in regs if r["holds"] and r["round"] == latest] or members[:1]
        decision = _checked_decision(keys, 1, {"epoch": 1, "gen": 1, "round": latest or 0, "members": members,
                                              "holders": holders, "left": {}, "joined": members,
                                              "refused": dict(list(refused.items())[:64]), "admitted_upto": count,
                                              "fresh": latest is None})
        for who, why in decision.get("refused", {}).items():
            self._refuse(keys, who, why)
        self._set_latest(keys, 1, decision)

    def _decide(self, epoch: int, arrival: dict) -> dict:
        """Waits until every member of the last epoch arrived at ``epoch`` or is out; the first to
        see it writes the decision; returns the decision (everyone's)."""
        keys, prev = self._keys, self._decision
        members = prev["members"]
        arrivals: dict[str, dict] = {}
        poll, progress, since, ever_out, unreached_since = _Poll(), -1, time.perf_counter(), set(), None
        rewrite = _Rewrite(keys, f"e{epoch}/arrive/{self._me}", arrival, self._heartbeat)
        while True:
            self._pulse.check()
            rewrite()                             # (a store writer may delete it)
            decision = _read_decision(keys, epoch)
            if decision is not None:
                return decision
            if keys.sealed and self._pulse.reported(self._era_number) >= epoch:
                # A worker that answered this one's ping holds the epoch decided. A decider writes
                # the decision before it holds the epoch, so the decision was in the store before
                # the answer: read once more (`_decided_without_me`), and if it is gone, deleted.
                return self._decided_without_me(keys, epoch, {**prev, "epoch": epoch, "joined": [], "refused": {}})
            for m in members:
                if m not in arrivals:
                    theirs = self._peek_dict(keys, f"e{epoch}/arrive/{m}")
                    if theirs is not None and isinstance(theirs.get("holds"), bool) \
                            and isinstance(theirs.get("round"), int):
                        arrivals[m] = theirs
            out: dict[str, str] = {}
            for m in members:
                if m in arrivals:
                    continue
                leave = self._peek_dict(keys, f"leave/{m}")
                if leave is not None:
                    out[m] = "left: " + str(leave.get("why", "its data ended"))[:300]
                elif self._pulse.quiet(m, self._timeout):     # (its link's answers outweigh the store)
                    out[m] = self._why_gone(m)
            missing = [m for m in members if m not in arrivals and m not in out]
            # `late_timeout` counts from the last progress: an arrival, or a member out for the
            # first time (not any change: a store writer toggling a forged `leave/` record must
            # not hold the epoch forever)
            ever_out.update(out)
            if len(arrivals) + len(ever_out) != progress:
                progress, since = len(arrivals) + len(ever_out), time.perf_counter()
            if missing and time.perf_counter() - since > self._late_timeout:
                out.update({m: f"not at the epoch {self._late_timeout:.0f} s after the others"
                            for m in missing})
                missing = []
            if keys.sealed:
                # Only a member whose silence can count (`Pulse.evidence`: linked once, dead, or
                # without an address) is left out for its silence or lateness
                # (else a store writer who keeps the addresses deleted, the counters held back and
                # the arrivals deleted has two sets of members each decide alone: a fork). Waited
                # for a while, then an error (`_unreached`).
                unreached = [m for m in out if not out[m].startswith("left: ") and not self._pulse.evidence(m)]
                unreached_since = (unreached_since or time.perf_counter()) if unreached else None
                if unreached:
                    self._unreached(epoch, unreached, time.perf_counter() - unreached_since)
                    missing = unreached
            if not missing:
                joiners, refused, upto, pending = self._joiners(keys, prev, [m for m in members if m in arrivals])
                if not pending:
                    break
            poll()
        continuing = [m for m in members if m in arrivals]
        holders = [m for m in continuing if arrivals[m]["holds"]]
        # Nothing committed yet in an era that started from fresh models: everyone's model is as
        # good as the first holder's was. Anywhere else an empty list of holders is an error.
        fresh = bool(prev.get("fresh")) and self._outcome != "commit"
        if not holders and continuing and fresh and all(arrivals[m].get("fresh") for m in continuing):
            holders = continuing[:1]
        holders = self._latest_holders(holders, arrivals)
        rounds = {arrivals[m]["round"] for m in holders} or {max(arrivals[m]["round"] for m in continuing)}
        if len(rounds) > 1:
            raise RuntimeError(f"{_PREFIX}: epoch {epoch}: members arrived at different rounds {sorted(rounds)} "
                               "(a bug: please report it)")
        rnd = rounds.pop()
        new_members = continuing + joiners
        # A new group also when a member no longer has the last one (it destroyed it after a
        # failure that the others did not see).
        changed = new_members != members or self._outcome != "commit" or \
            any(arrivals[m].get("group") != prev["gen"] for m in continuing)
        decision = {"epoch": epoch, "gen": prev["gen"] + (1 if changed else 0), "round": rnd,
                    "members": new_members, "holders": holders,
                    "left": out, "joined": joiners, "refused": refused, "admitted_upto": upto, "fresh": fresh}
        if keys.sealed:
            # A member about to be left out that is linked may have decided this epoch while this
            # worker was frozen (it counted this one out): its answer to a ping sent from now on
            # says so, where one from before the freeze could not.
            self._await_fresh_answers([m for m in members if m not in continuing and m != self._me])
        if keys.sealed and self._decided_before(keys, epoch):
            # The epoch was decided (`latest` is past it, it has an outcome, or a member's answer
            # says so) and its decision is gone: a store writer deleted it, perhaps with this worker's arrival or others'.
            # Deciding it again could fork the run (two sets of members, each in a generation of
            # its own): this worker counts itself left out, and joins again. (Sealed records
            # only: without the secret a store writer forges decisions anyway, and a forged
            # `latest` would make every member leave an epoch nobody decides.)
            return self._decided_without_me(keys, epoch, decision)
        decision = _checked_decision(keys, epoch, decision)
        self._set_latest(keys, epoch, decision)
        return decision

    def _set_latest(self, keys: Keys, epoch: int, decision: dict) -> None:
        """Writes ``latest``, and keeps it there (every heartbeat puts it back: a store writer who
        deletes it must not make a new worker take the era for unstarted); the liveness answers
        say from now on that this worker holds ``decision``."""
        keys.set("latest", epoch)
        self._pulse.decided(self._era_number, epoch, _digest(decision))

    def _arrival(self) -> dict:
        """What this worker says of itself when it arrives at an epoch."""
        return {"holds": self._holds, "round": self._round, "group": self._gen,
                "fresh": not self._checkpoint and self._round == 0 and not self._history}

    def _latest_holders(self, holders: list[str], arrivals: dict[str, dict]) -> list[str]:
        """The holders whose state the epoch carries on (every holder arrives at the same round
        here; `hetcomm.train.elastic.run` picks the most advanced)."""
        return holders

    def _joiners(self, keys: Keys, prev: dict,
                 continuing: list[str]) -> tuple[list[str], dict[str, str], int, bool]:
        """The workers that asked to join and have shown they live, those refused (why: another
        model, compression or hetcomm settings than the run's: they stop, the run goes on), the
        join index after them, and whether to wait a moment for one that asked just now (it had
        no time to show it lives). One not known to live after that waits for the next decision
        (with those after it); one silent for ``timeout`` is passed over (if alive, it asks again)."""
        regs, upto = self._registrations(keys, prev["admitted_upto"])
        ours = self._config()
        self._pulse.watch([r["who"] for _, r in regs if self._refusal(r.get("config"), ours) is None])
        joiners: list[str] = []
        refused: dict[str, str] = {}
        for index, r in regs:
            who = r["who"]
            if who in continuing or who in joiners or who in refused or keys.has(f"leave/{who}"):
                continue
            why = self._refusal(r.get("config"), ours)
            if why:
                self._refuse(keys, who, why)
                if len(refused) < 64:              # (the decision carries them: bounded)
                    refused[who] = why
            elif self._pulse.confirmed(who):
                joiners.append(who)
            elif self._pulse.silent(who) <= self._timeout:
                if self._pulse.silent(who) <= 2 * self._heartbeat + 0.5:
                    return joiners, refused, index, True
                return joiners, refused, index, False
        return joiners, refused, upto, False

    def _synchronise(self, admitted: dict | None = None) -> bool:
        """Epochs until one commits (True) or a decision leaves this worker out (False)."""
        while True:
            if admitted is None:
                begin = time.perf_counter()
                epoch = self._decision["epoch"] + 1
                decision = self._decide(epoch, self._arrival())
                self._count("idle", begin)
                self._phases.mark("epoch")
                if self._me not in decision["members"]:
                    self._dropped_why = decision["left"].get(self._me, "arrived after the decision")
                    self._left_by = [m for m in decision["members"] or self._decision["members"] if m != self._me]
                    self._decision, self._dropped_at = None, decision["epoch"]
                    self._pulse.member_of(0)             # (no longer answers for the era)
                    return False
            else:
                decision, admitted = admitted, None
            if self._attempt(decision, self._column()):
                return True

    def _attempt(self, decision: dict, column: list[float]) -> bool:
        # A member (every way in goes through here): it answers probes for the era and keeps
        # `latest` there (a store writer who deletes it must not make the era look unstarted).
        self._pulse.member_of(self._era_number)
        self._pulse.decided(self._era_number, decision["epoch"], _digest(decision))
        if self._keys.sealed:
            self._check_no_rival(decision)
        self._pulse.watch(decision["members"])
        self._pulse.keep(decision["members"])
        self._scanned = (decision["admitted_upto"], 0.0)     # watch the pending joiners again
        # The decision says who holds the state: a worker that loaded a checkpoint but is not
        # named (the run is past it) holds nothing until its transfer lands and a round commits.
        self._holds = self._me in decision["holders"]
        self._note_membership(decision)
        begin = time.perf_counter()
        if not decision["holders"]:
            raise RuntimeError(f"{_PREFIX}: round {decision['round']}: no member of epoch {decision['epoch']} "
                               "holds the run's state (every worker that did is gone): restart from checkpoints")
        failure = None
        try:
            if decision["gen"] != self._gen:
                self._form_group(decision)
                self._phases.mark("group")
            if set(decision["holders"]) != set(decision["members"]):
                self._transfer(decision)
            self._check_table(decision, column)
        except StoreUnreachable:
            raise
        except ValueError:
            raise                                     # the same on every member: not a link failure
        except RuntimeError as e:
            failure = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        self._count("sync", begin)
        begin = time.perf_counter()
        outcome = self._outcome_of(decision, failure)
        self._count("idle", begin)
        self._phases.mark("commit")
        self._decision, self._outcome = decision, "commit" if outcome == "commit" else "abort"
        if outcome != "commit":
            self._event({"round": decision["round"], "epoch": decision["epoch"], "generation": decision["gen"],
                         "aborted": outcome.removeprefix("abort: ")},
                        f"round {decision['round']}: epoch {decision['epoch']} failed ({outcome.removeprefix('abort: ')}); "
                        "nothing applied, it is redone")
            self._destroy_group()
            members = tuple(decision["members"])
            self._aborts = (self._aborts if self._aborts and self._aborts[-1] == members else []) + [members]
            if len(self._aborts) >= _MAX_ABORTS:
                raise RuntimeError(f"{_PREFIX}: round {decision['round']}: the epoch failed {len(self._aborts)} "
                                   f"times in a row with the same members ({self._names(decision['members'])}); the "
                                   f"last: {outcome.removeprefix('abort: ')}")
            return False
        self._aborts = []
        self._committed = decision                    # (a checkpoint's position: `checkpoint.save`)
        begin = time.perf_counter()
        self._apply(decision)
        self._count("sync", begin)
        return True

    def _outcome_of(self, decision: dict, failure: str | None) -> str:
        """Two-phase end of an epoch: ``commit`` once every member is done, else ``abort: why``."""
        keys, epoch, members = self._keys, decision["epoch"], decision["members"]
        if failure is not None:
            outcome = _first_outcome(keys, epoch, f"abort: {self.worker_id}: {failure}")
            if outcome == "commit":
                # (the others committed without this worker's part: a store writer deleted records
                # they had read; it must not start a generation it has no group for)
                return f"abort: {self.worker_id}: {failure} (in an epoch the others committed)"
            return outcome
        poll, deadline, done = _Poll(), time.monotonic() + self._collective_timeout, set()
        # a sealed record each, not a counter (see Keys); written again now and then: a store
        # writer may delete it
        rewrite = _Rewrite(keys, f"e{epoch}/done/{self._me}", 1, self._heartbeat)
        while True:
            self._pulse.check()
            rewrite()
            if time.monotonic() > deadline:
                return _first_outcome(keys, epoch, f"abort: no outcome within collective_timeout="
                                  f"{self._collective_timeout:.0f} s (records on the store deleted?)")
            try:
                outcome = keys.peek(f"e{epoch}/outcome")
            except ValueError:
                outcome = None
            if isinstance(outcome, str) and (outcome == "commit" or outcome.startswith("abort")):
                return outcome
            done.update(m for m in members if m not in done and keys.has(f"e{epoch}/done/{m}"))
            if len(done) == len(members):
                return _first_outcome(keys, epoch, "commit")
            gone = [m for m in members if self._pulse.quiet(m, self._timeout)]
            if gone:
                return _first_outcome(keys, epoch, "abort: " + "; ".join(
                    f"{self._names([m])} gone during the epoch ({self._why_gone(m)})" for m in gone))
            poll()

    @staticmethod
    def _peek_dict(keys: Keys, key: str) -> dict | None:
        """A record (a JSON object) at ``key``, or None when there is none (or anything else)."""
        try:
            value = keys.peek(key)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _why_gone(self, member: str) -> str:
        silent = self._pulse.silent(member)
        return "its process exited" if math.isinf(silent) else f"no heartbeat for {silent:.1f} s"

    def _note_membership(self, decision: dict) -> None:
        refused = decision.get("refused", {})
        if not decision["left"] and not decision["joined"] and not refused:
            return
        names = self._names
        parts = [f"{names([m])} left ({why})" for m, why in decision["left"].items()]
        if decision["joined"]:
            parts.append(f"{names(decision['joined'])} joined")
        parts += [f"{names([m])} refused ({why})" for m, why in refused.items()]
        record = {"round": decision["round"], "epoch": decision["epoch"], "generation": decision["gen"],
                  "left": {names([m]): why for m, why in decision["left"].items()},
                  "joined": [names([m]) for m in decision["joined"]],
                  "members": [names([m]) for m in decision["members"]]}
        if refused:
            record["refused"] = {names([m]): why for m, why in refused.items()}
        self._event(record,
                    f"round {decision['round']}: " + "; ".join(parts) +
                    f"; members {names(decision['members'])} (generation {decision['gen']})")

    def _event(self, record: dict, line: str) -> None:
        if record in self._events:           # a joiner received the earlier ones already
            return
        self._events.append(record)
        now = time.perf_counter()
        self._timeline.append(("membership", now, now))
        self._log(line)

    def _log(self, line: str) -> None:
        if self._verbose:
            print(f"{_PREFIX} [{self.worker_id}]: {line}", flush=True)

    @staticmethod
    def _names(members: Sequence[str]) -> str:
        return ",".join(m.split("#")[0] for m in members)
