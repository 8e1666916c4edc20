"""Values with exactly known results, for checking collectives: input patterns whose every
reduction over up to four ranks is exactly representable in its dtype (whatever the order of
the additions), the expected results computed with plain torch, and assertions that say where a
result differs. Used inside ranks and in the test process alike (no process management here:
that is harness.py).
"""
from __future__ import annotations

import functools
from typing import Sequence

MAX_WORLD_SIZE = 4
STRIDE = 4  # >= MAX_WORLD_SIZE, so that i * STRIDE + rank tells both i and rank apart

# The largest magnitude up to which every integer is representable (floats) or which does not
# overflow (integers). Patterns keep |x| <= LIMIT / MAX_WORLD_SIZE so that every partial sum of
# up to four ranks' values is an exactly representable integer, in any reduction order.
_EXACT_LIMIT = {
    "torch.float16": 2048, "torch.bfloat16": 256, "torch.float32": 2 ** 24,
    "torch.float64": 2 ** 53, "torch.int8": 127, "torch.uint8": 255,
    "torch.int32": 2 ** 31 - 1, "torch.int64": 2 ** 62,
}


def is_signed(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_signed


def pattern(n: int, dtype, rank: int, salt: int = 0):
    """``x[i] = (i % period) * STRIDE + rank - offset``: exact under SUM/MIN/MAX of <= 4 ranks.

    ``salt`` shifts i, so that one rank can hold several distinct tensors (one per peer in
    reduce_scatter, all_to_all, scatter). Signed dtypes are centred on zero, so that MIN and
    MAX see negative values. bool: bit ``rank`` of i, so that AND, OR and XOR all vary.
    Returns a fresh tensor the caller may modify.
    """
    return _cached_pattern(n, dtype, rank, salt).clone()


@functools.lru_cache(maxsize=32)
def _cached_pattern(n: int, dtype, rank: int, salt: int):
    # Cached, and built from one period tiled in the target dtype, because the suites build
    # every rank's 16 MiB input again and again to compute expected values, and filling fresh
    # int64 memory is slow on small machines.
    import torch

    if dtype == torch.bool:
        i = torch.arange(n, dtype=torch.int64) + 7 * salt
        return ((i >> rank) & 1).bool()
    per_rank = _EXACT_LIMIT[str(dtype)] // MAX_WORLD_SIZE
    span = 2 * per_rank if is_signed(dtype) else per_rank
    period = min((span - STRIDE) // STRIDE, 1_000_003)
    offset = (period * STRIDE) // 2 if is_signed(dtype) else 0
    k = (torch.arange(min(n, period), dtype=torch.int64) + 7 * salt) % period
    one_period = (k * STRIDE + rank - offset).to(dtype)
    if n <= period:
        return one_period
    return one_period.repeat((n + period - 1) // period)[:n].clone()


def exact_counts(total: int, shares) -> list[int]:
    """``total`` elements split by ``shares`` in exact arithmetic, for a total that every share
    divides (asserted): the expected counts of a test then need no rounding rule, so they do not
    depend on the engine's own (``sharesToCounts``, which has hand-computed cases of its own in
    tests/cpp/test_ring_schedule.cc and tests/plan/test_planner.py). Shares are read as the short
    fractions they stand for (0.3 as 3/10, 1/3 as 1/3)."""
    from fractions import Fraction

    parts = [Fraction(s).limit_denominator(1000) for s in shares]
    counts = [total * p / sum(parts) for p in parts]
    assert all(c.denominator == 1 for c in counts), f"{total} does not split exactly by {list(shares)}"
    return [int(c) for c in counts]


def product_pattern(n: int, dtype, rank: int, salt: int = 0):
    """Values in {0, 1, 2, 3} (and -1, -2 when signed): a product of four fits int8 and bf16."""
    import torch

    if dtype == torch.bool:
        return pattern(n, dtype, rank, salt)
    choices = [1, 2, -1, 1, 0, -2, 3] if is_signed(dtype) else [1, 2, 3, 1, 0, 2, 1]
    i = torch.arange(n, dtype=torch.int64) * 3 + rank * 2 + salt
    return torch.tensor(choices, dtype=torch.int64)[i % len(choices)].to(dtype)


def reduce_op_names():
    import torch.distributed as dist

    R = dist.ReduceOp
    return {R.SUM: "SUM", R.AVG: "AVG", R.PRODUCT: "PRODUCT", R.MIN: "MIN", R.MAX: "MAX",
            R.BAND: "BAND", R.BOR: "BOR", R.BXOR: "BXOR"}


def ops_for(dtype) -> list:
    """The reductions that are defined for a dtype (AVG for floats, bitwise ops for integers)."""
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    if dtype == torch.bool:
        return [R.SUM, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def inputs_for(op, n: int, dtype, rank: int, salt: int = 0):
    import torch.distributed as dist

    if op == dist.ReduceOp.PRODUCT:
        return product_pattern(n, dtype, rank, salt)
    return pattern(n, dtype, rank, salt)


def expected_reduce(tensors: Sequence, op):
    """The reduction of ``tensors`` computed with plain torch in their own dtype."""
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    dtype = tensors[0].dtype
    if op == R.AVG:
        total = functools.reduce(torch.add, [t.double() for t in tensors])
        return (total / len(tensors)).to(dtype)
    if dtype == torch.bool:
        fold = {R.SUM: torch.logical_or, R.PRODUCT: torch.logical_and, R.MIN: torch.logical_and,
                R.MAX: torch.logical_or, R.BAND: torch.logical_and, R.BOR: torch.logical_or,
                R.BXOR: torch.logical_xor}[op]
    else:
        fold = {R.SUM: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum,
                R.MAX: torch.maximum, R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or,
                R.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(fold, tensors)


def poison_like(expected):
    """A buffer that differs from ``expected`` in every element: unwritten output shows up."""
    import torch

    if expected.dtype == torch.bool:
        return ~expected
    return expected + 1  # integer overflow wraps, and still differs


def assert_same(got, expected, what: str = "") -> None:
    """Exact equality of dtype, shape and every element, with a message that shows where."""
    import torch

    prefix = f"{what}: " if what else ""
    got, expected = got.cpu(), expected.cpu()  # results of CUDA collectives are checked here too
    assert got.dtype == expected.dtype, f"{prefix}dtype {got.dtype} != expected {expected.dtype}"
    assert got.shape == expected.shape, \
        f"{prefix}shape {tuple(got.shape)} != expected {tuple(expected.shape)}"
    if torch.equal(got, expected):
        return
    g, e = got.reshape(-1), expected.reshape(-1)
    wrong = (g != e).nonzero().reshape(-1)
    first = wrong[:5].tolist()
    raise AssertionError(
        f"{prefix}{wrong.numel()} of {e.numel()} elements wrong; first at "
        + ", ".join(f"[{i}] got {g[i].item()} expected {e[i].item()}" for i in first))


def assert_close_avg(got, expected_sum_exact, world_size: int, what: str = "") -> None:
    """AVG may divide before or after summing: allow a few ulps of the result."""
    import torch

    got, expected_sum_exact = got.cpu(), expected_sum_exact.cpu()
    exact = expected_sum_exact.double() / world_size
    eps = torch.finfo(got.dtype).eps
    tol = world_size * eps * (exact.abs() + 1)
    err = (got.double() - exact).abs()
    assert got.dtype == expected_sum_exact.dtype and got.shape == exact.shape, \
        f"{what}: dtype/shape {got.dtype}{tuple(got.shape)}"
    if bool((err <= tol).all()):
        return
    i = int(torch.argmax(err - tol))
    raise AssertionError(f"{what}: {(err > tol).sum().item()} elements off; worst [{i}] got "
                         f"{got.reshape(-1)[i].item()} expected {exact.reshape(-1)[i].item()}")
