"""The join records of an elastic run: a worker that asks to join takes an index from the
``joins`` counter and writes its request at ``join/<index>``; the members scan the records from
the newest decision's ``admitted_upto`` on. Neither the counter nor the records are trusted
without an out-of-band secret: a store writer may inflate the counter, set it back, replace it
with garbage, or delete, copy or garble records, and no worker stops for it."""
from __future__ import annotations

import time

from hetcomm.train.elastic.common import _MAX_SKIPPED, _PREFIX, INCARNATION, _read_decision, _read_int
from hetcomm.train.membership import Keys, SecretMismatch

_MAX_UNCOUNTED = 4096       # join records read past the counter (a store writer may set it back)
_MAX_GAP = 64               # missing join records in a row that end a scan (a store writer may inflate the counter)
_MAX_CLAIMS = 1 << 16       # join indices a worker tries before it gives up


class JoinRecords:
    """Taking a join index and scanning the requests (a mixin of `ElasticBase`, whose
    ``_keys``, ``_me``, ``_timeout``, ``_gaps`` (join index -> when first seen missing), ``job``,
    ``_holds``, ``_round`` and ``_config()`` it uses)."""

    def _registrations(self, keys: Keys, start: int, wait: bool = True) -> tuple[list[tuple[int, dict]], int]:
        """The join requests from index ``start`` on (index, request), and the index after them.
        A request whose index was taken but whose record never appeared (its worker died in
        between) is skipped once it has been missing for ``timeout`` seconds (at once without
        ``wait``); the missing records of a run are timed from when the scan first met the run,
        together. A record that is not a request (a store writer's; one whose ``who`` is not an
        incarnation's name) is skipped; a join counter
        that is not one reads as no new request."""
        # The counter only hands out indices; the records are what counts. A counter a store
        # writer replaced (garbage, or a smaller number) must not hide them: read on past it
        # while records follow (and a waiting joiner puts the counter back past its own index).
        end = max(keys.count("joins") or 0, start)
        for passed in [k for k in self._gaps if k < start]:
            del self._gaps[passed]                   # (the members read no further below)
        regs, i, seen, missing = [], start, set(), 0
        # A run of missing records is timed from when a scan first met its first index, so
        # that the whole run is skipped after one timeout (not one timeout per record).
        while i < end + _MAX_UNCOUNTED:
            try:
                record = keys.peek(f"join/{i}")
            except ValueError:                       # not JSON (a store writer's)
                record = False
            missing = missing + 1 if record is None else 0
            if record is None and i >= end:
                break                                # past the counter and no record: the end
            if missing > _MAX_GAP:
                # A counter far past the records (a store writer's): the end, and the next scan
                # starts again at the first missing record (a joiner then takes the first free
                # index from the newest decision's admitted_upto: _register)
                i -= missing - 1
                break
            if record is None:
                if wait and time.monotonic() - self._gaps.setdefault(i - missing + 1, time.monotonic()) \
                        <= self._timeout:
                    break                            # not written yet: next time
            else:
                self._gaps.pop(i, None)              # (a record deleted later is timed afresh)
                if isinstance(record, dict) and isinstance(record.get("who"), str) \
                        and INCARNATION.fullmatch(record["who"]) and isinstance(record.get("holds"), bool) \
                        and isinstance(record.get("round"), int) \
                        and record["who"] not in seen:   # (a copy of a request under another index: once)
                    seen.add(record["who"])
                    regs.append((i, record))
            i += 1
        return regs, i

    def _register(self, at_least: int = 0) -> int:
        """Takes a join index and writes this worker's request there, at or above the floor: the
        newest decision's ``admitted_upto``, below which the members no longer read (at least
        ``at_least``, the one of a decision in hand: a store writer may have deleted the
        decisions `_join_floor` reads). The index
        is claimed with compare_set (the first writer wins), so a counter a store writer set
        back cannot make two workers share one, and a lost claim (or garbage there) moves to the
        next index. An index from the counter the members' scans would not reach (`_reachable`)
        is replaced by the first free index from the floor."""
        mine, keys, floor = self._request(), self._keys, max(self._join_floor(), at_least)
        try:
            index = keys.add("joins", 1) - 1
        except ValueError:                           # not a counter (a store writer's)
            index = None
        if index is None or not self._reachable(index, floor):
            index = self._first_free(floor)
        for _ in range(_MAX_CLAIMS):
            try:
                if keys.first(f"join/{index}", mine) == mine:
                    return index
            except SecretMismatch:
                raise
            except ValueError:                       # garbage there, or a store writer keeps
                pass                                 # replacing it (Forged): taken
            index += 1                               # taken: the next (a counter set back lands on
                                                     # records; the members read on past it)
        raise ValueError(f"{_PREFIX}: this worker cannot ask to join run {self.job!r}: every join index it tried "
                         "was taken (the store's join records are being tampered with)")

    def _join_floor(self) -> int:
        """The newest decision's ``admitted_upto`` (0 before the first): the lowest join index
        the members still read. ``latest`` may lag behind its decision (read on past it), and a
        store writer may have deleted the newest decisions (look back past them)."""
        epoch = _read_int(self._keys, "latest") or 0
        while _read_decision(self._keys, epoch + 1) is not None:
            epoch += 1
        for back in range(epoch, max(0, epoch - _MAX_SKIPPED), -1):
            decision = _read_decision(self._keys, back)
            if decision is not None:
                return decision["admitted_upto"]
        return 0

    def _reachable(self, index: int, floor: int) -> bool:
        """Whether the members' scans, which start at ``floor``, reach ``index``: it is not below
        the floor nor more than _MAX_UNCOUNTED past it, and no run of more than _MAX_GAP missing
        records lies between (a counter a store writer inflated, with or without a record of
        its own past the run: the scans rewind at the run and never get there)."""
        if not floor <= index <= floor + _MAX_UNCOUNTED:
            return False
        missing = 0
        for i in range(floor, index):
            missing = missing + 1 if self._free(i) else 0
            if missing > _MAX_GAP:
                return False
        return True

    def _first_free(self, floor: int) -> int:
        for i in range(floor, floor + _MAX_CLAIMS):
            if self._free(i):
                return i
        raise ValueError(f"{_PREFIX}: this worker cannot ask to join run {self.job!r}: the {_MAX_CLAIMS} join "
                         f"records from index {floor} on are all taken (the store's join records are being "
                         "tampered with)")

    def _free(self, index: int) -> bool:
        try:
            return self._keys.peek(f"join/{index}") is None
        except ValueError:
            return False

    def _request(self) -> dict:
        return {"who": self._me, "holds": self._holds, "round": self._round, "config": self._config()}

    def _keep_request(self, index: int) -> None:
        """Writes this worker's join request again if it is no longer there as it wrote it (a
        store writer overwrote or deleted it: the members would never see this worker ask), and
        puts the counter back past its index if a store writer set it back below (the members'
        scans end at the first missing record past the counter)."""
        mine = self._request()
        try:
            there = self._keys.peek(f"join/{index}")
        except ValueError:
            there = None
        if there != mine:
            self._keys.set(f"join/{index}", mine)
        self._keys.at_least("joins", index + 1)
