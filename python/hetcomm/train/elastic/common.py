"""What the parts of `ElasticDiLoCo` share: the rows of the table every member contributes a
column to at each epoch, the protocol's constants, the fingerprint of the global parameters and
the store's polling."""
from __future__ import annotations

import time

from hetcomm.train.flat import fingerprint


_PREFIX = "hetcomm ElasticDiLoCo"
# Rows of the table every member contributes a column to at each epoch.
(_STEPS, _SAMPLES, _LOSS_SUM, _LOSS_N, _FINITE, _PRINT, _HOLDS, _MAX_ROUNDS, _MAX_SAMPLES, _CONFIG, _SHARE,
 _ROWS) = range(12)
_MAX_ABORTS = 4               # attempts of one round in a row with the same members before giving up
_TIMELINE = 100_000           # timeline entries kept (the latest)
_POLL = (0.005, 0.1)          # the store is polled from every 5 ms, backing off to 100 ms


_CHUNK = 4 << 20              # bytes per store value of an offer (the libuv TCPStore refuses over 8 MiB)


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
