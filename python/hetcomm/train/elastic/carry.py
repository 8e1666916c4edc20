"""What a generation of `ElasticRun` (`hetcomm.train.elastic.run`) starts from, agreed over its
process group: the group's members hold the job's secret, the store does not, so nothing here is
read from the store, and nothing is unpickled (a member's bytes are numbers and UTF-8, checked).

* `start_table`: every member's worker name, the round and outer steps it carries in, its
  samples, and whether the decision (from the store) names a round other than the one this
  member holds: the worker labels and the run's counts follow from it on every rank alike.
* `share_timing`: rank 0's step times (by worker name) and ``time`` policy state, as numbers.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hetcomm.train.partition import exchange_columns

NAME_BYTES = 128              # a worker's name, UTF-8 (`Elastic(worker=)`, `worker_id`)
_HEAD = 6                     # rows before the name's bytes


def encode_name(name: str) -> list[float]:
    raw = name.encode()
    if len(raw) > NAME_BYTES:
        raise ValueError(f"a worker's name is at most {NAME_BYTES} bytes of UTF-8, got {len(raw)}: {name[:40]!r}...")
    return [float(b) for b in raw] + [0.0] * (NAME_BYTES - len(raw))


def _decode_name(values) -> str:
    raw = bytes(int(v) & 0xFF for v in values if 0 < v < 256)
    return raw.decode("utf-8", "replace")


def start_table(name: str, explicit: bool, carried_round: int, carried_applied: int, samples: int,
                disowned: bool) -> dict:
    """One exchange over the generation's group. ``disowned``: this member holds the run's state
    and the decision names another round than its own (a forged record on the store)."""
    column = [float(carried_round), float(carried_applied), float(samples), float(explicit), float(disowned), 0.0]
    table = exchange_columns(column + encode_name(name))
    world = len(table[0])
    names = [_decode_name([table[_HEAD + i][r] for i in range(NAME_BYTES)]) for r in range(world)]
    return {"rounds": [int(x) for x in table[0]], "applied": [int(x) for x in table[1]],
            "samples": [int(x) for x in table[2]], "explicit": [x > 0 for x in table[3]],
            "disowned": [r for r in range(world) if table[4][r] > 0], "names": names}


def share_timing(step_times: dict[str, tuple[float, int]], policy: dict | None,
                 names: list[str]) -> tuple[dict[str, tuple[float, int]], dict | None]:
    """Rank 0's step times of this generation's workers (``names``, one per worker) and its
    ``time`` policy state, broadcast as float64 and checked: every rank plans alike."""
    values = []
    for name in names:
        t, windows = step_times.get(name, (math.nan, 0))
        values += [float(t), float(windows)]
    p = policy or {}
    values += [1.0 if policy is not None else 0.0, _num(p.get("round_seconds")), _num(p.get("sync_seconds")),
               _num(p.get("stretch"))]
    flat = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(flat, src=0)
    values = flat.tolist()
    times = {}
    for i, name in enumerate(names):
        t, windows = values[2 * i], values[2 * i + 1]
        if math.isfinite(t) and t > 0 and math.isfinite(windows) and windows >= 0:
            times[name] = (t, int(min(windows, 1 << 30)))
    has, round_seconds, sync_seconds, stretch = values[2 * len(names):]
    if not has:
        return times, None
    return times, {"name": "time", "round_seconds": _positive(round_seconds),
                   "sync_seconds": sync_seconds if math.isfinite(sync_seconds) and sync_seconds >= 0 else None,
                   "stretch": stretch if math.isfinite(stretch) and stretch >= 1.0 else 1.0}


def _num(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _positive(value: float) -> float | None:
    return value if math.isfinite(value) and value > 0 else None
