"""One object that wires DDP, the sample-weighted hook, the partitioner and the loader together.

::

    adp = hetcomm.AdaptiveDataParallel(model, dataset, global_batch=256)
    opt = torch.optim.AdamW(adp.module.parameters())
    for epoch in range(epochs):
        for x, y in adp.batches(epoch):                # this rank's share of each global batch
            loss_fn(adp.module(x), y).backward()       # a mean over this rank's samples
            opt.step(); opt.zero_grad()

The step's work between two iterations of `batches` must be the forward, backward and optimizer
step of that batch, exactly once: the timing and the hook's sample counts assume it. What it does
each step (sampler, hook, timing, `Partitioner`): docs/training.md#what-adaptivedataparallel-does-each-step.
"""
# No `from __future__ import annotations`: DDP.register_comm_hook checks the hook's annotations
# against dist.GradBucket and torch.futures.Future[torch.Tensor] objects, not strings.
import collections
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

from hetcomm.train import hooks
from hetcomm.train.data import HeteroBatchSampler
from hetcomm.train.partition import Partitioner

__all__ = ["AdaptiveDataParallel"]

_HOOKS = {
    None: hooks.weighted_allreduce_hook,
    "fp16": hooks.weighted_fp16_hook,
    "bf16": hooks.weighted_bf16_hook,
}


class _StepClock:
    """When this rank's last bucket reached the hook, and when the last allreduce completed.

    Written from DDP's autograd thread (hook calls) and the backend's completion threads (future
    callbacks); read by the training loop after backward, when no bucket is in flight.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.last_handed = None
            self.last_done = None

    def handed(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self.last_handed = now if self.last_handed is None else max(self.last_handed, now)

    def done(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self.last_done = now if self.last_done is None else max(self.last_done, now)

    def blocked_seconds(self) -> float:
        with self._lock:
            if self.last_handed is None or self.last_done is None:
                return 0.0
            return max(0.0, self.last_done - self.last_handed)


class _ClockedState(hooks.SampleWeightState):
    def __init__(self, process_group: Optional[dist.ProcessGroup], clock: _StepClock) -> None:
        super().__init__(process_group)
        self.clock = clock
        self.hook: Callable = hooks.weighted_allreduce_hook


def _clocked_hook(state: _ClockedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.clock.handed()
    fut = state.hook(state, bucket)

    def stamp(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.clock.done()
        return f.value()

    return fut.then(stamp)


class AdaptiveDataParallel:
    """DDP with per-rank batches proportional to measured speed and exact gradients.

    Args:
        model: the module (already on this rank's device).
        dataset: a map-style dataset; every rank must hold the same one (same length, same order).
        global_batch: samples per global step, split across the ranks.
        partition: ``"adaptive"`` (re-balanced online) or ``"equal"`` (DDP's usual split; the
            statistics are still collected).
        group: the process group (None: the default group).
        speeds: declared relative speeds of every rank for the first steps (default equal).
        max_batch: this rank's memory cap in samples (`hetcomm.partition.probe_max_batch`
            measures one on CUDA); the caps of all ranks are exchanged at construction.
        min_batch: fewest samples any rank gets in a full step.
        compression: None, ``"fp16"`` or ``"bf16"``: the dtype of gradients on the wire.
        interval, threshold, ema: the partitioner's agreement period (steps), the predicted gain
            a re-partition must beat, and the smoothing weight of new measurements.
        seed, shuffle, drop_last: the sampler's epoch order (see `HeteroBatchSampler`).
        loader_kwargs: passed to the DataLoader (``collate_fn``, ``num_workers``, ...).
        ddp_kwargs: passed to DistributedDataParallel (``device_ids``, ``bucket_cap_mb``, ...).

    Construction is collective (the partitioner exchanges the caps): every rank of the group
    must construct it, in the same order relative to other collectives.
    """

    def __init__(self, model: torch.nn.Module, dataset: Any, global_batch: int, *,
                 partition: str = "adaptive", group: Optional[dist.ProcessGroup] = None,
                 speeds: Optional[Sequence[float]] = None, max_batch: Optional[int] = None,
                 min_batch: int = 1, compression: Optional[str] = None, interval: int = 5,
                 threshold: float = 0.05, ema: float = 0.3, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, loader_kwargs: Optional[dict] = None,
                 ddp_kwargs: Optional[dict] = None) -> None:
        if partition not in ("adaptive", "equal"):
            raise ValueError(f"AdaptiveDataParallel: partition must be 'adaptive' or 'equal', got {partition!r}")
        if compression not in _HOOKS:
            raise ValueError(f"AdaptiveDataParallel: compression must be None, 'fp16' or 'bf16', got {compression!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("AdaptiveDataParallel: call torch.distributed.init_process_group() first")
        self.partition_mode = partition
        # "equal" is the same machinery with a threshold no gain can beat: same measurements,
        # same statistics, never a re-partition.
        self.partitioner = Partitioner(global_batch, group=group, speeds=None if partition == "equal" else speeds,
                                       max_per_rank=max_batch, min_per_rank=min_batch, ema=ema,
                                       threshold=float("inf") if partition == "equal" else threshold,
                                       interval=interval)
        self.sampler = HeteroBatchSampler(dataset, self.partitioner, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self._step_sizes: collections.deque[list[int]] = collections.deque()
        loader_kwargs = dict(loader_kwargs or {})
        loader_kwargs["collate_fn"] = EmptyBatchCollate(dataset, loader_kwargs.get("collate_fn"))
        self.loader = DataLoader(dataset, batch_sampler=_RecordingSampler(self.sampler, self._step_sizes),
                                 **loader_kwargs)
        self.module = DistributedDataParallel(model, process_group=group, **(ddp_kwargs or {}))
        self._clock = _StepClock()
        self.state = _ClockedState(group, self._clock)
        self.state.hook = _HOOKS[compression]
        self.module.register_comm_hook(self.state, _clocked_hook)
        self.steps = 0
        self.samples = 0                    # this rank's samples, all epochs
        self.compute_seconds = 0.0          # this rank's, all steps
        self.idle_seconds = 0.0
        self._wall_seconds = 0.0            # inside batches(), between the first and last step

    @property
    def sizes(self) -> list[int]:
        """The current per-rank batch sizes (identical on every rank)."""
        return self.partitioner.sizes

    def batches(self, epoch: int = 0, max_steps: Optional[int] = None) -> Iterator[Any]:
        """This rank's batch of every global step of ``epoch`` (at most ``max_steps`` of them).

        A step is timed and recorded when the loop asks for the next batch, so stop early with
        ``max_steps``, not with ``break``: a loop left with ``break`` does not record its last
        step (recording may be a collective, which must not run while a loop unwinds).
        """
        if max_steps is not None and max_steps < 0:
            raise ValueError(f"AdaptiveDataParallel.batches: max_steps must be >= 0, got {max_steps}")
        self.sampler.set_epoch(epoch)
        iterator = iter(self.loader)
        started = time.perf_counter()
        taken = 0
        try:
            while max_steps is None or taken < max_steps:
                taken += 1
                step_start = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                sizes = self._step_sizes.popleft()
                local = sizes[self.partitioner.rank]
                self.state.set_samples(local, sum(sizes))
                self._clock.reset()
                yield batch
                step_seconds = time.perf_counter() - step_start
                idle = min(step_seconds, self._clock.blocked_seconds())
                self.steps += 1
                self.samples += local
                self.compute_seconds += step_seconds - idle
                self.idle_seconds += idle
                self.partitioner.record(step_seconds - idle, idle, local)
        finally:
            self._wall_seconds += time.perf_counter() - started

    def stats(self) -> dict:
        """Agreed per-rank figures (a collective: call it on every rank at the same step).

        ``sizes``, ``repartitions``, per-rank ``compute_seconds``, ``idle_seconds``, ``samples``
        and ``samples_per_second`` (compute speed) from the partitioner; ``wall_seconds`` (the
        slowest rank's time inside `batches`), ``throughput`` (all samples / wall seconds) and
        ``ideal_throughput`` (the sum of the ranks' compute speeds: what a perfect split with free
        communication would reach).
        """
        stats = self.partitioner.gather_stats()
        wall = torch.tensor([self._wall_seconds], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=self.state.process_group)
        stats["wall_seconds"] = float(wall)
        stats["throughput"] = sum(stats["samples"]) / stats["wall_seconds"] if stats["wall_seconds"] > 0 else 0.0
        stats["ideal_throughput"] = sum(stats["samples_per_second"])
        return stats


class EmptyBatchCollate:
    """A collate function that also turns an empty list of samples into an empty batch.

    The sampler gives a rank no indices on purpose (its share is 0, or the epoch's last step has
    fewer samples than ranks), and DDP still needs that rank's forward and backward. The default
    collate cannot build a batch from no samples (it looks at the first); this one collates one
    real sample (``dataset[0]``) and keeps none of its rows: tensors of length 0 in the batch
    dimension, empty lists, same structure (tuples, named tuples, dicts) as a normal batch.
    Picklable, so DataLoader workers can use it.
    """

    def __init__(self, dataset: Any, collate_fn: Optional[Any] = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self._empty: Any = None

    def __call__(self, samples: list) -> Any:
        if len(samples) > 0:
            return self.collate_fn(samples)
        if self._empty is None:
            if len(self.dataset) == 0:
                raise ValueError("AdaptiveDataParallel: the dataset is empty")
            self._empty = _no_rows(self.collate_fn([self.dataset[0]]))
        return self._empty


def _no_rows(batch: Any) -> Any:
    """``batch`` with none of its rows (the leading dimension of every tensor cut to 0)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)({k: _no_rows(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_no_rows(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        if batch and all(isinstance(v, (str, bytes)) for v in batch):
            return type(batch)()  # per-sample values (default_collate keeps strings as a list)
        return type(batch)(_no_rows(v) for v in batch)
    return batch


class _RecordingSampler:
    """The sampler's batches, noting every step's per-rank sizes for the training loop.

    A DataLoader draws indices ahead of the batches it returns (workers prefetch), but always in
    order, so the loop pops the sizes of the batch it is handed from the front of the queue.
    """

    def __init__(self, sampler: HeteroBatchSampler, sink: collections.deque) -> None:
        self.sampler = sampler
        self.sink = sink

    def __iter__(self) -> Iterator[list[int]]:
        self.sink.clear()
        for indices in self.sampler:
            self.sink.append(list(self.sampler.last_step_sizes))
            yield indices

    def __len__(self) -> int:
        return len(self.sampler)
