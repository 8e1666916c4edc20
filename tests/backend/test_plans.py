"""The ring engine under non-uniform plans, the plan API, and the probe on a shaped cluster.

Any share vector and ring order must give exact results (ring_schedule.h argues why); these tests
hold the engine to that for every dtype and op, with zero shares, one owner of everything and
arbitrary ring orders, large enough that the ring (not recursive doubling) runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only, needs_netns
from simrun import assert_shaped
from harness import run_ranks, run_ranks_outcomes
from values import assert_close_avg, assert_same, expected_reduce, inputs_for, ops_for

pytestmark = pytest.mark.usefixtures("backend_importable")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
# Above the 32 KB recursive-doubling limit for every dtype, not divisible by the world size.
NUMEL = 70001


def plans_for(world_size: int) -> list[tuple[list[int], list[float]]]:
    reversed_order = list(reversed(range(world_size)))
    shuffled = [0] + list(range(world_size - 1, 0, -1))[::2] + list(range(world_size - 1, 0, -1))[1::2]
    one_owner = [0.0] * world_size
    one_owner[world_size - 1] = 1.0
    zero_first = [0.0] + [1.0] * (world_size - 1)
    uneven = [float(r + 1) ** 2 for r in range(world_size)]
    return [
        (list(range(world_size)), one_owner),
        (reversed_order, zero_first),
        (shuffled, uneven),
        (shuffled, one_owner[::-1]),
    ]


def _under_plans(rank: int, world_size: int) -> list[str]:
    import hetcomm

    failures = []
    for order, shares in plans_for(world_size):
        hetcomm.backend_of().set_plan(order, shares, 0, 0)
        for dtype in DTYPES:
            for op in ops_for(dtype):
                inputs = [inputs_for(op, NUMEL, dtype, r) for r in range(world_size)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                try:
                    if op == dist.ReduceOp.AVG:
                        assert_close_avg(t, expected_reduce(inputs, dist.ReduceOp.SUM), world_size)
                    else:
                        assert_same(t, expected_reduce(inputs, op))
                except AssertionError as e:
                    failures.append(f"plan {order} {shares} {dtype} {op}: {str(e)[:200]}")
        # Ring collectives with fixed per-rank blocks follow the plan's order too.
        block = 1000 + rank  # uneven blocks
        ins = [torch.full((1000 + r,), float(r * 10 + rank)) for r in range(world_size)]
        out = torch.empty(block)
        dist.reduce_scatter(out, ins)
        want = torch.full((block,), float(sum(rank * 10 + r for r in range(world_size))))
        if not torch.equal(out, want):
            failures.append(f"plan {order} {shares} reduce_scatter")
        gathered = [torch.empty(1000 + r) for r in range(world_size)]
        dist.all_gather(gathered, torch.full((block,), float(rank)))
        if not all(torch.equal(g, torch.full((1000 + r,), float(r))) for r, g in enumerate(gathered)):
            failures.append(f"plan {order} {shares} all_gather")
    return failures


@hetcomm_only("sets hetcomm ring plans")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_engine_is_exact_under_any_plan(world_size: int) -> None:
    results = run_ranks(world_size, _under_plans, timeout=300)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:20])


def _plan_roundtrip(rank: int, world_size: int) -> dict:
    import hetcomm
    from hetcomm.planner import Plan

    plan = Plan((2, 0, 1), (0.5, 0.25, 0.25), min_bytes=1 << 20, segment_bytes=64 << 10)
    hetcomm.set_plan(plan)
    got = hetcomm.get_plan()
    t = torch.ones(300000)
    dist.all_reduce(t)
    try:
        hetcomm.backend_of().set_plan([0, 0, 1], [1.0, 1.0, 1.0], 0, 0)  # not a permutation
        rejected = ""
    except ValueError as e:
        rejected = str(e)
    return {"got": (got.order, got.shares, got.min_bytes, got.segment_bytes), "sum": t[0].item(),
            "rejected": rejected}


@hetcomm_only("hetcomm's plan API")
def test_get_and_set_plan_round_trip() -> None:
    for res in run_ranks(3, _plan_roundtrip):
        assert res["got"] == ((2, 0, 1), (0.5, 0.25, 0.25), 1 << 20, 64 << 10)
        assert res["sum"] == 3.0
        assert "permutation" in res["rejected"], res["rejected"]


def _disagreeing_plans(rank: int, world_size: int) -> None:
    import hetcomm

    shares = [1.0, 1.0] if rank == 0 else [1.0, 3.0]
    hetcomm.backend_of().set_plan([0, 1], shares, 0, 0)
    t = torch.ones(100000)
    dist.all_reduce(t)


@hetcomm_only("hetcomm's plan fingerprint")
def test_ranks_with_different_plans_get_an_error_not_wrong_numbers() -> None:
    outcomes = run_ranks_outcomes(2, _disagreeing_plans, timeout=60, pg_timeout=20)
    for o in outcomes:
        assert o.status == "raised", o.describe()
        assert "disagree about the collective" in o.message or "earlier failure" in o.message, o.describe()
    assert any("ring plan differ" in o.message for o in outcomes), [o.message for o in outcomes]


PROBE_SCRIPT = textwrap.dedent("""
    import json, torch.distributed as dist, hetcomm
    dist.init_process_group("hetcomm")
    m = hetcomm.link_model()
    if dist.get_rank() == 0:
        print("MODEL", json.dumps({"bw": m.bw.tolist(), "plan": hetcomm.get_plan().shares}), flush=True)
    dist.destroy_process_group()
""")


@hetcomm_only("probes hetcomm links")
@needs_netns
def test_probe_recovers_shaped_rates_on_the_simulator(tmp_path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    nics = [400, 100, 200]
    env = {k: v for k, v in os.environ.items() if k not in ("HETCOMM_PROBE", "HETCOMM_LINK_MBIT")}
    proc = subprocess.run([sys.executable, "-m", "hetcomm.sim", "--nic-mbit", ",".join(map(str, nics)), "--",
                           sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if "MODEL" in l)
    result = json.loads(line.split("MODEL", 1)[1])
    # TCP carries at most ~95.6% of a shaped wire rate as payload (headers; measured on the
    # simulator with one flow), so that is the rate a probe can recover.
    tcp_payload = 0.956
    for i in range(3):
        for j in range(3):
            if i == j:
                continue
            reachable = min(nics[i], nics[j]) * 1e6 / 8 * tcp_payload
            # at most the shaper's rate (load cannot raise it), at least half (a wrong shaper)
            assert_shaped(result["bw"][i][j], reachable, f"probed link {i}->{j}")
    # With rank 1 behind the slowest NIC, the plan must shift the buffer towards it.
    assert result["plan"][1] > 1 / 3, result


def _probe_on_demand(rank: int, world_size: int) -> dict:
    import hetcomm

    model = hetcomm.probe()  # the function, not a module of the same name
    return {"ranks": model.world_size, "same_as_stored": hetcomm.link_model() == model,
            "positive": all(model.bw[i][j] > 0 for i in range(world_size) for j in range(world_size) if i != j)}


@hetcomm_only("hetcomm.probe")
def test_probe_can_be_rerun_on_demand() -> None:
    for res in run_ranks(2, _probe_on_demand):
        assert res == {"ranks": 2, "same_as_stored": True, "positive": True}
