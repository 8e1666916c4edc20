"""DistributedDataParallel on the backend under test: same result as gloo, no deadlock.

One 2-rank job trains the same small MLP, from the same seed on the same data, once on the
default group (the backend under test) and once on a gloo group, for each variant: plain DDP,
many small buckets, the built-in communication hooks (allreduce, fp16 compression, PowerSGD),
find_unused_parameters and Join with uneven inputs. With two ranks every sum has one possible
order, so the parameters must agree to 1e-6 (in practice bit for bit).

PowerSGD is the deadlock trap of design.md section 5: its future callbacks block on further
collectives, so a backend that completes futures on its communication thread hangs here (the
harness deadline turns a hang into a failure with a stack dump).

The weighted variants run hetcomm's sample-weighted hooks with uneven per-rank batches (8 and 5
samples) on both groups. The suite is tests/support/ddp_suite.py (test_cuda.py runs it on CUDA,
against gloo on CUDA).
"""
from __future__ import annotations

import pytest
import torch

from ddp_suite import VARIANTS, WORLD_SIZE, ddp_suite, train
from harness import run_ranks_outcomes, run_suite
from marks import hetcomm_only

pytestmark = pytest.mark.usefixtures("backend_importable")

_REPORT = []


def _report():
    if not _REPORT:
        _REPORT.append(run_suite(WORLD_SIZE, ddp_suite, families=VARIANTS, timeout=240,
                                 pg_timeout=60))
    return _REPORT[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ddp_matches_gloo_and_ranks_agree(variant: str) -> None:
    """Each variant's parameters after training match the same run on gloo (checked inside the
    job, to 1e-6), and -- DDP's invariant -- all ranks hold the same parameters, bit for bit.
    (One test: the two checks were two tests over the same job.)"""
    report = _report()
    report.assert_family(variant)
    per_rank = [v[variant] for v in report.values]
    for k, (a, b) in enumerate(zip(per_rank[0], per_rank[1], strict=True)):
        assert torch.equal(a, b), \
            f"parameter {k}: rank 0 and rank 1 differ by {(a - b).abs().max()}"


def powersgd_many_buckets(rank: int, world_size: int) -> list[torch.Tensor]:
    initial, final = train("powerSGD_hook_many_buckets", rank, None)
    assert max(float((a - b).abs().max()) for a, b in zip(final, initial, strict=True)) > 1e-4
    return final


@hetcomm_only("gloo itself deadlocks here: its 2 worker threads both block in PowerSGD callbacks")
def test_powerSGD_many_buckets_in_flight_never_hangs() -> None:
    """Several PowerSGD buckets in flight, each callback blocking on further collectives.

    A backend that completes futures on a fixed small pool of threads that also run the
    collectives deadlocks once more callbacks block than it has threads; gloo (2 threads) does.
    hetcomm completes futures on a pool that grows, so it never deadlocks. What it cannot do is
    give an order to collectives that two threads issue at the same time: PowerSGD's callbacks
    (on completion threads) race with DDP issuing the next bucket (on the autograd thread), so
    the ranks may issue them in different orders. hetcomm's contract there: no hang, no wrong
    numbers — either the ranks end with identical parameters, or every rank raises the
    "disagree about the collective" error.
    """
    outcomes = run_ranks_outcomes(WORLD_SIZE, powersgd_many_buckets, timeout=90, pg_timeout=30)
    assert all(o.status in ("ok", "raised") for o in outcomes), [o.describe() for o in outcomes]
    if all(o.status == "ok" for o in outcomes):
        for k, (a, b) in enumerate(zip(*(o.value for o in outcomes), strict=True)):
            assert torch.equal(a, b), f"parameter {k}: rank 0 and rank 1 differ"
        return
    for o in outcomes:
        assert o.status == "raised", f"one rank finished while the other failed: {o.describe()}"
        assert "disagree about the collective" in o.message or "earlier failure" in o.message, o.describe()
