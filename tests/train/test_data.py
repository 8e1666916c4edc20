"""HeteroBatchSampler (python/hetcomm/train/data.py), every rank simulated in this one process.

One sampler per rank over a shared partition object; `lockstep` advances them one global step
at a time, so a test can change the partition between steps exactly as a Partitioner would on
every rank at once.
"""
from __future__ import annotations


import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hetcomm.train.data import HeteroBatchSampler, StaticPartition
from hetcomm.train.partition import Partitioner


def samplers(length: int, partition, **kwargs) -> list[HeteroBatchSampler]:
    return [HeteroBatchSampler(length, partition, rank=r, **kwargs)
            for r in range(len(partition.sizes))]


def lockstep(ranks: list[HeteroBatchSampler], changes: dict | None = None) -> list[list[list[int]]]:
    """``steps[k][r]`` = rank r's batch at global step k. ``changes[k]``: sizes set after step k."""
    iterators = [iter(s) for s in ranks]
    steps = []
    while True:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            return steps
        assert None not in batches, f"ranks ran out at different steps: {batches}"
        steps.append(batches)
        if changes and len(steps) in changes:
            ranks[0].partition.sizes = changes[len(steps)]


def assert_partitions_epoch(steps: list[list[list[int]]], covered: range) -> None:
    seen = [i for batches in steps for b in batches for i in b]
    assert len(seen) == len(set(seen)), "an index went to two ranks or two steps"
    assert sorted(seen) == list(covered)


@pytest.mark.parametrize("sizes", [[3, 5, 2], [1, 1, 1, 1], [7], [0, 4, 4], [10, 1]])
@pytest.mark.parametrize("length", [0, 1, 10, 37, 100])
@pytest.mark.parametrize("shuffle", [False, True])
def test_no_overlap_full_coverage(sizes, length, shuffle) -> None:
    partition = StaticPartition(sizes)
    ranks = samplers(length, partition, shuffle=shuffle, seed=3)
    steps = lockstep(ranks)
    assert_partitions_epoch(steps, range(length))
    B = sum(sizes)
    assert len(steps) == -(-length // B) == len(ranks[0])
    for batches in steps[:length // B]:          # full steps follow the partition exactly
        assert [len(b) for b in batches] == sizes


def test_unshuffled_slices_are_contiguous_in_rank_order() -> None:
    steps = lockstep(samplers(20, StaticPartition([3, 5, 2]), shuffle=False))
    assert steps[0] == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9]]
    assert steps[1] == [[10, 11, 12], [13, 14, 15, 16, 17], [18, 19]]


def test_partition_change_mid_epoch() -> None:
    shared = types.SimpleNamespace(sizes=[2, 2, 2])
    ranks = samplers(50, shared, seed=1)
    # Same global batch after step 2; a larger one after step 4 (the sampler allows that too).
    steps = lockstep(ranks, changes={2: [4, 1, 1], 4: [1, 3, 6]})
    assert [[len(b) for b in batches] for batches in steps] == [
        [2, 2, 2], [2, 2, 2], [4, 1, 1], [4, 1, 1], [1, 3, 6], [1, 3, 6],
        [1, 2, 3]]                               # 50 - 44 = 6 left: split 1:3:6, minimum 1
    assert_partitions_epoch(steps, range(50))
    unshuffled = lockstep(samplers(50, types.SimpleNamespace(sizes=[2, 2, 2]), shuffle=False),
                          changes={2: [4, 1, 1]})
    assert unshuffled[2] == [[12, 13, 14, 15], [16], [17]]


def test_last_partial_step_split_in_proportion() -> None:
    steps = lockstep(samplers(10, StaticPartition([3, 1]), shuffle=False))
    assert steps == [[[0, 1, 2], [3]], [[4, 5, 6], [7]], [[8], [9]]]  # 2 left: one each
    steps = lockstep(samplers(17, StaticPartition([6, 3, 1]), shuffle=False))
    assert steps[-1] == [[10, 11, 12, 13], [14, 15], [16]]            # 7 over 6:3:1
    # Fewer indices left than ranks: every rank still takes the step, one with an empty batch.
    steps = lockstep(samplers(2, StaticPartition([1, 1, 1]), shuffle=False))
    assert steps == [[[0], [1], []]]


def test_drop_last() -> None:
    ranks = samplers(10, StaticPartition([3, 1]), shuffle=False, drop_last=True)
    steps = lockstep(ranks)
    assert len(steps) == len(ranks[1]) == 2
    assert_partitions_epoch(steps, range(8))
    assert lockstep(samplers(3, StaticPartition([3, 1]), drop_last=True)) == []


def test_deterministic_per_seed_and_new_order_per_epoch() -> None:
    def epoch_batches(seed: int, epoch: int) -> list[list[list[int]]]:
        ranks = samplers(64, StaticPartition([5, 3]), seed=seed)
        for s in ranks:
            s.set_epoch(epoch)
        return lockstep(ranks)

    first = epoch_batches(seed=7, epoch=0)
    assert epoch_batches(seed=7, epoch=0) == first
    assert epoch_batches(seed=7, epoch=1) != first
    assert epoch_batches(seed=8, epoch=0) != first
    assert_partitions_epoch(epoch_batches(seed=7, epoch=1), range(64))


def test_works_as_dataloader_batch_sampler() -> None:
    dataset = TensorDataset(torch.arange(23) * 10)
    sampler = HeteroBatchSampler(dataset, StaticPartition([3, 2]), rank=1, seed=4)
    loader = DataLoader(dataset, batch_sampler=sampler)
    got = [batch[0].tolist() for batch in loader]
    assert got == [[10 * i for i in indices] for indices in sampler]
    assert [len(b) for b in got] == [2, 2, 2, 2, 1]   # 23 = 4 * 5 + 3, the last 3 split 2:1
    assert len(loader) == 5


def test_rank_defaults_and_validation() -> None:
    assert HeteroBatchSampler(10, StaticPartition([2, 2])).rank == 0   # no torch.distributed
    assert HeteroBatchSampler(10, types.SimpleNamespace(sizes=[2, 2], rank=1)).rank == 1
    single = HeteroBatchSampler(10, Partitioner(4), shuffle=False)
    assert list(single) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="rank 2 outside"):
        HeteroBatchSampler(10, StaticPartition([2, 2]), rank=2)
    for bad in ([], [0, 0], [1, -1], [1.5]):
        with pytest.raises(ValueError, match="hetcomm HeteroBatchSampler"):
            StaticPartition(bad)
    shrinking = types.SimpleNamespace(sizes=[2, 2])
    it = iter(HeteroBatchSampler(10, shrinking, rank=1))
    next(it)
    shrinking.sizes = [4]
    with pytest.raises(ValueError, match="rank 1 outside a partition of 1"):
        next(it)
