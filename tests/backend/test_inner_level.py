"""The inner level of a host as a pluggable backend (csrc/algorithms/inner_level.h): with
HETCOMM_LOCAL=gloo, torch's own Gloo group over each host's ranks replaces hetcomm's shared memory,
so the whole composition runs here on CPU with another library plugged in where NCCL goes on GPUs.

* one host: every collective of the suite through the Gloo level, on host memory and on the
  emulated device (device memory that the level takes directly, as NCCL takes CUDA memory);
* three levels (ranks in hosts of 1 and 2 ranks, hosts in unequal sites): every dtype and op,
  exact results, the same bits on every rank, the path counter, on host memory and on the emulated
  device, where only each rank's slice of the host's reduce-scatter crosses to host memory;
* a rank killed inside the Gloo level fails the whole group, naming it, before the timeout;
* the choice of levels from HETCOMM_LOCAL / HETCOMM_SHM, and the levels a group reports.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import collective_suite
from harness import run_ranks, run_suite
from level_suite import level_suite
from marks import hetcomm_only

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("inner level")]

GLOO = {"HETCOMM_LOCAL": "gloo"}
EMULATED = {"HETCOMM_DEBUG_EMULATE_DEVICE": "1"}
THREE = {"HETCOMM_HOST_ID": "0,1,1,2,3,3", "HETCOMM_SITES": "0,0,0,0,1,1", "HETCOMM_PROBE": "0",
         "HETCOMM_SMALL_ALLREDUCE_BYTES": "0"}

# --------------------------------------------------------------------------- one host, every collective

ONE_HOST = {"host_memory": GLOO, "emulated_device": {**GLOO, **EMULATED}}
FAMILIES = [f for f in collective_suite.FAMILIES if f not in collective_suite.NEEDS_PEER]
_SUITES: dict = {}


def _suite_and_levels(rank: int, ws: int) -> None:
    import hetcomm
    from harness import Cases
    with Cases(rank).case("levels", "the group took the Gloo level"):
        assert hetcomm.backend_of().inner_levels() == ["gloo"], hetcomm.backend_of().inner_levels()
    before = hetcomm.stats()["collectives_by_path"]["gloo"]
    collective_suite.collective_suite(rank, ws)
    with Cases(rank).case("levels", "collectives took the gloo path"):
        assert hetcomm.stats()["collectives_by_path"]["gloo"] > before + 100


def _one_host(config: str):
    if config not in _SUITES:
        _SUITES[config] = run_suite(3, _suite_and_levels, families=FAMILIES + ["levels"], timeout=400,
                                    pg_timeout=60, env=ONE_HOST[config])
    return _SUITES[config]


@pytest.mark.parametrize("config,family", [
    pytest.param(c, f, id=f"{c}-{f}") for c in ONE_HOST for f in FAMILIES + ["levels"]])
def test_one_host_collectives_through_gloo(config: str, family: str) -> None:
    _one_host(config).assert_family(family)


# -------------------------------------------------------------------------------- three levels

@pytest.mark.parametrize("memory", ["host_memory", "emulated_device"])
def test_three_levels_with_gloo_inside_hosts(memory: str) -> None:
    """Site 0: hosts {0} {1,2} {3}; site 1: host {4,5} -- 3 hosts against 1, hosts of 1 and 2 ranks."""
    env = {**THREE, **GLOO, **(EMULATED if memory == "emulated_device" else {})}
    families = ["all_reduce", "identical", "path"]
    report = run_suite(6, level_suite, "three", families=families, env=env, timeout=300)
    for family in families:
        report.assert_family(family)
    assert not report.job_problems, report.job_problems


# ------------------------------------------------------------------------------------ failures

def _killed_in_gloo(rank: int, ws: int, victim: int) -> dict:
    import hetcomm
    assert hetcomm.backend_of().inner_levels() == ["gloo"]
    x = torch.ones(1 << 20)
    dist.all_reduce(x)  # everyone is connected and in step
    if rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), 9)).start()
    start = time.monotonic()
    try:
        for _ in range(100_000):
            dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        return {"message": str(e), "elapsed": time.monotonic() - start}
    return {"message": "no error", "elapsed": time.monotonic() - start}


def test_a_rank_killed_inside_the_gloo_level_fails_the_group_naming_it() -> None:
    """Hosts {0,1} {2,3}, the host plan: rank 1 dies while the ranks loop over allreduces whose
    host steps run in Gloo. Its host peer (rank 0) learns it from Gloo or its liveness connection,
    the other host from the TCP steps or the group's failure report; all name rank 1, none by
    the timeout (its message would say "timed out"). A host peer that gave up but stayed alive
    is another matter: Gloo has no abort (docs/hosts-and-sites.md)."""
    env = {"HETCOMM_HOST_ID": "0,0,1,1", "HETCOMM_PROBE": "0", **GLOO}
    results = run_ranks(4, _killed_in_gloo, 1, expect_dead=[1], pg_timeout=20, env=env)
    for rank in (0, 2, 3):
        res = results[rank]
        assert "rank 1" in res["message"], res
        assert "timed out" not in res["message"], res


# ---------------------------------------------------------------------------------- the choice

@pytest.mark.parametrize("local,shm,expected", [
    ("", "", ("shm", "")),
    ("shm", "", ("shm", "")),
    ("nccl", "", ("shm", "nccl")),
    ("gloo", "", ("gloo", "")),
    ("tcp", "", ("tcp", "")),
    ("", "0", ("tcp", "")),
    ("gloo", "0", ("gloo", "")),       # HETCOMM_SHM=0 turns shared memory off, not Gloo
    ("GLOO ", "", ("gloo", "")),
])
def test_levels_chosen_from_the_environment(monkeypatch, local: str, shm: str, expected: tuple) -> None:
    from hetcomm import hosts
    monkeypatch.setenv("HETCOMM_LOCAL", local)
    monkeypatch.setenv("HETCOMM_SHM", shm or "1")
    assert hosts.inner_level_choice() == expected


def test_nccl_needs_a_gpu_per_rank_of_a_host() -> None:
    from hetcomm.hosts import _nccl_problem
    # GPUs by UUID: two ranks that each see their GPU as cuda:0 (CUDA_VISIBLE_DEVICES) differ.
    assert _nccl_problem(["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-a"], [0, 0, 1]) == ""
    assert _nccl_problem(["cuda:GPU-a", "cuda:GPU-a"], [0, 0]) == "ranks 0 and 1 of one host are both on cuda:GPU-a"
    # distinct NCCL_HOSTIDs: NCCL takes the ranks for two machines, so they may share the GPU
    assert _nccl_problem(["cuda:GPU-a@r0", "cuda:GPU-a@r1"], [0, 0]) == ""
    assert _nccl_problem(["cuda:GPU-a@h", "cuda:GPU-a@h"], [0, 0]) == "ranks 0 and 1 of one host are both on cuda:GPU-a@h"
    assert _nccl_problem(["cuda:GPU-a", "no CUDA device"], [0, 1]) == "rank 1 has no CUDA device"


def test_an_unknown_level_is_refused(monkeypatch) -> None:
    from hetcomm import hosts
    monkeypatch.setenv("HETCOMM_LOCAL", "infiniband")
    with pytest.raises(ValueError, match="choose shm, nccl, gloo or tcp"):
        hosts.inner_level_choice()
    monkeypatch.setenv("HETCOMM_LOCAL", "nccl")
    monkeypatch.setenv("HETCOMM_SHM", "0")
    with pytest.raises(ValueError, match="keeps shared memory for host memory"):
        hosts.inner_level_choice()
    # Unauthenticated levels would void TLS.
    monkeypatch.setenv("HETCOMM_SHM", "1")
    for level in ("gloo", "nccl"):
        monkeypatch.setenv("HETCOMM_LOCAL", level)
        monkeypatch.setenv("HETCOMM_TLS", "all")
        with pytest.raises(ValueError, match="not authenticated"):
            hosts.inner_level_choice()
    monkeypatch.setenv("HETCOMM_LOCAL", "shm")
    assert hosts.inner_level_choice() == ("shm", "")


def _nccl_refused(rank: int, ws: int) -> str:
    return "formed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no rank has a GPU")
def test_nccl_asked_for_without_gpus_fails_creation_on_every_rank() -> None:
    from harness import run_ranks_outcomes
    outcomes = run_ranks_outcomes(2, _nccl_refused, pg_timeout=10, env={"HETCOMM_LOCAL": "nccl"})
    for o in outcomes:
        assert o.status == "raised" and "rank 0 has no" in o.message, o
