"""The staged (device) path of every collective, on machines without a GPU.

CUDA tensors cross the transport through pinned staging slots, segment by segment, with copies and
reductions queued on a stream (algorithms/staged_pipeline.cc). With HETCOMM_DEBUG_EMULATE_DEVICE=1
CPU tensors take exactly that path, on an emulated device whose queue is a thread that runs each
copy or reduction later, after a random pause, from small slots: a collective that sends bytes
before their reduction was queued, or writes into a slot the queue still reads, gets wrong
numbers here, in CI, instead of only on a GPU.

* The whole collective suite of test_collectives.py, with every allreduce staged segment by
  segment (HETCOMM_DEVICE_HOST_REDUCE_BYTES=0), on 2 and 3 ranks.
* Allreduces of medium sizes (tens to hundreds of KB: ring schedules with several segments per
  chunk, where the all-gather half forwards what the reduce-scatter half has just reduced), many
  times over, on 2 and 3 ranks: the sizes where a missing dependency shows.
* The same medium sizes staged whole (the default below HETCOMM_DEVICE_HOST_REDUCE_BYTES).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import Cases, run_suite
from values import assert_same, expected_reduce, inputs_for
from collective_suite import FAMILIES, collective_suite, family_params

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("HETCOMM_DEBUG_EMULATE_DEVICE is hetcomm's")]

R = dist.ReduceOp
# HETCOMM_SHM=0: these ranks share one machine, where every collective would otherwise go through
# shared memory; the staged TCP pipeline under test runs between hosts. (test_shm.py runs the
# suite on an emulated device through shared memory.)
EMULATED = {"HETCOMM_DEBUG_EMULATE_DEVICE": "1", "HETCOMM_SHM": "0"}
ALL_STAGED = {**EMULATED, "HETCOMM_DEVICE_HOST_REDUCE_BYTES": "0"}
WORLD_SIZES = [2, 3]

_SUITES: dict[int, object] = {}


def _suite(world_size: int):
    if world_size not in _SUITES:
        _SUITES[world_size] = run_suite(world_size, collective_suite, families=FAMILIES,
                                        timeout=300, pg_timeout=60, env=ALL_STAGED)
    return _SUITES[world_size]


@pytest.mark.parametrize("world_size,family", family_params(WORLD_SIZES))
def test_collective_through_staging(world_size: int, family: str) -> None:
    _suite(world_size).assert_family(family)


MEDIUM = [8_193, 50_000, 100_000, 300_001]
REPEATS = 3


def medium_allreduces(rank: int, world_size: int) -> None:
    cases = Cases(rank)
    for dtype, ops in ((torch.float32, (R.SUM, R.MAX)), (torch.float16, (R.SUM,)),
                       (torch.int64, (R.SUM, R.MIN))):
        for n in MEDIUM:
            for op in ops:
                for k in range(REPEATS):
                    with cases.case("medium", f"{op} {dtype} n={n} #{k}"):
                        inputs = [inputs_for(op, n, dtype, r, salt=k) for r in range(world_size)]
                        t = inputs[rank].clone()
                        dist.all_reduce(t, op=op)
                        assert_same(t, expected_reduce(inputs, op))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("mode", ["segments", "whole"])
def test_medium_allreduces_through_staging(world_size: int, mode: str) -> None:
    env = ALL_STAGED if mode == "segments" else {**EMULATED, "HETCOMM_DEVICE_HOST_REDUCE_BYTES": str(1 << 22)}
    run_suite(world_size, medium_allreduces, families=["medium"], timeout=300, pg_timeout=60,
              env=env).assert_family("medium")


def mixed_all_to_all(rank: int, world_size: int, path: str) -> list:
    import os

    # Rank 0 stages its tensors as a CUDA rank does (exchange by exchange); the others move host
    # memory with every peer at once (collectives.cc): the headers must still match.
    os.environ["HETCOMM_SHM"] = "0"
    if rank == 0:
        os.environ["HETCOMM_DEBUG_EMULATE_DEVICE"] = "1"
    dist.init_process_group("hetcomm", init_method=f"file://{path}", rank=rank, world_size=world_size)
    def size(src: int, dst: int) -> int:                          # rank 0 sends rank 1 nothing
        return 0 if (src, dst) == (0, 1) else 10 * src + dst + 1

    send = [size(rank, j) for j in range(world_size)]
    recv = [size(j, rank) for j in range(world_size)]
    inp = torch.cat([torch.full((n,), float(100 * rank + j)) for j, n in enumerate(send)])
    out = torch.zeros(sum(recv))
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    expected = torch.cat([torch.full((n,), float(100 * j + rank)) for j, n in enumerate(recv)])
    assert torch.equal(out, expected), (out, expected)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_between_a_staged_rank_and_host_ranks(world_size: int, tmp_path) -> None:
    from harness import run_ranks

    # Fails (RankFailure) when a rank raises, e.g. on a header it did not expect, or gets wrong data.
    run_ranks(world_size, mixed_all_to_all, str(tmp_path / "store"), init=None, timeout=120)
