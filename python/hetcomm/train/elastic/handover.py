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

A failure of the job (a peer gone) fails the generation as a failed synchronisation does; the
joiner, which holds nothing until the state has landed, is then not a holder in the next epoch.
"""
from __future__ import annotations

import concurrent.futures
import copy
import time

import torch

from hetcomm.train.elastic.common import _PREFIX, _fingerprint


def deferred(run, decision: dict) -> bool:
    """Whether the transfer of ``decision`` runs in the generation's background (the same on every
    member: the decision and the options are)."""
    absent = set(decision["members"]) - set(decision["holders"])
    return bool(run._options["overlap"]) and bool(absent) and absent <= set(decision["joined"])


def start(run, inner) -> None:
    """At the end of `ElasticRun._build`, on every member, when the epoch deferred the transfer:
    queues it on ``inner``'s background thread; a member without the state waits for it and loads
    it. Raises RuntimeError when the job fails (the generation failed), ValueError when what
    arrived is not the run's state."""
    decision, run._state_deferred = run._state_deferred, None
    if decision is None:
        return
    holder = run._me in decision["holders"]
    sent = run._state_to_send(clone=True) if holder else None
    inner._state_job = inner._executor.submit(run._exchange_state, decision, sent, inner._sync_group)
    if holder:
        return
    begin = time.perf_counter()
    received = inner._state_job.result()
    inner._state_job = None
    run._take_state(*received)
    if float(_fingerprint(run._flatten_global())) != run._holders_print:
        raise ValueError(f"{_PREFIX}: this worker cannot join: the global parameters it received differ from the "
                         "holders' (their fingerprint in the epoch's table)")
    with torch.no_grad():
        for mine, g in zip(inner._global, run._global):
            mine.copy_(g)
        inner._start.copy_(inner._flatten_global())
    inner.outer_optimizer.load_state_dict(copy.deepcopy(run.outer_optimizer.state_dict()))
    inner._load_global()
    run._holds = True
    run._log(f"received the run's state (round {run._round}) in {time.perf_counter() - begin:.2f} s, while the "
             "others trained")


def check(inner) -> None:
    """A holder, between steps: raises the job's error once it failed (RuntimeError: the generation
    is over, as after a failed synchronisation)."""
    job = inner._state_job
    if job is not None and job.done():
        inner._state_job = None
        if not job.cancelled() and job.exception() is not None:
            raise job.exception()


def wait(inner, timeout: float) -> None:
    """Before the generation's groups go: its transfer is over (done, failed or past ``timeout``)."""
    job = inner._state_job
    if job is not None:
        concurrent.futures.wait([job], timeout=timeout)
