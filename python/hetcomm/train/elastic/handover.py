"""The run's state for joiners, sent while the others train (`hetcomm.train.elastic.run`).

In an epoch the holders send the run's state to the members without it before the group commits
(`Generation._transfer`): every member waits for the bytes, which for a model of N parameters
and an outer optimizer with momentum is 8N bytes through the joiner's link (2.4M parameters at
100 Mbit/s: 1.5 s, and the whole epoch waits for the slowest rank's start-up besides). With
overlap the generation has a background thread and a group of its own; when the members without
the state are all joiners (they carry no round), the transfer runs there instead, as the
generation's first background job, on every member:

* a holder queues it with a copy of the state as the epoch committed it, and trains on at once
  (its later synchronisations queue behind it, on the same thread and group);
* a joiner waits for it before its first step: it loads the global parameters and the outer
  optimizer's state into the generation's DiLoCo and its model, and checks the parameters against
  the holders' fingerprint from the epoch's table (a ValueError when they differ).

A holder's first round boundary waits for the job (its collectives there share the group). A
failure of the job (a peer gone) fails the generation as a failed synchronisation does; the
joiner, which holds nothing until the state has landed, is then not a holder in the next epoch.
Until then the joiner does not know the run's sample count either: before such a generation the
members agree on whether the run ends there (`agree_on_stop`), and if it does, the state goes to
the joiners at once (`send_now`), so that no worker ends a run without its state.
"""
from __future__ import annotations

import copy
import math
import time

import torch

from hetcomm.train.elastic.common import _PREFIX, _fingerprint, _read_ended
from hetcomm.train.partition import exchange_columns


def deferred(run, decision: dict) -> bool:
    """Whether the transfer of ``decision`` runs in the generation's background (the same on every
    member: the decision and the options are)."""
    absent = set(decision["members"]) - set(decision["holders"])
    return bool(run._options["overlap"]) and bool(absent) and absent <= set(decision["joined"])


def start(run, inner) -> None:
    """At the end of `ElasticRun._build`, on every member, when the epoch deferred the transfer:
    queues it on ``inner``'s background thread; a member without the state waits for it and loads
    it (the wait counts as idle, not as its first step). Raises RuntimeError when the job fails
    (the generation failed), ValueError when what arrived is not the run's state."""
    decision, run._state_deferred = run._state_deferred, None
    if decision is None:
        return
    holder = run._me in decision["holders"]
    sent = run._state_to_send(clone=True) if holder else None
    inner._state_job = inner._executor.submit(run._exchange_state, decision, sent, inner._sync_group)
    if holder:
        return
    begin, clock = time.perf_counter(), inner._clock()
    received = inner._state_job.result()
    inner._state_job = None
    _take(run, decision, received)
    with torch.no_grad():
        for mine, g in zip(inner._global, run._global):
            mine.copy_(g)
        inner._start.copy_(inner._flatten_global())
    inner.outer_optimizer.load_state_dict(copy.deepcopy(run.outer_optimizer.state_dict()))
    inner._load_global()
    end = inner._clock()
    inner._totals["idle"] += end - clock
    inner._timeline.append(("idle", clock, end))
    inner._mark = end
    run._log(f"received the run's state (round {run._round}) in {time.perf_counter() - begin:.2f} s, while the "
             "others trained")


def _take(run, decision: dict, received: tuple) -> None:
    """A joiner loads what arrived, checked against the decision's round and the holders'
    fingerprint from the epoch's table; then it holds the run's state."""
    meta, pieces = received
    if meta["round"] != decision["round"]:
        raise ValueError(f"{_PREFIX}: this worker cannot join: the holders sent the state of round {meta['round']}, "
                         f"the epoch's decision names round {decision['round']}")
    run._take_state(meta, pieces)
    if float(_fingerprint(run._flatten_global())) != run._holders_print:
        raise ValueError(f"{_PREFIX}: this worker cannot join: the global parameters it received differ from the "
                         "holders' (their fingerprint in the epoch's table)")
    run._holds = True


def agree_on_stop(run) -> None:
    """Before a generation whose transfer was deferred: whether the run ends here, the same on
    every member. A joiner does not know the run's samples (nor its outer steps) until its state
    lands, so the members take the holders' counts (one exchange over the group, with whether
    each read the run's end on the store or stopped already), then check the budgets alike."""
    ended = _read_ended(run._keys)
    column = [float(run._samples_total) if run._holds else -1.0,
              1.0 if run._stopped or ended is not None else 0.0,
              float(run._applied_total) if run._holds else -1.0]
    table = exchange_columns(column)
    samples, applied = max(table[0]), max(table[2])
    for what, x in (("samples", samples), ("outer steps", applied)):
        if not (math.isfinite(x) and x == int(x) and 0 <= x < 2 ** 53):
            raise ValueError(f"{_PREFIX}: the holders sent {x!r} as the run's {what}: not a count")
    run._samples_total, run._applied_total = int(samples), int(applied)
    if not run._stopped:
        run._check_budgets()
    if not run._stopped and max(table[1]) > 0:
        run._stopped = True
        run._stop_reason = "the run ended as this generation formed (another member saw its end)"


def send_now(run) -> None:
    """The run ends at the epoch that deferred the transfer: the epoch's transfer runs now, over
    the generation's group, so that the joiners end with the run's state."""
    decision, run._state_deferred = run._state_deferred, None
    holder = run._me in decision["holders"]
    try:
        if holder:
            run._exchange_state(decision, run._state_to_send(clone=False), None)
        else:
            _take(run, decision, run._exchange_state(decision, None, None))
    except RuntimeError as e:
        if holder:              # (the run is over for the holders; the joiner hears of it)
            run._log(f"the run ended; its state could not be sent to the joiners ({str(e).splitlines()[0][:200]})")
            return
        raise RuntimeError(f"{_PREFIX}: the run ended as this worker joined, and its state did not arrive "
                           f"({str(e).splitlines()[0][:300]})") from e
    if not holder:
        run._log(f"the run ended as this worker joined: it received the run's state (round {run._round}) at once")


def check(inner) -> None:
    """A holder, between steps and at the round's boundary: raises the job's error once it
    failed (RuntimeError: the generation is over, as after a failed synchronisation; a
    ValueError, the state not being plain data, ends this worker as it would in the epoch)."""
    job = inner._state_job
    if job is not None and job.done():
        inner._state_job = None
        if not job.cancelled() and job.exception() is not None:
            raise job.exception()
