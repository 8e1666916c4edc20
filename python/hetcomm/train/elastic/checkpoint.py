"""Checkpoints of DiLoCo in generations (`ElasticRun.state_dict`, `ElasticRun.load_state_dict`).

A checkpoint holds the run's state as of the rounds this worker has applied: the global
parameters and the outer optimizer, the round, the outer steps applied, the samples, the history
and the membership records, the step times and the ``time`` policy's round length (by worker
name), and this worker's model and inner optimizer. A generation's own machinery (its group, the
quantisation residuals, a round carried through a membership change) is not in it: a resumed
worker starts a new round from the global parameters, as a worker admitted by an epoch does.

With overlap, `save` waits for the synchronisation in flight (and staggered fragments) to land,
so that the state includes the round that just ended; the replica's steps since each staggered
fragment's trigger are not in the state (they were not sent), and are lost on resuming.
Without overlap, with ``fixed`` steps, one rank per
worker and no error feedback (its residuals are not saved), a whole job resumed from every
worker's checkpoint computes what the uninterrupted job computes.

Where it cannot read a round boundary's state -- the synchronisation in flight failed (the next
`step` starts the next generation), or staggered fragments of the round in progress have landed
-- it holds the state the generation started from if the generation has applied no outer step
yet (that is then the newest boundary: a round carried in after a failure), else it raises
RuntimeError: a checkpoint never goes back; the caller keeps its last one. Limit: a generation that starts
inside a carried round whose fragments fired starts from parameters that hold them; a checkpoint
of it and an older one of the same round differ, and a whole job resumed from both stops with
an error naming the difference.
"""
from __future__ import annotations

import concurrent.futures
import copy

from hetcomm.train.diloco.checkpoint import _cpu_copy
from hetcomm.train.elastic import sharded
from hetcomm.train.elastic.common import _PREFIX
from hetcomm.train.local_steps import TimeSteps

KIND = "hetcomm DiLoCo in generations"
VERSION = 1


def save(run, generation_start: bool = False) -> dict:
    """`ElasticRun.state_dict`: the rounds applied so far; call it when `step` returned True (the
    round in progress is not in it; see the module doc for when it raises). No communication;
    with overlap it blocks until the synchronisation in flight has landed."""
    if not run._holds:
        raise RuntimeError(f"{_PREFIX}: state_dict() before this worker was admitted (it holds no state yet)")
    if run._torn:
        raise RuntimeError(f"{_PREFIX}: state_dict() after close() while a synchronisation was still running: "
                           "the global parameters may be half updated; keep the last checkpoint")
    inner = None if generation_start else run._inner
    if inner is None:
        global_, outer = list(run._global), run.outer_optimizer.state_dict()
        round_, applied, samples, history = run._round, run._applied_total, run._samples_total, list(run._history)
        times, policy = dict(run._step_times), run._policy_state
    elif inner._stagger and any(inner._fired):
        # Inside a round whose staggered fragments have fired (a round carried in after a
        # failure, or a call mid-round): their updates are applied mid-round, so the global
        # parameters are not those of a round boundary.
        return _generation_start(run, inner, "inside a round whose staggered fragments have landed")
    else:
        jobs = [f for f in inner._background_jobs() if f is not None]
        start = inner._clock()
        done, _ = concurrent.futures.wait(jobs, timeout=run._collective_timeout + 10.0)
        end = inner._clock()
        inner._totals["idle"] += end - start            # (as DiLoCo.state_dict: not the next step's compute)
        inner._timeline.append(("idle", start, end))
        inner._mark = inner._clock()
        if len(done) < len(jobs) or any(f.cancelled() or f.exception() is not None for f in jobs):
            # The generation failed (the next step starts the next one)
            return _generation_start(run, inner, "the synchronisation in flight failed or did not end")
        records = [run._renumber(r) for r in inner._history]      # every one applied
        global_, outer = list(inner._global), inner.outer_optimizer.state_dict()
        round_, applied = run._base[0] + len(records), run._base[1] + inner._applied
        samples = run._samples_total + sum(sum(r["samples"]) for r in records)
        history = list(run._history) + records
        times = dict(run._step_times)
        for label, name in enumerate(run._workers_names):
            if inner._times._t[label] is not None:
                times[name] = (inner._times._t[label], inner._times._windows[label], inner._times._n[label])
        policy = inner._policy.state_dict() if isinstance(inner._policy, TimeSteps) else run._policy_state
    shares = {}
    if getattr(run, "_sharded", False):   # (this rank's share, and where it lies: `sharded.load_checkpoint`)
        shares = {"share": list(run._share), "fragments": [list(f) for f in run._whole],
                  "outer_type": type(run.outer_optimizer).__name__}
    state = _cpu_copy({
        **shares, "kind": KIND, "version": VERSION, "job": run.job, "global": global_, "outer_optimizer": outer,
        "round": round_, "applied": applied, "samples_total": samples, "history": history,
        "membership": list(run._events), "step_times": times, "policy": policy,
        # the liveness addresses its generations gave (`Pulse.learn`): a worker restarted from
        # this asks the era's members there whether they live, not where the store says
        # (its own too: restarted, it is another incarnation, and finds the old one dead there)
        "liveness": ({k: v.decode("ascii", "replace")
                      for k, v in {**run._pulse.memory()[2], run._me: run._pulse.address}.items()}
                     if getattr(run, "_pulse", None) is not None else {}),
        # where in the job it was: a worker restarted from this judges whether the era lives by
        # this decision where the store shows none as new (a store writer deleted the newer ones)
        "position": _position(run),
        "model": run.model.state_dict(),
        "inner_optimizer": run.inner_optimizer.state_dict() if run.inner_optimizer is not None else None,
    })
    if inner is not None:
        inner._mark = inner._clock()          # neither the wait nor the copy is the next step's compute
    return state


def _position(run) -> dict:
    """The era, epoch and members of the last decision the worker took part in that committed
    ({} before one): its generation formed, so the checkpoint has its members' addresses."""
    decision = getattr(run, "_committed", None)
    if not decision or not getattr(run, "_era_number", 0):
        return {}
    return {"era": run._era_number, "epoch": decision["epoch"], "members": list(decision["members"])}


def _generation_start(run, inner, why: str) -> dict:
    """Where no round boundary's state can be read: the state the generation started from, when
    it has applied no outer step yet (then that is the newest boundary: a carried round after a
    failure; the generation's state is still the one it started from, which the run keeps in the
    generation's tensors, not in a copy: its jobs in flight are waited for first, since they
    write those tensors); else a RuntimeError, since a checkpoint must not go back: save at the
    next boundary."""
    busy = [f for f in inner._background_jobs() if f is not None and not f.done()]
    if busy:
        start = inner._clock()
        concurrent.futures.wait(busy, timeout=run._collective_timeout + 10.0)
        end = inner._clock()
        inner._totals["idle"] += end - start
        inner._timeline.append(("idle", start, end))
        inner._mark = inner._clock()
        if any(not f.done() for f in busy):
            raise RuntimeError(f"{_PREFIX}: state_dict() {why}: a synchronisation still runs; keep the last "
                               "checkpoint and save when step() next returns True")
    if inner._applied or inner._history:
        raise RuntimeError(f"{_PREFIX}: state_dict() {why}: no round boundary's state to save (the generation "
                           f"started at round {run._round} and has applied {inner._applied} outer step(s) since); "
                           "keep the last checkpoint and save when step() next returns True")
    return save(run, generation_start=True)


def load(run, state: dict) -> None:
    """`ElasticRun.load_state_dict`: before `join`. The worker then brings this state to the
    job's era when it starts (the workers with the latest round's checkpoint hold the run's state); its
    replica starts from the checkpoint's global parameters (the model's buffers as saved)."""
    if run._joined:
        raise RuntimeError(f"{_PREFIX}: load_state_dict() after join(): load the checkpoint first")
    if not isinstance(state, dict) or state.get("kind") != KIND:
        what = (state.get("kind", "no kind: a DiLoCo checkpoint, or one of ElasticDiLoCo before it ran in "
                                  "generations") if isinstance(state, dict) else type(state).__name__)
        raise ValueError(f"{_PREFIX}: this is not a checkpoint of DiLoCo in generations ({what}); each checkpoint "
                         "resumes a run of the class that saved it")
    if "share" in state or getattr(run, "_sharded", False):
        sharded.load_checkpoint(run, state, VERSION)
    else:
        run._load_checkpoint(state, VERSION)
    run._load_global()                       # a new round starts from the global parameters
    run._applied_total = int(state["applied"])
    run._step_times = {str(k): tuple(v) for k, v in state["step_times"].items()}
    run._policy_state = copy.deepcopy(state["policy"])
    run._carried = (run._round, run._applied_total, True)    # what it brings when the era starts
    run._jobs_done = None                         # (no generation's reductions: `carry.added`)
    liveness = state.get("liveness", {})          # (none in a checkpoint from before 12-05)
    run._liveness = {str(k): str(v).encode() for k, v in liveness.items()} if isinstance(liveness, dict) else {}
    position = state.get("position", {})           # (none in a checkpoint from before 12-06)
    run._position = position if _position_ok(position) else {}


def _position_ok(p) -> bool:
    return isinstance(p, dict) and all(isinstance(p.get(k), int) and not isinstance(p.get(k), bool) and p[k] >= 1
                                       for k in ("era", "epoch")) \
        and isinstance(p.get("members"), list) and p["members"] and all(isinstance(m, str) for m in p["members"])
