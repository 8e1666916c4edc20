"""`ElasticBase`: what an elastic run keeps besides its generations' DiLoCo (`ElasticRun`): its
construction, the store and the heartbeat, admission (`join`), the training loop's side (`loop`,
`finish`, `close`), the records (`membership`, `stats`, `timeline`) and the checkpoint's common
part; the protocol is the package's other modules (`hetcomm.train.elastic`)."""

from __future__ import annotations

import collections
import zlib
import math
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hetcomm import compress as _compress
from hetcomm.train import flat as _flat
from hetcomm.train.diloco.outer import WEIGHTINGS, default_outer_optimizer
from hetcomm.train.elastic.common import (_PREFIX, _MAX_ROUNDS, _MAX_SAMPLES, _CONFIG, _ROWS, _TIMELINE,
                                          _PER_RANK_VARIABLES)
from hetcomm.train.elastic.epochs import Epochs
from hetcomm.train.elastic.generation import Generation
from hetcomm.train.elastic.phases import Phases
from hetcomm._engine import store_seal_key
from hetcomm.train.membership import Keys, connect
from hetcomm.train.pulse import Pulse


class ElasticBase(Epochs, Generation, _flat.FlatParameters):
    """The membership side of an elastic run (`ElasticRun`, a subclass, runs the generations).

    Args: the model and inner optimizer as `hetcomm.DiLoCo`; the others as `Elastic` (``store``,
    ``worker_id``, ``job``, ``min_workers``, ``heartbeat``, ``timeout``, ``late_timeout``,
    ``collective_timeout``, ``backend``, ``verbose``), and ``outer_optimizer``, ``weighting``,
    ``compress``, ``block`` as `hetcomm.DiLoCo` (they are part of the configuration a joiner must
    share with the run).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 store, worker_id: str | None = None, job: str = "diloco",
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 weighting: str = "batch", compress: str = "fp32", block: int = 2048, min_workers: int = 1,
                 heartbeat: float = 2.0, timeout: float = 10.0, late_timeout: float = 600.0,
                 collective_timeout: float = 60.0, backend: str = "hetcomm", verbose: bool = True) -> None:
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(f"{_PREFIX}: torch.distributed is already initialised; an elastic run forms the "
                               "default process group itself, once per generation of workers (start the worker "
                               "without init_process_group)")
        for name, value in (("heartbeat", heartbeat), ("timeout", timeout), ("late_timeout", late_timeout),
                            ("collective_timeout", collective_timeout)):
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{_PREFIX}: {name} must be a positive number of seconds, got {value!r}")
        if timeout < 3 * heartbeat:
            raise ValueError(f"{_PREFIX}: timeout ({timeout} s) must be at least three heartbeats ({heartbeat} s): "
                             "observers sample the heartbeat once per interval, and beats jitter")
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
        self._min_workers, self._heartbeat, self._timeout = min_workers, float(heartbeat), float(timeout)
        self._late_timeout, self._collective_timeout = float(late_timeout), float(collective_timeout)
        self._backend, self._verbose, self.job = backend, verbose, job
        self._phases = Phases()               # (what a change of generation costs: `run`)
        self.worker_id = worker_id or os.environ.get("HETCOMM_WORKER_ID") or f"{socket.gethostname()}:{os.getpid()}"
        if not isinstance(self.worker_id, str) or "#" in self.worker_id or len(self.worker_id) > 256:
            raise ValueError(f"{_PREFIX}: worker_id must not contain '#' and have at most 256 characters, got "
                             f"{str(self.worker_id)[:300]!r}")
        self._me = f"{self.worker_id}#{uuid.uuid4().hex[:8]}"     # this incarnation

        client, address = connect(store, timeout=max(self._timeout, 5.0))
        root = f"hetcomm/ft/{job}/"
        # With HETCOMM_SECRET(_FILE), every value the workers trust is sealed (membership.Keys).
        self._job_keys = Keys(client, address, root, seal=store_seal_key(root))
        if self._job_keys.sealed and "hetcomm" not in str(backend):
            print(f"{_PREFIX}: warning: HETCOMM_SECRET seals the run's records on the store, but the {backend!r} "
                  "groups of its generations meet through the store unsealed: a store writer can redirect them "
                  "(use backend='hetcomm')", file=sys.stderr, flush=True)
        self._keys: Keys | None = None                            # the era's keys, once joined
        self._era_number = 0                                      # its era, once joined
        self._group_store = self._job_keys.clone()                # the generation groups' rendezvous
        self._group_store.set_timeout(2 * self._timeout)

        master = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        self._master = master
        with torch.no_grad():
            self._global = [torch.nn.Parameter(p.detach().to("cpu", master).clone()) for p in self._params]
        self.outer_optimizer = factory(self._global)

        self._holds = False            # this worker holds the run's global state (after admission)
        self._checkpoint = False       # it was loaded from a checkpoint before joining
        self._round = 0                # rounds committed in the run
        self._samples_total = 0
        self._history: list[dict] = []
        self._events: list[dict] = []
        self._decision: dict | None = None    # the last epoch's decision this worker took part in
        self._dropped_at = 0                  # the epoch of the decision that last dropped this worker
        self._outcome = "commit"
        self._gen: int | None = None
        self._joined = self._stopped = self._closed = False
        self._stop_reason: str | None = None
        self._budgets: dict[str, float] = {}
        self._pulse: Pulse | None = None
        self._gaps: dict[int, float] = {}     # join indices taken but not (yet) written: since when
        self._totals = {"idle": 0.0, "sync": 0.0}       # (the epochs')
        self._timeline: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=_TIMELINE)
        self._aborts: list[tuple[str, ...]] = []   # member lists of this round's failed attempts in a row
        self._scanned = (0, 0.0)                   # join requests watched up to, and when last looked
        self._step_calls = 0

    # ---- the training loop's side ------------------------------------------------------------

    def join(self) -> None:
        """Connects, waits until an epoch admits this worker, then loads the global
        parameters into the model (`loop` calls it; call it yourself before the first inner step
        of a loop of your own). Returns at once if the run has already ended (`should_stop`)."""
        if self._joined:
            return
        if self._closed:
            raise RuntimeError(f"{_PREFIX}: join() after close()")
        self._joined = True
        try:
            self._pulse = Pulse(self._job_keys.clone(), self._me, self._heartbeat)
            self._pulse.learn(getattr(self, "_liveness", {}))   # (a checkpoint's: `checkpoint.load`)
            self._era_number = self._era()
            self._pulse.hold("era", self._era_number)       # (a store writer may set it back)
            self._keys = self._job_keys.under(f"era{self._era_number}")
            self._admit()
        except BaseException:
            self.close()
            raise

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
            if not self._stopped:
                self._check_budgets()
            for item in self._agreed(batches):
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

    def _agreed(self, batches: Iterable) -> Iterator:
        """The batches this worker steps on (`ElasticRun`: until any rank of its worker has none)."""
        return iter(batches)

    def finish(self) -> None:
        """Leaves in good order: synchronises this worker's partial round (if it took steps since
        the last synchronisation and the run goes on), tells the others it left (they drop it at
        once instead of after ``timeout``), and releases the group and the heartbeat."""
        self._finish("it finished")

    def close(self) -> None:
        """Releases the group and stops the heartbeat, without telling anyone (the others drop
        this worker after ``timeout``). `finish` calls it."""
        if self._closed:
            return
        self._closed = True
        if self._pulse is not None:
            self._pulse.stop()
        self._destroy_group()

    def __enter__(self) -> "ElasticBase":
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
    def membership(self) -> list[dict]:
        """Membership changes, failed epochs and failed generations this worker saw, in order."""
        return list(self._events)

    def stats(self) -> dict:
        """This worker's view: rounds, generation, current members, membership changes, samples
        of the run, and the seconds this worker spent in epochs: idle (waiting for others) and
        sync (the epochs' collectives)."""
        members = self._decision["members"] if self._decision else []
        return {"rounds": self._round, "generation": self._gen, "members": [m.split("#")[0] for m in members],
                "membership": self.membership, "samples_total": self._samples_total,
                "idle_seconds": self._totals["idle"], "sync_seconds": self._totals["sync"]}

    def timeline(self) -> list[tuple[str, float, float]]:
        """(kind, start, end) in time.time() seconds of the epochs: idle, sync and, at the instant
        of each membership change, ("membership", t, t) (the rounds': `stats`' generations)."""
        offset = time.time() - time.perf_counter()
        return [(k, a + offset, b + offset) for k, a, b in self._timeline]

    # ---- checkpoints (`hetcomm.train.elastic.checkpoint`) ----------------------------------

    def _load_checkpoint(self, state: dict, version: int) -> None:
        """What a checkpoint holds besides a generation's own: checked against this worker's model,
        then loaded (the global parameters, outer optimizer, model, inner optimizer, round, samples,
        history and membership records); this worker then holds it when the era starts."""
        if state.get("version") != version:
            raise ValueError(f"{_PREFIX}: checkpoint version {state.get('version')!r}, expected {version}")
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
        self._holds = self._checkpoint = True

    # ---- epochs ------------------------------------------------------------------------------

    def _column(self) -> list[float]:
        """This worker's column of the epoch's table (`Generation._check_table`)."""
        col = [0.0] * _ROWS
        col[_MAX_ROUNDS] = self._budgets.get("max_rounds", 0)
        col[_MAX_SAMPLES] = self._budgets.get("max_samples", 0)
        col[_CONFIG] = float(zlib.crc32(f"{self._codec_name}, numel={sum(p.numel() for p in self._params)}".encode()))
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
