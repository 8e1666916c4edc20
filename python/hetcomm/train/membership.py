"""Who is in an elastic DiLoCo run: heartbeats, arrivals and decisions on a c10d store.

The store (`hetcomm.store`, a TCPStore served outside the workers) is the only thing the workers
share besides their process group, and the only place where they agree on membership: keys under
``hetcomm/ft/<job>/`` for the era, each incarnation's heartbeat and liveness address, join
requests, arrivals, the decision and outcome of each epoch (written once with compare_set: the
first writer wins), through `Keys`. A worker's heartbeat and the liveness connections that tell
a death at once are `hetcomm.train.pulse.Pulse`. ``who`` is an incarnation,
``<worker_id>#<nonce>``, so a restarted worker's heartbeat cannot keep its dead predecessor
looking alive.

Every key: docs/elastic-protocol.md#store-keys.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

_PREFIX = "hetcomm ElasticDiLoCo"


class StoreUnreachable(RuntimeError):
    """The job's c10d store cannot be reached (its process died, or its machine is unreachable)."""


def connect(store: str | dist.Store, timeout: float) -> tuple[dist.Store, str]:
    """A client of ``store`` ("host:port" or a torch.distributed Store) and its address for messages."""
    if isinstance(store, str):
        host, sep, port = store.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{_PREFIX}: store must be 'host:port' or a torch.distributed.Store, got {store!r}")
        try:
            client = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise StoreUnreachable(f"{_PREFIX}: cannot reach the store at {store}: {e}") from e
        return client, store
    if not isinstance(store, dist.Store):
        raise TypeError(f"{_PREFIX}: store must be 'host:port' or a torch.distributed.Store, "
                        f"got {type(store).__name__}")
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    address = f"{inner.host}:{inner.port}" if isinstance(inner, dist.TCPStore) else type(inner).__name__
    return store, address


class Forged(ValueError):
    """A store value that does not open with the out-of-band secret's key: written by someone
    without the secret, or moved from another key. It is never acted on."""


class SecretMismatch(ValueError):
    """This worker has no out-of-band secret, and the job's records are sealed: its workers were
    started with HETCOMM_SECRET(_FILE). Raised, not ignored: the worker must stop and say so.
    Only until the worker read a well-formed plain decision of the job (`Keys.saw_plain_record`):
    after that, a value that looks sealed is a store writer's garbage, which must not stop a
    member."""


_TAG = 32                     # bytes of the seal after a value (HMAC-SHA-256)
# What an atomic read is told to expect (`Keys._raw`): the store answers it when the key has no
# value. Random per process: a store writer who could put these bytes under a key would make it
# read as absent (and a compare_set from absent never match it).
_NOTHING = b"\0hetcomm: no value " + os.urandom(16).hex().encode() + b"\0"
_FIRST_TRIES = 50             # compare_set attempts against values that keep failing their seal


class Keys:
    """The job's keys on one store client; every store failure becomes StoreUnreachable naming it.

    With an out-of-band secret (``seal``, from `hetcomm._engine.store_seal_key`), every value
    written is followed by an HMAC over its full key and bytes, and every value read must carry
    a valid one: one that does not raises `Forged` (a ValueError naming the key) instead of being
    parsed, and `first` replaces it. Seals are deterministic, so a store writer can put back an
    older value of the same key (heartbeats count only upwards for that reason) but can never
    write a value of its own, or move one between keys or jobs. Counters (`add`, `count`) are not
    sealed: a store writer can change them, and nothing is decided on them alone. Reads are
    atomic (`peek_bytes`).
    """

    def __init__(self, store: dist.Store, address: str, root: str, seal: bytes | None = None,
                 plain_seen: list | None = None) -> None:
        self.store, self.address, self.root, self._seal_key = store, address, root, seal
        # Whether a plain (unsealed) decision of the job was read (`saw_plain_record`): the job
        # is then not sealed, and a value that looks sealed is a store writer's garbage, not a
        # sign that this worker lacks the secret (shared by the clones and sub-keys of one job's
        # keys). Not any plain value: a worker's own write, or one anyone can plant, is none.
        self._plain_seen = plain_seen if plain_seen is not None else [False]

    def saw_plain_record(self) -> None:
        self._plain_seen[0] = True

    @property
    def sealed(self) -> bool:
        return self._seal_key is not None

    def mac(self, what: str, value: bytes) -> bytes:
        """A MAC of ``value`` for data that goes elsewhere than the store (the liveness greeting,
        ``what`` naming it), b"" without a secret: under a key of its own, so that no store
        record's seal can be obtained this way."""
        if self._seal_key is None:
            return b""
        key = hmac.new(self._seal_key, b"hetcomm elastic: not a store record", hashlib.sha256).digest()
        full = (self.root + what).encode()
        return hmac.new(key, len(full).to_bytes(4, "little") + full + value, hashlib.sha256).digest()

    def clone(self) -> "Keys":
        """Another connection to the same store (a TCPStore client is one socket: threads each
        get their own)."""
        try:
            return Keys(self._call("connect", self.store.clone), self.address, self.root, self._seal_key,
                        self._plain_seen)
        except (AttributeError, NotImplementedError):
            return self           # a store without clone (HashStore in tests): share it

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:           # DistNetworkError, DistStoreError are RuntimeErrors
            raise StoreUnreachable(f"{_PREFIX}: the store at {self.address} failed ({what}): {e} -- is the store "
                                   "process (python -m hetcomm.store) still running and reachable?") from e

    def _tag(self, key: str, value: bytes) -> bytes:
        full = (self.root + key).encode()
        return hmac.new(self._seal_key, len(full).to_bytes(4, "little") + full + value, hashlib.sha256).digest()

    def _sealed(self, key: str, value: bytes) -> bytes:
        return value + self._tag(key, value) if self._seal_key is not None else value

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The value of a sealed record, or None when its seal is not right."""
        if self._seal_key is None:
            return raw
        value, tag = raw[:-_TAG], raw[-_TAG:]
        return value if len(raw) >= _TAG and hmac.compare_digest(tag, self._tag(key, value)) else None

    def _opened(self, key: str, raw: bytes) -> bytes:
        value = self._open(key, raw)
        if value is None:
            _log_forged(self.root + key)
            raise Forged(f"{_PREFIX}: the store value {self.root + key} does not open with the out-of-band secret "
                         "(someone without HETCOMM_SECRET(_FILE) wrote it, or a worker has another secret): "
                         "ignored")
        return value

    def set(self, key: str, value) -> None:
        self.set_bytes(key, _dump(value).encode())

    def get(self, key: str):
        """The key's value (JSON); a ValueError naming the key when it has none, or a forged one,
        or one that is not JSON. Callers look with `has` or `peek` first: the value was there."""
        return self._parse(key, self.get_bytes(key))

    def has(self, key: str) -> bool:
        """Whether the key holds a value; with a seal, one that opens (a forged value is not
        there: it is logged and ignored, and the worker goes on waiting for an authentic one)."""
        return self.peek_bytes(key) is not None

    def _raw(self, key: str) -> bytes:
        """The key's bytes as stored (sealed or not), or _NOTHING: one atomic read that never
        waits (a compare_set that cannot match: torch's store then answers the value, or the
        `expected` it was given when there is none)."""
        return self._call(f"read {key}", self.store.compare_set, self.root + key, _NOTHING, _NOTHING)

    def peek_bytes(self, key: str) -> bytes | None:
        """The key's value now, opened, or None when it has none (or a forged one): one atomic
        read that never waits (`_raw`). Unlike `has` then `get`, no
        store writer can change the value between the two, nor make the get wait for a key it
        deleted."""
        raw = self._raw(key)
        if raw == _NOTHING:
            return None
        value = self._open(key, raw)
        if value is None:
            _log_forged(self.root + key)
        return value

    def peek(self, key: str):
        """`peek_bytes` as JSON: None when there is no (authentic) value."""
        raw = self.peek_bytes(key)
        return None if raw is None else self._parse(key, raw)

    def _parse(self, key: str, raw: bytes):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as e:
            looks_sealed = self._seal_key is None and len(raw) > _TAG and _looks_sealed(raw)
            if looks_sealed and self._plain_seen[0]:
                # A store writer's, most likely: the job's records read plain. But a store writer
                # may also have planted the plain one this worker read: say what else it can be.
                _log_forged(self.root + key, "it looks sealed (JSON and a 32-byte MAC) in a job whose records "
                            "read plain: a store writer's, or this worker lacks the HETCOMM_SECRET(_FILE) the "
                            "others have")
            elif looks_sealed:
                raise SecretMismatch(f"{_PREFIX}: the store value {self.root + key} is sealed: the job's workers "
                                     "were started with HETCOMM_SECRET(_FILE), this one without it; start every "
                                     "worker with the same secret") from None
            raise ValueError(f"{_PREFIX}: the store value {self.root + key} is not JSON: "
                             f"{type(e).__name__}") from None
        return value

    def set_bytes(self, key: str, value: bytes) -> None:
        self._call(f"set {key}", self.store.set, self.root + key, self._sealed(key, value))

    def get_bytes(self, key: str) -> bytes:
        value = self.peek_bytes(key)
        if value is None:
            raise Forged(f"{_PREFIX}: the store value {self.root + key} is gone, or does not open with the "
                         "out-of-band secret (someone without it replaced it)")
        return value

    def add(self, key: str, n: int) -> int:
        """A decimal counter in the store, added to with compare_set; the value after. A value
        there that is not a counter (a store writer's) raises a ValueError naming the key.

        Not the store's own `add`: on a value that is not a decimal the store closes the client's
        connection, and a store writer could put one there between any check and the `add`.
        compare_set answers the value there, not whether it was ours: two workers adding at once
        may both get the same value back and the counter move once (a lost update), so callers
        take the counter as a hint (the join index is claimed with `first`). Raises Forged (a
        ValueError) after _FIRST_TRIES attempts that each found the value changed."""
        for _ in range(_FIRST_TRIES):
            raw = self._raw(key)
            if raw == _NOTHING:
                now, expected = 0, b""            # compare_set from nothing creates the key
            elif _is_counter(raw):
                now, expected = int(raw), raw
            else:
                raise ValueError(f"{_PREFIX}: the store value {self.root + key} is not a counter (someone else wrote it)")
            desired = str(now + n).encode()
            if self._call(f"add {key}", self.store.compare_set, self.root + key, expected, desired) == desired:
                return now + n
        raise Forged(f"{_PREFIX}: the store counter {self.root + key} changed under each of this worker's "
                     f"{_FIRST_TRIES} compare_sets (many workers adding at once, or someone writing it)")

    def at_least(self, key: str, n: int, sealed: bool = False) -> tuple[int, bool] | None:
        """Puts a decimal counter back to ``n`` if it is below (or not a counter: a store
        writer's), with compare_set; gives up quietly after _FIRST_TRIES changes under it (the
        caller tries again later: None). With ``sealed``, a number written sealed (the era), where
        one that does not open counts as none. The number there afterwards, and whether this call
        wrote it."""
        desired = self._sealed(key, str(n).encode()) if sealed else str(n).encode()
        for _ in range(_FIRST_TRIES):
            raw = self._raw(key)
            value = raw if raw == _NOTHING or not sealed else (self._open(key, raw) or _NOTHING)
            if value != _NOTHING and _is_counter(value) and int(value) >= n:
                return int(value), False
            expected = b"" if raw == _NOTHING else raw
            if self._call(f"set {key}", self.store.compare_set, self.root + key, expected, desired) == desired:
                return n, True
        return None

    def first(self, key: str, value):
        """compare_set from nothing: the value that is there afterwards (ours if we were first).
        A value there that fails its seal counts as nothing: ours replaces it."""
        mine, expected = self._sealed(key, _dump(value).encode()), b""
        for _ in range(_FIRST_TRIES):
            raw = self._call(f"compare_set {key}", self.store.compare_set, self.root + key, expected, mine)
            if expected and raw == expected:
                expected = b""                    # the key is gone (torch then answers `expected`)
                continue
            opened = self._open(key, raw)
            if opened is not None:
                return self._parse(key, opened)
            expected = raw                        # a forged value: replace it, unless someone did
        raise Forged(f"{_PREFIX}: the store value {self.root + key} keeps being replaced by values that do not "
                     "open with the out-of-band secret: someone without the secret is writing it")

    def counters(self, keys: Sequence[str]) -> list[int]:
        """Heartbeat counters (decimal); a value that is not one, or does not open (a store
        writer's), reads as -2."""
        if not keys:
            return []
        # One atomic read each (a multi_get waits for a key a store writer deleted).
        opened = [self.peek_bytes(k) for k in keys]
        return [-2 if v is None else _counter(v) for v in opened]

    def count(self, key: str) -> int | None:
        """A counter's value without adding to it (0 when there is none), or None when the value
        there is not a counter (a store writer's)."""
        raw = self._raw(key)
        return 0 if raw == _NOTHING else (int(raw) if _is_counter(raw) else None)

    def under(self, sub: str) -> "Keys":
        """The same connection, keys under ``sub/``."""
        return Keys(self.store, self.address, f"{self.root}{sub}/", self._seal_key, self._plain_seen)

    def set_timeout(self, seconds: float) -> None:
        self._call("set_timeout", self.store.set_timeout, datetime.timedelta(seconds=seconds))


_LOGGED: set[str] = set()         # keys whose forged values were logged (each once; at most 1,000)


def _log_forged(key: str, why: str = "it does not open with the out-of-band secret (written by someone without "
                                      "it, or by a worker started without the same HETCOMM_SECRET)") -> None:
    if key not in _LOGGED and len(_LOGGED) < 1000:
        _LOGGED.add(key)
        print(f"{_PREFIX}: ignored the store value {key}: {why}", file=sys.stderr, flush=True)


def _looks_sealed(raw: bytes) -> bool:
    """Whether a value that is not JSON is JSON followed by a seal (an unsealed worker's read)."""
    try:
        json.loads(raw[:-_TAG])
        return True
    except (ValueError, RecursionError):
        return False


def _dump(value) -> str:
    return json.dumps(value, sort_keys=True)


def _is_counter(raw: bytes) -> bool:
    """What the store's `add` accepts (and writes): a decimal number that fits in 64 bits."""
    return 0 < len(raw) <= 18 and raw.isdigit()


def _counter(raw: bytes) -> int:
    if not raw:
        return 0
    if len(raw) <= 19 and raw.isdigit():
        return int(raw)
    return -2
