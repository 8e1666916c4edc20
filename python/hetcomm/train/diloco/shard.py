"""State that scales with the worker: in a worker of S ranks, each rank keeps DiLoCo's state for
1/S of the model (global parameters, outer-optimizer state, start point, pseudo-gradients,
quantisation residuals) instead of all of it.

`Layout` cuts every fragment (whole tensors, `schedule.fragment_bounds`) into S contiguous
element ranges; the worker's rank k holds range k. A rank's *pieces* are the views of the model's
parameters that lie in its ranges, in order, and DiLoCo computes on them exactly as it would on
the whole model (its ``_params``): the round's pseudo-gradient, the start estimate, the outer
step and the moves are element-wise, and the replicas of a worker's ranks are identical (they
train one replica with synchronous data parallelism), so the rank that holds a range can compute
the replica's new values there alone. After each such write the worker's ranks exchange what
they wrote (`Layout.exchange`, over the worker's group, in chunks of at most `CHUNK` elements),
and every rank holds the whole replica again. Across workers, rank k of every worker reduces
range k (the worker's cross group), as the replicated layout's sharded reduction did.

Ranks of a worker beyond the smallest worker's size (workers of unequal sizes) hold no range:
they receive the replica and keep no state. The derivation and the memory it takes:
docs/diloco.md#state-sharded-over-a-workers-ranks.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from hetcomm import compress as _compress
from hetcomm.train import flat as _flat
from hetcomm.train.diloco.outer import PER_PARAMETER
from hetcomm.train.partition import exchange_columns
from hetcomm.train.workers import resolve_members, shard_bounds

__all__ = ["CHUNK", "Layout", "LocalShards", "ShardedState", "reachable_bytes", "shard_bounds", "state_device"]

_PREFIX = "hetcomm DiLoCo"

# Elements per all-gather of the exchange: the exchange's buffers, (ranks + 1) x CHUNK elements of
# the master precision, are the only memory of a rank that does not shrink with the worker.
CHUNK = 1 << 18


STATE_DEVICES = (None, "cpu", "model")


def state_device(params: Sequence[torch.Tensor], option: str | None) -> torch.device:
    """Where this rank would keep DiLoCo's state (DiLoCo's ``state_device``; the ranks then
    agree: `ShardedState._agree_on_device`): ``"cpu"``; ``"model"``: the device of the model's
    parameters (of their local shards with FSDP2), the CPU or one CUDA device, an error
    otherwise; None (default): that device when it is one CUDA device, else the CPU (a device
    without float64, as MPS, could not compute the fingerprints there)."""
    if option not in STATE_DEVICES:
        raise ValueError(f"{_PREFIX}: state_device must be None, 'cpu' or 'model', got {option!r}")
    devices = sorted({str(p.device) for p in params})
    if option == "cpu":
        return torch.device("cpu")
    one = torch.device(devices[0]) if len(devices) == 1 else None
    if one is not None and one.type in ("cpu", "cuda"):
        return one
    if option == "model":
        raise ValueError(f"{_PREFIX}: state_device='model' needs the model's parameters on the CPU or on one CUDA "
                         f"device, they lie on {', '.join(devices)}: state_device='cpu'")
    return torch.device("cpu")


def _offsets(sizes: Iterable[int]) -> list[int]:
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    return cum


@torch.no_grad()
def _copy_range(tensors: Sequence[torch.Tensor], cum: Sequence[int], x: int, y: int, flat: torch.Tensor, *,
                into: bool) -> None:
    """Elements [x, y) of ``tensors`` laid end to end (``cum``: their offsets) to ``flat``, or
    with ``into`` from ``flat`` into the tensors (dtype and device converted)."""
    t = bisect.bisect_right(cum, x) - 1
    done = 0
    while x < y:
        while cum[t + 1] <= x:
            t += 1
        end = min(y, cum[t + 1])
        part = tensors[t].detach().reshape(-1)[x - cum[t]:end - cum[t]]
        if into:
            part.copy_(flat[done:done + end - x])
        else:
            flat[done:done + end - x].copy_(part)
        done += end - x
        x = end


class Layout:
    """Where rank ``index`` of a worker of ``size`` ranks keeps its part of DiLoCo's state (see
    the module doc). ``fragments``: (first tensor, end tensor, first element, end element) of
    each fragment of the whole model; ``index`` None: this rank holds nothing."""

    replicated = True      # the worker's ranks each hold the whole replica

    def __init__(self, params: Sequence[torch.Tensor], fragments: Sequence[tuple[int, int, int, int]],
                 shards: int, index: int | None) -> None:
        self.shards, self.index = shards, index
        self.whole = [tuple(f) for f in fragments]            # the fragments of the whole model
        self._full = _offsets(p.numel() for p in params)
        self.pieces: list[tuple[int, int, int]] = []          # (tensor, first element, elements)
        self.fragments: list[tuple[int, int, int, int]] = []  # each fragment in the pieces' space
        local = 0
        for i, j, a, b in self.whole:
            bounds = shard_bounds(b - a, shards)
            lo, hi = (a + bounds[index], a + bounds[index + 1]) if index is not None else (a, a)
            first, start = len(self.pieces), local
            for t in range(i, j):
                x, y = max(self._full[t], lo), min(self._full[t + 1], hi)
                if y > x:
                    self.pieces.append((t, x - self._full[t], y - x))
                    local += y - x
            self.fragments.append((first, len(self.pieces), start, local))
        self.size = local                                      # elements this rank holds
        if not self.pieces:
            # A rank with no share: one empty piece, outside every fragment (an optimizer needs
            # a parameter; the state is empty all the same).
            self.pieces.append((0, 0, 0))
        self._local = _offsets(n for _, _, n in self.pieces)
        longest = max((max(b - a for a, b in zip(s, s[1:])) for s in
                       (shard_bounds(f[3] - f[2], shards) for f in self.whole)), default=0)
        self.chunk = max(1, min(CHUNK, longest))
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def describe(self) -> dict:
        """What a checkpoint of this rank's state needs to match."""
        return {"shards": self.shards, "index": self.index, "fragments": [list(f) for f in self.whole]}

    def views(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces of ``params`` (the model's, in the order given at construction):
        1-D views that write through to the parameters."""
        return [params[t].detach().view(-1)[o:o + n] for t, o, n in self.pieces]

    @torch.no_grad()
    def exchange(self, fragments: Iterable[int], local: Sequence[torch.Tensor], full: Sequence[torch.Tensor], *,
                 group: dist.ProcessGroup | None, size: int, dtype: torch.dtype) -> None:
        """Collective over the worker's ``size`` ranks (``group``, rank k of the worker is shard
        k): every rank's ``local`` pieces of ``fragments`` (tensors in the pieces' order, this
        rank's part) written into ``full`` (one tensor per parameter of the whole model) on every
        rank, in chunks of at most `CHUNK` elements of ``dtype``."""
        if self._buffers is None or self._buffers[1].shape[0] != size or self._buffers[0].dtype != dtype:
            # kept for the run: fresh ones would pay their page faults at every exchange
            self._buffers = (torch.zeros(self.chunk, dtype=dtype), torch.empty(size, self.chunk, dtype=dtype))
        send, recv = self._buffers
        for f in fragments:
            _, _, a, b = self.whole[f]
            bounds = shard_bounds(b - a, self.shards)
            longest = max(y - x for x, y in zip(bounds, bounds[1:]))
            mine = self.fragments[f][2]
            held = self.fragments[f][3] - mine
            for c in range(0, longest, self.chunk):
                m = min(self.chunk, longest - c)
                if c < held:
                    _copy_range(local, self._local, mine + c, mine + min(held, c + m), send, into=False)
                dist.all_gather([recv[r, :m] for r in range(size)], send[:m], group=group)
                for k in range(self.shards):
                    n = min(bounds[k + 1] - bounds[k] - c, m)
                    if n > 0:
                        x = a + bounds[k] + c
                        _copy_range(full, self._full, x, x + n, recv[k, :n], into=True)


class LocalShards:
    """The layout of a model sharded with FSDP2 (``fully_shard``) over a worker's ranks: the
    replica itself is sharded, so a rank's state covers its parameters' local shards (whole local
    tensors), nothing is exchanged inside the worker, and rank k of every worker (whose local
    shards correspond, the workers being alike) reduces them together."""

    replicated = False

    def __init__(self, params: Sequence[torch.Tensor], fragments: Sequence[tuple[int, int, int, int]],
                 shards: int, index: int) -> None:
        self.shards, self.index = shards, index
        self.whole = [tuple(f) for f in fragments]
        local = _offsets(p.to_local().numel() for p in params)
        self.fragments = [(i, j, local[i], local[j]) for i, j, _, _ in self.whole]
        self.pieces = [(t, 0, local[t + 1] - local[t]) for t in range(len(params))]   # whole local shards
        self.size = local[-1]

    def describe(self) -> dict:
        return {"shards": self.shards, "index": self.index, "fragments": [list(f) for f in self.whole], "fsdp": True}

    def views(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The local shards of ``params`` (aliases: writes go to the parameters)."""
        return [p.to_local().detach() for p in params]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a tensor's storage; (0, 0) for one without (a DTensor's wrapper)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                 # (older torch: no FSDP2 either)
        return None
    return DTensor


class ShardedState:
    """The parts of `DiLoCo` that depend on whether its state is sharded over a worker's ranks
    (``_layout``: a `Layout`, or None when every rank keeps all of it)."""

    def _agree_on_device(self, option: str | None, group, error: ValueError | None) -> None:
        """The ranks keep the state on the same kind of device (the outer step and the
        fingerprints must round alike on every rank): where one rank's would be on the CPU and
        another's on a GPU, every rank keeps it on the CPU (``state_device`` None), or every rank
        refuses (``"model"``). ``error``: this rank could not place it (raised here, on the
        others an error that names the rank)."""
        on_gpu, failed, model = exchange_columns([float(self._device.type == "cuda"), float(error is not None),
                                                  float(option == "model")], group=group)
        if error is not None:
            raise error
        if any(failed):
            raise ValueError(f"{_PREFIX}: rank(s) {[r for r, bad in enumerate(failed) if bad]} could not place DiLoCo's "
                             "state (their error names the cause)")
        if len(set(on_gpu)) > 1:
            if any(model):                  # (any rank's "model": every rank decides alike)
                raise ValueError(f"{_PREFIX}: state_device='model', but the models of ranks "
                                 f"{[r for r, g in enumerate(on_gpu) if g]} are on a GPU and the others' on the CPU: "
                                 "every rank keeps the state alike (state_device=None or 'cpu')")
            self._device = torch.device("cpu")

    def _choose_layout(self, shard_state: bool | None, whole: list, labels: Sequence[int],
                       rank: int) -> Layout | LocalShards | None:
        """The layout of this rank's state: sharded over the worker when ``shard_state`` is True,
        or None (default) and the smallest worker has two or more ranks."""
        if shard_state is not None and not isinstance(shard_state, bool):
            raise TypeError(f"{_PREFIX}: shard_state must be True, False or None, got {shard_state!r}")
        members = resolve_members(labels)
        dtensor = _dtensor_type()
        distributed = [dtensor is not None and isinstance(p, dtensor) for p in self._model_params]
        if any(distributed):
            return self._fsdp_layout(shard_state, whole, members, labels[rank], distributed)
        shards = min(len(m) for m in members)
        if shard_state is False or shards < 2:
            if shard_state:
                raise ValueError(f"{_PREFIX}: shard_state=True needs workers of two or more ranks each (workers: "
                                 f"{members})")
            return None
        odd = [i for i, p in enumerate(self._model_params) if not p.is_contiguous()]
        if odd:
            if shard_state:
                raise ValueError(f"{_PREFIX}: shard_state=True needs contiguous parameters (parameters {odd} are not)")
            warnings.warn(f"{_PREFIX}: parameters {odd} are not contiguous (channels_last?): every rank of a worker "
                          "keeps the whole DiLoCo state (shard_state=False)", RuntimeWarning, stacklevel=4)
            return None
        mine = members[labels[rank]].index(rank)
        return Layout(self._model_params, whole, shards, mine if mine < shards else None)

    def _fsdp_layout(self, shard_state, whole, members, worker, distributed) -> LocalShards:
        """The layout of an FSDP2 model, after checking that it is sharded over exactly this
        rank's worker, alike in every worker."""
        if not all(distributed):
            raise ValueError(f"{_PREFIX}: {distributed.count(False)} of the model's parameters are not DTensors "
                             "while others are: shard the whole model with fully_shard")
        if shard_state is False:
            raise ValueError(f"{_PREFIX}: shard_state=False with an FSDP2 model: its replica is sharded over the "
                             "worker, and so is DiLoCo's state")
        if len({len(m) for m in members}) > 1:
            raise ValueError(f"{_PREFIX}: an FSDP2 model needs workers of equal sizes (rank k of every worker "
                             f"reduces the same shard), got {members}")
        mine = [dist.get_global_rank(self._group, r) if self._group is not None else r for r in members[worker]]
        for p in self._model_params:
            mesh = p.device_mesh
            ranks = mesh.mesh.flatten().tolist()
            if mesh.ndim != 1 or ranks != sorted(mine):
                raise ValueError(f"{_PREFIX}: the model is sharded over ranks {ranks} (a mesh of {mesh.ndim} "
                                 f"dimension(s)); DiLoCo's worker of this rank is ranks {sorted(mine)}: shard it with "
                                 "fully_shard over a mesh of the worker's ranks (e.g. a 2-D mesh's inner dimension)")
            if not p.to_local().is_contiguous():
                raise ValueError(f"{_PREFIX}: a parameter's local shard is not contiguous")
        return LocalShards(self._model_params, whole, len(mine), sorted(mine).index(dist.get_rank()))

    def _make_outer_optimizer(self, factory, shard_state: bool | None, whole: list) -> torch.optim.Optimizer:
        """The outer optimizer over ``_global``. Sharded, the factory sees placeholders of the
        parameters' shapes (device meta), so that groups by shape, ndim or position come out as
        over the whole model; the optimizer of its type is then built over this rank's pieces,
        each in its tensor's group with that group's settings. An optimizer that is not
        element-wise cannot step pieces: the state is then kept whole (the factory is called
        again, on the real parameters), with a warning, or an error if sharding was asked for."""
        with torch.no_grad():
            self._global = [torch.nn.Parameter(p.detach().to(self._device, self._master, copy=True))
                            for p in self._params]
        self._fragments = whole if self._layout is None else self._layout.fragments
        if self._layout is None:
            return factory(self._global)
        proxies = [torch.nn.Parameter(torch.empty(p.shape, dtype=self._master, device="meta"))
                   for p in self._model_params]
        template = factory(proxies)
        if type(template) in PER_PARAMETER:
            group_of = {id(p): k for k, g in enumerate(template.param_groups) for p in g["params"]}
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in template.param_groups]
            for piece, (t, _, _) in zip(self._global, self._layout.pieces):
                k = group_of.get(id(proxies[t]))
                if k is not None:                     # (a tensor the factory left out stays out)
                    groups[k]["params"].append(piece)
            return type(template)(groups)
        allowed = ", ".join(sorted(c.__name__ for c in PER_PARAMETER))
        if shard_state or self._fsdp:
            raise ValueError(f"{_PREFIX}: {'an FSDP2 model' if self._fsdp else 'shard_state=True'} steps the outer "
                             f"optimizer on pieces of tensors, which only element-wise optimizers allow ({allowed}); "
                             f"{type(template).__name__} is not known to be"
                             + ("" if self._fsdp else ": use shard_state=False"))
        warnings.warn(f"{_PREFIX}: the outer optimizer {type(template).__name__} is not known to be element-wise "
                      f"({allowed} are): every rank of a worker keeps the whole DiLoCo state (shard_state=False)",
                      RuntimeWarning, stacklevel=4)
        self._layout = None
        return self._make_outer_optimizer(factory, shard_state, whole)

    @property
    def _fsdp(self) -> bool:
        return isinstance(self._layout, LocalShards)

    @torch.no_grad()
    def _broadcast_replica(self, group) -> None:
        """Every replica starts from the first worker's (its group rank 0's; with FSDP2, the shards
        of the first worker's rank k go to rank k of every worker). Not when every replica is
        known to be equal already (``_replicas_equal``: an elastic run's generation, whose epoch
        loaded the checked global parameters into every model)."""
        if getattr(self, "_replicas_equal", False):
            return
        if not self._fsdp:
            _flat.broadcast(self._model_params, self._master, group=group,
                            src=0 if group is None else dist.get_global_rank(group, 0))
            return
        src = self._workers.global_ranks[self._workers.members[0][self._layout.index]]
        _flat.broadcast(self._params, self._master, src=src, group=self._workers.cross_group)

    @property
    def _params(self) -> list[torch.Tensor]:
        """What this rank's state covers: the model's floating-point parameters, or with sharded
        state this rank's pieces of them (fresh views: a parameter's storage may be swapped)."""
        if self._layout is None:
            return self._model_params
        return self._layout.views(self._model_params)

    def global_parameters(self) -> list[torch.Tensor]:
        """The global parameters (on the device of the state: `state_device`; identical on every
        rank after each synchronisation); with
        overlap, after the latest update that landed (a synchronisation in flight is waited for,
        not applied; with staggered fragments, mid-round, that waits for the other ranks to reach
        the fragments in flight: call it at a round boundary). No communication: with state
        sharded over a worker's ranks a rank holds only its share until `finish` (then the model
        holds them), so this raises before; `gather_global_parameters` gathers them. With an
        FSDP2 model: DTensors on the model's mesh."""
        if self._final_global is not None:
            return self._final_global
        if self._layout is not None and self._layout.replicated:
            if not self._finished:
                raise RuntimeError(f"{_PREFIX}: global_parameters() before finish() with the state sharded over the "
                                   "worker's ranks: this rank holds only its share; call "
                                   "diloco.gather_global_parameters() on every rank of the worker (a collective), "
                                   "or construct DiLoCo with shard_state=False")
            return [p.detach().to(self._device, self._master) for p in self._model_params]
        if self._pending is not None and not self._closed:     # (a closed object's may never finish)
            self._hurry_streams()
            concurrent.futures.wait([self._pending])
        if not self._closed:
            self._join_streams()
        return self._gather_global()

    def gather_global_parameters(self) -> list[torch.Tensor]:
        """The whole global parameters as `global_parameters`, gathered from the worker's ranks when
        the state is sharded over them: a collective over the worker (call it on all of its ranks
        at the same point, at a round boundary), before `finish`."""
        if self._layout is None or not self._layout.replicated or self._finished:
            return self.global_parameters()
        if self._closed:
            raise RuntimeError(f"{_PREFIX}: gather_global_parameters() after close()")
        jobs = ([self._pending] if self._pending is not None else []) + [j["future"] for j in self._flight.values()]
        concurrent.futures.wait(jobs)
        self._agree_landed(jobs)              # (a rank whose job failed must not leave the others in the gather)
        return self._gather_global()

    def _share(self, fragments: Iterable[int]) -> None:
        """After this rank wrote its pieces of the replica in ``fragments`` (as every rank of its
        worker did at the same point): every rank holds the whole replica again."""
        if self._layout is not None and self._layout.replicated:
            self._layout.exchange(fragments, self._params, self._model_params, group=self._workers.agree_group,
                                  size=self._workers.size, dtype=self._master)

    def _gather_global(self) -> list[torch.Tensor]:
        """The whole global parameters (collective over the worker with sharded state)."""
        if self._layout is None:
            return [g.detach() for g in self._global]
        if self._fsdp:                   # DTensors over the worker's mesh, as the model's parameters
            dtensor = _dtensor_type()
            return [dtensor.from_local(g.detach().to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                       stride=p.stride(), run_check=False) for g, p in zip(self._global, self._model_params)]
        out = [torch.empty(p.shape, dtype=self._master, device=self._device) for p in self._model_params]
        self._layout.exchange(range(len(self._fragments)), list(self._global), out,
                              group=self._workers.agree_group, size=self._workers.size, dtype=self._master)
        return out

    def _replica_print(self, fragment: int | None = None) -> float:
        """A fingerprint of the whole replica (or of a fragment's tensors), equal on a worker's
        ranks when their replicas are: the float64 sum of the elements (0 with FSDP2: they hold
        different shards)."""
        if self._fsdp:
            return 0.0
        i, j = (0, len(self._model_params)) if fragment is None else self._layout.whole[fragment][:2]
        if i == j:
            return 0.0
        # one sum per tensor on its device, then one transfer per device (not one per tensor)
        sums: dict = {}
        for p in self._model_params[i:j]:
            sums.setdefault(p.device, []).append(torch.sum(p.detach(), dtype=torch.float64))
        return sum(float(torch.stack(parts).sum()) for _, parts in sorted(sums.items(), key=lambda kv: str(kv[0])))

    def _reduce(self, delta: torch.Tensor, weights: Sequence[float], feedback) -> torch.Tensor:
        """Σ_w weights[w] Δ_w of this rank's part of a fragment (`hetcomm.train.workers`)."""
        if self._workers.single:
            return _compress.weighted_allreduce(delta, weights, codec=self._codec, group=self._sync_group,
                                                feedback=feedback, finite_checked=True)
        if self._layout is not None:          # this rank's range, with the same range of the others
            return self._workers.reduce_range(delta, weights, codec=self._codec, feedback=feedback)
        return self._workers.reduce(delta, weights, codec=self._codec, feedback=feedback)

    def _reduce_agreed(self, delta: torch.Tensor, weights: Sequence[float], feedback, *,
                       background: bool, fragment: int) -> torch.Tensor:
        """`_reduce`, then, with the state sharded over the worker's ranks, an agreement of the
        worker's ranks that every one of them has its range reduced (a two-phase outer step): a
        worker's ranks then step their ranges of the outer optimizer all together or not at all,
        so that after a failure inside the reduction every range of a worker holds the same
        count of outer steps (an elastic run carries the state on from them). A rank whose
        reduction failed raises its error, the others of its worker one that names it. Paced in
        the background with ``pace`` (`hetcomm.train.diloco.pacing`)."""
        if background and self._pacer is not None:
            with self._pacer.job(fragment):
                return self._reduce_agreed_now(delta, weights, feedback, background)
        return self._reduce_agreed_now(delta, weights, feedback, background)

    def _reduce_agreed_now(self, delta: torch.Tensor, weights: Sequence[float], feedback,
                           background: bool) -> torch.Tensor:
        if self._layout is None or not self._layout.replicated or self._workers.size == 1:
            return self._reduce(delta, weights, feedback)
        error = None
        try:
            part = self._reduce(delta, weights, feedback)
        except Exception as e:  # noqa: BLE001 - raised below, after the worker heard of it
            error = e
        ok = self._workers.all_ok(error is None, background=background)
        if error is not None:
            raise error
        if not ok:
            raise RuntimeError(f"{_PREFIX}: another rank of this worker failed its synchronisation (its error names "
                               "the cause); no rank of this worker applied the outer step")
        return part

    def _piece_starts(self) -> list[int]:
        """Where each tensor of ``_global`` starts in the flat model (its pieces' with sharded state)."""
        if self._layout is None:
            return _offsets(g.numel() for g in self._global)[:-1]
        return [self._layout._full[t] + o for t, o, _ in self._layout.pieces]

    def _global_print(self, background: bool) -> int:
        """52 bits of `flat.additive_print` of the whole global parameters: with state sharded over
        the worker's ranks, their shares' summed over the worker (a collective over it, on the
        group of the thread that calls it: the synchronisation's from the ``background``)."""
        total = _flat.additive_print(self._global, self._piece_starts())
        if self._layout is not None and self._layout.replicated and self._workers.size > 1:
            halves = torch.tensor([total & 0xFFFFFFFF, total >> 32], dtype=torch.float64)    # (sums exact)
            dist.all_reduce(halves, group=self._workers.gather_group if background else self._workers.agree_group)
            total = int(halves[0].item()) + (int(halves[1].item()) << 32)
        return _flat.print_bits(total)

    def state_bytes(self) -> int:
        """Bytes of the tensors this rank's DiLoCo keeps for the run, whatever holds them (global
        parameters, outer-optimizer state, start point, pseudo-gradients, scratch, quantisation
        residuals, the exchange's buffers): every distinct storage reachable from the object,
        except the model's and the inner optimizer's."""
        return reachable_bytes(self, self.model, self.inner_optimizer)


def reachable_bytes(root, model: torch.nn.Module, inner_optimizer) -> int:
    """Bytes of every distinct tensor storage reachable from ``root``'s attributes (through
    dicts, sequences, optimizers and hetcomm's own objects), except ``model``'s parameters and
    buffers and what ``inner_optimizer`` holds."""
    skip = {id(v) for v in (model, inner_optimizer)}
    seen: set[int] = set()
    exclude: set[int] = set()
    dtensor = _dtensor_type()
    for t in list(model.parameters()) + list(model.buffers()):
        exclude.add(_storage(t.to_local() if dtensor is not None and isinstance(t, dtensor) else t)[0])
    total = 0
    stack: list = [vars(root)]
    visited: set[int] = set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited or id(obj) in skip:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            ptr, nbytes = _storage(obj)
            if ptr and ptr not in seen and ptr not in exclude:
                seen.add(ptr)
                total += nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend([obj.state, obj.param_groups])
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)) and \
                type(obj).__module__.startswith(("hetcomm", "torch.optim", "collections")):
            stack.append(vars(obj))
    return total
