"""The table DiLoCo's ranks agree on at every synchronisation, and what is decided from it alone:
when the run stops, the history record of a round, the prediction of the last round's length.

Every function here is a function of agreed values only, so every rank decides the same.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist

# Rows of the table exchanged at every synchronisation (one column per rank, exact and identical
# on every rank: `hetcomm.partition.exchange_columns`; agreed, one column per worker, its ranks'
# samples summed).
(_STEPS, _SAMPLES, _COMPUTE, _LOSS_SUM, _LOSS_N, _FINITE, _TOT_IDLE, _TOT_SYNC, _TOT_BYTES,
 _DONE, _ELAPSED, _MAX_ROUNDS, _MAX_SAMPLES, _MAX_SECONDS, _TOT_WAN, _REPLICA, _LANDED, _SYNC_WALL,
 _FRAGMENTS, _REFORM) = range(20)
_ROWS = 20
# How a worker of several ranks sums up its ranks' columns (`hetcomm.train.workers`): its ranks
# step together, so steps and seconds are its slowest rank's; samples, losses and bytes add up.
_AGGREGATE = ("max", "sum", "max", "sum", "sum", "min", "max", "max", "sum", "min", "max", "max", "max", "max", "sum",
              "max", "max", "max", "max", "max")
_BUDGETS = {"max_rounds": _MAX_ROUNDS, "max_samples": _MAX_SAMPLES, "max_seconds": _MAX_SECONDS}


def _known(values: Sequence[float]) -> list[float | None]:
    """NaN (not measured: a non-hetcomm group) as None, so that agreed records compare equal."""
    return [None if math.isnan(v) else v for v in values]


def _hetcomm_bytes_sent(group: dist.ProcessGroup | None) -> float:
    """This rank's bytes sent on ``group`` so far, or NaN when the group is not hetcomm."""
    try:
        if dist.get_backend(group) != "hetcomm":
            return math.nan
        from hetcomm._backend import stats
        return float(sum(stats(group)["bytes_sent"]))
    except (RuntimeError, ValueError, ImportError, AttributeError):
        return math.nan


def budget_seconds(table: Sequence[Sequence[float]], agreed_samples: float) -> float | None:
    """From an agreed round's table and the samples of every agreed round: after how many seconds
    of computing in the round after it the sample budget is predicted to be reached, at its rate (its
    samples over its slowest rank's compute seconds, so idling does not count). None when there
    is no sample budget or no rate to predict by."""
    limit, last, compute = table[_MAX_SAMPLES][0], sum(table[_SAMPLES]), max(table[_COMPUTE])
    if not (limit and last > 0 and compute > 0):
        return None
    return max(0.0, (limit - agreed_samples) * compute / last)


def last_round_seconds(table: Sequence[Sequence[float]], agreed_samples: float) -> float | None:
    """With overlap, from the agreed table of the round before the last: `budget_seconds` when
    the last round, predicted to train as much as that one, reaches the sample budget; else None
    (no sample budget, not reached, or no rate to predict by)."""
    if not agreed_samples + sum(table[_SAMPLES]) >= table[_MAX_SAMPLES][0]:
        return None
    return budget_seconds(table, agreed_samples)


def stop_decision(table: list[list[float]], *, ahead: bool, rounds: int, samples: float,
                  last_elapsed: float) -> str | None:
    """Why every rank stops after this agreement (None: go on), with ``rounds`` settled and
    ``samples`` agreed before it, and ``last_elapsed`` the slowest rank's clock at the agreement
    before.

    ``ahead`` (overlap): the table is the previous round's, and stopping now still synchronises
    the round that is ending: its budgets count that round too, predicted as the previous one
    (exact for a fixed schedule; a run whose rounds grow may stop one round late)."""
    if all(d > 0 for d in table[_DONE]):
        return "every rank is out of data (or called finish)"
    elapsed = max(table[_ELAPSED])
    if ahead:
        rounds += 1
        samples += sum(table[_SAMPLES])
        elapsed += max(0.0, elapsed - last_elapsed)
    limit = {name: table[row][0] for name, row in _BUDGETS.items()}
    if limit["max_rounds"] and rounds >= limit["max_rounds"]:
        return f"max_rounds: {rounds} rounds"
    if limit["max_samples"] and samples >= limit["max_samples"]:
        # (with overlap a prediction: the run's `history` has what was trained)
        return f"max_samples: {samples:.0f} samples" + (" predicted (the last round as the one before it)"
                                                         if ahead else "")
    if limit["max_seconds"] and elapsed >= limit["max_seconds"]:
        return f"max_seconds: {elapsed:.1f} s"
    if any(x > 0 for x in table[_REFORM]):
        # An elastic run (`hetcomm.train.elastic.run`): a worker asks to join, or one leaves; the
        # generation ends here on every rank, and the next one forms with the new members (a
        # budget reached at the same agreement ends the run instead).
        return "membership: a worker asks to join or leave"
    return None


def history_record(table: list[list[float]], weights: list[float], round_index: int, plan: dict) -> dict:
    """The agreed record of a round in `DiLoCo.history`."""
    return {
        "round": round_index,
        "plan": plan,
        "steps": [round(s) for s in table[_STEPS]],
        "samples": [round(s) for s in table[_SAMPLES]],
        "compute_seconds": table[_COMPUTE],
        "loss": [s / n if n > 0 else None for s, n in zip(table[_LOSS_SUM], table[_LOSS_N])],
        "weights": weights,
        "idle_seconds_total": table[_TOT_IDLE],
        "sync_seconds_total": table[_TOT_SYNC],
        "bytes_sent_total": _known(table[_TOT_BYTES]),
        "wan_bytes_total": _known(table[_TOT_WAN]),
        # with overlap: the steps each worker took this round before the previous round's
        # update moved it (its steps: at the round's end); 0 without overlap
        "landed_after_steps": [round(x) for x in table[_LANDED]],
    }
