"""CUDA tensors end to end: every collective, stream semantics, DDP. Needs a GPU.

* Collectives: the whole suite of test_collectives.py (every collective, dtype and op; sizes 0,
  1, fewer elements than ranks, not divisible by the world size, 16 MiB) with every tensor on
  the GPU, compared with the same CPU-computed results. With one GPU every rank shares it.
* Streams (design.md section 5), with HETCOMM_TEST_DEVICE_DELAY_MS holding the backend's stream
  back before its last writes, so that a missing stream dependency shows up as wrong numbers
  every time rather than as a rare race:
  - an input written by a kernel queued just before the collective is what gets reduced;
  - a kernel queued on the current stream right after wait(), or after the future, sees the
    result;
  - is_completed() means the data is on the device;
  - memory the caller dropped at once is not handed out again while the backend still writes it;
  - no collective waits for the whole device (an unrelated stream stays busy throughout).
* DDP (test_ddp.py's job: built-in hooks, fp16, PowerSGD, Join, the sample-weighted hooks) on
  CUDA, against gloo on CUDA.
* Every path a CUDA tensor can take (CUDA_PATHS): one host through shared memory (its segment
  pageable, and registered with the GPU: HETCOMM_SHM_PIN=1), through TCP
  (staged) and through the NCCL inner level; hosts of two through shared memory and through NCCL
  (only each rank's slice of a piece leaves the GPU); sites of hosts (pinned pieces between
  sites); three levels with NCCL inside hosts. On each: fp16/bf16 AVG of values whose sum
  overflows stays finite and within rounding of a float64 mean (tests/support/device_suite.py,
  which CI runs on the emulated device), every dtype and op of the level's plan (level_suite),
  and the pinned staging memory after a 1 GiB allreduce (at most the slots and one piece) and
  after the group is destroyed (none). Two ranks share the one GPU of a test machine through
  NCCL with a distinct NCCL_HOSTID each (NCCL then connects them as machines); HETCOMM_HOST_ID
  keeps them in one hetcomm host.

Without a GPU, or with a CPU-only build of hetcomm, every test here skips and says which. Set
HETCOMM_REQUIRE_CUDA=1 (scripts/gpu_check.sh does) to make that a failure instead: on a GPU
machine a skip would hide a broken CUDA build.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import Cases, run_suite
from values import assert_same
from collective_suite import FAMILIES, NEEDS_PEER, collective_suite, family_params
from ddp_suite import VARIANTS, ddp_suite
from device_suite import AVG_FAMILIES, large_avg_suite, staging_suite
from level_suite import level_suite


def _missing_cuda() -> str:
    if not torch.cuda.is_available():
        return ("needs a CUDA GPU: torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    import hetcomm
    if "cuda" not in hetcomm.supported_devices():
        return ("needs hetcomm built with CUDA: this build is CPU-only (it was compiled against a "
                "CPU-only torch or without nvcc)")
    return ""


_MISSING = _missing_cuda()
if _MISSING and os.environ.get("HETCOMM_REQUIRE_CUDA") == "1":
    raise RuntimeError(f"HETCOMM_REQUIRE_CUDA=1 but {_MISSING}")
pytestmark = [pytest.mark.usefixtures("backend_importable"),
              pytest.mark.skipif(bool(_MISSING), reason=_MISSING)]

WORLD_SIZES = [1, 2, 3]

# --------------------------------------------------------------------------------------------
# Every collective on the GPU
# --------------------------------------------------------------------------------------------

_COLLECTIVE_REPORTS: dict[int, object] = {}


def _collective_report(world_size: int):
    if world_size not in _COLLECTIVE_REPORTS:
        families = [f for f in FAMILIES if world_size > 1 or f not in NEEDS_PEER]
        _COLLECTIVE_REPORTS[world_size] = run_suite(world_size, collective_suite, "cuda",
                                                    families=families, timeout=240,
                                                    pg_timeout=60)
    return _COLLECTIVE_REPORTS[world_size]


@pytest.mark.parametrize("world_size,family", family_params(WORLD_SIZES))
def test_collective_on_cuda(world_size: int, family: str) -> None:
    _collective_report(world_size).assert_family(family)


# --------------------------------------------------------------------------------------------
# Stream semantics
# --------------------------------------------------------------------------------------------

DELAY_MS = 300              # HETCOMM_TEST_DEVICE_DELAY_MS for the stream job
N = 1 << 20                 # 4 MiB of float32: a ring allreduce through the staged pipeline
SLEEP_200MS = 400_000_000   # torch.cuda._sleep cycles: >= 0.2 s at up to 2 GHz
SLEEP_LONG = 8_000_000_000  # >= 4 s at up to 2 GHz: outlasts every collective of the case

STREAM_FAMILIES = ["inputs_ready", "result_after_wait", "result_after_future", "is_completed",
                   "record_stream", "no_device_sync"]


def _full(value: float, device) -> torch.Tensor:
    return torch.full((N,), float(value), device=device)


def stream_suite(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    total = torch.full((N,), float(sum(r + 1 for r in range(world_size))))
    cases = Cases(rank)

    # Warm up everything that allocates (staging slots, events, pinned buffers, streams): a first
    # allocation may synchronise the device, which the no_device_sync case must not see.
    warm = _full(1, device)
    dist.all_reduce(warm)
    dist.all_reduce(torch.ones(8, device=device))
    dist.all_gather_into_tensor(torch.empty(world_size * 8, device=device), torch.ones(8, device=device))
    dist.broadcast(torch.ones(8, device=device), src=0)
    if world_size > 1:
        peer = (rank + 1) % world_size, (rank - 1) % world_size
        works = [dist.isend(torch.ones(8, device=device), dst=peer[0]),
                 dist.irecv(torch.empty(8, device=device), src=peer[1])]
        for w in works:
            w.wait()
    torch.cuda.synchronize()

    with cases.case("inputs_ready", "input written by a kernel queued behind a 0.2 s sleep"):
        x = torch.zeros(N, device=device)
        torch.cuda._sleep(SLEEP_200MS)
        x.fill_(rank + 1)
        dist.all_reduce(x)
        assert_same(x, total)

    with cases.case("result_after_wait", "a kernel queued right after wait() sees the result"):
        x = _full(rank + 1, device)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        y = x * 1  # on the current stream, at once: the backend's last write is 0.3 s away
        assert_same(y, total)

    with cases.case("result_after_future", "after future.wait(), and inside then()"):
        x = _full(rank + 1, device)
        fut = dist.all_reduce(x, async_op=True).get_future()
        got = fut.wait()[0] * 1
        assert_same(got, total, "after future.wait()")
        x2 = _full(rank + 1, device)
        chained = dist.all_reduce(x2, async_op=True).get_future().then(lambda f: f.value()[0] * 1)
        assert_same(chained.wait(), total, "in then()")

    with cases.case("is_completed", "is_completed() only once the device has the result"):
        x = _full(rank + 1, device)
        work = dist.all_reduce(x, async_op=True)
        deadline = time.monotonic() + 60
        while not work.is_completed():
            assert time.monotonic() < deadline, "the work never completed"
            time.sleep(0.001)
        # No wait(): is_completed() alone must mean the backend's stream has written x.
        assert_same(x, total)

    with cases.case("record_stream", "memory dropped right after issue is not reused too early"):
        x = _full(rank + 1, device)
        dist.all_reduce(x, async_op=True)  # the work is dropped at once, and so is x
        del x
        dist.barrier()    # the worker is past the allreduce: its references are gone...
        time.sleep(0.05)  # ...and the completion thread's too (the device is still held back)
        junk = torch.full((N,), 7.0, device=device)  # x's size: the allocator's first choice
        torch.cuda.synchronize()
        assert_same(junk, torch.full((N,), 7.0), "a tensor allocated after the drop")

    with cases.case("no_device_sync", "collectives finish while an unrelated stream sleeps"):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_LONG)
        x = _full(rank + 1, device)
        dist.all_reduce(x)
        small = torch.full((8,), float(rank + 1), device=device)
        dist.all_reduce(small)
        gathered = torch.empty(world_size * 8, device=device)
        dist.all_gather_into_tensor(gathered, torch.full((8,), float(rank), device=device))
        if world_size > 1:
            got = torch.empty(8, device=device)
            works = [dist.isend(torch.full((8,), float(rank), device=device), dst=peer[0]),
                     dist.irecv(got, src=peer[1])]
            for w in works:
                w.wait()
        results = [x.cpu(), small.cpu(), gathered.cpu()]  # synchronises the current stream only
        busy = not side.query()
        side.synchronize()
        assert busy, "the unrelated stream had finished: something synchronised the whole device"
        assert_same(results[0], total, "all_reduce")
        assert_same(results[1], total[:8], "small all_reduce")
        assert_same(results[2], torch.arange(world_size, dtype=torch.float32).repeat_interleave(8),
                    "all_gather_into_tensor")
        if world_size > 1:
            assert_same(got, torch.full((8,), float(peer[1])), "irecv")


_STREAM_REPORT: list = []


def _stream_report():
    if not _STREAM_REPORT:
        _STREAM_REPORT.append(run_suite(2, stream_suite, families=STREAM_FAMILIES, timeout=150,
                                        pg_timeout=60,
                                        env={"HETCOMM_TEST_DEVICE_DELAY_MS": str(DELAY_MS)}))
    return _STREAM_REPORT[0]


@pytest.mark.parametrize("family", STREAM_FAMILIES)
def test_stream_semantics(family: str) -> None:
    _stream_report().assert_family(family)


# --------------------------------------------------------------------------------------------
# DDP on CUDA, against gloo on CUDA
# --------------------------------------------------------------------------------------------

_DDP_REPORT: list = []


def _ddp_report():
    if not _DDP_REPORT:
        _DDP_REPORT.append(run_suite(2, ddp_suite, "cuda", families=VARIANTS, timeout=200,
                                     pg_timeout=60))
    return _DDP_REPORT[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ddp_on_cuda_matches_gloo(variant: str) -> None:
    _ddp_report().assert_family(variant)


# --------------------------------------------------------------------------------------------
# Every path a CUDA tensor takes
# --------------------------------------------------------------------------------------------

def _nccl_hosts(ws: int) -> list[str]:
    return [f"hetcomm-test-rank{r}" for r in range(ws)]


NCCL = {"HETCOMM_LOCAL": "nccl"}
LEVELS = {"HETCOMM_SMALL_ALLREDUCE_BYTES": "0"}   # small allreduces take the level's plan too
# name: (world size, environment, the level's plan for level_suite or None for one host, inner level)
CUDA_PATHS = {
    "one-host-shm": (2, {}, None, "shm"),
    "one-host-shm-pinned": (2, {"HETCOMM_SHM_PIN": "1"}, None, "shm"),   # the segment registered
    "one-host-tcp": (2, {"HETCOMM_LOCAL": "tcp"}, None, None),
    "one-host-nccl": (2, {**NCCL, "NCCL_HOSTID": _nccl_hosts(2)}, None, "nccl"),
    "hosts-shm": (4, {"HETCOMM_HOST_ID": "0,0,1,1", **LEVELS}, "host", "shm"),
    "hosts-nccl": (4, {"HETCOMM_HOST_ID": "0,0,1,1", **LEVELS, **NCCL, "NCCL_HOSTID": _nccl_hosts(4)}, "host",
                   "nccl"),
    # Declared links slow between the sites, so that the planner takes the site plan.
    "sites": (4, {"HETCOMM_HOST_ID": "0,1,2,3", "HETCOMM_SITES": "0,0,1,1",
                  "HETCOMM_LINK_MBIT": "0,10000,100,100;10000,0,100,100;100,100,0,10000;100,100,10000,0"},
              None, None),
    "three-levels-nccl": (6, {"HETCOMM_HOST_ID": "0,1,1,2,3,3", "HETCOMM_SITES": "0,0,0,0,1,1", **LEVELS, **NCCL,
                              "NCCL_HOSTID": _nccl_hosts(6)}, "three", "nccl"),
}
PATH_ENV = {"HETCOMM_PROBE": "0"}
LEVEL_FAMILIES = ["all_reduce", "identical", "path"]
GIB_FLOATS = 1 << 28                                  # a 1 GiB float32 allreduce
STAGING_BOUND = 8 * (1 << 20) + (32 << 20)            # 8 slots of 1 MiB + one 32 MiB piece (the defaults)


def _path_families(path: str) -> list[str]:
    ws, _, level, _ = CUDA_PATHS[path]
    one_host = FAMILIES if path == "one-host-nccl" else []
    return ["inner_level"] + AVG_FAMILIES + (LEVEL_FAMILIES if level else []) + one_host + ["staging"]


def path_suite(rank: int, ws: int, path: str) -> dict:
    import hetcomm
    _, _, level, inner = CUDA_PATHS[path]
    hosts = os.environ.get("HETCOMM_HOST_ID", "").split(",")
    if len(hosts) == ws and hosts.count(hosts[rank]) < 2:
        inner = None                                  # alone on its host: nothing to join
    with Cases(rank).case("inner_level", f"this rank's host took {inner or 'no'} inner level"):
        levels = hetcomm.backend_of().inner_levels()
        assert (inner in levels) if inner else not levels, levels
        if os.environ.get("HETCOMM_SITES"):
            assert hetcomm.get_plan().sites is not None, "no site plan"
    large_avg_suite(rank, ws, "cuda")
    if os.environ.get("HETCOMM_SHM_PIN") == "1":
        from hetcomm._engine import extension
        with Cases(rank).case("inner_level", "the segment is registered with the GPU"):
            # (a registration that failed would only warn, and the path would pass unpinned)
            assert extension().registered_host_bytes() > 0, "HETCOMM_SHM_PIN=1, but nothing is registered"
    if level:
        level_suite(rank, ws, level, "cuda")
    if path == "one-host-nccl":
        collective_suite(rank, ws, "cuda")
    held = staging_suite(rank, ws, "cuda", GIB_FLOATS, STAGING_BOUND)    # destroys the group
    if os.environ.get("HETCOMM_SHM_PIN") == "1":
        from hetcomm._engine import extension
        with Cases(rank).case("staging", "the segment is unregistered once the group is destroyed"):
            assert extension().registered_host_bytes() == 0, extension().registered_host_bytes()
    return held


_PATH_REPORTS: dict = {}


def _path_report(path: str):
    if path not in _PATH_REPORTS:
        ws, env, _, _ = CUDA_PATHS[path]
        report = run_suite(ws, path_suite, path, families=_path_families(path), timeout=300, pg_timeout=60,
                           env={**PATH_ENV, **env})
        print(f"staging memory per rank, {path}: " + ", ".join(
            f"rank {r}: {v['held']} bytes after a 1 GiB allreduce, {v['after_destroy']} after destroy"
            if v else f"rank {r}: none" for r, v in enumerate(report.values)))
        _PATH_REPORTS[path] = report
    return _PATH_REPORTS[path]


@pytest.mark.parametrize("path,family", [pytest.param(p, f, id=f"{p}-{f}")
                                         for p in CUDA_PATHS for f in _path_families(p)])
def test_every_cuda_path(path: str, family: str) -> None:
    _path_report(path).assert_family(family)
