"""Fault-tolerant DiLoCo: dead workers are dropped at the round, restarted ones rejoin, nothing is lost.

::

    python -m hetcomm.store --port 29400                    # once, on a machine that runs no worker
    diloco = hetcomm.ElasticDiLoCo(model, opt, store="STORE_HOST:29400", worker_id="w3", job="run7",
                                   steps=50)                 # every worker; restart with the same command
    for x, y in diloco.loop(loader, max_rounds=1000):
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        diloco.step(samples=len(x), loss=loss.item())

Membership changes only at a round's synchronisation. Every attempt (an *epoch*) goes arrive,
decide (compare_set on the store), admit, reduce, then commit or abort, so a round either
completes on every member or is redone (membership on the store: `hetcomm.train.membership`).
The protocol: docs/elastic.md#a-synchronisation-attempt-step-by-step; behaviour: docs/elastic.md.
"""
from __future__ import annotations

import collections
import datetime
import hashlib
import zlib
import math
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hetcomm import compress as _compress
from hetcomm import hosts as _hosts
from hetcomm.train import flat as _flat
from hetcomm.train.diloco.checkpoint import _cpu_copy
from hetcomm.train.diloco.outer import WEIGHTINGS, default_outer_optimizer, outer_weights
from hetcomm.train.membership import Keys, Pulse, StoreUnreachable, connect
from hetcomm.train.partition import exchange_columns

__all__ = ["ElasticDiLoCo", "StoreUnreachable"]

_PREFIX = "hetcomm ElasticDiLoCo"
# Rows of the table every member contributes a column to at each epoch.
(_STEPS, _SAMPLES, _LOSS_SUM, _LOSS_N, _FINITE, _PRINT, _HOLDS, _MAX_ROUNDS, _MAX_SAMPLES, _CONFIG, _SHARE,
 _ROWS) = range(12)
_MAX_ABORTS = 4               # attempts of one round in a row with the same members before giving up
_TIMELINE = 100_000           # timeline entries kept (the latest)
_POLL = (0.005, 0.1)          # the store is polled from every 5 ms, backing off to 100 ms


_CHUNK = 4 << 20              # bytes per store value of an offer (the libuv TCPStore refuses over 8 MiB)


def _offer_layout(total: int, shards: int, chunk: int = _CHUNK) -> list[tuple[int, int, int]]:
    """An offer of ``total`` bytes in ``shards`` byte ranges: (lo, hi, values of ``chunk`` bytes)."""
    out = []
    for i in range(shards):
        lo, hi = total * i // shards, total * (i + 1) // shards
        out.append((lo, hi, -(-(hi - lo) // chunk)))
    return out


def _byte_range(raw: list[torch.Tensor], lo: int, hi: int) -> bytes:
    """Bytes [lo, hi) of the concatenation of ``raw`` (uint8 tensors), copying only those."""
    parts, at = [], 0
    for r in raw:
        a, b = max(lo, at), min(hi, at + r.numel())
        if a < b:
            parts.append(r[a - at:b - at].numpy().tobytes())
        at += r.numel()
    return b"".join(parts)


def _delete_offer(keys, rnd: int, layout: list[tuple[int, int, int]], only: int | None = None) -> None:
    """Deletes an offer's keys: every shard's (a dead member's too), or only shard ``only``."""
    for i, (_, _, chunks) in enumerate(layout):
        if only is not None and i != only:
            continue
        keys.delete(f"snap/r{rnd}/{i}/sum")
        for k in range(chunks):
            keys.delete(f"snap/r{rnd}/{i}/{k}")
    if only is None:
        keys.delete(f"snap/r{rnd}/meta")


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


def _fingerprint(flat: torch.Tensor) -> int:
    """52 bits of a hash of the exact bytes (an integer a float64 carries exactly)."""
    digest = hashlib.blake2b(flat.contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 12


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


class ElasticDiLoCo(_flat.FlatParameters):
    """DiLoCo whose workers may die, come back and join while it runs (see the module doc).

    Args:
        model: this worker's replica; its floating-point parameters are synchronised.
        inner_optimizer: the optimizer the training loop steps (kept across rounds).
        store: the job's c10d store, ``"host:port"`` (`hetcomm.store`) or a torch.distributed Store.
        worker_id: this worker's name in logs and `stats` (default ``$HETCOMM_WORKER_ID``, else
            ``host:pid``); a restarted worker may reuse it.
        job: the run's name on the store (a new run needs a new one).
        steps: inner steps per round (each worker's own count), unless ``round_seconds``.
        round_seconds: end each round after this many seconds on each worker's clock instead.
        outer_optimizer: ``callable(params) -> Optimizer`` over the global parameters (CPU);
            default `hetcomm.diloco.default_outer_optimizer`.
        weighting, compress, block: as `hetcomm.DiLoCo`.
        min_workers: the first generation forms once this many workers have asked to join.
        heartbeat: seconds between heartbeats.
        timeout: a worker whose heartbeat has not changed for this long is dropped (at most 10 s
            by default, as INTELLECT-1's 2 s / 10 s).
        late_timeout: a live worker still missing from the synchronisation this long after the
            last change among the others (one arrived or was dropped) is dropped too (it
            rejoins when it gets there).
        collective_timeout: the generation group's operation timeout (a frozen peer).
        backend: the generation group's backend (``"hetcomm"`` or ``"gloo"``).
        early_join: when this worker asks to join while a round runs, it loads the state that
            round started from (offered by the members through the store as soon as they see
            the request) and trains in it, contributing at its end; without (or when the offer
            is not complete in time) it is admitted at the round's end and contributes from the
            next. Members offer to the joiners that ask for it whatever their own setting.
        verbose: print one line per membership change (they are in `stats` either way).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 store, worker_id: str | None = None, job: str = "diloco", steps: int = 50,
                 round_seconds: float | None = None,
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 weighting: str = "batch", compress: str = "fp32", block: int = 2048, min_workers: int = 1,
                 heartbeat: float = 2.0, timeout: float = 10.0, late_timeout: float = 600.0,
                 collective_timeout: float = 60.0, backend: str = "hetcomm", early_join: bool = True,
                 verbose: bool = True) -> None:
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(f"{_PREFIX}: torch.distributed is already initialised; ElasticDiLoCo forms the "
                               "default process group itself, once per generation of workers (start the worker "
                               "without init_process_group)")
        for name, value in (("heartbeat", heartbeat), ("timeout", timeout), ("late_timeout", late_timeout),
                            ("collective_timeout", collective_timeout)):
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{_PREFIX}: {name} must be a positive number of seconds, got {value!r}")
        if timeout < 3 * heartbeat:
            raise ValueError(f"{_PREFIX}: timeout ({timeout} s) must be at least three heartbeats ({heartbeat} s): "
                             "observers sample the heartbeat once per interval, and beats jitter")
        if round_seconds is None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"{_PREFIX}: steps must be an int >= 1, got {steps!r}")
        if round_seconds is not None and not (round_seconds > 0 and math.isfinite(round_seconds)):
            raise ValueError(f"{_PREFIX}: round_seconds must be > 0, got {round_seconds!r}")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"{_PREFIX}: min_workers must be an int >= 1, got {min_workers!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"{_PREFIX}: unknown weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")
        if not job or "/" in job:
            raise ValueError(f"{_PREFIX}: job must be a non-empty name without '/', got {job!r}")
        if "hetcomm" in str(backend):                 # also a device map such as "cpu:hetcomm"
            for name in _PER_RANK_VARIABLES:
                value = os.environ.get(name, "").strip()
                if value and (name != "HETCOMM_HOST_ID" or "," in value):
                    raise ValueError(f"{_PREFIX}: {name}={value!r} describes the job by rank, but ranks change "
                                     "with every generation of workers: let hetcomm measure the links and find "
                                     "the sites (a single HETCOMM_HOST_ID=<label> for this process is fine)")
        self.model, self.inner_optimizer = model, inner_optimizer
        self._params = [p for p in model.parameters() if p.is_floating_point()]
        if not self._params:
            raise ValueError(f"{_PREFIX}: the model has no floating-point parameters")
        factory = outer_optimizer or default_outer_optimizer
        if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
            raise TypeError(f"{_PREFIX}: outer_optimizer must be a callable params -> Optimizer")
        self.weighting = weighting
        self._codec = _compress.get_codec(compress, block=block)
        self._codec_name = f"compress={compress!r}, block={block}"
        self._steps, self._round_seconds = steps, round_seconds
        self._min_workers, self._heartbeat, self._timeout = min_workers, float(heartbeat), float(timeout)
        self._late_timeout, self._collective_timeout = float(late_timeout), float(collective_timeout)
        self._backend, self._verbose, self.job = backend, verbose, job
        self._early_join = bool(early_join)
        self.worker_id = worker_id or os.environ.get("HETCOMM_WORKER_ID") or f"{socket.gethostname()}:{os.getpid()}"
        if "#" in self.worker_id:
            raise ValueError(f"{_PREFIX}: worker_id must not contain '#', got {self.worker_id!r}")
        self._me = f"{self.worker_id}#{uuid.uuid4().hex[:8]}"     # this incarnation

        client, address = connect(store, timeout=max(self._timeout, 5.0))
        self._job_keys = Keys(client, address, f"hetcomm/ft/{job}/")
        self._keys: Keys | None = None                            # the era's keys, once joined
        self._group_store = self._job_keys.clone()                # the generation groups' rendezvous
        self._group_store.set_timeout(2 * self._timeout)

        master = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        self._master = master
        with torch.no_grad():
            self._global = [torch.nn.Parameter(p.detach().to("cpu", master).clone()) for p in self._params]
        self.outer_optimizer = factory(self._global)
        self._start = self._flatten_global()

        self._holds = False            # this worker holds the run's global state (after admission)
        self._checkpoint = False       # it was loaded from a checkpoint before joining
        self._round = 0                # rounds committed in the run
        self._samples_total = 0
        self._history: list[dict] = []
        self._events: list[dict] = []
        self._decision: dict | None = None    # the last epoch's decision this worker took part in
        self._outcome = "commit"
        self._gen: int | None = None
        self._joined = self._stopped = self._closed = False
        self._stop_reason: str | None = None
        self._budgets: dict[str, float] = {}
        self._pulse: Pulse | None = None
        self._gaps: dict[int, float] = {}     # join indices taken but not (yet) written: since when
        self._totals = {"compute": 0.0, "idle": 0.0, "sync": 0.0}
        self._timeline: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=_TIMELINE)
        self._aborts: list[tuple[str, ...]] = []   # member lists of this round's failed attempts in a row
        self._scanned = (0, 0.0)                   # join requests watched up to, and when last looked
        self._step_calls = 0
        self._early: dict | None = None            # joined early: trains in the round in progress
        self._offered = -1                         # the round whose state this worker offered last
        self._offers: list[tuple[int, list]] = []  # (round, layout) offers made, deleted later
        self._uploader: threading.Thread | None = None
        self._snap_keys: Keys | None = None        # the uploader's own store connection
        self._early_joins = 0
        self._offer_refused = -1                   # an offered round whose model is not this one
        self._offer_wanted = -1                    # the round in which a joiner asked for an offer
        self._snapped = False                      # this worker wrote snapped/<me>
        self._reset_round()

    # ---- the training loop's side ------------------------------------------------------------

    def join(self) -> None:
        """Connects, waits until a round boundary admits this worker, then loads the global
        parameters into the model (`loop` calls it; call it yourself before the first inner step
        of a loop of your own). Returns at once if the run has already ended (`should_stop`)."""
        if self._joined:
            return
        if self._closed:
            raise RuntimeError(f"{_PREFIX}: join() after close()")
        self._joined = True
        try:
            self._pulse = Pulse(self._job_keys.clone(), self._me, self._heartbeat)
            self._keys = self._job_keys.under(f"era{self._era()}")
            self._admit()
        except BaseException:
            self.close()
            raise
        self._reset_round()
        self._mark = time.perf_counter()

    def step(self, samples: int | None = None, loss: float | None = None) -> bool:
        """Call after every inner step; synchronises when the round is over (returns True then)."""
        if not self._joined or self._closed or self._stopped:
            raise RuntimeError(f"{_PREFIX}: step() " + ("before join() (or use loop())" if not self._joined
                                                        else f"after the run stopped ({self._stop_reason})"
                                                        if self._stopped else "after close()"))
        now = time.perf_counter()
        self._pulse.check()
        self._watch_joiners()
        n = 1 if samples is None else int(samples)
        if n < 0:
            raise ValueError(f"{_PREFIX}: samples must be >= 0, got {samples!r}")
        self._step_calls += 1
        self._r_steps += 1
        self._r_samples += n
        if loss is not None and n > 0:
            self._r_loss += float(loss) * n
            self._r_loss_n += n
        self._totals["compute"] += now - self._mark
        self._timeline.append(("compute", self._mark, now))
        over = (self._r_steps >= self._steps if self._round_seconds is None
                else now - self._round_start >= self._round_seconds)
        try:
            if self._early is not None:
                over = self._early_step(over)
            elif over:
                self._end_round()
        except BaseException:
            self.close()
            raise
        self._mark = time.perf_counter()
        return over

    def loop(self, batches: Iterable, *, max_rounds: int | None = None,
             max_samples: int | None = None) -> Iterator:
        """Joins, yields ``batches`` until the run stops, then leaves (`finish`).

        ``max_rounds`` (rounds of the run, counted across restarts and joins) and ``max_samples``
        (samples of every worker together) stop every member at the same round; a worker whose
        ``batches`` end synchronises its last partial round and leaves, and the others go on."""
        for name, value in (("max_rounds", max_rounds), ("max_samples", max_samples)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{_PREFIX}: {name} must be > 0, got {value!r}")
        self._budgets = {"max_rounds": max_rounds or 0, "max_samples": max_samples or 0}
        self.join()
        try:
            if not self._stopped and self._early is None:     # (an early joiner is not a member yet)
                self._check_budgets()
            for item in batches:
                if self._stopped:
                    break
                calls = self._step_calls
                yield item
                if self._step_calls != calls + 1:
                    raise RuntimeError(f"{_PREFIX}: the body of loop() must call step() exactly once per batch "
                                       f"(it called it {self._step_calls - calls} times)")
        except GeneratorExit:
            if self._step_calls == calls + 1:     # the body stopped after its step (a break)
                self._finish("its loop stopped")
            else:
                # stopped inside the body (an exception, or a break before step()): the model may
                # be half-updated, so this round's steps are not synchronised
                self._finish("it stopped inside its loop (its partial round is not synchronised)",
                             synchronise=False)
            raise
        except BaseException:
            self.close()
            raise
        self._finish("its data ended")

    def finish(self) -> None:
        """Leaves in good order: synchronises this worker's partial round (if it took steps since
        the last synchronisation and the run goes on), tells the others it left (they drop it at
        once instead of after ``timeout``), and releases the group and the heartbeat."""
        self._finish("it finished")

    def _finish(self, why: str, synchronise: bool = True) -> None:
        if self._closed:
            return
        try:
            if synchronise and self._joined and not self._stopped and self._r_steps and self._early is None:
                self._end_round()     # (a worker that joined early and is not a member yet has no round to end)
            if self._keys is not None:
                self._keys.set(f"leave/{self._me}", {"round": self._round, "why": why})
        finally:
            self.close()

    def close(self) -> None:
        """Releases the group and stops the heartbeat, without telling anyone (the others drop
        this worker after ``timeout``). `finish` calls it."""
        if self._closed:
            return
        self._closed = True
        if self._pulse is not None:
            self._pulse.stop()
        self._destroy_group()
        if self._uploader is not None:
            self._uploader.join(timeout=2.0)
        try:
            self._withdraw_offers(everything=True)
        except StoreUnreachable:
            pass

    def __enter__(self) -> "ElasticDiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    @property
    def should_stop(self) -> bool:
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @property
    def rounds(self) -> int:
        """Rounds committed in the run (the same on every member)."""
        return self._round

    @property
    def history(self) -> list[dict]:
        """One record per round this worker committed (identical on every member of that round;
        a joiner receives the earlier ones): round, epoch, generation, members (worker ids),
        their steps, samples, mean losses and weights, and ``fingerprint``, a hash of the global
        parameters after the round's update."""
        return list(self._history)

    @property
    def membership(self) -> list[dict]:
        """Membership changes and failed synchronisations this worker saw, in order."""
        return list(self._events)

    def global_parameters(self) -> list[torch.Tensor]:
        return [g.detach() for g in self._global]

    def fingerprint(self) -> int:
        """A hash of the global parameters (equal on every member after each round)."""
        return _fingerprint(self._flatten_global())

    def stats(self) -> dict:
        """This worker's view: rounds, generation, current members, membership changes, samples
        of the run, and this worker's compute, idle (waiting for others) and sync seconds."""
        members = self._decision["members"] if self._decision else []
        return {"rounds": self._round, "generation": self._gen, "members": [m.split("#")[0] for m in members],
                "membership": self.membership, "samples_total": self._samples_total,
                "compute_seconds": self._totals["compute"], "idle_seconds": self._totals["idle"],
                "sync_seconds": self._totals["sync"], "early_joins": self._early_joins}

    def timeline(self) -> list[tuple[str, float, float]]:
        """(kind, start, end) in time.time() seconds: compute, idle, sync and, at the instant of
        each membership change, ("membership", t, t)."""
        offset = time.time() - time.perf_counter()
        return [(k, a + offset, b + offset) for k, a, b in self._timeline]

    # ---- checkpoints -------------------------------------------------------------------------

    _STATE_VERSION = 1

    def state_dict(self) -> dict:
        """The run's state as this worker holds it (CPU copies): global parameters, outer
        optimizer, round, samples, history, membership, and this worker's model and inner
        optimizer. Call it between rounds (after `join`, when `step` returned True, or after the
        run stopped); no communication."""
        if self._r_steps:
            raise RuntimeError(f"{_PREFIX}: state_dict() inside a round ({self._r_steps} steps since the last "
                               "synchronisation): call it when step() returned True")
        if not self._holds:
            raise RuntimeError(f"{_PREFIX}: state_dict() before this worker was admitted (it holds no state yet)")
        return _cpu_copy({
            "version": self._STATE_VERSION, "job": self.job, "global": list(self._global),
            "outer_optimizer": self.outer_optimizer.state_dict(), "round": self._round,
            "samples_total": self._samples_total, "history": self._history, "membership": self._events,
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict() if self.inner_optimizer is not None else None,
        })

    def load_state_dict(self, state: dict) -> None:
        """Loads a checkpoint before `join`: this worker then offers its state when the job's era
        starts (the holders of the latest round provide it; see the module doc)."""
        if self._joined:
            raise RuntimeError(f"{_PREFIX}: load_state_dict() after join(): load the checkpoint first")
        if state.get("version") != self._STATE_VERSION:
            raise ValueError(f"{_PREFIX}: checkpoint version {state.get('version')!r}, expected {self._STATE_VERSION}")
        if [tuple(t.shape) for t in state["global"]] != [tuple(g.shape) for g in self._global]:
            raise ValueError(f"{_PREFIX}: the checkpoint's parameters do not match the model's shapes")
        with torch.no_grad():
            for g, t in zip(self._global, state["global"]):
                g.copy_(t)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.model.load_state_dict(state["model"])
        if state["inner_optimizer"] is not None and self.inner_optimizer is not None:
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self._round, self._samples_total = int(state["round"]), int(state["samples_total"])
        self._history, self._events = list(state["history"]), list(state["membership"])
        self._start = self._flatten_global()
        self._holds = self._checkpoint = True

    # ---- rounds ------------------------------------------------------------------------------

    def _reset_round(self) -> None:
        self._r_steps = self._r_samples = self._r_loss_n = 0
        self._r_loss = 0.0
        self._r_share = 1.0            # the part of the round this worker trained (< 1: joined early)
        self._round_start = time.perf_counter()

    def _end_round(self, admitted: dict | None = None) -> None:
        """Synchronises the round (``admitted``: in the decision already read)."""
        begin = time.perf_counter()
        delta = (self._start - self._flatten_model()).float()
        self._count("sync", begin)
        column = self._column(delta)
        if not self._synchronise(delta, column, admitted=admitted):
            self._event({"round": self._round, "worker": self.worker_id, "dropped": self._dropped_why},
                        f"round {self._round}: this worker was dropped ({self._dropped_why}); its "
                        f"{self._r_steps} steps are discarded and it joins again")
            self._holds = False
            self._destroy_group()
            self._reset_round()
            self._new_incarnation()
            self._admit()
        self._check_budgets()
        self._reset_round()

    def _column(self, delta: torch.Tensor | None) -> list[float]:
        total = float(delta.double().sum()) if delta is not None and delta.numel() else 0.0
        col = [0.0] * _ROWS
        col[_SHARE] = self._r_share
        col[_STEPS], col[_SAMPLES] = self._r_steps, self._r_samples
        col[_LOSS_SUM], col[_LOSS_N] = self._r_loss, self._r_loss_n
        col[_FINITE] = 1.0 if math.isfinite(total) else 0.0
        col[_MAX_ROUNDS] = self._budgets.get("max_rounds", 0)
        col[_MAX_SAMPLES] = self._budgets.get("max_samples", 0)
        col[_CONFIG] = float(zlib.crc32(f"{self._codec_name}, numel={self._start.numel()}".encode()))
        return col

    def _check_budgets(self) -> None:
        limit_r, limit_s = self._budgets.get("max_rounds", 0), self._budgets.get("max_samples", 0)
        reason = None
        if limit_r and self._round >= limit_r:
            reason = f"max_rounds: {self._round} rounds"
        elif limit_s and self._samples_total >= limit_s:
            reason = f"max_samples: {self._samples_total} samples"
        if reason is not None:
            self._stopped, self._stop_reason = True, reason
            self._keys.first("ended", {"round": self._round, "reason": reason})

    # ---- membership --------------------------------------------------------------------------

    def _new_incarnation(self) -> None:
        """A dropped worker joins again as a new incarnation: the others may have marked the old
        one dead, and must not mistake it for a member."""
        self._pulse.stop()
        if self._snapped:
            self._snapped = False
            self._keys.delete(f"snapped/{self._me}")
        self._me = f"{self.worker_id}#{uuid.uuid4().hex[:8]}"
        self._pulse = Pulse(self._job_keys.clone(), self._me, self._heartbeat)

    def _registrations(self, keys: Keys, start: int) -> tuple[list[tuple[int, dict]], int]:
        """The join requests from index ``start`` on (index, request), and the index after them.
        A request whose index was taken but whose record never appeared (its worker died in
        between) is skipped once it has been missing for ``timeout`` seconds."""
        regs, i, count = [], start, keys.add("joins", 0)
        while i < count:
            if keys.has(f"join/{i}"):
                regs.append((i, keys.get(f"join/{i}")))
            else:
                first = self._gaps.setdefault(i, time.monotonic())
                if time.monotonic() - first <= self._timeout:
                    break                            # not written yet: next time
            i += 1
        return regs, i

    def _watch_joiners(self) -> None:
        """Between synchronisations, every half second (or heartbeat, if shorter): watch the
        workers that asked to join, so that by the round's end they have shown they live and can
        be admitted at once, and offer the state to those that join early."""
        now = time.monotonic()
        if self._decision is None or now - self._scanned[1] < min(self._heartbeat, 0.5):
            return
        regs, upto = self._registrations(self._keys, max(self._scanned[0], self._decision["admitted_upto"]))
        ours, watch, early = self._config(), [], False
        for _, r in regs:
            why = self._refusal(r.get("config"), ours)
            if why:
                self._refuse(self._keys, r["who"], why)
            else:
                watch.append(r["who"])
                early = early or bool(r.get("early"))
        self._pulse.watch(watch)
        self._scanned = (upto, now)
        if early:                    # (a member offers whatever its own early_join)
            self._offer_wanted = self._round
        if self._offer_wanted == self._round:
            self._offer_state()      # (retried at the next look if an upload is still under way)

    # ---- joining early: the state a round started from, offered through the store ------------

    def _offer_state(self) -> None:
        """A worker asked to join: offer it the state this round started from (the global
        parameters, the outer optimizer's state, the round count and history) so that it can
        train in the round in progress instead of waiting for its end. Every member of the last
        decision puts one shard of the raw bytes on the store (the transfer is spread over them),
        in values of at most `_CHUNK` bytes, sent from a thread; once per round."""
        decision = self._decision
        if (not self._holds or self._outcome != "commit" or decision is None or self._offered == self._round
                or self._me not in decision["members"] or (self._uploader and self._uploader.is_alive())):
            return
        begin = time.perf_counter()
        self._offered = rnd = self._round
        members = decision["members"]
        n, i = len(members), members.index(self._me)
        extra: list[torch.Tensor] = []
        skeleton = self._skeleton(self.outer_optimizer.state_dict(), extra)
        tensors = [g.detach() for g in self._global] + [t.detach() for t in extra]
        raw = [t.reshape(-1).contiguous().view(torch.uint8) for t in tensors]
        layout = _offer_layout(sum(r.numel() for r in raw), n)
        lo, hi, chunks = layout[i]
        mine = _byte_range(raw, lo, hi)
        last = self._history[-1] if self._history else None
        fingerprint = (last["fingerprint"] if last and last["round"] == rnd
                       else _fingerprint(self._flatten_global()))
        meta = {"round": rnd, "epoch": decision["epoch"], "shards": n, "bytes": layout[-1][1], "chunk": _CHUNK,
                "skeleton": _to_json(skeleton), "globals": len(self._global), "fingerprint": fingerprint,
                "tensors": [[str(t.dtype), list(t.shape), r.numel()] for t, r in zip(tensors, raw)],
                "samples_total": self._samples_total, "history": list(self._history),
                "membership": list(self._events), "budgets": dict(self._budgets), "codec": self._codec_name,
                "shapes": [list(g.shape) for g in self._global]}
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            self._log(f"cannot offer the state to joiners (the outer optimizer's state is not plain data: {e}); "
                      "they are admitted at the round's end")
            return
        if self._snap_keys is None:
            self._snap_keys = self._keys.clone()
        keys = self._snap_keys
        self._offers.append((rnd, layout, i))     # withdrawn (every shard of it) once the round is over

        def upload() -> None:
            try:
                for k in range(chunks):
                    keys.set_bytes(f"snap/r{rnd}/{i}/{k}", mine[k * _CHUNK:(k + 1) * _CHUNK])
                keys.set(f"snap/r{rnd}/{i}/sum", hashlib.blake2b(mine, digest_size=16).hexdigest())
                keys.first(f"snap/r{rnd}/meta", meta)
                if self._round == rnd:
                    keys.set("snap/latest", rnd)
                if self._round > rnd or self._closed:      # over while it was being sent
                    _delete_offer(keys, rnd, layout, None if self._round > rnd else i)
            except StoreUnreachable as e:
                self._log(f"could not offer the state of round {rnd} to a joiner: {e}")
        self._uploader = threading.Thread(target=upload, name="hetcomm-elastic-offer", daemon=True)
        self._uploader.start()
        self._count("sync", begin)

    def _withdraw_offers(self, everything: bool = False) -> None:
        """Deletes the offers of rounds that are over (all, when closing): every shard, a dead
        member's too (a joiner that loaded one is past it; one still reading falls back)."""
        old = [o for o in list(self._offers) if everything or o[0] < self._round]
        if old and self._keys is not None:
            for rnd, layout, i in old:
                self._offers.remove((rnd, layout, i))
                # the round in progress (closing): only its own shard; the others withdraw theirs,
                # and a joiner finds the offer incomplete and joins at the boundary
                _delete_offer(self._keys, rnd, layout, None if rnd < self._round else i)
        if self._snapped and (everything or self._holds):
            self._snapped = False
            self._keys.delete(f"snapped/{self._me}")

    def _take_offer(self, index: int, epoch: int, last: dict) -> bool:
        """A joiner, waiting (``last``: the latest decision, of epoch ``epoch - 1``): if the members
        offer the state that decision committed, load it and train from it (True); `_early_step`
        then watches for the round's decision."""
        keys = self._keys
        if (not keys.has("snap/latest") or not keys.has(f"e{epoch - 1}/outcome")
                or keys.get(f"e{epoch - 1}/outcome") != "commit"):
            return False
        rnd = int(keys.get("snap/latest"))
        if rnd == self._offer_refused or not keys.has(f"snap/r{rnd}/meta"):
            return False
        reader = keys.clone()
        if reader is not keys:
            reader.set_timeout(max(2.0, self._heartbeat))    # (an offer withdrawn meanwhile: no long wait)
        begin = time.perf_counter()
        try:
            if not reader.has(f"snap/r{rnd}/meta"):
                return False
            meta = reader.get(f"snap/r{rnd}/meta")
            if meta["epoch"] != epoch - 1:
                return False                  # the state of an earlier decision
            if not all(reader.has(f"snap/r{rnd}/{i}/sum") for i in range(meta["shards"])):
                return False                  # not all there yet (or a member died offering it)
            if meta["shapes"] != [list(g.shape) for g in self._global] or meta["codec"] != self._codec_name:
                self._offer_refused = rnd     # another model: the decision refuses this worker
                return False
            buf = bytearray(meta["bytes"])
            for i, (lo, hi, chunks) in enumerate(_offer_layout(meta["bytes"], meta["shards"], meta["chunk"])):
                shard = b"".join(reader.get_bytes(f"snap/r{rnd}/{i}/{k}") for k in range(chunks))
                if len(shard) != hi - lo or (hashlib.blake2b(shard, digest_size=16).hexdigest()
                                             != reader.get(f"snap/r{rnd}/{i}/sum")):
                    self._offer_refused = rnd
                    self._log(f"the state offered for round {rnd} arrived damaged: waiting for the boundary")
                    return False
                buf[lo:hi] = shard
        except StoreUnreachable:
            return False                      # withdrawn meanwhile, or the store died (the next call says)
        finally:
            del reader
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        pieces, at = [], 0
        for dtype, shape, nbytes in meta["tensors"]:
            pieces.append(flat[at:at + nbytes].clone().view(getattr(torch, dtype.removeprefix("torch."))).view(shape))
            at += nbytes
        if _fingerprint(torch.cat([p.reshape(-1).to(self._master) for p in pieces[:meta["globals"]]])) \
                != meta["fingerprint"]:
            self._offer_refused = rnd
            self._log(f"the state offered for round {rnd} does not match its fingerprint: waiting for the boundary")
            return False
        try:
            self.outer_optimizer.load_state_dict(self._fill(_from_json(meta["skeleton"]), pieces[meta["globals"]:]))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            self._offer_refused = rnd         # another outer optimizer: the decision refuses this worker
            self._log(f"cannot load the outer optimizer's state offered for round {rnd} ({e}): waiting for the boundary")
            return False
        with torch.no_grad():
            for g, piece in zip(self._global, pieces):
                g.copy_(piece)
        self._round, self._samples_total = meta["round"], meta["samples_total"]
        own = [e for e in self._events if e.get("worker") == self.worker_id and e not in meta["membership"]]
        self._history, self._events = list(meta["history"]), list(meta["membership"]) + own
        run = {k: meta["budgets"].get(k, 0) for k in ("max_rounds", "max_samples")}
        if {k: self._budgets.get(k, 0) for k in run} != run:
            self._log(f"the run's budgets are {run} (0 = none), not this worker's {self._budgets}: taking the run's")
            self._budgets = run
        self._start = self._flatten_global()
        self._load_global()
        self._holds = False                   # not a member until a decision names it
        keys.set(f"snapped/{self._me}", rnd)
        self._snapped = True
        self._count("sync", begin)
        if keys.has(f"e{epoch}/decision"):
            return False                      # the round ended meanwhile: its decision says what next
        self._early = {"index": index, "epoch": epoch, "round": rnd, "watched": last["members"],
                       "looked": 0.0, "began": time.perf_counter()}
        self._log(f"loaded the state of round {rnd} offered by {meta['shards']} members "
                  f"({len(buf) / 1e6:.1f} MB): training in round {rnd + 1} until its decision")
        return True

    def _round_share(self) -> float:
        """The part of the round an early joiner trained: its steps over ``steps``, or its time
        over ``round_seconds`` (`_weights`)."""
        if self._round_seconds is None:
            return min(1.0, self._r_steps / self._steps)
        return min(1.0, (time.perf_counter() - self._early["began"]) / self._round_seconds)

    def _early_step(self, over: bool) -> bool:
        """After each step of a worker that joined early: once the round's decision is out (waiting
        for it if this worker's round is over), take part in it as a holder of the state it
        loaded, its steps weighed by the part of the round it trained; if the decision does not name it a holder,
        discard the steps and be admitted as usual. Returns whether a synchronisation took place."""
        early, keys = self._early, self._keys
        poll, begin = _Poll(), time.perf_counter()
        while True:
            if keys.has(f"e{early['epoch']}/decision"):
                decision = keys.get(f"e{early['epoch']}/decision")
                break
            now = time.monotonic()
            if over or now - early["looked"] >= self._heartbeat:
                early["looked"] = now
                self._pulse.check()
                self._raise_if_refused(keys)
                if keys.has("ended"):
                    decision = None
                    break
                if all(self._pulse.silent(m) > self._timeout for m in early["watched"]):
                    raise RuntimeError(f"{_PREFIX}: every member of epoch {early['epoch'] - 1} "
                                       f"({self._names(early['watched'])}) is gone, and the run's state with them: "
                                       "restart the job from checkpoints (load_state_dict)")
            if not over:
                return False
            poll()
        if over:
            self._count("idle", begin)
        if decision is not None and self._me in decision["holders"]:
            self._r_share = self._round_share()
            self._early = None
            self._end_round(admitted=decision)
            if self._holds and self._history and self._history[-1]["round"] == decision["round"] + 1:
                self._early_joins += 1        # it contributed to the round it joined
            return True
        # left out, or named without the state it loaded (the round moved on): discard the steps
        self._early = None
        self._log(f"the round it joined early went on without it ({self._r_steps} steps discarded): "
                  "joining at the boundary")
        self._reset_round()
        self._admit(resume=(early["index"], early["epoch"]))
        if self._early is None and not self._stopped:
            self._check_budgets()
        self._reset_round()
        return self._early is None and not self._stopped

    def _era(self) -> int:
        """The job's current era (1 at the first start). A worker that loaded a checkpoint and
        finds the era's last members all silent starts the next one (a whole-job restart)."""
        era = int(self._job_keys.first("era", 1))
        if not self._checkpoint:
            return era
        keys = self._job_keys.under(f"era{era}")
        if not keys.has("latest"):
            return era
        newest = int(keys.get("latest"))          # written after its decision: it may lag behind
        while keys.has(f"e{newest + 1}/decision"):
            newest += 1
        last = keys.get(f"e{newest}/decision")
        if keys.has("ended"):
            dead = True
        else:
            self._pulse.watch(last["members"])
            poll = _Poll()
            while True:
                self._pulse.check()
                if keys.has(f"e{last['epoch'] + 1}/decision"):
                    return era                       # the era is alive: join it
                silent = min(self._pulse.silent(m) for m in last["members"])
                if silent > self._timeout:
                    dead = True
                    break
                poll()
        if dead:
            new = self._job_keys.swap("era", str(era), str(era + 1))
            era = int(new)
            self._log(f"era {era - 1} of job {self.job!r} has no live worker: this worker (checkpoint at round "
                      f"{self._round}) starts era {era}")
        return era

    def _admit(self, resume: tuple[int, int] | None = None) -> None:
        """Asks to join (or, with ``resume``, goes on waiting on the request it made: its join
        index and the next epoch to read) and waits for a decision that admits this worker; then
        takes part in epochs until one commits (this worker then holds the global state). Returns
        early, with ``_early`` set, when it takes the state offered for the round in progress."""
        keys = self._keys
        begin = time.perf_counter()
        if resume is None:
            index = self._register()
            epoch = int(keys.get("latest")) if keys.has("latest") else 1
        else:
            index, epoch = resume
        poll, watched, last = _Poll(), None, None
        while True:
            self._pulse.check()
            self._raise_if_refused(keys)
            if keys.has("ended"):
                ended = keys.get("ended")
                self._stopped, self._stop_reason = True, f"the run ended at round {ended['round']} ({ended['reason']})"
                self._joined = True
                self._count("idle", begin)
                return
            if keys.has(f"e{epoch}/decision"):
                decision = keys.get(f"e{epoch}/decision")
                if self._me in decision.get("refused", {}):
                    raise ValueError(f"{_PREFIX}: this worker cannot join run {self.job!r}: "
                                     f"{decision['refused'][self._me]}")
                self._pulse.watch(decision["members"])
                if self._me in decision["members"]:
                    self._count("idle", begin)
                    if self._synchronise(None, self._column(None), admitted=decision):
                        return
                    self._event({"round": decision["round"], "worker": self.worker_id,
                                 "dropped": f"while being admitted: {self._dropped_why}"},
                                f"dropped while being admitted ({self._dropped_why}): asking again")
                    self._destroy_group()
                    self._new_incarnation()
                    index, begin = self._register(), time.perf_counter()
                    epoch = int(keys.get("latest"))
                    continue
                if decision["admitted_upto"] > index:
                    # passed over (thought dead when the decision was taken), or refused in an
                    # earlier decision than this one: ask again unless refused
                    self._raise_if_refused(keys)
                    self._new_incarnation()
                    index = self._register()
                epoch += 1
                watched, last = decision["members"], decision
                self._pulse.watch(watched)
                self._pulse.keep(watched)
                continue
            if epoch == 1:
                self._bootstrap(keys)
            elif watched and all(self._pulse.silent(m) > self._timeout for m in watched):
                raise RuntimeError(f"{_PREFIX}: every member of epoch {epoch - 1} ({self._names(watched)}) is gone, "
                                   "and the run's state with them: restart the job from checkpoints (load_state_dict)")
            elif watched and self._early_join and self._take_offer(index, epoch, last):
                self._count("idle", begin)
                return
            poll()

    def _register(self) -> int:
        index = self._keys.add("joins", 1) - 1
        self._keys.set(f"join/{index}", {"who": self._me, "holds": self._holds, "round": self._round,
                                         "config": self._config(), "early": self._early_join})
        return index

    def _config(self) -> dict:
        """What a worker must share with the run to be admitted: the model's layout, the outer
        optimizer, the weighting, the compression, the backend and (for hetcomm) the settings
        every rank of a group must agree on."""
        shapes = ";".join(",".join(map(str, g.shape)) for g in self._global)
        return {"model": f"{len(self._global)} tensors, {sum(g.numel() for g in self._global)} elements in "
                         f"{str(self._master).removeprefix('torch.')}, shapes "
                         f"{hashlib.sha256(shapes.encode()).hexdigest()[:12]}",
                "outer optimizer": type(self.outer_optimizer).__name__, "weighting": self.weighting,
                "compression": self._codec_name, "backend": self._backend,
                "settings": _hosts.environment_settings() if "hetcomm" in str(self._backend) else {}}

    @staticmethod
    def _refusal(theirs, ours: dict) -> str | None:
        """Why a worker that registered ``theirs`` (its `_config`) cannot be admitted into a run
        whose members have ``ours`` (None: it can)."""
        if not isinstance(theirs, dict) or not all(k in theirs for k in ours) or \
                not isinstance(theirs["settings"], dict):
            return "its join request does not describe its configuration (another version of hetcomm?)"
        problems = [f"its {k} is {theirs[k]!r}, the run's {ours[k]!r}" for k in ours
                    if k != "settings" and theirs[k] != ours[k]]
        for name in sorted(set(ours["settings"]) | set(theirs["settings"])):
            value, other = ours["settings"].get(name, ""), theirs["settings"].get(name, "")
            if other != value:
                problems.append(f"it was started with {name}={other!r}, the run's workers with {name}={value!r}")
        return "; ".join(problems) or None

    def _refuse(self, keys: Keys, who: str, why: str) -> None:
        """Tells a joiner at once that it is refused (it also reads it in the next decision)."""
        keys.first(f"refused/{who}", why)

    def _note_waiting(self, line: str) -> None:
        if line != getattr(self, "_last_wait_note", None):
            self._last_wait_note = line
            self._log(line)

    def _raise_if_refused(self, keys: Keys) -> None:
        if keys.has(f"refused/{self._me}"):
            raise ValueError(f"{_PREFIX}: this worker cannot join run {self.job!r}: {keys.get(f'refused/{self._me}')}")

    def _bootstrap(self, keys: Keys) -> None:
        """The first decision of an era: once ``min_workers`` asked to join, they are its members
        (sorted by worker id: a deterministic order of ranks), the holders of the latest
        checkpoint its holders (else the first of them, whose fresh model everyone starts from).
        The run's configuration is the holders' (else the one most of them share, ties to the
        first): one whose configuration differs is refused."""
        found, count = self._registrations(keys, 0)
        if count < keys.add("joins", 0):
            return                                   # a request not written yet: next poll
        self._pulse.watch([r["who"] for _, r in found])
        regs = []
        for _, r in found:
            if self._pulse.confirmed(r["who"]):
                regs.append(r)
            elif self._pulse.silent(r["who"]) <= self._timeout:
                return                               # not known to live yet (nor to be dead): wait
        regs.sort(key=lambda r: r["who"])
        latest = max((r["round"] for r in regs if r["holds"]), default=None)
        refused: dict[str, str] = {}
        if regs:
            configs = [r.get("config") for r in regs]
            held = next((r.get("config") for r in regs if r["holds"] and r["round"] == latest), None)
            reference = held or max(configs, key=lambda c: (configs.count(c), -configs.index(c)))
            if isinstance(reference, dict) and isinstance(reference.get("settings"), dict):
                refused = {r["who"]: why for r in regs if (why := self._refusal(r.get("config"), reference))}
            regs = [r for r in regs if r["who"] not in refused]
        if len(regs) < self._min_workers:
            if refused:                              # refusals bind only with the decision: say why it waits
                self._note_waiting(f"waiting for min_workers={self._min_workers} workers whose configuration "
                                   f"agrees: {len(regs)} so far; " + "; ".join(
                                       f"{self._names([w])} differs ({why})" for w, why in refused.items()))
            return
        members = [r["who"] for r in regs]
        holders = [r["who"] for r in regs if r["holds"] and r["round"] == latest] or members[:1]
        decision = keys.first("e1/decision", {"epoch": 1, "gen": 1, "round": latest or 0, "members": members,
                                              "holders": holders, "left": {}, "joined": members,
                                              "refused": refused, "admitted_upto": count, "fresh": latest is None})
        for who, why in decision.get("refused", {}).items():
            self._refuse(keys, who, why)
        keys.set("latest", 1)

    def _decide(self, epoch: int) -> dict:
        """Waits until every member of the last epoch arrived at ``epoch`` or is out; the first to
        see it writes the decision; returns the decision (everyone's)."""
        keys, prev = self._keys, self._decision
        members = prev["members"]
        arrivals: dict[str, dict] = {}
        poll, last_missing, since = _Poll(), None, time.perf_counter()
        while True:
            self._pulse.check()
            if keys.has(f"e{epoch}/decision"):
                return keys.get(f"e{epoch}/decision")
            for m in members:
                if m not in arrivals and keys.has(f"e{epoch}/arrive/{m}"):
                    arrivals[m] = keys.get(f"e{epoch}/arrive/{m}")
            out: dict[str, str] = {}
            for m in members:
                if m in arrivals:
                    continue
                if keys.has(f"leave/{m}"):
                    out[m] = "left: " + keys.get(f"leave/{m}").get("why", "its data ended")
                elif self._pulse.silent(m) > self._timeout:
                    out[m] = self._why_gone(m)
            missing = [m for m in members if m not in arrivals and m not in out]
            if missing != last_missing:
                last_missing, since = missing, time.perf_counter()
            if missing and time.perf_counter() - since > self._late_timeout:
                out.update({m: f"not at the synchronisation {self._late_timeout:.0f} s after the others"
                            for m in missing})
                missing = []
            if not missing:
                joiners, refused, upto, pending = self._joiners(keys, prev, [m for m in members if m in arrivals])
                if not pending:
                    break
            poll()
        continuing = [m for m in members if m in arrivals]
        holders = [m for m in continuing if arrivals[m]["holds"]]
        # Nothing committed yet in an era that started from fresh models: everyone's model is as
        # good as the first holder's was. Anywhere else an empty list of holders is an error.
        fresh = bool(prev.get("fresh")) and self._outcome != "commit"
        if not holders and continuing and fresh and all(arrivals[m].get("fresh") for m in continuing):
            holders = continuing[:1]
        rounds = {arrivals[m]["round"] for m in holders} or {max(arrivals[m]["round"] for m in continuing)}
        if len(rounds) > 1:
            raise RuntimeError(f"{_PREFIX}: epoch {epoch}: members arrived at different rounds {sorted(rounds)} "
                               "(a bug: please report it)")
        rnd = rounds.pop()
        # joiners that loaded the state this round started from (`_take_offer`) hold it too
        holders += [j for j in joiners if keys.has(f"snapped/{j}") and keys.get(f"snapped/{j}") == rnd]
        new_members = continuing + joiners
        changed = new_members != members or self._outcome != "commit"
        decision = {"epoch": epoch, "gen": prev["gen"] + (1 if changed else 0), "round": rnd,
                    "members": new_members, "holders": holders,
                    "left": out, "joined": joiners, "refused": refused, "admitted_upto": upto, "fresh": fresh}
        decision = keys.first(f"e{epoch}/decision", decision)
        keys.set("latest", epoch)
        return decision

    def _joiners(self, keys: Keys, prev: dict,
                 continuing: list[str]) -> tuple[list[str], dict[str, str], int, bool]:
        """The workers that asked to join and have shown they live, those refused (why: another
        model, compression or hetcomm settings than the run's: they stop, the run goes on), the
        join index after them, and whether to wait a moment for one that asked just now (it had
        no time to show it lives). One not known to live after that waits for the next decision
        (with those after it); one silent for ``timeout`` is passed over (if alive, it asks again)."""
        regs, upto = self._registrations(keys, prev["admitted_upto"])
        ours = self._config()
        self._pulse.watch([r["who"] for _, r in regs if self._refusal(r.get("config"), ours) is None])
        joiners: list[str] = []
        refused: dict[str, str] = {}
        for index, r in regs:
            who = r["who"]
            if who in continuing or who in joiners or who in refused or keys.has(f"leave/{who}"):
                continue
            why = self._refusal(r.get("config"), ours)
            if why:
                self._refuse(keys, who, why)
                refused[who] = why
            elif self._pulse.confirmed(who):
                joiners.append(who)
            elif self._pulse.silent(who) <= self._timeout:
                if self._pulse.silent(who) <= 2 * self._heartbeat + 0.5:
                    return joiners, refused, index, True
                return joiners, refused, index, False
        return joiners, refused, upto, False

    def _synchronise(self, delta: torch.Tensor | None, column: list[float], admitted: dict | None = None) -> bool:
        """Epochs until one commits (True) or a decision leaves this worker out (False)."""
        while True:
            if admitted is None:
                begin = time.perf_counter()
                epoch = self._decision["epoch"] + 1
                self._keys.set(f"e{epoch}/arrive/{self._me}",
                               {"holds": self._holds, "round": self._round,
                                "fresh": not self._checkpoint and self._round == 0 and not self._history})
                decision = self._decide(epoch)
                self._count("idle", begin)
                if self._me not in decision["members"]:
                    self._dropped_why = decision["left"].get(self._me, "arrived after the decision")
                    self._decision = None
                    return False
            else:
                decision, admitted = admitted, None
            if self._attempt(decision, delta, column):
                return True

    def _attempt(self, decision: dict, delta: torch.Tensor | None, column: list[float]) -> bool:
        self._pulse.watch(decision["members"])
        self._pulse.keep(decision["members"])
        self._scanned = (decision["admitted_upto"], 0.0)     # watch the pending joiners again
        # The decision says who holds the state: a worker that loaded a checkpoint but is not
        # named (the run is past it) holds nothing until its transfer lands and a round commits.
        self._holds = self._me in decision["holders"]
        self._note_membership(decision)
        begin = time.perf_counter()
        if not decision["holders"]:
            raise RuntimeError(f"{_PREFIX}: round {decision['round']}: no member of epoch {decision['epoch']} "
                               "holds the run's state (every worker that did is gone): restart from checkpoints")
        reduced, table, failure = None, None, None
        try:
            if decision["gen"] != self._gen:
                self._form_group(decision)
            if set(decision["holders"]) != set(decision["members"]):
                self._transfer(decision)
            table, reduced = self._reduce(decision, delta, column)
        except StoreUnreachable:
            raise
        except ValueError:
            raise                                     # the same on every member: not a link failure
        except RuntimeError as e:
            failure = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        self._count("sync", begin)
        begin = time.perf_counter()
        outcome = self._outcome_of(decision, failure)
        self._count("idle", begin)
        self._decision, self._outcome = decision, "commit" if outcome == "commit" else "abort"
        if outcome != "commit":
            self._event({"round": decision["round"], "epoch": decision["epoch"], "generation": decision["gen"],
                         "aborted": outcome.removeprefix("abort: ")},
                        f"round {decision['round']}: synchronisation failed ({outcome.removeprefix('abort: ')}); "
                        "nothing applied, it is redone")
            self._destroy_group()
            members = tuple(decision["members"])
            self._aborts = (self._aborts if self._aborts and self._aborts[-1] == members else []) + [members]
            if len(self._aborts) >= _MAX_ABORTS:
                raise RuntimeError(f"{_PREFIX}: round {decision['round']}: the synchronisation failed {len(self._aborts)} "
                                   f"times in a row with the same members ({self._names(decision['members'])}); the "
                                   f"last: {outcome.removeprefix('abort: ')}")
            return False
        self._aborts = []
        begin = time.perf_counter()
        self._apply(decision, table, reduced)
        self._withdraw_offers()
        self._count("sync", begin)
        return True

    def _outcome_of(self, decision: dict, failure: str | None) -> str:
        """Two-phase end of an epoch: ``commit`` once every member is done, else ``abort: why``."""
        keys, epoch, members = self._keys, decision["epoch"], decision["members"]
        if failure is None:
            keys.add(f"e{epoch}/done", 1)
        else:
            keys.first(f"e{epoch}/outcome", f"abort: {self.worker_id}: {failure}")
        poll = _Poll()
        while True:
            self._pulse.check()
            if keys.has(f"e{epoch}/outcome"):
                return keys.get(f"e{epoch}/outcome")
            if keys.add(f"e{epoch}/done", 0) >= len(members):
                return keys.first(f"e{epoch}/outcome", "commit")
            gone = [m for m in members if self._pulse.silent(m) > self._timeout]
            if gone:
                return keys.first(f"e{epoch}/outcome", "abort: " + "; ".join(
                    f"{self._names([m])} gone during the synchronisation ({self._why_gone(m)})" for m in gone))
            poll()

    def _why_gone(self, member: str) -> str:
        silent = self._pulse.silent(member)
        return "its process exited" if math.isinf(silent) else f"no heartbeat for {silent:.1f} s"

    def _note_membership(self, decision: dict) -> None:
        refused = decision.get("refused", {})
        if not decision["left"] and not decision["joined"] and not refused:
            return
        names = self._names
        parts = [f"{names([m])} left ({why})" for m, why in decision["left"].items()]
        if decision["joined"]:
            parts.append(f"{names(decision['joined'])} joined")
        parts += [f"{names([m])} refused ({why})" for m, why in refused.items()]
        record = {"round": decision["round"], "epoch": decision["epoch"], "generation": decision["gen"],
                  "left": {names([m]): why for m, why in decision["left"].items()},
                  "joined": [names([m]) for m in decision["joined"]],
                  "members": [names([m]) for m in decision["members"]]}
        if refused:
            record["refused"] = {names([m]): why for m, why in refused.items()}
        self._event(record,
                    f"round {decision['round']}: " + "; ".join(parts) +
                    f"; members {names(decision['members'])} (generation {decision['gen']})")

    def _event(self, record: dict, line: str) -> None:
        if record in self._events:           # a joiner received the earlier ones already
            return
        self._events.append(record)
        now = time.perf_counter()
        self._timeline.append(("membership", now, now))
        self._log(line)

    def _log(self, line: str) -> None:
        if self._verbose:
            print(f"{_PREFIX} [{self.worker_id}]: {line}", flush=True)

    @staticmethod
    def _names(members: Sequence[str]) -> str:
        return ",".join(m.split("#")[0] for m in members)

    # ---- the generation's group --------------------------------------------------------------

    def _form_group(self, decision: dict) -> None:
        self._destroy_group()
        store = dist.PrefixStore(f"{self._keys.root}g{decision['gen']}", self._group_store.store)
        # torch names the default group after a counter (its keys on the store carry the name)
        # that a failed init_process_group advances and only destroy_process_group resets: put
        # it back, or this worker's next group would wait on keys its peers never write.
        count = dist.distributed_c10d._world.group_count
        try:
            dist.init_process_group(self._backend, store=store, rank=decision["members"].index(self._me),
                                    world_size=len(decision["members"]),
                                    timeout=datetime.timedelta(seconds=self._collective_timeout))
        except BaseException:
            if not dist.is_initialized():
                dist.distributed_c10d._world.group_count = count
            raise
        self._gen = decision["gen"]

    def _destroy_group(self) -> None:
        self._gen = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed group: it is being left behind anyway
                pass

    def _transfer(self, decision: dict) -> None:
        """The holders send the run's state to the members without it, one shard each."""
        members, holders = decision["members"], decision["holders"]
        sources = [members.index(h) for h in holders]
        mine = self._me in holders
        tensors: list[torch.Tensor] = []
        meta = None
        if mine:
            skeleton = self._skeleton(self.outer_optimizer.state_dict(), tensors)
            meta = {"skeleton": skeleton, "round": self._round, "samples_total": self._samples_total,
                    "history": self._history, "membership": self._events, "codec": self._codec_name,
                    "shapes": [list(g.shape) for g in self._global],
                    "sizes": [g.numel() for g in self._global] + [t.numel() for t in tensors]}
        box = [meta]
        dist.broadcast_object_list(box, src=sources[0])
        meta = box[0]
        if not mine:
            shapes = [list(g.shape) for g in self._global]
            if meta["shapes"] != shapes or meta["codec"] != self._codec_name:
                raise ValueError(f"{_PREFIX}: this worker cannot join: the run's model has parameter shapes "
                                 f"{meta['shapes']} and {meta['codec']}; this worker's {shapes} and {self._codec_name}")
        total = sum(meta["sizes"])
        if mine:
            flat = torch.cat([g.detach().reshape(-1).double() for g in self._global] +
                             [t.detach().reshape(-1).double() for t in tensors])
        else:
            flat = torch.zeros(total, dtype=torch.float64)
        for src, shard in zip(sources, flat.tensor_split(len(sources))):
            if shard.numel():
                dist.broadcast(shard, src=src)
        if mine:
            return
        pieces = flat.split(meta["sizes"])
        with torch.no_grad():
            for g, piece in zip(self._global, pieces):
                g.copy_(piece.view(g.shape))
        state = self._fill(meta["skeleton"], list(pieces[len(self._global):]))
        self.outer_optimizer.load_state_dict(state)
        self._round, self._samples_total = meta["round"], meta["samples_total"]
        own = [e for e in self._events if e.get("worker") == self.worker_id and e not in meta["membership"]]
        self._history, self._events = list(meta["history"]), list(meta["membership"]) + own
        self._start = self._flatten_global()
        self._load_global()

    @classmethod
    def _skeleton(cls, obj, tensors: list):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {"__tensor__": len(tensors) - 1, "shape": list(obj.shape), "dtype": str(obj.dtype)}
        if isinstance(obj, dict):
            return {k: cls._skeleton(v, tensors) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cls._skeleton(v, tensors) for v in obj)
        return obj

    @classmethod
    def _fill(cls, obj, pieces: list):
        if isinstance(obj, dict) and "__tensor__" in obj:
            dtype = getattr(torch, obj["dtype"].removeprefix("torch."))
            return pieces[obj["__tensor__"]].view(obj["shape"]).to(dtype).clone()
        if isinstance(obj, dict):
            return {k: cls._fill(v, pieces) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cls._fill(v, pieces) for v in obj)
        return obj

    def _reduce(self, decision: dict, delta: torch.Tensor | None,
                column: list[float]) -> tuple[list[list[float]], torch.Tensor | None]:
        col = list(column)
        col[_PRINT] = float(_fingerprint(self._flatten_global()))
        col[_HOLDS] = 1.0 if self._me in decision["holders"] else 0.0
        table = exchange_columns(col)
        self._agree_on_budgets(decision, table)
        prints = table[_PRINT]
        if len(set(prints)) > 1:
            raise ValueError(f"{_PREFIX}: round {decision['round']}: the members' global parameters differ "
                             f"(fingerprints {dict(zip(self._names(decision['members']).split(','), prints))}): "
                             "a bug, please report it")
        self._leave_out_offenders(decision, table)
        weights = self._weights(table)
        if not any(s > 0 for s in table[_STEPS]) or not any(w != 0.0 for w in weights):
            return table, None
        x = delta if delta is not None else torch.zeros(self._start.numel(), dtype=torch.float32)
        return table, _compress.weighted_allreduce(x, weights, codec=self._codec, finite_checked=True)

    def _weights(self, table: list[list[float]]) -> list[float]:
        """The outer update's weights. Under ``batch`` and ``uniform``, which weigh every member
        as if it trained the whole round, a member that joined early and trained a part of it
        weighs that part of its weight (its pseudo-gradient covers that part of a round: at full
        weight its few steps would dilute the update); ``samples`` and ``normalized`` follow the
        samples and steps themselves."""
        weights = outer_weights(self.weighting, table[_SAMPLES], table[_STEPS])
        if self.weighting in ("batch", "uniform") and any(f < 1.0 for f in table[_SHARE]):
            scaled = [w * min(1.0, max(0.0, f)) for w, f in zip(weights, table[_SHARE])]
            total = sum(scaled)
            weights = [w / total for w in scaled] if total > 0 else weights
        return weights

    def _leave_out_offenders(self, decision: dict, table: list[list[float]]) -> None:
        """A member whose pseudo-gradient is not finite, or whose compression or model size is not
        the run's, stops with a ValueError saying why; the others abort the attempt and redo the
        round without it. When every member is at fault, every member raises."""
        configs = {c for c, h in zip(table[_CONFIG], table[_HOLDS]) if h}
        if len(configs) > 1:
            raise ValueError(f"{_PREFIX}: round {decision['round']}: the workers that hold the run's state use "
                             "different compress/block settings or model sizes; every worker must use the same")
        offenders = {}
        for m, finite, config in zip(decision["members"], table[_FINITE], table[_CONFIG]):
            if finite == 0.0:
                offenders[m] = "its pseudo-gradient is not finite (NaN or Inf in its parameters)"
            elif configs and config not in configs:
                offenders[m] = "its compress/block settings or model size are not the run's"
        if not offenders:
            return
        if self._me in offenders:
            raise ValueError(f"{_PREFIX}: round {decision['round']}: this worker stops: {offenders[self._me]}; "
                             "no outer update was applied" + ("" if len(offenders) == len(decision["members"])
                                                              else " and the others go on without it"))
        raise RuntimeError("; ".join(f"{self._names([m])} left out: {why}" for m, why in offenders.items()))

    def _agree_on_budgets(self, decision: dict, table: list[list[float]]) -> None:
        """The run's budgets (`loop`'s max_rounds, max_samples) are the holders': they must agree;
        a joining worker started with others takes theirs (and says so)."""
        run = {}
        for name, row in (("max_rounds", _MAX_ROUNDS), ("max_samples", _MAX_SAMPLES)):
            values = {v for v, h in zip(table[row], table[_HOLDS]) if h}
            if len(values) > 1:
                raise ValueError(f"{_PREFIX}: round {decision['round']}: the workers passed different {name} to "
                                 f"loop(): {dict(zip(self._names(decision['members']).split(','), table[row]))} "
                                 "(0 = none); every worker must pass the same")
            run[name] = values.pop() if values else 0
        if {k: self._budgets.get(k, 0) for k in run} != run:
            self._log(f"the run's budgets are {run} (0 = none), not this worker's {self._budgets}: taking the run's")
            self._budgets = run

    def _apply(self, decision: dict, table: list[list[float]], reduced: torch.Tensor | None) -> None:
        if reduced is not None:
            for g, piece in zip(self._global, self._split(reduced)):
                g.grad = piece.view(g.shape).to(g.dtype)
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
        self._load_global()
        self._start = self._flatten_global()
        self._holds = True
        if not any(s > 0 for s in table[_STEPS]):
            self._round = decision["round"]         # an admission of the first generation: no round
            return
        weights = self._weights(table)
        self._round = decision["round"] + 1
        self._samples_total += round(sum(table[_SAMPLES]))
        self._history.append({
            "round": self._round, "epoch": decision["epoch"], "generation": decision["gen"],
            "members": self._names(decision["members"]).split(","),
            "steps": [round(s) for s in table[_STEPS]], "samples": [round(s) for s in table[_SAMPLES]],
            "loss": [s / n if n > 0 else None for s, n in zip(table[_LOSS_SUM], table[_LOSS_N])],
            "weights": weights, "fingerprint": _fingerprint(self._start),
        })

    # ---- parameters --------------------------------------------------------------------------

    def _count(self, kind: str, begin: float) -> None:
        end = time.perf_counter()
        self._totals[kind] += end - begin
        self._timeline.append((kind, begin, end))
