"""Eras of an elastic run: the job's `era` key, and whether the era it names is alive. A whole
job restarted from checkpoints finds the last era's members gone and starts the next era; a store
writer may set the key back, delete the records that show an era began, or replay the members'
heartbeats, and must not send a worker to a dead era, make it fork a live one, or hold it for
ever."""
from __future__ import annotations

import collections
import math
import random
import time
import uuid

from hetcomm.train.elastic.common import (_PREFIX, _Poll, _last_decided, _next_decided, _read_decision,
                                          _read_ended, _read_int, _start_epoch)
from hetcomm.train.membership import Keys, SecretMismatch
from hetcomm.train.pulse import PROBE_SLOTS

_MAX_ERAS_AHEAD = 64         # later eras a worker reads on to from the `era` key (a store writer set it back)
_FIRST_REQUESTS = 8          # join requests at the start of an era that show it has begun


class Eras:
    """The era lookup (a mixin of `ElasticBase`, whose ``_job_keys``, ``_checkpoint``,
    ``_pulse``, ``_timeout``, ``_heartbeat``, ``_round``, ``job``, ``_log`` and ``_names`` it
    uses)."""

    def _era(self) -> int:
        """The job's current era (1 at the first start). A worker that loaded a checkpoint and
        finds the era's last members all silent starts the next one (a whole-job restart)."""
        era = self._job_keys.first("era", 1)
        if not isinstance(era, int) or isinstance(era, bool) or era < 1:
            raise ValueError(f"{_PREFIX}: the store value {self._job_keys.root}era is not an era number "
                             "(someone else wrote it)")
        position = getattr(self, "_position", {}) if self._checkpoint else {}
        # (a checkpoint of a later era than the key says: a store writer set it back, or deleted it)
        era = self._newest_era(max(era, position.get("era", 0)))
        if not self._checkpoint:
            return era
        keys = self._job_keys.under(f"era{era}")
        # The newest decision: from `latest` (it may lag behind, or be an old value put back) on,
        # past decisions a store writer deleted.
        last = _read_decision(keys, _last_decided(keys, _start_epoch(keys, 1)))
        if position.get("era") == era and (last is None or last["epoch"] < position["epoch"]):
            # The store shows no decision as new as the one this worker took part in: it lost them
            # (a new store), or a store writer deleted them. Judge by the checkpoint's.
            last = {"epoch": position["epoch"], "members": position["members"]}
        if last is None:
            return era
        if _read_ended(keys) is None and self._era_alive(era, keys, last):
            return era                               # join it
        # (not a swap from `era`: a store writer may have set the key back; if another worker
        # started the next era, or a later one, first, this one joins it)
        self._job_keys.at_least("era", era + 1, sealed=True)
        there = _read_int(self._job_keys, "era")
        dead, era = era, self._newest_era(max(era + 1, there or 0))
        self._log(f"era {dead} of job {self.job!r} has no live worker: this worker (checkpoint at round "
                  f"{self._round}) starts or joins era {era}")
        return era

    def _era_alive(self, era: int, keys: Keys, last: dict) -> bool:
        """Whether the era whose newest decision found is ``last`` is alive: a later decision
        appears, a member of it answers on its liveness connection, or any member of the era
        (whoever: a store writer may have deleted the decisions that name the live ones) echoes
        this worker's fresh `probe` under ``era<n>/echo`` (a heartbeat a store writer replays
        cannot), or a worker the checkpoint knows says it is a member of the era. False once
        ``last``'s members have all been silent for ``timeout`` (with a secret: each at an address
        read, `Pulse.reached`) and no member answered for two heartbeats; a RuntimeError when
        that cannot be told for longer than a live member takes to answer (someone replays their
        heartbeats or keeps their addresses deleted: neither starting a new era, which would fork
        a live one, nor waiting for ever)."""
        members, slot, sent = last["members"], random.randrange(PROBE_SLOTS), collections.deque(maxlen=64)
        # Also the workers the checkpoint knows (their addresses from its generations): one that
        # answers that it is a member of the era (sealed) shows it lives, wherever the store's
        # decisions stop.
        known = [m for m in getattr(self, "_liveness", {}) if m not in members][:64]
        self._pulse.watch(list(members) + known)
        poll, start, asked = _Poll(), time.monotonic(), -math.inf
        while True:
            self._pulse.check()
            if _next_decided(keys, last["epoch"]) != last["epoch"] or any(self._pulse.linked(m) for m in members) \
                    or self._pulse.reported(era) > 0:
                return True
            if time.monotonic() - asked >= min(self._heartbeat, 0.5):
                asked = time.monotonic()
                if keys.peek_bytes(f"echo/{slot}") in sent:
                    return True
                # A fresh nonce every time: a member echoes each new one (an echo a store writer
                # deleted is written again), and another worker asking in the same slot only
                # delays the answer.
                sent.append(uuid.uuid4().hex.encode())
                self._job_keys.set_bytes(f"probe/{slot}", sent[-1])
            waited = time.monotonic() - start
            # (with a secret, only members whose address was read: a store writer who keeps the
            # addresses deleted and replays no heartbeat must not make a live era look dead)
            if min(self._pulse.silent(m) for m in members) > self._timeout and waited > 2 * self._heartbeat + 1 \
                    and (not keys.sealed or all(self._pulse.reached(m) for m in members)):
                return False
            if waited > 2 * (self._timeout + self._heartbeat):
                why = ("their heartbeats move, but none answers this worker: someone may be replaying their "
                       "heartbeats in the store" if min(self._pulse.silent(m) for m in members) <= self._timeout else
                       "this worker never read their liveness addresses (the store's sealed addr/<worker>): someone "
                       "may keep deleting them")
                raise RuntimeError(f"{_PREFIX}: era {era} of job {self.job!r}: whether its members "
                                   f"({self._names(members)}) live cannot be told: {why}. Not starting a new era "
                                   "(it could fork a live one): check the store's access, then start this worker again")
            poll()

    def _newest_era(self, era: int) -> int:
        """``era``, or the newest later era that has begun: one with a decision, or a request to
        join at its first index (what a worker that starts an era writes first). The ``era`` key
        may be older than the job's era: a store writer deleted it (the next worker then writes
        1) or put an old value back (with a secret, an old sealed value still opens); members
        put it back every heartbeat (`Pulse.hold`), and a worker reads on from it here."""
        for _ in range(_MAX_ERAS_AHEAD):
            if not self._begun(era + 1):
                return era
            era += 1
        return era

    def _begun(self, era: int) -> bool:
        """Whether ``era`` has begun: it has a decision, or a request to join at its first index."""
        keys = self._job_keys.under(f"era{era}")
        return _next_decided(keys, 0) > 0 or _start_epoch(keys, 0) > 0 \
            or any(isinstance(self._request_at(keys, i), dict) for i in range(_FIRST_REQUESTS))

    @staticmethod
    def _request_at(keys: Keys, index: int):
        try:
            return keys.peek(f"join/{index}")
        except SecretMismatch:
            raise
        except ValueError:
            return None
