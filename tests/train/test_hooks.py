"""Sample-weighted DDP hooks (hetcomm.hooks): uneven batches give the full-batch gradient.

One 3-rank job checks every hook on the backend under test and on gloo (a gloo group inside
the same job), over the whole world and over a 2-rank subgroup. Each rank builds the same model
from the same seed and the same global batch, takes its own slice of it through DDP and
compares ``p.grad`` with the gradient of the full batch computed in that one process.

Tolerances are norm-wise relative errors per parameter, ``|g - ref| / |ref|``: element-wise
relative errors are meaningless for gradient entries near zero.

* weighted_allreduce_hook: 1e-5 (float32 and float64; the observed error is float rounding).
* fp16 / bf16 on the wire: each rank's weighted share is rounded once to the wire format
  (relative error <= u) and every addition of the reduction rounds once more, so an element's
  error is at most about ``world_size * u`` times the sum of the shares' magnitudes; the shares
  of this model's ranks have similar norms, within 2x of the sum's. Hence
  ``2 * world_size * u``: fp16 u = 2**-11 (3 ranks: 2.9e-3), bf16 u = 2**-8 (3 ranks: 2.3e-2).
* DDP's default (divide by world size) must be off by more than 100x the weighted tolerance
  on uneven splits, or the weighted checks would prove nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetcomm.train import hooks
from harness import Cases, SuiteReport, job_backend, run_suite

pytestmark = pytest.mark.usefixtures("backend_importable")

WORLD_SIZE = 3
FAMILIES = ["weighted", "compressed", "default_is_wrong", "agree_samples", "errors"]
WEIGHTED_RTOL = 1e-5
WIRE_UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
COMPRESSED_HOOKS = {torch.float16: hooks.weighted_fp16_hook,
                    torch.bfloat16: hooks.weighted_bf16_hook}
# Per-step partitions of the global batch: each run takes two steps with different splits,
# so that a hook still using the previous step's counts fails.
SPLITS = {2: [(3, 13), (13, 3), (7, 0), (0, 9)],
          3: [(1, 6, 25), (25, 1, 6), (0, 5, 11)]}


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def global_batch(size: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(size, 16, generator=g, dtype=dtype),
            torch.randn(size, 4, generator=g, dtype=dtype))


def full_batch_grads(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model = mlp(x.dtype)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def ddp_grads(group, hook, dtype: torch.dtype, splits: list[tuple[int, ...]],
              set_samples: bool = True) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per step: (the gradients DDP left in p.grad, the full-batch reference gradients).

    ``hook`` None: DDP's default reduction. Small buckets put several in flight at once.
    """
    model = mlp(dtype)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)
    state = hooks.SampleWeightState(group)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    rank = dist.get_rank(group)
    results = []
    for step, split in enumerate(splits):
        x, y = global_batch(sum(split), step, dtype)
        start = sum(split[:rank])
        mine = slice(start, start + split[rank])
        if set_samples:
            state.set_samples(split[rank], sum(split))
        model.zero_grad()
        # A rank with no samples still runs forward and backward on an empty batch.
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        results.append(([p.grad.clone() for p in model.parameters()], full_batch_grads(x, y)))
    return results


def relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True))


def worst_error(results) -> float:
    return max(relative_error(got, ref) for got, ref in results)


def check_hook_against_full_batch(group, hook, dtype: torch.dtype, splits, rtol: float) -> None:
    err = worst_error(ddp_grads(group, hook, dtype, splits))
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


def groups_by_backend(rank: int) -> dict[str, dict[int, object]]:
    """{backend: {size: group}}; every rank creates every group, in the same order."""
    names = list(dict.fromkeys([job_backend(), "gloo"]))
    groups = {}
    for name in names:
        world = None if name == job_backend() else dist.new_group(backend=name)
        pair = dist.new_group(ranks=[0, 1], backend=name)
        groups[name] = {3: world, 2: pair if rank in (0, 1) else None}
    return groups


def hooks_suite(rank: int, world_size: int) -> None:
    cases = Cases(rank)
    groups = groups_by_backend(rank)

    for backend, by_size in groups.items():
        for size, group in by_size.items():
            if size == 2 and rank == 2:
                continue  # not a member of the pair
            splits = SPLITS[size]
            for dtype in (torch.float64, torch.float32):
                with cases.case("weighted", f"{backend} {size} ranks {dtype} {splits}"):
                    check_hook_against_full_batch(group, hooks.weighted_allreduce_hook, dtype,
                                                  splits, WEIGHTED_RTOL)
            for wire, hook in COMPRESSED_HOOKS.items():
                rtol = 2 * size * WIRE_UNIT_ROUNDOFF[wire]
                with cases.case("compressed", f"{backend} {size} ranks {wire} on the wire"):
                    check_hook_against_full_batch(group, hook, torch.float32, splits, rtol)
            with cases.case("default_is_wrong", f"{backend} {size} ranks {splits}"):
                err = worst_error(ddp_grads(group, None, torch.float64, splits))
                assert err > 100 * WEIGHTED_RTOL, \
                    f"DDP's default is within {err:.3g} of the full batch: the splits are too even"
            with cases.case("agree_samples", f"{backend} {size} ranks"):
                state = hooks.SampleWeightState(group)
                local = 4 + 3 * rank
                total = state.agree_samples(local)
                assert total == sum(4 + 3 * r for r in range(size)), total
                assert (state.local_samples, state.global_samples) == (local, total)

        for size, group in by_size.items():
            if size == 2 and rank == 2:
                continue
            with cases.case("errors", f"{backend} {size} ranks: hook before set_samples"):
                # Every rank raises before its first collective, so none waits for another.
                try:
                    ddp_grads(group, hooks.weighted_allreduce_hook, torch.float32, [(5,) * size],
                              set_samples=False)
                except RuntimeError as e:
                    assert "set_samples" in str(e) and f"rank {rank}" in str(e), str(e)
                else:
                    raise AssertionError("backward without set_samples did not raise")
            with cases.case("errors", f"{backend} {size} ranks: wire dtype the backend rejects"):
                state = hooks.SampleWeightState(group)
                buffer = torch.ones(8)
                try:  # gloo rejects it in the future, hetcomm at once: both must say the same
                    hooks._allreduce_into_bucket(state, "fp8_hook", buffer,
                                                 buffer.to(torch.float8_e4m3fn)).wait()
                except RuntimeError as e:
                    for word in ("fp8_hook", "torch.float8_e4m3fn", repr(backend), f"rank {rank}"):
                        assert word in str(e), f"{word!r} not in {str(e)!r}"
                else:
                    raise AssertionError(f"{backend} reduced float8; pick a dtype it rejects")


@pytest.fixture(scope="module")
def report() -> SuiteReport:
    """The one job every family reads its checks from (run once, on first use)."""
    return run_suite(WORLD_SIZE, hooks_suite, families=FAMILIES, timeout=180, pg_timeout=60)


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks(report: SuiteReport, family: str) -> None:
    report.assert_family(family)


@pytest.mark.parametrize("local, total, error", [
    (-1, 10, ValueError), (11, 10, ValueError), (0, 0, ValueError), (3, -4, ValueError),
    (1.5, 10, TypeError), (True, 10, TypeError), (1, torch.tensor(10), TypeError),
])
def test_set_samples_rejects_invalid_counts(local, total, error) -> None:
    state = hooks.SampleWeightState()
    with pytest.raises(error, match="SampleWeightState"):
        state.set_samples(local, total)
    assert state.local_samples is None and state.global_samples is None


def test_set_samples_accepts_edges() -> None:
    state = hooks.SampleWeightState()
    state.set_samples(0, 1)
    assert state.weight() == 0.0
    state.set_samples(7, 7)
    assert state.weight() == 1.0


def test_weight_before_set_samples_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"call state\.set_samples"):
        hooks.SampleWeightState().weight()
