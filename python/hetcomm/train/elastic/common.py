"""What the parts of an elastic run share: the rows of the table every member contributes a
column to at each epoch, the protocol's constants, the fingerprint of the global parameters and
the store's polling."""
from __future__ import annotations

import hashlib
import json
import re
import time

from hetcomm.train.flat import fingerprint
from hetcomm.train.membership import SecretMismatch


_PREFIX = "hetcomm ElasticDiLoCo"
# Rows of the table every member contributes a column to at each epoch.
_PRINT, _HOLDS, _MAX_ROUNDS, _MAX_SAMPLES, _CONFIG, _ROWS = range(6)
_MAX_ABORTS = 4               # failed epochs (generations) in a row before giving up
_TIMELINE = 100_000           # timeline entries kept (the latest)
_POLL = (0.005, 0.1)          # the store is polled from every 5 ms, backing off to 100 ms


_fingerprint = fingerprint


def _to_json(obj):
    """An optimizer state's skeleton as JSON can carry it (integer keys and tuples kept)."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _to_json(v) for k, v in obj.items()}
        return {"__items__": [[k, _to_json(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [_to_json(v) for v in obj]
    return obj


def _from_json(obj):
    if isinstance(obj, dict):
        if set(obj) == {"__items__"}:
            return {k: _from_json(v) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(_from_json(v) for v in obj["__tuple__"])
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


# `<worker_id>#<nonce>`: an incarnation's name (a join request naming anything else is not read: a
# store writer's name of megabytes would be a key the store refuses, closing the reader's client)
INCARNATION = re.compile(r"[^#]{1,256}#[0-9a-f]{8}")


def _digest(decision: dict) -> str:
    """A decision's digest (16 hex digits): in its generation's group prefix, and in the answers
    to liveness pings (what a member holds decided)."""
    return hashlib.sha256(json.dumps(decision, sort_keys=True).encode()).hexdigest()[:16]


def _decision_ok(d, epoch: int | None = None) -> bool:
    """Whether a decision read from the store (for ``epoch``) is one the protocol could have
    written: the fields and types it uses, incarnation names, members without duplicates,
    holders and joiners among them (one that is not, a store writer's without an out-of-band
    secret, is treated as absent)."""
    if not (isinstance(d, dict) and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool)
                                        and d[k] >= 0 for k in ("epoch", "gen", "round", "admitted_upto"))
            and all(isinstance(d.get(k), list) and all(isinstance(m, str) and INCARNATION.fullmatch(m) for m in d[k])
                    for k in ("members", "holders", "joined"))
            and isinstance(d.get("left"), dict) and isinstance(d.get("refused", {}), dict)):
        return False
    members = set(d["members"])
    return (len(members) == len(d["members"]) and members >= set(d["holders"]) and members >= set(d["joined"])
            and (epoch is None or d["epoch"] == epoch))


def _read_decision(keys, epoch: int) -> dict | None:
    """Epoch ``epoch``'s decision, or None while there is none (or none well formed)."""
    try:
        d = keys.peek(f"e{epoch}/decision")
    except SecretMismatch:
        raise
    except ValueError:
        return None
    if not _decision_ok(d, epoch):
        return None
    if not keys.sealed:
        keys.saw_plain_record()          # (the job is not sealed: `SecretMismatch`)
    return d


def _read_int(keys, key: str) -> int | None:
    try:
        value = keys.peek(key)
    except SecretMismatch:
        raise
    except ValueError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_MAX_SKIPPED = 64            # deleted decisions in a row a waiting worker reads past


def _next_decided(keys, epoch: int) -> int:
    """The epoch a worker waiting for decision ``epoch`` reads instead: ``epoch`` while no later
    decision exists, else the first later one (a store writer deleted this one, and perhaps the
    next few). Looks as far as ``latest`` says, or _MAX_SKIPPED epochs when ``latest`` is gone,
    never further."""
    newest = _read_int(keys, "latest")
    if newest is not None and newest > epoch + _MAX_SKIPPED:
        # (far behind: the decisions between may be gone too; `latest`'s own, or the newest of
        # the _MAX_SKIPPED below it)
        below = _start_epoch(keys, epoch)
        if below > epoch:
            return below
    reach = epoch + _MAX_SKIPPED if newest is None else min(max(newest, epoch + 1), epoch + _MAX_SKIPPED)
    for e in range(epoch + 1, reach + 1):
        if _read_decision(keys, e) is not None:
            return e
    return epoch


_MAX_HOPS = 4096              # steps of `_last_decided` (a store writer may write decisions ahead of the reader)


def _last_decided(keys, epoch: int) -> int:
    """The newest decision from ``epoch`` on: read on past up to _MAX_SKIPPED missing ones at a
    time, whatever ``latest`` says (a store writer may have put an old value back); at most
    _MAX_HOPS decisions on (without a secret, a store writer could write them faster)."""
    for _ in range(_MAX_HOPS):
        later = next((e for e in range(epoch + 1, epoch + _MAX_SKIPPED + 1) if _read_decision(keys, e) is not None),
                     None)
        if later is None:
            break
        epoch = later
    return epoch


def _start_epoch(keys, known: int = 1) -> int:
    """Where a worker that asks to join starts reading decisions: ``latest`` when its decision
    is there, else the newest decision up to _MAX_SKIPPED below it (a store writer may have
    deleted ``latest``'s, or forged a ``latest`` no decision will reach), never below
    ``known`` (past the last decision this worker read); ``known`` when none is found."""
    newest = _read_int(keys, "latest")
    if newest is not None:
        for e in range(newest, max(known - 1, newest - _MAX_SKIPPED, 0), -1):
            if _read_decision(keys, e) is not None:
                return e
    return known


def _read_ended(keys) -> dict | None:
    """The run's end (``{"round", "reason"}``), or None while it goes on."""
    try:
        e = keys.peek("ended")
    except SecretMismatch:
        raise
    except ValueError:
        return None
    return {"round": e.get("round"), "reason": str(e.get("reason", ""))[:300]} if isinstance(e, dict) else None


# Settings that describe the job by global rank (HETCOMM_HOST_ID only in its per-rank form, with
# commas): meaningless when ranks change every generation.
_PER_RANK_VARIABLES = ("HETCOMM_HOST_ID", "HETCOMM_SITES", "HETCOMM_LINK_MBIT")


class _Poll:
    """Sleeps that start short and back off (a decision usually lands within milliseconds)."""

    def __init__(self) -> None:
        self.wait = _POLL[0]

    def __call__(self) -> None:
        time.sleep(self.wait)
        self.wait = min(_POLL[1], self.wait * 1.5)
