"""`DiLoCo`: the loop and its bookkeeping (construction, `step`, `loop`, `finish`, the round
boundary and the agreement on its table); the overlap's moves are in `schedule`, checkpoints in
`checkpoint`, the outer step in `outer`, the table in `table`."""
from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hetcomm import compress as _compress
from hetcomm._backend import group_timeout
from hetcomm.train import flat as _flat
from hetcomm.train.diloco import handoff
from hetcomm.train.diloco.agreement import Agreement
from hetcomm.train.diloco.checkpoint import Checkpoint
from hetcomm.train.diloco.outer import PER_PARAMETER, WEIGHTINGS, default_outer_optimizer, estimate_step
from hetcomm.train.diloco.pacing import check_pace
from hetcomm.train.diloco.results import Results
from hetcomm.train.diloco.schedule import Overlap, check_overlap_options, fragment_bounds
from hetcomm.train.diloco.shard import ShardedState
from hetcomm.train.diloco.shard import state_device as state_device_of
from hetcomm.train.diloco.stream import Streams
from hetcomm.train.diloco.table import _AGGREGATE, _BUDGETS, _TOT_BYTES, _TOT_IDLE, _TOT_SYNC, _TOT_WAN, _known
from hetcomm.train.local_steps import FixedSteps, LocalStepPolicy, SpeedSteps, StepTimes, TimeSteps, make_policy
from hetcomm.train.partition import exchange_columns
from hetcomm.train.workers import Workers, resolve_labels, resolve_members

_PREFIX = "hetcomm DiLoCo"


class DiLoCo(Results, ShardedState, Agreement, Checkpoint, Streams, Overlap, _flat.FlatParameters):
    """DiLoCo over ``group`` (default: the world) for ``model`` trained by ``inner_optimizer``.

    Args:
        model: the replica this rank trains; its floating-point parameters are synchronised.
        inner_optimizer: the optimizer the training loop steps (its parameters must be the
            model's); DiLoCo never steps it, it keeps its state across rounds.
        group: the process group (any backend with CPU tensors: hetcomm, gloo).
        outer_optimizer: ``callable(params) -> Optimizer`` over the global parameters (on the
            device of the state, ``state_device``); default `default_outer_optimizer`.
        local_steps: ``"fixed"``, ``"speed"``, ``"time"`` or a `hetcomm.local_steps.LocalStepPolicy`.
        steps: H: the steps per round of ``fixed``, the slowest rank's for ``speed`` and the
            length of a ``time`` round in the slowest rank's steps.
        round_seconds: ``time`` only: a fixed round length instead of H · t_slowest.
        weighting: ``"batch"`` (default), ``"samples"``, ``"uniform"`` or ``"normalized"`` (see the
            module doc).
        compress: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"`` or ``"int4"`` (`hetcomm.compress`).
        block: elements per int8 / int4 scale.
        error_feedback: carry the quantisation residual to the next round.
        overlap: synchronise in the background while the next round runs (see the module doc).
        overlap_steps: with overlap, when the late update moves the replica onto the new global
            parameters: None (default) as soon as it has arrived (checked after every step), or
            after this many inner steps of the next round, waiting for it if need be (a schedule
            that does not depend on timing: with ``fixed``, the run is deterministic).
        fragments: with overlap, reduce the pseudo-gradient in this many pieces (whole parameter
            tensors, about equal sizes, each with its own outer step) and move each piece of the
            replica as soon as it has landed (with ``overlap_steps`` = τ: τ steps after its
            synchronisation started, waiting for it if need be). Staggered (default): fragment f
            is synchronised at step ⌊f·H/F⌋ of every round (H: the worker's planned steps), so
            that the link carries one fragment at a time (`hetcomm.train.diloco.stream`);
            ``stagger=False``: all at the round boundary, one after another, the first landing
            after about 1/F of the synchronisation. Needs an outer optimizer whose step treats
            every parameter on its own (SGD, Adam, ...: a step skips parameters without a gradient).
        stagger: with ``fragments`` > 1, whether they are staggered over the round (see above).
        pace: staggered, spread each fragment's transfer over this share [0.05, 1] of its slot (a
            round's planned compute over F), hetcomm's backend (None: at once; `diloco.pacing`).
        early_weight: with overlap, the share of the displacement made by the steps taken before
            the late update landed that the replica keeps when it moves onto it (β in the module
            doc): 1 keeps those steps whole (the behaviour before this option), 0 drops them.
            Default (None) 0.25. The same on every rank. A round in which the update did not
            land before its end keeps its steps whole (the move then has no steps after it).
        ema: weight of the newest round in the agreed step times (`StepTimes`: of its seconds and of its steps).
        threshold: ``speed`` hysteresis: the predicted idle fraction must fall by this much.
        workers: what a DiLoCo worker is: ``"sites"`` (default: hetcomm's sites when the group
            spans two or more, else every rank), ``"ranks"``, or one label per group rank. A
            worker of several ranks trains one replica with synchronous data parallelism and
            spreads the outer reduction over its ranks (`hetcomm.train.workers`); the policies,
            weights, `history` and `stats` then count workers.
        inner_sync: with workers of several ranks, average the gradients over the worker before
            every step of ``inner_optimizer``; False when DDP or FSDP over `worker_group` does it.
        worker_backend: the backend of the groups inside a worker (default: the group's).
        shard_state: with workers of several ranks, each rank keeps DiLoCo's state (global
            parameters, outer-optimizer state, start point, pseudo-gradients, residuals) for its
            share of the model only, and the worker's ranks exchange the replica's new values
            after each update (`hetcomm.train.diloco.shard`). None (default): when every worker
            has two or more ranks and the outer optimizer is element-wise (SGD, Adam, ...); True:
            required (else an error); False: every rank keeps the whole state. Sharded, a rank
            holds only its share of the global parameters until `finish`:
            `gather_global_parameters` gathers them (docs/diloco.md#state-sharded-over-a-workers-ranks).
        state_device: where the state lives: None (default) on the device of the model's
            parameters when they all lie on one (a GPU's: the pseudo-gradients, outer step and
            codecs run there, and only the encoded bytes cross to the CPU for the group), else
            on the CPU; ``"cpu"``; ``"model"`` (an error when the parameters lie on several
            devices). An elastic run keeps it on the CPU (docs/diloco.md#where-the-state-lives).
        clock: the clock DiLoCo times steps, rounds and synchronisations by, in seconds
            (default ``time.perf_counter``); a simulation, or a test, may give one of its own.
        membership: None (default): the ranks of ``group``, fixed for the run;
            ``hetcomm.Elastic(store=..., ...)``: workers may die, come back, join and leave while
            it runs; the constructor then returns a `hetcomm.train.elastic.run.ElasticRun` (not a
            DiLoCo), which runs this class in generations (docs/elastic.md#diloco-in-generations).
    """

    def __new__(cls, *args, membership=None, **kwargs):
        if membership is None or membership == "fixed":
            return super().__new__(cls)
        from hetcomm.train.elastic.run import Elastic, ElasticRun
        if not isinstance(membership, Elastic):
            raise TypeError(f"{_PREFIX}: membership must be None (the group's ranks, fixed) or "
                            f"hetcomm.Elastic(store=...), got {membership!r}")
        return ElasticRun(*args, membership=membership, **kwargs)

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 membership: None = None, group: dist.ProcessGroup | None = None,
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 local_steps: str | LocalStepPolicy = "fixed", steps: int = 50,
                 round_seconds: float | None = None, weighting: str = "batch", compress: str = "fp32",
                 block: int = 2048, error_feedback: bool = False, overlap: bool = False,
                 overlap_steps: int | None = None, fragments: int = 1, stagger: bool = True, pace: float | None = None,
                 early_weight: float | None = None,
                 ema: float = 0.3, threshold: float = 0.01,
                 workers="sites", inner_sync: bool = True, worker_backend: str | None = None,
                 shard_state: bool | None = None, state_device: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{_PREFIX}: torch.distributed is not initialised "
                               "(call dist.init_process_group first)")
        if not callable(clock):
            raise TypeError(f"{_PREFIX}: clock must be a callable that returns seconds, got {type(clock).__name__}")
        self._group = group
        self._rank = dist.get_rank(group)
        if self._rank < 0:
            raise ValueError(f"{_PREFIX}: this process is not a member of the group")
        self._world = dist.get_world_size(group)
        self._labels = resolve_labels(workers, group, self._world)
        self._nworkers = max(self._labels) + 1
        self._col = self._labels[self._rank]          # this rank's worker: its column in the history
        if weighting not in WEIGHTINGS:
            raise ValueError(f"{_PREFIX}: unknown weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")
        self.weighting = weighting
        self._codec = _compress.get_codec(compress, block=block)
        self._error_feedback = bool(error_feedback)
        self._policy = make_policy(local_steps, steps, round_seconds=round_seconds, threshold=threshold)
        self._policy.bind(self._col, self._nworkers)
        self._times = StepTimes(self._nworkers, ema=ema)

        self.model = model
        self._model_params = [p for p in model.parameters() if p.is_floating_point()]
        if not self._model_params:
            raise ValueError(f"{_PREFIX}: the model has no floating-point parameters")
        if inner_optimizer is not None:
            mine = {id(p) for p in model.parameters()}
            stray = sum(1 for g in inner_optimizer.param_groups for p in g["params"] if id(p) not in mine)
            if stray:
                raise ValueError(f"{_PREFIX}: the inner optimizer steps {stray} tensors that are not parameters "
                                 "of the model (pass the optimizer of this model)")
        self.inner_optimizer = inner_optimizer
        if inner_sync and inner_optimizer is None and len(set(self._labels)) < self._world:
            raise ValueError(f"{_PREFIX}: workers of several ranks ({resolve_members(self._labels)}): pass the inner "
                             "optimizer (its gradients are averaged over the worker before each step), or "
                             "inner_sync=False with DDP over diloco.worker_group")
        factory = outer_optimizer or default_outer_optimizer
        if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
            raise TypeError(f"{_PREFIX}: outer_optimizer must be a callable params -> Optimizer "
                            "(the global parameters live inside DiLoCo), e.g. "
                            "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)")
        self.overlap = bool(overlap)
        self._rebase_after, self._early_weight = check_overlap_options(overlap, overlap_steps, early_weight,
                                                                       fragments)
        whole = fragment_bounds([p.numel() for p in self._model_params], fragments)
        self._whole_sizes = [b - a for _, _, a, b in whole]      # elements of each fragment, whole model

        # All replicas start from group rank 0's parameters; the state is held in fp32 (fp64 for
        # fp64 models), for the whole model or (sharded) this rank's pieces of it.
        master = torch.float64 if any(p.dtype == torch.float64 for p in self._model_params) else torch.float32
        self._master = master
        error = None
        try:
            self._device = state_device_of(self._model_params, state_device)
        except ValueError as e:                   # (told to the others in the agreement)
            error, self._device = e, torch.device("cpu")
        self._agree_on_device(state_device, group, error)
        self._workers = Workers(self._labels, group, worker_backend=worker_backend, background=self.overlap)
        error = None
        try:
            self._layout = self._choose_layout(shard_state, whole, self._labels, self._rank)
        except (ValueError, TypeError) as e:      # (a check one rank alone may fail: tell the others)
            error, self._layout = e, None
        refused = [r for r, bad in enumerate(exchange_columns([float(error is not None)], group=group)[0]) if bad]
        if error is not None:
            raise error
        if refused:
            raise ValueError(f"{_PREFIX}: rank(s) {refused} could not lay out DiLoCo's state (their error names the "
                             "cause)")
        self._broadcast_replica(group)
        self.outer_optimizer = self._make_outer_optimizer(factory, shard_state, whole)
        self._start = self._flatten_global()      # where the replica started this round
        if len(self._fragments) > 1 and type(self.outer_optimizer) not in PER_PARAMETER:
            raise ValueError(f"{_PREFIX}: fragments={fragments} steps the outer optimizer once per fragment, which "
                             f"only optimizers that treat each parameter on its own allow ({', '.join(sorted(c.__name__ for c in PER_PARAMETER))}); "
                             f"{type(self.outer_optimizer).__name__} may count steps per group: use fragments=1")
        self._agree_on_schedule(stagger, group)
        self._landed = 0                         # fragments of the update in flight that have landed
        self._moved = 0                          # ... and that this replica has moved onto
        # quantisation residuals: one per fragment (each is reduced as a vector of its own)
        self._feedback = ([_compress.ErrorFeedback() for _ in self._fragments] if self._error_feedback else None)
        self._rebased = True                     # no late update is waiting to be applied
        self._shortening_checked = True          # `_shorten_last_round` ran for the round in flight
        self._until_landed = False               # this round (the last, shortened) ends only once it landed
        self._pending_agreed = None              # (round, table) the one in flight agreed on
        self._warned_link_bound = False
        self._sync_group = group
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._groups_released = False
        self._pending: concurrent.futures.Future | None = None
        self._pending_round: tuple | None = None  # its pseudo-gradient and the round's counts (`carry`)
        self._pending_order = -1                 # ... its number (`_jobs`)
        if self.overlap:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self._world))
            backend = dist.get_backend(group)
            # Named by torch's group counter when every rank of the job calls this (a hashed name
            # depends on how many groups each rank has seen, which may differ across ranks).
            whole = len(ranks) == dist.get_world_size()
            # (the parent's timeout: a background collective a failure left waiting ends with it)
            self._sync_group = dist.new_group(ranks, backend=backend, timeout=group_timeout(group),
                                              use_local_synchronization=not whole)
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetcomm-diloco")
        # The round boundary works in place, in buffers of the model's size kept for the run: a
        # fresh 10 MB tensor costs its page faults every round (measured: 9 ms for one
        # subtraction of 2.4M floats, 0.4 ms in place), which a rank with a fifth of a core pays
        # five times over. Pseudo-gradients alternate between two buffers with overlap: one
        # travels while the next round's is computed; the idle one is the move's scratch.
        self._deltas = [torch.empty_like(self._start) for _ in range(2 if self.overlap else 1)]
        self._init_streams(stagger, check_pace(pace, self.overlap, fragments, stagger))
        self._next_delta = 0
        self._sync_wall = 0.0          # seconds the last background synchronisation took here
        self._background_syncs = 0     # started by this object (the first one is a warm-up)
        # Round 1 starts together everywhere: a rank still receiving the broadcast (or still
        # starting up) must not count as a slow rank that the others idle for. (The hook goes on
        # the optimizer after this last collective: a construction that fails leaves none.)
        dist.barrier(group=group)
        self._hook = None
        self._defer_hook_errors = False          # a failure of the hook's collective: kept, raised by step
        self._hook_error: RuntimeError | None = None
        if self._workers.size > 1 and inner_sync and not self._fsdp:
            params = [p for p in model.parameters() if p.requires_grad]
            self._hook = inner_optimizer.register_step_pre_hook(lambda *_: self._average_gradients(params))
        self._clock = clock
        self._wall_offset = time.time() - self._clock()
        self._reset_round()
        self._own_step: float | None = None
        self._totals = {"idle": 0.0, "sync": 0.0}
        self._bytes0 = self._bytes_sent()
        self._wan0 = self._workers.inter_worker_bytes(self._outer_groups())
        self._agreed_totals: dict[str, list[float]] = {}
        self._history: list[dict] = []
        self._settled = 0
        self._timeline: list[tuple[str, float, float]] = []
        self._finished = False
        self._final_global: list[torch.Tensor] | None = None
        self._closed = False
        self._exhausted = False                  # this rank has no more steps to take
        self._stopped = False                    # every rank agreed that the run is over
        self._stop_reason: str | None = None
        self._budgets = {k: 0.0 for k in _BUDGETS}
        self._step_calls = 0
        # An elastic run's hooks (`hetcomm.train.elastic.run`): whether this rank asks to end the
        # generation at the next agreement, and a fingerprint of the global parameters in every
        # round's record. `_applied` counts the outer steps applied (one per fragment).
        self._reform: Callable[[], int] = lambda: 0
        self._print_rounds = False
        self._applied = 0
        # reductions numbered in order, alike on every rank (`_fire_last`); those applied here (`carry.added`)
        self._jobs, self._applied_jobs = 0, set()
        self._t0 = self._clock()
        self._last_elapsed = 0.0
        self._policy.start_round(self._clock())
        self._plan_triggers()
        self._mark = self._clock()

    # ---- the training loop's side ------------------------------------------------------------

    @property
    def policy(self) -> LocalStepPolicy:
        return self._policy

    @property
    def rounds(self) -> int:
        """Rounds whose outer update this rank has applied (with overlap: waited for); every rank
        has the same count after the same number of synchronising `step` calls."""
        return self._settled

    @property
    def history(self) -> list[dict]:
        """One agreed record per settled round (identical on every rank): the policy's plan, each
        rank's steps, samples, compute seconds and mean loss, the outer weights, the per-rank
        totals of idle and sync seconds and bytes sent (hetcomm groups) as of that round's exchange,
        and ``landed_after_steps``: with overlap, the steps each worker had taken in the round when
        the previous round's update landed and moved it (its steps: at the round's end; 0: nothing
        was in flight, or no overlap; with fragments, averaged over the elements)."""
        return self._history[:self._settled]

    @property
    def should_stop(self) -> bool:
        """True once every rank agreed, at a synchronisation, that the run is over (all ranks
        out of data, or a budget of `loop` reached); then `step` must not be called again."""
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        """Why the run stopped (None while it runs): identical on every rank."""
        return self._stop_reason

    def step(self, samples: int | None = None, loss: float | None = None) -> bool:
        """Call after every inner step; synchronises when the round is over (returns True then).

        Args:
            samples: samples in the step's batch (default: 1, i.e. weighting by steps).
            loss: the step's mean loss, averaged per round into `history` (optional).
        """
        if self._finished or self._stopped or self._exhausted or self._closed:
            raise RuntimeError(f"{_PREFIX}: step() after the run stopped or this rank called finish() "
                               f"({self._stop_reason or 'finish'})")
        now = self._clock()
        dt = now - self._mark
        n = 1 if samples is None else int(samples)
        if n < 0:
            raise ValueError(f"{_PREFIX}: samples must be >= 0, got {samples!r}")
        self._step_calls += 1
        self._r_steps += 1
        self._r_samples += n
        self._count_window(n)
        self._r_compute += dt
        if loss is not None and n > 0:
            self._r_loss += float(loss) * n
            self._r_loss_n += n
        self._own_step = dt if self._own_step is None else 0.7 * self._own_step + 0.3 * dt
        self._timeline.append(("compute", self._mark, now))
        # As soon as the background synchronisation has agreed on its table (at its start; its last
        # fragment lands near this round's end): before the round can end, so that a round whose
        # synchronisation agreed and landed within one step still takes the last round's deadline.
        agreed = self._pending_agreed if self._pending is not None else None
        if agreed is not None and not self._shortening_checked:
            self._shortening_checked = True
            if isinstance(self._policy, TimeSteps):
                self._shorten_last_round(*agreed)
        synced = self._policy.round_over(self._r_steps, now, self._own_step)
        synced = synced or self._cut_for_joiners()
        # With overlap a measurement round goes on until the previous synchronisation has landed:
        # its length is only a measurement, and the steps train instead of idling at its end.
        stretch = self._pending is not None and (self._policy.measuring or self._until_landed)
        if synced and stretch and not self._pending.done():
            synced = False
        if self._workers.size > 1 and (stretch or self._reform_at_boundary
                                       or not isinstance(self._policy, (FixedSteps, SpeedSteps))):
            synced = self._workers.agree(synced)      # a worker's ranks end the round together
        if self._stagger:
            self._after_step_streams(synced)
        if synced:
            self._synchronise()
        elif self._pending is not None and not self._rebased:
            self._maybe_rebase()
        self._mark = self._clock()
        return synced

    def _average_gradients(self, params: list[torch.Tensor]) -> None:
        """The inner optimizer's pre-step hook, with workers of several ranks."""
        if self._hook_error is not None:
            return                                  # the worker's group failed: step raises it
        try:
            self._workers.average_gradients(params)
        except RuntimeError as e:
            if not self._defer_hook_errors:
                raise
            self._hook_error = e                    # (an elastic run ends the generation in step)

    def loop(self, batches: Iterable, *, max_rounds: int | None = None, max_samples: int | None = None,
             max_seconds: float | None = None, max_steps: int | None = None) -> Iterator:
        """Yields ``batches`` until every rank agrees to stop; then runs `finish`.

        The body must call `step` once per batch. When this rank's ``batches`` end, or it has
        taken ``max_steps`` steps (a budget of this rank only), the rank takes part in the
        following synchronisations without steps until every rank is out; ``max_rounds``,
        ``max_samples`` (all ranks together) and ``max_seconds`` (since construction, the slowest
        rank's clock) end the run for everyone at the first synchronisation that reaches them
        (with overlap the agreement on a round lands one round later: the budget then counts the
        round that is ending as the one before it, exact for a fixed schedule).
        Leaving the loop with ``break`` counts as this rank's data ending. With workers of
        several ranks, a worker stops stepping when any of its ranks has no batch left.
        Budgets of the run must be the same on every rank (a mismatch raises on every rank, at
        the first synchronisation). Every rank leaves at the same round boundary, whatever the
        policy; afterwards the model holds the global parameters and `stop_reason` says why.
        """
        for name, value in (("max_rounds", max_rounds), ("max_samples", max_samples), ("max_seconds", max_seconds),
                            ("max_steps", max_steps)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{_PREFIX}: {name} must be > 0, got {value!r}")
        if self._finished or self._closed or self._stopped:
            raise RuntimeError(f"{_PREFIX}: loop() after the run ended ({self._stop_reason or 'closed'}): one DiLoCo "
                               "object runs one loop; chain the epochs into one iterable")
        self._budgets = {"max_rounds": float(max_rounds or 0), "max_samples": float(max_samples or 0),
                         "max_seconds": float(max_seconds or 0)}
        taken = 0
        iterator = iter(batches)
        try:
            while not self._stopped:
                item, have = None, max_steps is None or taken < max_steps
                if have:
                    try:
                        item = next(iterator)
                    except StopIteration:
                        have = False
                if self._workers.size > 1:
                    have = self._workers.all_have(have)   # a worker's ranks stop stepping together
                if not have:
                    break
                calls = self._step_calls
                try:
                    yield item
                except GeneratorExit:
                    # `break` out of the loop: this rank is done, as if its data had ended (every
                    # rank that breaks drains with the others; the last round is synchronised).
                    self.finish()
                    raise
                if self._step_calls != calls + 1:
                    raise RuntimeError(f"{_PREFIX}: the body of diloco.loop() must call diloco.step() exactly once "
                                       f"per batch (it called it {self._step_calls - calls} times)")
                taken += 1
        except BaseException:
            self.close()          # no collective on the way out of an error: release what we hold
            raise
        self.finish()

    def finish(self) -> None:
        """This rank has no more steps: synchronises until every rank is done, then cleans up.

        A collective that ranks may reach at different rounds: a rank that calls it early (its
        data ran out) takes part in the others' synchronisations without steps until every rank
        has called it (or a budget of `loop` stopped the run), so all leave at the same round
        boundary. The last partial round of every rank is synchronised, and with overlap the
        background synchronisation is waited for. Afterwards the model holds the global
        parameters, `stats` covers the whole run, and the overlap's process group is destroyed.
        """
        if self._finished:
            return
        if self._closed:
            raise RuntimeError(f"{_PREFIX}: finish() after close()")
        self._exhausted = True
        try:
            self._drain()
            if self._layout is not None and any(p.dtype != self._master for p in self._model_params):
                # The model holds the global parameters rounded to its dtype: gather them whole
                # (the worker's groups go with close).
                self._final_global = self._gather_global()
        except BaseException:
            self.close()
            raise
        self._finished = True
        self.close()

    def _drain(self) -> None:
        while not self._stopped:
            self._synchronise()
        # The totals agreed at a synchronisation predate its own reduction: agree on them once
        # more, so that `stats` covers the whole run.
        self._reset_round()
        table = self._workers.aggregate(exchange_columns(self._column(torch.zeros(0)), group=self._sync_group),
                                        _AGGREGATE)
        self._agreed_totals.update({"idle": table[_TOT_IDLE], "sync": table[_TOT_SYNC],
                                    "bytes": _known(table[_TOT_BYTES]), "wan": _known(table[_TOT_WAN])})
        self._final_counts = (self._bytes_sent() - self._bytes0,
                              self._workers.inter_worker_bytes(self._outer_groups()) - self._wan0)

    def close(self) -> None:
        """Releases the background thread and the overlap's process group, without communicating
        (`finish` calls it; call it yourself only on the way out of an error)."""
        if self._closed:
            return
        self._closed = True
        # A synchronisation still running in the background (only on the way out of an error)
        # keeps using its group: leave both to the process's exit rather than pull them away.
        # One still queued is cancelled first: it never joins its collective, so the group is
        # destroyed, and the peers already in that collective fail at once instead of at their
        # timeout.
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._release_groups()

    def _release_groups(self) -> bool:
        """After `close`: destroys DiLoCo's own process groups once no background job uses them
        (the peers waiting in a collective that this rank will never join then fail at once);
        returns whether they are gone. An elastic run calls it again once the jobs it waited
        for have ended."""
        if any(f is not None and not f.done() for f in self._background_jobs()):
            return False
        if not self._groups_released:
            self._groups_released = True
            self._workers.destroy()
            if self._sync_group is not None and self._sync_group is not self._group:
                try:
                    dist.destroy_process_group(self._sync_group)
                except (RuntimeError, ValueError):
                    pass                              # already gone with the default group
                self._sync_group = self._group
        return True

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    # ---- synchronisation ---------------------------------------------------------------------

    def _reset_round(self) -> None:
        self._r_steps = 0
        self._r_samples = 0
        self._r_compute = 0.0
        self._r_loss = 0.0
        self._r_loss_n = 0
        # steps this round before the previous round's late update landed (0: none pending)
        # (staggered fragments: their moves this round count, whatever is in flight at the boundary)
        self._r_landed: float | None = None if self._pending is not None or self._stagger else 0
        self._moved_at: dict[int, tuple[int, int]] = {}     # fragment -> (whole elements, steps) of its move

    def _synchronise(self) -> None:
        # This thread's own work at the boundary (flattening, the start estimate, loading the
        # parameters) counts as sync; waiting and the exchange count themselves.
        begin = self._clock()
        progress = self._progress()                          # Δ_r in the master precision
        delta = progress.float()                             # what travels
        plan = self._policy.plan()
        if self._pending is not None and self._policy.measuring:
            plan = {**plan, "until_landed": True}       # a measurement round stretched (see step)
        self._count_sync(begin)
        if self._pending is not None:          # overlap: the previous round's synchronisation
            self._wait_pending()
        begin = self._clock()
        column = self._column(delta)
        # Once the run is to stop, the round is synchronous (never left in the background), and so
        # is the round max_rounds makes the last, even when no agreement landed to say so. (A rank
        # out of steps keeps the others' rhythm, agreements one round late, so that the policy's
        # plans, recorded in the history, stay identical on every rank.)
        limit = self._budgets["max_rounds"]
        last = bool(limit) and len(self._history) + 1 >= limit
        if self._reform_at_boundary and self._stagger and self._rebase_after is not None and not self._stopped:
            self._count_sync(begin)               # (before the agreement: see `_agree_on_reform`)
            self._fire_rest()
            begin = self._clock()
        self._agree_on_reform(last)
        if self._carry_round:
            self._carry_on()
            self._count_sync(begin)
            return
        if not self.overlap or self._stopped or last:
            self._count_sync(begin)
            if self._stagger:                     # (the jobs fired inside the round: idle)
                self._join_streams(agree=self._workers.size > 1)
            self._sending = self._applied         # until the global parameters are loaded
            self._sent, self._sending_from = {}, len(self._history)
            if self._stagger:
                self._fire_last()                 # their steps since their trigger, here and now
            error = None
            try:
                table, _ = self._exchange_and_reduce(column, delta, timed=True, plan=plan)
            except Exception as e:  # noqa: BLE001 - raised below, once the worker's ranks know
                error = e
            self._worker_agrees(error)
            begin = self._clock()
            self._after_agreement(table)
            self._load_global()
            self._share(range(len(self._fragments)))
            self._global_into(self._start)
            self._sending = None
            self._count_sync(begin)
            self._policy.start_round(self._clock())
        else:
            # The next round starts at Opt*(θ^{k-1}, Δ_r^k) (see the module doc), computed before
            # the background thread takes the outer optimizer.
            # The old start is no longer needed: the estimate replaces it in place.
            if self._stagger:
                self._count_sync(begin)
                self._fire_rest()                 # the fragments this round did not reach, first
                begin = self._clock()             # (each counts its own sync and idle)
            j, b = self._boundary[-1][1], self._boundary[-1][3]
            params = self._params[:j]
            start = _flat.split(self._start[:b], params)
            estimate_step(self.outer_optimizer, self._global[:j], _flat.split(progress[:b], params), start)
            self._landed = self._moved = 0
            self._pending_agreed = None
            job = handoff.after(handoff.fence(self._device), self._device, self._exchange_and_reduce)
            self._pending_order, self._jobs = self._jobs, self._jobs + 1
            self._pending = self._executor.submit(job, column, delta, timed=False, plan=plan, order=self._pending_order)
            counts = (self._r_steps, self._r_samples, self._r_compute, self._r_loss, self._r_loss_n)
            self._pending_round = (progress, counts)     # (carried on if it fails: `elastic.carry`)
            _flat.load(params, start)
            self._share(range(len(self._boundary)))
            self._rebased = False
            self._shortening_checked = False
            self._until_landed = False
            self._count_sync(begin)
            now = self._clock()
            # Deadlines chain: time a rank left unused before the last deadline is not lost.
            previous = getattr(self._policy, "deadline", None)
            self._policy.start_round(now, start=None if previous is None else max(previous, now))
        self._reset_round()
        self._plan_triggers()                     # after the policy started the round

    def _count_sync(self, begin: float) -> None:
        end = self._clock()
        self._totals["sync"] += end - begin
        self._timeline.append(("sync", begin, end))
