"""DiLoCo / local SGD for unequal workers: local steps set by measured speed, sample-weighted outer update.

::

    diloco = hetcomm.DiLoCo(model, opt, local_steps="time", steps=50)   # opt: the inner optimizer
    for x, y in diloco.loop(loader, max_samples=1_000_000):  # stops every rank at the same round
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        diloco.step(samples=len(x), loss=loss.item())        # synchronises when the round is over

After each round (its length from `hetcomm.local_steps`) every rank reduces the weighted
pseudo-gradient (`hetcomm.compress`; over workers of several ranks, `hetcomm.train.workers`) and
takes one outer step; with ``overlap=True`` that runs on a background thread during the next
round. Every rank must construct the object with the same arguments and call `step` after every
inner step. The algorithm and the derivations of the weighting and the overlap:
docs/diloco.md#the-algorithm, docs/diloco.md#outer-weights, docs/diloco.md#overlap-the-derivation.
"""
from __future__ import annotations

import concurrent.futures
import copy
import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hetcomm import compress as _compress
from hetcomm.train import flat as _flat
from hetcomm.train.local_steps import FixedSteps, LocalStepPolicy, SpeedSteps, StepTimes, TimeSteps, make_policy
from hetcomm.train.workers import Workers, resolve_labels, resolve_members
from hetcomm.train.partition import exchange_columns

__all__ = ["DiLoCo", "WEIGHTINGS", "outer_weights", "default_outer_optimizer"]

# With overlap and `time`, rounds stretched to at least this many times H steps by the
# synchronisation in flight are reported once (`DiLoCo._warn_if_link_bound`).
LINK_BOUND_WARNING = 1.25

_PREFIX = "hetcomm DiLoCo"
WEIGHTINGS = ("batch", "samples", "uniform", "normalized")

# Rows of the table exchanged at every synchronisation (one column per rank, exact and identical
# on every rank: `hetcomm.partition.exchange_columns`).
(_STEPS, _SAMPLES, _COMPUTE, _LOSS_SUM, _LOSS_N, _FINITE, _TOT_IDLE, _TOT_SYNC, _TOT_BYTES,
 _DONE, _ELAPSED, _MAX_ROUNDS, _MAX_SAMPLES, _MAX_SECONDS, _TOT_WAN, _REPLICA, _LANDED, _SYNC_WALL,
 _FRAGMENTS) = range(19)
_ROWS = 19
# How a worker of several ranks sums up its ranks' columns (`hetcomm.train.workers`): its ranks
# step together, so steps and seconds are its slowest rank's; samples, losses and bytes add up.
_AGGREGATE = ("max", "sum", "max", "sum", "sum", "min", "max", "max", "sum", "min", "max", "max", "max", "max", "sum",
              "max", "max", "max", "max")
_BUDGETS = {"max_rounds": _MAX_ROUNDS, "max_samples": _MAX_SAMPLES, "max_seconds": _MAX_SECONDS}


def default_outer_optimizer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def outer_weights(weighting: str, samples: Sequence[float], steps: Sequence[float]) -> list[float]:
    """The weights w_r of the outer update Δ = Σ_r w_r Δ_r (see the module doc).

    ``samples`` and ``steps`` are the agreed per-rank counts of the round. Ranks without steps
    (out of data, waiting for the others to finish) contribute nothing under every weighting
    (``uniform``: 1/P over the ranks with steps); if no rank processed a sample, the counts fall
    back to steps (a batch of one per step).
    """
    P = len(samples)
    if weighting == "uniform":
        active = sum(1 for t in steps if t > 0)
        return [1.0 / active if t > 0 else 0.0 for t in steps] if active else [1.0 / P] * P
    n = [float(s) for s in samples]
    if sum(n) <= 0:
        n = [float(t) for t in steps]
    total = sum(n)
    if total <= 0:
        return [0.0] * P
    p = [s / total for s in n]
    if weighting == "samples":
        return p
    if weighting == "batch":
        per_step = [x / t if t > 0 else 0.0 for x, t in zip(n, steps)]      # mean batch of each rank
        total_batch = sum(per_step)
        return [b / total_batch for b in per_step] if total_batch > 0 else [0.0] * P
    if weighting == "normalized":
        tau_eff = sum(pr * t for pr, t in zip(p, steps))
        return [pr * tau_eff / t if t > 0 else 0.0 for pr, t in zip(p, steps)]
    raise ValueError(f"{_PREFIX}: unknown weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")


def last_round_seconds(table: Sequence[Sequence[float]], agreed_samples: float) -> float | None:
    """With overlap, from the agreed table of the round before the last and the samples of every
    agreed round: after how many seconds of computing in the last round its sample budget is
    predicted to be reached, at the previous round's rate (its samples over its slowest rank's
    compute seconds, so idling does not count). None when there is no sample budget, it is not
    reached, or there is no rate to predict by."""
    limit, last, compute = table[_MAX_SAMPLES][0], sum(table[_SAMPLES]), max(table[_COMPUTE])
    if not (limit and last > 0 and compute > 0 and agreed_samples + last >= limit):
        return None
    return max(0.0, (limit - agreed_samples) * compute / last)


def _fragment_bounds(sizes: Sequence[int], fragments: int) -> list[tuple[int, int, int, int]]:
    """Up to ``fragments`` runs of consecutive tensors of about equal total size, none empty, as
    (first tensor, end tensor, first element, end element); fewer when fewer tensors hold
    elements. Empty tensors go with a neighbour."""
    n = len(sizes)
    cum = [0]
    for size in sizes:
        cum.append(cum[-1] + size)
    total = cum[-1]
    cuts = [0]
    for k in range(1, min(fragments, sum(1 for x in sizes if x > 0))):
        # the tensor boundary nearest k/F of the elements that leaves both sides non-empty
        options = [c for c in range(cuts[-1] + 1, n) if cum[cuts[-1]] < cum[c] < total]
        if not options:
            break
        cuts.append(min(options, key=lambda c: abs(cum[c] - total * k / fragments)))
    cuts.append(n)
    return [(i, j, cum[i], cum[j]) for i, j in zip(cuts, cuts[1:])]


# Outer optimizers whose step keeps per-parameter state only and skips parameters without a
# gradient: stepping the fragments one by one is one step (fragments > 1 allows these only).
_PER_PARAMETER = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam,
                            torch.optim.RAdam, torch.optim.Adamax, torch.optim.Adagrad, torch.optim.RMSprop})


def _known(values: Sequence[float]) -> list[float | None]:
    """NaN (not measured: a non-hetcomm group) as None, so that agreed records compare equal."""
    return [None if math.isnan(v) else v for v in values]


def _cpu_copy(obj):
    """A deep copy with every tensor detached and copied to the CPU (for checkpoints)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _hetcomm_bytes_sent(group: dist.ProcessGroup | None) -> float:
    """This rank's bytes sent on ``group`` so far, or NaN when the group is not hetcomm."""
    try:
        if dist.get_backend(group) != "hetcomm":
            return math.nan
        from hetcomm._backend import stats
        return float(sum(stats(group)["bytes_sent"]))
    except (RuntimeError, ValueError, ImportError, AttributeError):
        return math.nan


class DiLoCo(_flat.FlatParameters):
    """DiLoCo over ``group`` (default: the world) for ``model`` trained by ``inner_optimizer``.

    Args:
        model: the replica this rank trains; its floating-point parameters are synchronised.
        inner_optimizer: the optimizer the training loop steps (its parameters must be the
            model's); DiLoCo never steps it, it keeps its state across rounds.
        group: the process group (any backend with CPU tensors: hetcomm, gloo).
        outer_optimizer: ``callable(params) -> Optimizer`` over the global parameters (CPU);
            default `default_outer_optimizer`.
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
            tensors, about equal sizes, one after another, each with its own outer step) and move
            each piece of the replica as soon as it has landed (with ``overlap_steps``: all at
            that step). The first piece lands after about 1/F of the synchronisation instead of
            the whole (see the module doc). Needs an outer optimizer whose step treats every
            parameter on its own (SGD, Adam, ...: a step skips parameters without a gradient).
        early_weight: with overlap, the share of the displacement made by the steps taken before
            the late update landed that the replica keeps when it moves onto it (β in the module
            doc): 1 keeps those steps whole (the behaviour before this option), 0 drops them.
            Default (None) 0.25. The same on every rank. A round in which the update did not
            land before its end keeps its steps whole (the move then has no steps after it).
        ema: weight of the newest measurement in the agreed step times.
        threshold: ``speed`` hysteresis: the predicted idle fraction must fall by this much.
        workers: what a DiLoCo worker is: ``"sites"`` (default: hetcomm's sites when the group
            spans two or more, else every rank), ``"ranks"``, or one label per group rank. A
            worker of several ranks trains one replica with synchronous data parallelism and
            spreads the outer reduction over its ranks (`hetcomm.train.workers`); the policies,
            weights, `history` and `stats` then count workers.
        inner_sync: with workers of several ranks, average the gradients over the worker before
            every step of ``inner_optimizer``; False when DDP or FSDP over `worker_group` does it.
        worker_backend: the backend of the groups inside a worker (default: the group's).
        clock: the clock DiLoCo times steps, rounds and synchronisations by, in seconds
            (default ``time.perf_counter``); a simulation, or a test, may give one of its own.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 group: dist.ProcessGroup | None = None,
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 local_steps: str | LocalStepPolicy = "fixed", steps: int = 50,
                 round_seconds: float | None = None, weighting: str = "batch", compress: str = "fp32",
                 block: int = 2048, error_feedback: bool = False, overlap: bool = False,
                 overlap_steps: int | None = None, fragments: int = 1, early_weight: float | None = None,
                 ema: float = 0.3, threshold: float = 0.01,
                 workers="sites", inner_sync: bool = True, worker_backend: str | None = None,
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
        self._params = [p for p in model.parameters() if p.is_floating_point()]
        if not self._params:
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

        # All replicas start from group rank 0's parameters, held in fp32 (fp64 for fp64 models).
        master = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        self._master = master
        flat = self._flatten_model()
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(flat, src=src, group=group)
        self._global = [torch.nn.Parameter(piece.view(p.shape).to(master).clone())
                        for piece, p in zip(self._split(flat), self._params)]
        self.outer_optimizer = factory(self._global)
        self._load_global()
        self._start = self._flatten_global()      # where the replica started this round

        self.overlap = bool(overlap)
        if overlap_steps is not None and (isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int)
                                          or overlap_steps < 1 or not self.overlap):
            raise ValueError(f"{_PREFIX}: overlap_steps must be an int >= 1, with overlap=True (got "
                             f"{overlap_steps!r}, overlap={overlap!r})")
        self._rebase_after = overlap_steps
        if early_weight is not None and (isinstance(early_weight, bool) or not isinstance(early_weight, numbers.Real)
                                         or not 0.0 <= float(early_weight) <= 1.0 or not self.overlap):
            raise ValueError(f"{_PREFIX}: early_weight must be a number in [0, 1], with overlap=True (got "
                             f"{early_weight!r}, overlap={overlap!r})")
        self._early_weight = 0.25 if early_weight is None else float(early_weight)
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1 or (fragments > 1
                                                                                             and not self.overlap):
            raise ValueError(f"{_PREFIX}: fragments must be an int >= 1, > 1 only with overlap=True (got "
                             f"{fragments!r}, overlap={overlap!r})")
        self._fragments = _fragment_bounds([p.numel() for p in self._params], fragments)
        if len(self._fragments) > 1 and type(self.outer_optimizer) not in _PER_PARAMETER:
            raise ValueError(f"{_PREFIX}: fragments={fragments} steps the outer optimizer once per fragment, which "
                             f"only optimizers that treat each parameter on its own allow ({', '.join(sorted(c.__name__ for c in _PER_PARAMETER))}); "
                             f"{type(self.outer_optimizer).__name__} may count steps per group: use fragments=1")
        self._landed = 0                         # fragments of the update in flight that have landed
        self._moved = 0                          # ... and that this replica has moved onto
        self._moved_at: list[tuple[int, int]] = []     # (elements, steps taken) per move this round
        # quantisation residuals: one per fragment (each is reduced as a vector of its own)
        self._feedback = ([_compress.ErrorFeedback() for _ in self._fragments] if self._error_feedback else None)
        self._rebased = True                     # no late update is waiting to be applied
        self._shortening_checked = True          # `_shorten_last_round` ran for the round in flight
        self._until_landed = False               # this round (the last, shortened) ends only once it landed
        self._pending_agreed = None              # (round, table) the one in flight agreed on
        self._warned_link_bound = False
        self._sync_group = group
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        if self.overlap:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self._world))
            backend = dist.get_backend(group)
            # Named by torch's group counter when every rank of the job calls this (a hashed name
            # depends on how many groups each rank has seen, which may differ across ranks).
            whole = len(ranks) == dist.get_world_size()
            self._sync_group = dist.new_group(ranks, backend=backend, use_local_synchronization=not whole)
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetcomm-diloco")
        # The round boundary works in place, in buffers of the model's size kept for the run: a
        # fresh 10 MB tensor costs its page faults every round (measured: 9 ms for one
        # subtraction of 2.4M floats, 0.4 ms in place), which a rank with a fifth of a core pays
        # five times over. Pseudo-gradients alternate between two buffers with overlap: one
        # travels while the next round's is computed; the idle one is the move's scratch.
        self._deltas = [torch.empty_like(self._start) for _ in range(2 if self.overlap else 1)]
        self._next_delta = 0
        self._sync_wall = 0.0          # seconds the last background synchronisation took here
        self._background_syncs = 0     # started by this object (the first one is a warm-up)
        self._workers = Workers(self._labels, group, worker_backend=worker_backend, background=self.overlap)
        self._hook = None
        if self._workers.size > 1 and inner_sync:
            params = [p for p in model.parameters() if p.requires_grad]
            self._hook = inner_optimizer.register_step_pre_hook(
                lambda *_: self._workers.average_gradients(params))

        # Round 1 starts together everywhere: a rank still receiving the broadcast (or still
        # starting up) must not count as a slow rank that the others idle for.
        dist.barrier(group=group)
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
        self._closed = False
        self._exhausted = False                  # this rank has no more steps to take
        self._stopped = False                    # every rank agreed that the run is over
        self._stop_reason: str | None = None
        self._budgets = {k: 0.0 for k in _BUDGETS}
        self._step_calls = 0
        self._t0 = self._clock()
        self._last_elapsed = 0.0
        self._policy.start_round(self._clock())
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
        self._r_compute += dt
        if loss is not None and n > 0:
            self._r_loss += float(loss) * n
            self._r_loss_n += n
        self._own_step = dt if self._own_step is None else 0.7 * self._own_step + 0.3 * dt
        self._timeline.append(("compute", self._mark, now))
        synced = self._policy.round_over(self._r_steps, now, self._own_step)
        # With overlap a measurement round goes on until the previous synchronisation has landed:
        # its length is only a measurement, and the steps train instead of idling at its end.
        stretch = self._pending is not None and (self._policy.measuring or self._until_landed)
        if synced and stretch and not self._pending.done():
            synced = False
        if self._workers.size > 1 and (stretch or not isinstance(self._policy, (FixedSteps, SpeedSteps))):
            synced = self._workers.agree(synced)      # a worker's ranks end the round together
        if synced:
            self._synchronise()
        elif self._pending is not None:
            if not self._rebased:
                self._maybe_rebase()
            # As soon as the background synchronisation has agreed on its table, at its start:
            # its last fragment lands near this round's end (the round outlasts it by design).
            agreed = self._pending_agreed
            if agreed is not None and not self._shortening_checked:
                self._shortening_checked = True
                if isinstance(self._policy, TimeSteps):
                    self._shorten_last_round(*agreed)
        self._mark = self._clock()
        return synced

    def _shorten_last_round(self, round_index: int, table: list[list[float]]) -> None:
        """With ``time`` and overlap, once the previous round's (``round_index``) background
        synchronisation has agreed on its ``table``: if that agreement will stop the run
        (`_stop_decision`, at this round's end, from the same agreed values) and a sample budget is
        set, this round's deadline moves to where that budget is predicted to be reached
        (`last_round_seconds` of computing, less what this rank has computed so far, from now) if
        that is sooner: a long round at a slow link would otherwise overshoot it by up to a whole
        round. It still lasts until the synchronisation in flight has landed: ending sooner would
        only idle until then (the run ends at the same time either way), so the steps train
        instead. Round and time budgets keep the round whole; ``fixed`` and ``speed`` keep their
        step counts."""
        policy = self._policy
        if policy.deadline is None or policy.round_seconds is None:
            return
        # The rounds before it (the history gets round_index itself when its reduction ends).
        samples = sum(sum(rec["samples"]) for rec in self._history[:round_index - 1]) + sum(table[_SAMPLES])
        if self._stop_decision(table, ahead=True, settled=round_index, samples=samples) is None:
            return
        seconds = last_round_seconds(table, samples)
        if seconds is not None:
            policy.deadline = min(policy.deadline, self._clock() + max(0.0, seconds - self._r_compute))
            # Yet not before the synchronisation in flight has landed: the round would only wait
            # for it (1 s of a 17 s run at 20 Mbit/s, int4), and its steps train instead.
            self._until_landed = True

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
        busy = self._pending is not None and not self._pending.done()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if not busy:
            self._workers.destroy()
        if not busy and self._sync_group is not None and self._sync_group is not self._group:
            try:
                dist.destroy_process_group(self._sync_group)
            except (RuntimeError, ValueError):
                pass                                  # already gone with the default group
            self._sync_group = self._group

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    # ---- checkpoints -------------------------------------------------------------------------

    _STATE_VERSION = 2              # 2: "feedback" is a list (one per fragment), "sync_wall"

    def state_dict(self) -> dict:
        """Everything a resumed run needs, for this rank (CPU copies): the global parameters and the
        outer optimizer (identical on every rank), this rank's replica (the model's state), inner
        optimizer, start point and quantisation residuals, the policy's and the step times' state,
        the agreed history (rounds, samples: budgets of `loop` go on counting) and totals; with
        overlap also the synchronisation in flight, which it waits for (it blocks until every rank
        has ended the round) but does not apply.

        Call it at a round boundary (before the first step, when `step` returned True, or after
        `finish`); it does not communicate and changes nothing, so one rank may save alone (as
        long as the others keep stepping). Save each rank's dict (``torch.save``) if the replicas
        matter; `load_state_dict` on a freshly constructed object (same group, arguments and
        workers) resumes. A resumed run computes what the uninterrupted run computes, except that
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
        if self._pending is not None:
            start = self._clock()
            concurrent.futures.wait([self._pending])
            end = self._clock()
            self._totals["idle"] += end - start
            self._timeline.append(("idle", start, end))
            pending = {"table": self._pending.result()[0], "moved": self._rebased}
        if self._closed:
            sent, wan = self._final_counts
        else:
            sent = self._bytes_sent() - self._bytes0
            wan = self._workers.inter_worker_bytes(self._outer_groups()) - self._wan0
        state = _cpu_copy({
            "version": self._STATE_VERSION,
            "rank": self._rank,
            "labels": list(self._labels),
            "global": list(self._global),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict() if self.inner_optimizer is not None else None,
            "start": self._start,
            "feedback": [vars(f) for f in self._feedback] if self._feedback is not None else None,
            "pending": pending,
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
        first `step` (no communication). Another rank's state (when the replicas are alike) resumes
        the same global run; this rank then keeps its own counters and drops the other's
        quantisation residuals."""
        if self._step_calls or self._history:
            raise RuntimeError(f"{_PREFIX}: load_state_dict() after steps were taken: call it right after "
                               "constructing DiLoCo")
        if state.get("version") not in (1, self._STATE_VERSION):
            raise ValueError(f"{_PREFIX}: checkpoint version {state.get('version')!r}, expected 1 or {self._STATE_VERSION}")
        if list(state["labels"]) != list(self._labels):
            raise ValueError(f"{_PREFIX}: the checkpoint's workers {resolve_members(state['labels'])} differ from "
                             f"this run's {resolve_members(self._labels)} (the same group and workers are needed)")
        shapes = [tuple(g.shape) for g in self._global]
        if [tuple(t.shape) for t in state["global"]] != shapes:
            raise ValueError(f"{_PREFIX}: the checkpoint's parameters do not match the model's shapes")
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
                        setattr(fb, k, v.to("cpu") if isinstance(v, torch.Tensor) else v)
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
            self._landed = len(self._fragments)
            self._moved = self._landed if self._rebased else 0
        self._reset_round()
        self._policy.start_round(self._clock())
        self._mark = self._clock()

    # ---- results -----------------------------------------------------------------------------

    def global_parameters(self) -> list[torch.Tensor]:
        """The global parameters (CPU, identical on every rank after each synchronisation); with
        overlap, after the latest update that landed (a synchronisation in flight is waited for,
        not applied)."""
        if self._pending is not None and not self._closed:     # (a closed object's may never finish)
            concurrent.futures.wait([self._pending])
        return [g.detach() for g in self._global]

    def stats(self) -> dict:
        """Totals agreed at the last synchronisation, one entry per worker (per rank when every
        worker is one rank), identical on every rank.

        ``wan_bytes``: bytes each worker's ranks sent to ranks of other workers on DiLoCo's groups
        (the measurements' exchange and the outer reduction; with workers from sites, what crossed
        the WAN; None on groups that are not hetcomm's), ``wan_bytes_per_round`` their sum over
        workers per round. ``workers``: the group ranks of each worker.
        """
        t = self._agreed_totals
        if not t:
            return {}
        wall = [c + i + s for c, i, s in zip(t["compute"], t["idle"], t["sync"])]
        known_wan = all(b is not None for b in t["wan"])
        return {
            "rounds": self._settled,
            "workers": [list(m) for m in self._workers.members],
            "steps": [round(x) for x in t["steps"]],
            "samples": [round(x) for x in t["samples"]],
            "compute_seconds": t["compute"],
            "idle_seconds": t["idle"],
            "sync_seconds": t["sync"],
            "bytes_sent": t["bytes"],
            "wan_bytes": t["wan"],
            "wan_bytes_per_round": (sum(t["wan"]) / self._settled if known_wan and self._settled else None),
            "compute_fraction": [c / w if w > 0 else 0.0 for c, w in zip(t["compute"], wall)],
        }

    @property
    def workers(self) -> list[list[int]]:
        """The group ranks of each worker (one list per worker, in the order of `history`'s columns)."""
        return [list(m) for m in self._workers.members]

    @property
    def worker_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's worker (None when every worker is one rank): for DDP
        or FSDP inside the worker, with ``inner_sync=False``."""
        return self._workers.worker_group

    def timeline(self) -> list[tuple[str, float, float]]:
        """This rank's (kind, start, end) intervals in wall-clock seconds (time.time()):
        ``compute``, ``idle`` and ``sync`` (on the background thread with overlap)."""
        return [(k, a + self._wall_offset, b + self._wall_offset) for k, a, b in self._timeline]

    # ---- synchronisation ---------------------------------------------------------------------

    def _reset_round(self) -> None:
        self._r_steps = 0
        self._r_samples = 0
        self._r_compute = 0.0
        self._r_loss = 0.0
        self._r_loss_n = 0
        # steps this round before the previous round's late update landed (0: none pending)
        self._r_landed: float | None = None if self._pending is not None else 0
        self._moved_at = []

    def _column(self, delta: torch.Tensor) -> list[float]:
        # One pass: the float64 sum of a float32 vector is finite iff every element is (it cannot
        # overflow; an Inf or NaN anywhere makes it Inf or NaN). It is also the replica's fingerprint.
        total = float(torch.sum(delta, dtype=torch.float64)) if delta.numel() else 0.0
        finite = 1.0 if math.isfinite(total) else 0.0
        col = [0.0] * _ROWS
        col[_STEPS], col[_SAMPLES], col[_COMPUTE] = self._r_steps, self._r_samples, self._r_compute
        col[_LOSS_SUM], col[_LOSS_N], col[_FINITE] = self._r_loss, self._r_loss_n, finite
        col[_TOT_IDLE], col[_TOT_SYNC] = self._totals["idle"], self._totals["sync"]
        col[_TOT_BYTES] = self._bytes_sent() - self._bytes0
        col[_TOT_WAN] = self._workers.inter_worker_bytes(self._outer_groups()) - self._wan0
        col[_REPLICA] = total
        col[_LANDED] = self._landed_steps()
        col[_SYNC_WALL] = self._sync_wall
        col[_FRAGMENTS] = len(self._fragments)
        col[_DONE] = 1.0 if self._exhausted else 0.0
        col[_ELAPSED] = self._clock() - self._t0
        for name, row in _BUDGETS.items():
            col[row] = self._budgets[name]
        return col

    def _outer_groups(self) -> list:
        """The groups DiLoCo's synchronisation uses (the default group as None)."""
        groups = [self._sync_group]
        if not self._workers.single:
            groups += [self._workers.cross_group, self._workers.gather_group]
        return list({id(g): g for g in groups}.values())

    def _bytes_sent(self) -> float:
        return math.fsum(_hetcomm_bytes_sent(g) for g in self._outer_groups())

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
        # Once the run is to stop, the round is synchronous: the last round is never left in the
        # background. (A rank out of steps keeps the others' rhythm, agreements one round late,
        # so that the policy's plans, recorded in the history, stay identical on every rank.)
        if not self.overlap or self._stopped:
            self._count_sync(begin)
            table, _ = self._exchange_and_reduce(column, delta, timed=True, plan=plan)
            begin = self._clock()
            self._after_agreement(table)
            self._load_global()
            self._global_into(self._start)
            self._count_sync(begin)
            self._policy.start_round(self._clock())
        else:
            # The next round starts at Opt*(θ^{k-1}, Δ_r^k) (see the module doc), computed before
            # the background thread takes the outer optimizer.
            # The old start is no longer needed: the estimate replaces it in place.
            estimate = self._start_estimate(progress, out=self._start)
            self._landed = self._moved = 0
            self._pending_agreed = None
            self._pending = self._executor.submit(self._exchange_and_reduce, column, delta, timed=False, plan=plan)
            self._load_flat(estimate)
            self._rebased = False
            self._shortening_checked = False
            self._until_landed = False
            self._count_sync(begin)
            now = self._clock()
            # Deadlines chain: time a rank left unused before the last deadline is not lost.
            previous = getattr(self._policy, "deadline", None)
            self._policy.start_round(now, start=None if previous is None else max(previous, now))
        self._reset_round()

    def _count_sync(self, begin: float) -> None:
        end = self._clock()
        self._totals["sync"] += end - begin
        self._timeline.append(("sync", begin, end))

    @torch.no_grad()
    def _progress(self) -> torch.Tensor:
        """start − replica (Δ_r, master precision), in the next pseudo-gradient buffer."""
        out = self._deltas[self._next_delta]
        self._next_delta = (self._next_delta + 1) % len(self._deltas)
        for p, s, o in zip(self._params, self._split(self._start), self._split(out)):
            src = p.detach().reshape(-1)
            if src.device.type != "cpu" or src.dtype != o.dtype:
                o.copy_(src)                        # to the CPU and the master precision, no new tensor
                src = o
            torch.sub(s, src, out=o)
        return out

    @torch.no_grad()
    def _global_into(self, out: torch.Tensor) -> None:
        for g, o in zip(self._global, self._split(out)):
            o.copy_(g.detach().reshape(-1))

    @torch.no_grad()
    def _start_estimate(self, progress: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Opt*(θ^{k-1}, Δ_r^k) into ``out``: one outer step on a scratch copy of the outer
        optimizer's state (for torch.optim.SGD in closed form, without copying its state)."""
        if type(self.outer_optimizer) is torch.optim.SGD:
            return self._sgd_estimate(progress, out)
        return out.copy_(self._scratch_estimate(progress))

    @torch.no_grad()
    def _scratch_estimate(self, progress: torch.Tensor) -> torch.Tensor:
        """One step of any outer optimizer, its state and the global parameters restored after."""
        saved_state = copy.deepcopy(self.outer_optimizer.state_dict())
        saved = [g.detach().clone() for g in self._global]
        for g, piece in zip(self._global, self._split(progress)):
            g.grad = piece.view(g.shape).to(g.dtype)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        estimate = self._flatten_global()
        for g, old in zip(self._global, saved):
            g.copy_(old)
        self.outer_optimizer.load_state_dict(saved_state)
        return estimate

    @torch.no_grad()
    def _sgd_estimate(self, progress: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """torch.optim.SGD's step for gradient Δ_r, computed aside (into ``out``, which may not
        be ``progress``): d = ±Δ (− to maximize) + λθ; b = μ b + (1 − τ) d (b = d on the first
        step); d = d + μ b (Nesterov) or b; θ − η d. As a step is affine in d given b, it is
        θ − η (a d + c b_old) with a, c from the settings, computed in place without
        temporaries: (1 − η a λ) θ ∓ η a Δ − η c b_old."""
        if out is None:
            out = torch.empty_like(progress, dtype=self._master)
        settings = {id(p): group for group in self.outer_optimizer.param_groups for p in group["params"]}
        for g, d, o in zip(self._global, self._split(progress), self._split(out)):
            group = settings[id(g)]
            lr, mu, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
            old = self.outer_optimizer.state.get(g, {}).get("momentum_buffer") if mu else None
            if not mu:
                a, c = 1.0, 0.0
            elif old is None:                                   # the first step: b = d
                a, c = (1.0 + mu if group["nesterov"] else 1.0), 0.0
            else:
                keep = 1.0 - group["dampening"]
                a, c = ((1.0 + mu * keep, mu * mu) if group["nesterov"] else (keep, mu))
            sign = -1.0 if group.get("maximize", False) else 1.0
            o.copy_(g.detach().reshape(-1))
            if wd:
                o.mul_(1.0 - lr * a * wd)
            o.add_(d, alpha=-lr * a * sign)
            if c:
                o.add_(old.reshape(-1), alpha=-lr * c)
        return out

    def _maybe_rebase(self) -> None:
        """Moves the replica onto θ^k once round k's late update is in (see the module doc):
        p ← θ^k + β (p − θ̂_r^k), keeping a share β of the steps taken since its start; fragment by fragment
        as they land (a worker's ranks agree on how many)."""
        total = len(self._fragments)
        if self._rebase_after is None:
            # done: every fragment landed, or the synchronisation failed (-1: raised below on
            # every rank of the worker at once, before any move onto a partial update)
            done = self._pending.done()
            landed = (-1 if self._pending.exception() is not None else total) if done else self._landed
            if self._workers.size > 1:                 # a worker's replicas move at the same step
                landed = int(self._workers.least(landed))
            if landed < 0:
                if done and self._pending.exception() is not None:
                    self._pending.result()
                raise RuntimeError(f"{_PREFIX}: another rank of this worker failed its synchronisation "
                                   "(its error names the cause)")
            if landed < total:
                if landed > self._moved:
                    self._move_onto_global(landed)
                return
        elif self._r_steps < self._rebase_after:
            return
        start = self._clock()
        try:
            concurrent.futures.wait([self._pending])
        finally:
            end = self._clock()
            if end - start > 1e-4:
                self._totals["idle"] += end - start
                self._timeline.append(("idle", start, end))
        self._pending.result()                         # raises here if the synchronisation failed
        self._move_onto_global(total)
        self._rebased = True

    @torch.no_grad()
    def _move_onto_global(self, upto: int) -> None:
        """For the fragments landed since the last move (up to ``upto``): p ← θ^k + β (p − start),
        start ← θ^k (θ^k: the global parameters, the late update landed; β: ``early_weight``);
        counts as sync."""
        if upto <= self._moved:
            return
        start = self._clock()
        i, a = self._fragments[self._moved][0], self._fragments[self._moved][2]
        j, b = self._fragments[upto - 1][1], self._fragments[upto - 1][3]
        self._moved_at.append((b - a, self._r_steps))
        self._moved = upto
        # The pseudo-gradient buffer not in flight is free (its synchronisation was waited for).
        scratch = self._deltas[self._next_delta][a:b]
        params, glob = self._params[i:j], self._global[i:j]
        beta = self._early_weight
        for p, g, s, t in zip(params, glob, _flat.split(self._start[a:b], params), _flat.split(scratch, params)):
            new = g.detach().reshape(-1)
            if beta == 1.0:                             # p + θ^k − start: a small displacement added
                torch.sub(new, s, out=t)
                p.add_(t.view(p.shape).to(p.device, p.dtype))
            else:                                       # θ^k + β (p − start)
                t.copy_(p.detach().reshape(-1))         # to the CPU and the master precision
                t.sub_(s).mul_(beta).add_(new)
                p.copy_(t.view(p.shape))
            s.copy_(new)
        end = self._clock()
        self._totals["sync"] += end - start
        self._timeline.append(("sync", start, end))

    def _landed_steps(self) -> float:
        """Steps this round before the late update moved the replica (per element, averaged over
        its fragments; not yet moved: all of them; 0: nothing was in flight)."""
        if self._r_landed is not None:
            return self._r_landed
        n = self._start.numel()
        if n == 0:
            return self._r_steps
        moved = sum(size for size, _ in self._moved_at)
        return (sum(size * steps for size, steps in self._moved_at) + (n - moved) * self._r_steps) / n

    def _wait_pending(self) -> None:
        start = self._clock()
        future, self._pending = self._pending, None
        try:
            table = future.result()[0]
        finally:
            end = self._clock()
            self._totals["idle"] += end - start
            self._timeline.append(("idle", start, end))
        self._after_agreement(table, ahead=True)

    def _exchange_and_reduce(self, column: list[float], delta: torch.Tensor, *, timed: bool,
                             plan: dict) -> tuple[list[list[float]], list[float]]:
        group = self._sync_group
        start = self._clock()
        ranks = exchange_columns(column, group=group)
        agreed = self._clock()
        if timed:
            self._totals["idle"] += agreed - start
            self._timeline.append(("idle", start, agreed))
        round_index = len(self._history) + 1
        bad = [r for r in range(self._world) if ranks[_FINITE][r] == 0.0]
        if bad:
            raise ValueError(f"{_PREFIX}: round {round_index}: the pseudo-gradient of rank(s) {bad} is not finite "
                             "(NaN or Inf in their parameters); no outer update was applied")
        for name, row in _BUDGETS.items():
            if len(set(ranks[row])) > 1:
                raise ValueError(f"{_PREFIX}: the ranks passed different {name} to loop(): "
                                 f"{dict(enumerate(ranks[row]))} (0 = none); every rank must pass the same")
        if len(set(ranks[_FRAGMENTS])) > 1:             # the reduction would not line up
            raise ValueError(f"{_PREFIX}: the ranks reduce in different numbers of fragments: "
                             f"{dict(enumerate(int(x) for x in ranks[_FRAGMENTS]))}; construct DiLoCo with the same "
                             "fragments (and model) everywhere")
        split = self._workers.diverged(ranks[_REPLICA], list(zip(ranks[_STEPS], ranks[_LANDED])))
        if split:
            raise ValueError(f"{_PREFIX}: round {round_index}: the ranks of worker(s) {split} hold different replicas "
                             "(different steps, pseudo-gradients or steps at which the late update landed): a "
                             "worker's ranks must step together on the same replica (inner_sync=True, or DDP over "
                             "diloco.worker_group)")
        table = self._workers.aggregate(ranks, _AGGREGATE)
        if not timed:
            self._pending_agreed = (round_index, table)     # for `_shorten_last_round`, at once
        any_steps = any(s > 0 for s in table[_STEPS])
        weights = outer_weights(self.weighting, table[_SAMPLES], table[_STEPS])
        if any_steps and any(w != 0.0 for w in weights):
            for f, (i, j, a, b) in enumerate(self._fragments):
                feedback = self._feedback[f] if self._feedback is not None else None
                if self._workers.single:
                    part = _compress.weighted_allreduce(delta[a:b], weights, codec=self._codec, group=group,
                                                        feedback=feedback, finite_checked=True)
                else:                          # each rank of a worker carries one shard across
                    part = self._workers.reduce(delta[a:b], weights, codec=self._codec, feedback=feedback)
                # The outer step of this fragment's parameters alone (the others have no gradient).
                for g, piece in zip(self._global[i:j], _flat.split(part, self._global[i:j])):
                    g.grad = piece.view(g.shape).to(g.dtype)
                self.outer_optimizer.step()
                self.outer_optimizer.zero_grad(set_to_none=True)
                self._landed = f + 1           # the training thread may move onto these now
        self._landed = len(self._fragments)
        end = self._clock()
        self._timeline.append(("sync", agreed, end))
        if timed:
            self._totals["sync"] += end - agreed
        else:
            # From the agreement (not from this rank's boundary: waiting there for the last rank
            # would feed the skew between the ranks back into the round length). Not the first
            # one's: it pays for the group's first collectives and fresh connections (2.1 s
            # against 1.1 s at 20 Mbit/s, int4), and a round planned from it would be twice as
            # long as the link needs; unknown (0), the round lasts until the one in flight lands.
            self._background_syncs += 1
            self._sync_wall = end - agreed if self._background_syncs > 1 else 0.0
        if any_steps:
            self._record(table, weights, round_index, plan)
        return table, weights

    def _after_agreement(self, table: list[list[float]], ahead: bool = False) -> None:
        self._times.update(table[_COMPUTE], table[_STEPS])
        self._times.retire([d > 0 for d in table[_DONE]])
        if self.overlap:
            self._policy.sync_took(max(table[_SYNC_WALL]))
        self._policy.agreed(self._times)
        if self.overlap:
            self._warn_if_link_bound()
        self._agreed_totals = {
            "compute": [0.0] * self._nworkers, "idle": table[_TOT_IDLE], "sync": table[_TOT_SYNC],
            "bytes": _known(table[_TOT_BYTES]), "wan": _known(table[_TOT_WAN]),
            "samples": [0.0] * self._nworkers, "steps": [0.0] * self._nworkers,
        }
        self._settled = len(self._history)
        for rec in self._history:
            for key, row in (("compute", "compute_seconds"), ("samples", "samples"), ("steps", "steps")):
                self._agreed_totals[key] = [a + b for a, b in zip(self._agreed_totals[key], rec[row])]
        if not self._stopped:
            self._stop_reason = self._stop_decision(table, ahead)
            self._stopped = self._stop_reason is not None
        self._last_elapsed = max(table[_ELAPSED])

    def _warn_if_link_bound(self) -> None:
        """Once per object (group rank 0): says so when the synchronisation in flight, not compute,
        sets the length of `time`'s rounds. The replicas are then averaged less often per sample
        than H steps a round would (README, "When the link sets the pace")."""
        stretch = getattr(self._policy, "stretch", 1.0)
        if self._warned_link_bound or stretch < LINK_BOUND_WARNING or self._rank != 0:
            return
        self._warned_link_bound = True
        # Bytes per element: fp32 4, bf16/fp16 2, int8 about 1, int4 about 0.5 (plus a scale per block).
        fewer = {"fp32": "; compress='int8' sends about a quarter of fp32's bytes, 'int4' an eighth",
                 "bf16": "; compress='int8' sends about half the bytes of bf16, 'int4' a quarter",
                 "fp16": "; compress='int8' sends about half the bytes of fp16, 'int4' a quarter",
                 "int8": "; compress='int4' halves int8's bytes"}.get(self._codec.name, "")
        compute = self._policy.round_seconds / stretch
        warnings.warn(f"{_PREFIX}: the background synchronisation takes {self._policy.sync_seconds:.2f} s, longer "
                      f"than the {compute:.2f} s of {self._policy.steps} steps of the slowest worker: rounds last "
                      f"{stretch:.1f}x longer, so the replicas are averaged {stretch:.1f}x less often per sample than without "
                      f"overlap (the link, not compute, sets the pace){fewer}", RuntimeWarning, stacklevel=6)

    def _stop_decision(self, table: list[list[float]], ahead: bool, *, settled: int | None = None,
                       samples: float | None = None) -> str | None:
        """Why every rank stops after this agreement (None: go on); a function of agreed values only.

        ``ahead`` (overlap): the table is the previous round's, and stopping now still synchronises
        the round that is ending: its budgets count that round too, predicted as the previous one
        (exact for a fixed schedule; a run whose rounds grow may stop one round late)."""
        if all(d > 0 for d in table[_DONE]):
            return "every rank is out of data (or called finish)"
        rounds = self._settled if settled is None else settled
        samples = sum(self._agreed_totals["samples"]) if samples is None else samples
        elapsed = max(table[_ELAPSED])
        if ahead:
            rounds += 1
            samples += sum(table[_SAMPLES])
            elapsed += max(0.0, elapsed - self._last_elapsed)
        limit = {name: table[row][0] for name, row in _BUDGETS.items()}
        if limit["max_rounds"] and rounds >= limit["max_rounds"]:
            return f"max_rounds: {rounds} rounds"
        if limit["max_samples"] and samples >= limit["max_samples"]:
            return f"max_samples: {samples:.0f} samples"
        if limit["max_seconds"] and elapsed >= limit["max_seconds"]:
            return f"max_seconds: {elapsed:.1f} s"
        return None

    def _record(self, table: list[list[float]], weights: list[float], round_index: int, plan: dict) -> None:
        self._history.append({
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
        })

