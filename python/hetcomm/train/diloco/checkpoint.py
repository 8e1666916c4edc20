"""Checkpoints of `DiLoCo`: `Checkpoint.state_dict` and `Checkpoint.load_state_dict` (a mixin
over DiLoCo's state)."""
from __future__ import annotations

import concurrent.futures
import copy
import warnings

import torch

from hetcomm.train.diloco.table import _FRAGMENTS, _ROWS, _SYNC_WALL
from hetcomm.train.local_steps import TimeSteps
from hetcomm.train.workers import resolve_members

_PREFIX = "hetcomm DiLoCo"


def _cpu_copy(obj):
    """A deep copy with every tensor detached and copied to the CPU (for checkpoints)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _describe(layout: dict | None) -> str:
    if layout is None:
        return "the whole state"
    return f"share {layout['index']} of {layout['shards']} of the state over fragments {layout['fragments']}"


class Checkpoint:
    """Saving and resuming a `DiLoCo` run."""

    _STATE_VERSION = 4              # 2: "feedback" is a list (one per fragment), "sync_wall"; 3: "streams";
    #                                 4: "layout" (the share of a sharded state)

    def state_dict(self) -> dict:
        """Everything a resumed run needs, for this rank (CPU copies): the global parameters and the
        outer optimizer (identical on every rank; with sharded state, this rank's share), this rank's replica (the model's state), inner
        optimizer, start point and quantisation residuals, the policy's and the step times' state,
        the agreed history (rounds, samples: budgets of `loop` go on counting) and totals; with
        overlap also the synchronisation in flight, which it waits for (it blocks until every rank
        has ended the round) but does not apply.

        Call it at a round boundary (before the first step, when `step` returned True, or after
        `finish`); it does not communicate and changes nothing, so one rank may save alone (as
        long as the others keep stepping). Save each rank's dict (``torch.save``) if the replicas
        matter; `load_state_dict` on a freshly constructed object (same group, arguments and
        workers) resumes. With sharded state (``shard_state``) the dict holds this rank's share of
        the global parameters and outer optimizer: save every rank's. A resumed run computes what the uninterrupted run computes, except that
        with overlap an update in flight that lands "as soon as it arrives" lands at the first
        step after resuming (with ``overlap_steps``: at the same step), and that with ``time`` the
        first background synchronisation after resuming pays for new connections again: its
        duration is not used (the one agreed before the checkpoint still plans the rounds)."""
        if self._closed and not self._finished:
            raise RuntimeError(f"{_PREFIX}: state_dict() after close()")
        if self._r_steps:
            raise RuntimeError(f"{_PREFIX}: state_dict() inside a round ({self._r_steps} steps taken since the last "
                               "synchronisation): call it when step() returned True, or after finish()")
        pending = None
        self._hurry_streams()         # (the jobs ahead of the pending one unpaced: `pacing`)
        if self._pending is not None:
            start = self._clock()
            concurrent.futures.wait([self._pending])
            end = self._clock()
            self._totals["idle"] += end - start
            self._timeline.append(("idle", start, end))
            pending = {"table": self._pending.result()[0], "moved": self._rebased}
        self._join_streams()          # staggered fragments in flight: landed, their moves to come
        if self._closed:
            sent, wan = self._final_counts
        else:
            sent = self._bytes_sent() - self._bytes0
            wan = self._workers.inter_worker_bytes(self._outer_groups()) - self._wan0
        state = _cpu_copy({
            "version": self._STATE_VERSION,
            "rank": self._rank,
            "labels": list(self._labels),
            "layout": self._layout.describe() if self._layout is not None else None,
            "global": list(self._global),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict() if self.inner_optimizer is not None else None,
            "start": self._start,
            "feedback": [vars(f) for f in self._feedback] if self._feedback is not None else None,
            "pending": pending,
            "streams": self._stream_state(),
            "sync_wall": self._sync_wall,
            "warned_link_bound": self._warned_link_bound,
            "policy": self._policy.state_dict(),
            "step_times": self._times.state_dict(),
            "history": self._history,
            "settled": self._settled,
            "agreed_totals": self._agreed_totals,
            "totals": self._totals,
            "bytes": sent,
            "wan": wan,
            "elapsed": self._clock() - self._t0,
            "last_elapsed": self._last_elapsed,
            "stopped": (self._stopped, self._stop_reason),
        })
        self._mark = self._clock()          # neither the wait nor the copy is the next step's compute
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resumes from `state_dict`: call it on every rank, right after construction, before the
        first `step` (no communication). Another rank's state (when the replicas are alike and,
        with sharded state, it held the same share) resumes the same global run; this rank then
        keeps its own counters and drops the other's quantisation residuals."""
        if self._step_calls or self._history:
            raise RuntimeError(f"{_PREFIX}: load_state_dict() after steps were taken: call it right after "
                               "constructing DiLoCo")
        if state.get("version") not in (1, 2, 3, self._STATE_VERSION):
            raise ValueError(f"{_PREFIX}: checkpoint version {state.get('version')!r}, expected 1 to {self._STATE_VERSION}")
        if list(state["labels"]) != list(self._labels):
            raise ValueError(f"{_PREFIX}: the checkpoint's workers {resolve_members(state['labels'])} differ from "
                             f"this run's {resolve_members(self._labels)} (the same group and workers are needed)")
        layout = self._layout.describe() if self._layout is not None else None
        if state.get("layout") != layout:
            raise ValueError(f"{_PREFIX}: the checkpoint holds {_describe(state.get('layout'))}, this rank "
                             f"{_describe(layout)}: resume each rank from a checkpoint of the same share (the same "
                             "workers, rank within its worker, shard_state, fragments and model; a checkpoint of the "
                             "whole state, e.g. from before sharding, resumes with shard_state=False)")
        shapes = [tuple(g.shape) for g in self._global]
        if [tuple(t.shape) for t in state["global"]] != shapes:
            raise ValueError(f"{_PREFIX}: the checkpoint's parameters do not match the model's shapes")
        if (state.get("streams") is None) != (not self._stagger):
            raise ValueError(f"{_PREFIX}: the checkpoint was taken with{'' if state.get('streams') else 'out'} staggered "
                             f"fragments, this run is{'' if self._stagger else ' not'} staggered: construct DiLoCo with "
                             "the same fragments and stagger to resume it")
        if self._stagger and [tuple(x) for x in state["streams"]["bounds"]] != [tuple(x) for x in self._fragments]:
            raise ValueError(f"{_PREFIX}: the checkpoint's fragments {state['streams']['bounds']} differ from this "
                             f"run's {[list(x) for x in self._fragments]} (construct DiLoCo with the same fragments "
                             "and model)")
        if state["pending"] is not None and not self.overlap:
            raise ValueError(f"{_PREFIX}: the checkpoint was taken with overlap=True (a synchronisation in flight); "
                             "construct DiLoCo with overlap=True to resume it")
        with torch.no_grad():
            for g, t in zip(self._global, state["global"]):
                g.copy_(t)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.model.load_state_dict(state["model"])
        if state["inner_optimizer"] is not None and self.inner_optimizer is not None:
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self._start.copy_(state["start"])
        own = state.get("rank") == self._rank
        saved = state["feedback"]
        if isinstance(saved, dict):                   # one fragment
            saved = [saved]
        if self._feedback is not None and saved is not None and own:
            if len(saved) == len(self._feedback):
                for fb, values in zip(self._feedback, saved):
                    for k, v in values.items():
                        setattr(fb, k, v.to(self._device) if isinstance(v, torch.Tensor) else v)
            else:
                warnings.warn(f"{_PREFIX}: the checkpoint's quantisation residuals are of {len(saved)} fragment(s), "
                              f"this run reduces in {len(self._feedback)}: they start from zero", stacklevel=2)
        self._sync_wall = float(state.get("sync_wall", 0.0))
        self._warned_link_bound = bool(state.get("warned_link_bound", False))
        self._policy.load_state_dict(state["policy"])
        if isinstance(self._policy, TimeSteps) and not self.overlap:
            self._policy.sync_seconds = None   # no overlap: no sync duration (older checkpoints saved 0.0)
        self._times.load_state_dict(state["step_times"])
        self._history = copy.deepcopy(state["history"])
        self._settled = int(state["settled"])
        self._agreed_totals = copy.deepcopy(state["agreed_totals"])
        if own:
            self._totals = dict(state["totals"])
            self._bytes0 -= state["bytes"]
            self._wan0 -= state["wan"]
        self._t0 = self._clock() - state["elapsed"]
        self._last_elapsed = state["last_elapsed"]
        self._stopped, self._stop_reason = state["stopped"]
        if state["pending"] is not None:
            # The synchronisation in flight had landed on the global parameters; its agreement
            # (and, unless it had moved already, the replica's move) is still to be applied.
            table = [list(row) for row in state["pending"]["table"]]
            width = len(table[0]) if table else self._world
            defaults = {_SYNC_WALL: 0.0, _FRAGMENTS: float(len(self._fragments))}
            while len(table) < _ROWS:                  # a version 1 table: the rows added since
                table.append([defaults.get(len(table), 0.0)] * width)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result((table, None))
            self._pending, self._rebased = done, bool(state["pending"]["moved"])
            self._shortening_checked = False
            self._pending_agreed = (len(self._history), table)
            self._landed = len(self._boundary)
            self._moved = self._landed if self._rebased else 0
        self._load_stream_state(state.get("streams"))
        self._reset_round()
        self._policy.start_round(self._clock())
        self._plan_triggers()
        self._mark = self._clock()
