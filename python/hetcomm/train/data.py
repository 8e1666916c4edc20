"""Uneven per-rank batches from one shared epoch order: `HeteroBatchSampler`.

Every rank walks the same permutation of the dataset with the same cursor. Global step k takes
the next ``B = sum(sizes)`` indices; rank r takes the slice of them that starts after the sizes
of ranks 0..r-1::

    [cursor + sum(sizes[:r]), cursor + sum(sizes[:r + 1]))

``sizes`` is read from the partition at the start of every global step, so a `Partitioner` may
change it mid-epoch: as long as every rank sees the change at the same global step (which the
Partitioner guarantees), the ranks still cut the same B indices into disjoint slices.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from hetcomm.train.partition import split_batch

__all__ = ["HeteroBatchSampler", "StaticPartition", "PartitionLike"]

_PREFIX = "hetcomm HeteroBatchSampler"


class PartitionLike(Protocol):
    """Anything with per-rank batch sizes: a `Partitioner`, a `StaticPartition`, your own."""

    @property
    def sizes(self) -> Sequence[int]: ...


class StaticPartition:
    """A fixed partition: ``sizes[r]`` samples per step for rank r."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self._sizes = _checked_sizes(sizes)

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    def __repr__(self) -> str:
        return f"StaticPartition({self._sizes})"


def _checked_sizes(sizes: Sequence[int]) -> list[int]:
    out = []
    for r, b in enumerate(sizes):
        if isinstance(b, bool) or int(b) != b or b < 0:
            raise ValueError(f"{_PREFIX}: size of rank {r} must be a non-negative integer, "
                             f"got {b!r}")
        out.append(int(b))
    if not out or sum(out) == 0:
        raise ValueError(f"{_PREFIX}: the partition {list(sizes)} has no samples per step")
    return out


def _split_last_step(remaining: int, sizes: Sequence[int]) -> list[int]:
    """The epoch's last ``remaining < sum(sizes)`` indices, split in proportion to ``sizes``.

    One sample per active rank where there are enough (an empty batch gives a NaN mean loss);
    a rank with size 0 stays at 0; nobody gets more than its full-step size.
    """
    active = [r for r, b in enumerate(sizes) if b > 0]
    part = split_batch(remaining, [sizes[r] for r in active],
                       min_per_rank=1 if remaining >= len(active) else 0,
                       max_per_rank=[sizes[r] for r in active])
    out = [0] * len(sizes)
    for r, b in zip(active, part):
        out[r] = b
    return out


class HeteroBatchSampler(Sampler[list[int]]):
    """Yields this rank's batch of indices for every global step of an epoch.

    Use as ``DataLoader(dataset, batch_sampler=sampler)``; call `set_epoch` before each epoch.

    Each epoch is a permutation of ``range(len)`` (``torch.randperm`` with a generator seeded
    with ``seed + epoch``; the identity when ``shuffle=False``). Global step k takes the next
    ``B = sum(partition.sizes)`` indices, read afresh at the start of every step; this rank
    yields its slice ``[cursor + sum(sizes[:rank]), cursor + sum(sizes[:rank + 1]))``.
    The last partial step (fewer than B indices left) is dropped with ``drop_last``; otherwise
    its indices are split in proportion to the sizes (at least one per rank with a nonzero size
    when there are enough, never more than a rank's full size), so every index is still seen.

    Guarantees, for ranks that share ``dataset length, seed, shuffle, drop_last, epoch`` and
    partition sizes at every step:

    * no overlap: within an epoch no index goes to two ranks or two steps;
    * full coverage: every index is yielded exactly once per epoch (all but the last partial
      step's with ``drop_last``);
    * determinism: the same seed and epoch give the same batches on every run; another epoch
      gives another order;
    * every rank yields the same number of batches (possibly empty ones: a rank with size 0, or
      the last partial step when fewer indices remain than ranks), so the collectives of a
      training step stay matched; an empty batch must still take part in the step;
    * a partition that changes mid-epoch keeps these guarantees provided every rank sees the
      change at the same global step (a `Partitioner` driven by `Partitioner.record` once per
      step does; a DataLoader with workers reads the partition a few steps ahead, the same
      number of steps on every rank when all use the same loader settings).

    ``len(sampler)`` is the number of global steps for the *current* partition; it is
    approximate when the global batch size changes during the epoch (a `Partitioner` keeps it
    fixed).

    Args:
        dataset_len_or_dataset: the dataset length, or a sized dataset.
        partition: anything with ``.sizes`` (per-rank batch sizes), e.g. a `Partitioner`.
        rank: this rank's index in ``sizes``; default the partition's ``rank`` attribute if it
            has one, else ``dist.get_rank()`` when torch.distributed is initialised, else 0.
    """

    def __init__(self, dataset_len_or_dataset: int | Sized, partition: PartitionLike, *,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if isinstance(dataset_len_or_dataset, int):
            length = dataset_len_or_dataset
        else:
            length = len(dataset_len_or_dataset)
        if length < 0:
            raise ValueError(f"{_PREFIX}: dataset length must be >= 0, got {length}")
        if rank is None:
            rank = getattr(partition, "rank", None)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < len(partition.sizes):
            raise ValueError(f"{_PREFIX}: rank {rank} outside a partition of "
                             f"{len(partition.sizes)} ranks")
        self.length = length
        self.partition = partition
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        # Every rank's batch size in the step this sampler yielded last: its global batch is
        # their sum (smaller than the partition's in an epoch's last partial step).
        self.last_step_sizes: Optional[list[int]] = None

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's permutation (seeded with ``seed + epoch``); call on every rank."""
        self.epoch = int(epoch)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        cursor = 0
        while cursor < self.length:
            sizes = _checked_sizes(self.partition.sizes)
            if len(sizes) <= self.rank:
                raise ValueError(f"{_PREFIX}: rank {self.rank} outside a partition of "
                                 f"{len(sizes)} ranks")
            remaining = self.length - cursor
            if remaining < sum(sizes):
                if self.drop_last:
                    return
                sizes = _split_last_step(remaining, sizes)
            start = cursor + sum(sizes[:self.rank])
            self.last_step_sizes = sizes
            yield order[start:start + sizes[self.rank]]
            cursor += sum(sizes)

    def __len__(self) -> int:
        global_batch = sum(_checked_sizes(self.partition.sizes))
        if self.drop_last:
            return self.length // global_batch
        return math.ceil(self.length / global_batch)
