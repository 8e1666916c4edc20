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
