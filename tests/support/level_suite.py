"""An allreduce suite for the group's own hierarchical plan (hosts as the inner level, or three
levels): every dtype and op, sizes from empty to many shared-memory slots, exact results, the same
bits on every rank, and the path counter. Used by tests/backend/test_host_hierarchical.py and
test_three_level.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from device_suite import device_for
from harness import Cases
from values import assert_close_avg, assert_same, expected_reduce, inputs_for, ops_for, reduce_op_names

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
LARGE = (1 << 20) + 3          # 4 MiB of float32 and then some: many slots' worth


def level_suite(rank: int, ws: int, level: str, device: str = "cpu") -> dict:
    """Every dtype and op through the plan the group installed by itself, which must be of
    ``level`` ("host": hosts as the inner level; "three": hosts inside sites), with the tensors on
    ``device``."""
    import hetcomm
    dev = device_for(device, rank)
    plan = hetcomm.get_plan()
    assert plan.sites is not None, plan
    assert plan.sites.local_inner if level == "host" else plan.sites.three_level, plan
    cases = Cases(rank)
    before = hetcomm.stats()["collectives_by_path"]["hierarchical"]
    missed = []
    for dtype in DTYPES:
        for op in ops_for(dtype):
            large = [LARGE] if dtype == torch.float32 and op == R.SUM else []
            if dtype in (torch.float16, torch.bfloat16) and op in (R.SUM, R.AVG):
                large = [100_003]  # 200 KB: several 64 KB pieces, AVG divided per piece
            for n in [0, 1, ws - 1, 5 * ws + 1, 1031] + large:
                with cases.case("all_reduce", f"{reduce_op_names().get(op, op)} {dtype} n={n}"):
                    inputs = [inputs_for(op, n, dtype, r) for r in range(ws)]
                    t = inputs[rank].clone().to(dev)
                    seen = hetcomm.stats()["collectives_by_path"]["hierarchical"]
                    dist.all_reduce(t, op=op)
                    if n > 0 and hetcomm.stats()["collectives_by_path"]["hierarchical"] == seen:
                        missed.append(f"{op} {dtype} n={n}")
                    if op == R.AVG:
                        assert_close_avg(t.cpu(), expected_reduce(inputs, R.SUM), ws)
                    else:
                        assert_same(t.cpu(), expected_reduce(inputs, op))
    with cases.case("identical", "float32 sums are the same bits on every rank"):
        t = torch.randn(300_001, generator=torch.Generator().manual_seed(rank)).to(dev)
        dist.all_reduce(t)
        gathered = [torch.empty_like(t) for _ in range(ws)]
        dist.all_gather(gathered, t)
        for r, g in enumerate(gathered):
            assert torch.equal(g, t), f"rank {r}'s result differs from rank {rank}'s"
    with cases.case("path", f"every allreduce took the {level} level"):
        assert not missed, f"{len(missed)} allreduces did not take the host level: {missed[:8]}"
        assert hetcomm.stats()["collectives_by_path"]["hierarchical"] > before
    return {"sites": plan.sites.sites}
