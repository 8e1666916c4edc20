"""How a worker of DiLoCo in generations (`hetcomm.train.elastic.run`) takes part in the epochs of
`hetcomm.train.elastic.epochs`: what it says when it arrives, which holders
the epoch names, when it asks to end a generation, which join requests it watches, and the
transfer of the state to joiners that the generation's background may take over (`handover`)."""
from __future__ import annotations

import time

from hetcomm.train.elastic import handover, sharded
from hetcomm.train.elastic.common import INCARNATION

_MAX_REFUSALS = 256              # refusals recorded in `membership` (join records are a store writer's to forge)
_MAX_WAITING = 256               # joiners watched between two epochs (the same)


class RunEpochs:
    """The epoch hooks of `ElasticRun` (a mixin before `ElasticBase`)."""

    def _config(self) -> dict:
        # One entry per DiLoCo option, so that a refusal names the one that differs (not `pace`:
        # it changes when a rank's bytes leave, not what the members compute)
        options = {k: v for k, v in self._options.items() if k != "pace"}
        return {**super()._config(), **{f"DiLoCo's {k}": repr(v)
                                        for k, v in sorted({**options, "shard_state": self._sharded}.items())}}

    def _attempt(self, decision: dict, column: list[float]) -> bool:
        self._state_deferred = None
        return super()._attempt(decision, column)

    def _new_incarnation(self) -> None:
        self._state_deferred = None                # (dropped: a deferred transfer is not ours)
        super()._new_incarnation()

    def _transfer(self, decision: dict) -> None:
        if self._sharded:                          # (the shares move when the generation starts)
            sharded.send_meta(self, decision)
            return
        if handover.deferred(self, decision):
            self._state_deferred = decision        # sent once the generation runs (`handover`)
            return
        super()._transfer(decision)

    def _apply(self, decision: dict) -> None:
        super()._apply(decision)
        if (self._state_deferred is not None or self._sharded) and self._me not in decision["holders"]:
            self._holds = False                    # until its state has landed (`handover`, `sharded.load`)

    def _epoch_print(self) -> float:
        return 0.0 if self._sharded else super()._epoch_print()    # (shares: compared in `sharded.load`)

    def _load_global(self) -> None:
        if self._share == (1, 0):                  # (a share is loaded into the model by `sharded.load`)
            super()._load_global()

    def _arrival(self) -> dict:
        return {**super()._arrival(), "applied": self._applied_total}

    def _latest_holders(self, holders: list[str], arrivals: dict[str, dict]) -> list[str]:
        """The holders that applied the most outer steps (a failure inside a reduction may leave
        some one step ahead: they hold the state every member carries on from). An arrival whose
        count is not a non-negative int counts as none (`_build` checks the decision's round
        against what the holders hold, over the group)."""
        def applied(m: str) -> int:
            v = arrivals[m].get("applied")
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else -1
        best = max((applied(m) for m in holders), default=-1)
        return [m for m in holders if applied(m) == best] or holders

    def _wants_reform(self) -> int:
        """2: this worker leaves (its last round is reduced); 1: workers wait to join (the round goes
        on with them, `DiLoCo._agree_on_reform`); 0: neither."""
        if self._leaving:
            return 2
        return 1 if any(self._pulse.confirmed(w) for w in self._waiting) else 0

    def _scan(self) -> None:
        """Every half second (or heartbeat): the workers that asked to join since the last epoch
        (refused at once when their configuration is not the run's; watched otherwise). A
        request that names a member, one that left, or no incarnation is not a joiner; a
        malformed record is skipped (a store writer must not end generations at will, nor crash
        the members)."""
        now = time.monotonic()
        if self._decision is None or now - self._scanned[1] < min(self._heartbeat, 0.5):
            return
        try:
            regs, upto = self._registrations(self._keys, max(self._scanned[0], self._decision["admitted_upto"]))
        except (ValueError, TypeError, AttributeError, KeyError) as e:
            self._note_waiting(f"a join request on the store is malformed ({type(e).__name__}): not read")
            self._scanned = (self._scanned[0], now)
            return
        ours, members = self._config(), set(self._decision["members"])
        gone = [w for w in self._waiting if self._pulse.silent(w) > self._timeout]
        if gone:                           # (never beat, or stopped: the watch is for the living)
            self._waiting.difference_update(gone)
            self._pulse.keep(members | self._waiting)
        for index, r in regs:
            who = r.get("who") if isinstance(r, dict) else None
            if not isinstance(who, str) or not INCARNATION.fullmatch(who) or who in members \
                    or self._keys.has(f"leave/{who}"):
                continue
            why = self._refusal(r.get("config"), ours)
            if why:
                self._refuse(self._keys, who, why)
                # (no epoch follows a refusal here, whose decision would record it: recorded now,
                # once per joiner, and at most _MAX_REFUSALS of them)
                seen = self.__dict__.setdefault("_refusals_seen", set())
                if who not in seen and len(seen) < _MAX_REFUSALS:
                    seen.add(who)
                    self._event({"round": self.rounds, "refused": {who: why}},
                                f"round {self.rounds}: {self._names([who])} refused ({why})")
            elif len(self._waiting) < _MAX_WAITING:
                self._waiting.add(who)
            else:                  # (each one watched costs the heartbeat a store round trip a beat)
                self._note_waiting(f"more than {_MAX_WAITING} workers ask to join at once: the others are read "
                                   "once some of them are admitted or silent")
                upto = index       # (read again from here)
                break
        self._pulse.watch(sorted(self._waiting))
        self._scanned = (upto, now)
