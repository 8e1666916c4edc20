"""Link models of subgroups, the engine settings the planner models, and the cost of planning.

* Declared links (HETCOMM_LINK_MBIT) describe the job by global rank: a subgroup (new_group,
  DeviceMesh) takes its rows and columns. It used to index them by group rank, and every
  subgroup creation failed.
* A measured model is kept by global ranks: a later group it covers reuses it instead of probing.
* The planner reads the engine's settings from the extension, so HETCOMM_SMALL_ALLREDUCE_BYTES and
  HETCOMM_SEGMENT_BYTES change its predictions as they change the engine.
* Choosing a plan asks for the best plan of one model once per candidate message size; the search
  runs once (one search took 6 s for 8 ranks at two sites, and ran up to 26 times).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import run_ranks
from values import assert_same, expected_reduce, pattern

from hetcomm import planner, topology

MBIT = 1e6 / 8
DECLARED = "800,800,800,100"


def test_a_declared_model_is_restricted_to_the_group_by_global_rank(monkeypatch) -> None:
    monkeypatch.setenv("HETCOMM_LINK_MBIT", DECLARED)
    world = topology.declared_model([0, 1, 2, 3])
    assert world.bw[0][3] == 100 * MBIT and world.bw[0][1] == 800 * MBIT
    sub = topology.declared_model([1, 3])
    assert sub.world_size == 2 and sub.bw[0][1] == sub.bw[1][0] == 100 * MBIT
    assert topology.declared_model([2, 0]).bw.tolist() == [[0.0, 800 * MBIT], [800 * MBIT, 0.0]]
    with pytest.raises(ValueError, match="declares 4 ranks, but this group has global rank 5"):
        topology.declared_model([0, 5])


def test_restricted_model_keeps_rates_reduce_and_engine_settings() -> None:
    bw = [[0, 1e8, 2e8], [3e8, 0, 4e8], [5e8, 6e8, 0]]
    model = planner.LinkModel(bw=tuple(tuple(r) for r in bw), reduce_bps=(7e9, 8e9, 9e9), alpha=1e-4,
                              segment_bytes=1 << 16)
    sub = model.restricted([2, 0])
    assert sub.bw.tolist() == [[0.0, 5e8], [2e8, 0.0]] and sub.reduce_bps == (9e9, 7e9)
    assert (sub.alpha, sub.segment_bytes) == (1e-4, 1 << 16)
    with pytest.raises(ValueError):
        model.restricted([0, 0])


def test_a_measured_model_covers_later_groups_of_its_ranks(monkeypatch) -> None:
    world = planner.LinkModel.from_nics([100 * MBIT, 200 * MBIT, 300 * MBIT, 400 * MBIT])
    monkeypatch.setattr(topology, "_measured", {(0, 1, 2, 3): world})
    assert topology._covering_model((1, 3)) == world.restricted([1, 3])
    assert topology._covering_model((3, 1)) == world.restricted([3, 1])
    assert topology._covering_model((0, 4)) is None
    # the smallest group that covers wins: the freshest measurement of exactly those ranks
    pair = planner.LinkModel.from_nics([1 * MBIT, 2 * MBIT])
    topology._measured[(1, 3)] = pair
    assert topology._covering_model((1, 3)) == pair


def subgroups_with_declared_links(rank: int, world_size: int) -> dict:
    import hetcomm

    out = {}
    for ranks in ([1, 3], [0, 1, 2], [3, 2]):
        group = dist.new_group(ranks)  # every rank creates every group, as torch requires
        if rank not in ranks:
            continue
        model = hetcomm.link_model(group)
        out[tuple(ranks)] = {"bw": model.bw.tolist(), "shares": hetcomm.get_plan(group).shares}
        mine = ranks.index(rank)
        inputs = [pattern(100_000, torch.float32, r) for r in range(len(ranks))]
        t = inputs[mine].clone()
        dist.all_reduce(t, group=group)
        assert_same(t, expected_reduce(inputs, dist.ReduceOp.SUM), f"all_reduce on group {ranks}")
    return out


@hetcomm_only("HETCOMM_LINK_MBIT is hetcomm's")
def test_subgroups_with_declared_links_are_created_and_planned() -> None:
    results = run_ranks(4, subgroups_with_declared_links, timeout=180, env={"HETCOMM_LINK_MBIT": DECLARED})
    declared = planner.LinkModel.from_nics([800 * MBIT, 800 * MBIT, 800 * MBIT, 100 * MBIT])
    for rank, got in enumerate(results):
        for ranks, entry in got.items():
            assert entry["bw"] == declared.restricted(list(ranks)).bw.tolist(), (rank, ranks, entry)
    # Ranks 0, 1, 2 have equal NICs: a uniform plan. Every group holds the same plan on every rank.
    assert results[0][(0, 1, 2)]["shares"] == pytest.approx((1 / 3,) * 3)
    assert results[1][(1, 3)] == results[3][(1, 3)]


ENGINE_SCRIPT = textwrap.dedent("""
    import json
    from hetcomm import planner
    model = planner.LinkModel.from_nics([100e6, 100e6, 100e6, 12.5e6])
    print(json.dumps({"small": planner.SMALL_ALLREDUCE_BYTES, "segment": planner.SEGMENT_BYTES,
                      "model_small": model.small_allreduce_bytes, "model_segment": model.segment_bytes,
                      "crossover": planner.crossover_bytes(model)}))
""")


def _engine_view(env: dict) -> dict:
    import json
    import os

    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_planner_models_the_engine_settings_in_force() -> None:
    default = _engine_view({})
    assert default["small"] == default["model_small"] == 32 * 1024
    assert default["segment"] == default["model_segment"] == 0
    tuned = _engine_view({"HETCOMM_SMALL_ALLREDUCE_BYTES": str(1 << 20), "HETCOMM_SEGMENT_BYTES": str(1 << 16)})
    assert tuned["small"] == tuned["model_small"] == 1 << 20
    assert tuned["segment"] == tuned["model_segment"] == 1 << 16
    # Below 1 MiB the engine now uses recursive doubling, which ignores plans: the crossover moves.
    assert default["crossover"] < (1 << 20) < tuned["crossover"], (default, tuned)


def test_choosing_a_plan_searches_the_ring_orders_once() -> None:
    import random

    rng = random.Random(0)
    site = [0, 0, 0, 0, 1, 1, 1, 1]
    bw = [[0.0 if i == j else (125e6 if site[i] == site[j] else 12.5e6) * rng.uniform(0.9, 1.1) for j in range(8)]
          for i in range(8)]
    model = planner.LinkModel(bw=tuple(tuple(r) for r in bw), reduce_bps=tuple(2e9 * rng.uniform(0.9, 1.1)
                                                                              for _ in range(8)))
    planner.best_plan.cache_clear()
    planner.choose_plan(model)
    info = planner.best_plan.cache_info()
    assert info.misses == 1 and info.hits >= 1, info
