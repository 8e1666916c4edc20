"""hetcomm.compress: the codecs and the compressed weighted allreduce.

* Codecs, in this process: the round-trip error of every element is within ``error_bound`` for
  random data at scales from subnormal to near the fp32 maximum, with all-zero blocks, outliers,
  tiny and block-straddling lengths; the bounds are tight (the worst element reaches > 90% of
  its bound, so a bound that is too loose fails too); the encoded length is as documented.
* The collective, on 2 and 4 ranks with unequal weights and per-rank scales: for every codec the
  result is bit-identical on every rank and within ``reduced_error_bound`` of the float64 sum,
  for 30011 elements, 0, 1, fewer than ranks, and int8 with small blocks; a one-rank group too.
  On hetcomm the quantised codecs must also give the very bytes a gloo group gives (the owner's
  arithmetic is the same; only the transport differs).
* Error feedback: eight calls with the same inputs; the error of the *sum* of the results stays
  within one call's bound (plus fp32 rounding per call), where without feedback it is eight
  times one call's error.
* Agreement: a non-finite input on some ranks, an invalid input on one rank, unequal lengths and
  disagreeing weights make every rank raise a ValueError that names the ranks, and the group
  still works afterwards (no rank hung or desynchronised).
* hetcomm plans: with a plan that gives rank 0 a zero share and permutes the ring, the chunks
  follow ``Plan.counts`` and the results are still identical on every rank and within the bound;
  error feedback survives the plan change (the owner residual is dropped, not misapplied).

Every multi-process check runs in one job per world size (starting ranks costs seconds); the job
returns what each rank saw and the checks run here.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import BACKEND, is_hetcomm, run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")

N = 30011                  # not a multiple of any world size or block
SMALL_BLOCK = 64
EF_ROUNDS = 8
CODEC_NAMES = ("fp32", "bf16", "fp16", "int8", "int4")
ZERO_SHARE_PLAN = {2: ((1, 0), (0.0, 1.0)), 4: ((0, 3, 1, 2), (0.0, 0.5, 0.2, 0.3))}


def weights_for(world_size: int) -> list[float]:
    """Unequal, one negative and one that is not an fp32 value (0.1)."""
    return [0.6, 0.1, -0.25, 1.75][:world_size]


def inputs_for(world_size: int, n: int, salt: int = 0) -> list[torch.Tensor]:
    """Rank r's input: Gaussian at scale 10^(r-2), an all-zero block, outliers, a tiny block."""
    xs = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(1000 * salt + r)
        x = torch.randn(n, generator=g) * 10.0 ** (r - 2)
        if n > 3 * SMALL_BLOCK:
            x[SMALL_BLOCK:2 * SMALL_BLOCK] = 0.0                            # an all-zero block
            x[2 * SMALL_BLOCK:3 * SMALL_BLOCK] *= 1e-6                      # a block of tiny values
            x[(torch.arange(5) * 7919 + 13 * r) % n] *= 500.0               # outliers
        xs.append(x.float())
    return xs


def exact_sum(xs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    return sum(w * x.double() for w, x in zip(weights, xs))


def cases_for(world_size: int) -> list[tuple[str, int, int]]:
    """(codec, n, block) of the plain calls."""
    cases = [(c, n, 2048) for c in CODEC_NAMES for n in (N, 0, 1, world_size - 1)]
    cases.append(("int8", 4099, SMALL_BLOCK))
    cases.append(("int4", 4099, SMALL_BLOCK))       # odd chunks: a half-filled last byte
    return cases


# --------------------------------------------------------------------------------------------
# Codecs (single process)
# --------------------------------------------------------------------------------------------

def _codec_inputs() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for scale in (1e-44, 1e-40, 1e-30, 1e-3, 1.0, 1e3, 6e4, 1e5, 1e30, 1e38):
        for n in (1, 2, 7, 2047, 2048, 2049, 5000):
            x = torch.randn(n, generator=g, dtype=torch.float64) * scale
            if n > 100:
                x[:64] = 0.0                # an all-zero block (block 64) / zeros at the start
                x[70] *= 1e4                # an outlier
            out.append((f"scale {scale:g} n {n}", x.clamp(-3e38, 3e38).float()))
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.0, -65520.0, 1e-8, 2.0 ** -24, 2.0 ** -126,
                             2.0 ** -149, 3.3e38, -3.4e38, 1.0, -1.0], dtype=torch.float32)
    out.append(("special values", specials))
    fmax = torch.finfo(torch.float32).max           # int8: 127 · fl(FLT_MAX / 127) rounds past it
    out.append(("the largest floats", torch.tensor([fmax, 1.0, -2.0, -fmax, 0.5], dtype=torch.float32)))
    return out


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("block", [2048, 64, 1])
def test_round_trip_within_bound(name, block):
    from hetcomm.compress import get_codec

    codec = get_codec(name, block=block)
    for label, x in _codec_inputs():
        buf = codec.encode(x)
        assert buf.dtype == torch.uint8 and buf.shape == (codec.encoded_bytes(x.numel()),), label
        y = codec.decode(buf, x.numel())
        assert y.dtype == torch.float32 and y.shape == x.shape, label
        assert bool(torch.isfinite(y).all()), f"{name} {label}: non-finite output"
        err = (y.double() - x.double()).abs()
        bound = codec.error_bound(x)
        over = err > bound
        if bool(over.any()):
            i = int(torch.argmax((err - bound) / (bound + 1e-300)))
            raise AssertionError(f"{name} block {block} {label}: {int(over.sum())} elements over the bound; "
                                 f"x={x[i].item()!r} decoded {y[i].item()!r} error {err[i].item():.3g} "
                                 f"bound {bound[i].item():.3g}")
        if name == "fp32":
            assert torch.equal(y, x), label


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4"])
def test_bounds_are_tight(name):
    from hetcomm.compress import get_codec

    codec = get_codec(name)
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    err = (codec.decode(codec.encode(x), x.numel()).double() - x.double()).abs()
    worst = float((err / codec.error_bound(x)).max())
    assert 0.9 < worst <= 1.0, f"{name}: worst error / bound = {worst}"


def test_encoded_length_and_layout():
    from hetcomm.compress import CODECS, get_codec

    assert CODECS == CODEC_NAMES
    for n in (0, 1, 2047, 2048, 2049, 10 ** 6):
        assert get_codec("fp32").encoded_bytes(n) == 4 * n
        assert get_codec("bf16").encoded_bytes(n) == 2 * n
        assert get_codec("fp16").encoded_bytes(n) == 2 * n
        assert get_codec("int8").encoded_bytes(n) == n + 4 * math.ceil(n / 2048)
        assert get_codec("int8", block=100).encoded_bytes(n) == n + 4 * math.ceil(n / 100)
    assert 4 * 10 ** 6 / get_codec("int8").encoded_bytes(10 ** 6) > 3.99
    # int8 layout: the scales (fp32) first, then q; scale = max|x| / 127.
    x = torch.tensor([0.5, -2.0, 1.1, 0.0, 0.0, 0.0])
    buf = get_codec("int8", block=3).encode(x)
    scales = buf[:8].view(torch.float32)
    assert scales.tolist() == [torch.tensor(2.0 / 127).item(), 0.0]
    assert buf[8:].view(torch.int8).tolist() == [32, -127, 70, 0, 0, 0]
    assert get_codec("int8", block=3).decode(buf, 6)[3:].tolist() == [0.0, 0.0, 0.0]
    # int4: scale = max|x| / 7; q + 8 two to a byte, the even element in the low nibble; an odd
    # count's last high nibble is 8 (zero).
    for n in (0, 1, 2047, 2048, 2049, 10 ** 6):
        assert get_codec("int4").encoded_bytes(n) == (n + 1) // 2 + 4 * math.ceil(n / 2048)
    assert 4 * 10 ** 6 / get_codec("int4").encoded_bytes(10 ** 6) > 7.9
    x = torch.tensor([0.5, -2.0, 1.1, 0.0, 3.0])
    buf = get_codec("int4", block=3).encode(x)
    assert buf.numel() == 8 + 3
    assert buf[:8].view(torch.float32).tolist() == [torch.tensor(2.0 / 7).item(), torch.tensor(3.0 / 7).item()]
    q = [2, -7, 4, 0, 7]                        # round(x / scale)
    assert buf[8:].tolist() == [(q[0] + 8) | (q[1] + 8) << 4, (q[2] + 8) | (q[3] + 8) << 4, (q[4] + 8) | 8 << 4]
    assert get_codec("int4", block=3).decode(buf, 5).tolist() == \
        [torch.tensor(v, dtype=torch.float32).mul(s).item() for v, s in zip(q, [2.0 / 7] * 3 + [3.0 / 7] * 2)]
    # fp16 saturates instead of overflowing; bf16 rounds to nearest even.
    assert get_codec("fp16").decode(get_codec("fp16").encode(torch.tensor([1e5, -1e9])), 2).tolist() == \
        [65504.0, -65504.0]
    assert get_codec("bf16").decode(get_codec("bf16").encode(torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8])), 2) \
        .tolist() == [1.0, 1 + 2 ** -6]


def test_codec_arguments():
    from hetcomm.compress import Codec, get_codec

    with pytest.raises(ValueError, match="unknown codec 'int2'"):
        get_codec("int2")
    with pytest.raises(ValueError, match="block"):
        get_codec("int8", block=0)
    codec = get_codec("int8", block=16)
    assert isinstance(codec, Codec) and codec.name == "int8" and codec == get_codec("int8", 16)
    with pytest.raises(ValueError, match="17 elements take 25 bytes, got 20"):
        codec.decode(torch.zeros(20, dtype=torch.uint8), 17)
    with pytest.raises(TypeError, match="float32"):
        codec.encode(torch.zeros(3, dtype=torch.float64))
    # Any shape is read in row-major order; a non-contiguous input is copied first.
    x = torch.randn(8, 6).t()
    assert torch.equal(codec.encode(x), codec.encode(x.contiguous().reshape(-1)))


def test_reduced_error_bound_in_process():
    """The bound holds for the owner arithmetic simulated here (one rank owns everything)."""
    from hetcomm.compress import get_codec, reduced_error_bound

    xs, ws = inputs_for(4, 5000), weights_for(4)
    for name in CODEC_NAMES:
        codec = get_codec(name, block=SMALL_BLOCK)
        s = torch.zeros(5000)
        for w, x in zip(ws, xs):
            s.add_(codec.decode(codec.encode(x), 5000), alpha=torch.tensor(w).item())
        got = codec.decode(codec.encode(s), 5000)
        err = (got.double() - exact_sum(xs, ws)).abs()
        bound = reduced_error_bound(xs, ws, codec, counts=[5000, 0, 0, 0])
        assert bool((err <= bound).all()), name
        # Not vacuous: within a factor of a few of the worst error (the bound adds worst cases).
        if name != "fp32":
            assert float((err / bound).max()) > 0.2, name


# --------------------------------------------------------------------------------------------
# The collective (one job per world size)
# --------------------------------------------------------------------------------------------

def _agreement_errors(rank: int, world_size: int, n: int) -> dict[str, str]:
    from hetcomm.compress import weighted_allreduce

    ws = weights_for(world_size)
    x = inputs_for(world_size, n)[rank]
    seen = {}

    def attempt(label, *args, **kwargs):
        try:
            weighted_allreduce(*args, **kwargs)
        except ValueError as e:
            seen[label] = str(e)
        else:
            seen[label] = "no error"

    bad = x.clone()
    if rank == 1:
        bad[17] = float("nan")
    if rank == world_size - 1:
        bad[n - 1] = float("inf")
    attempt("non-finite", bad, ws, codec="int8")
    attempt("invalid", x.double() if rank == 0 else x, ws, codec="int8")
    attempt("lengths", x[:n - 1] if rank == world_size - 1 else x, ws, codec="int8")
    attempt("weights", x, [w + (rank == 1) for w in ws], codec="bf16")
    attempt("codec", x, ws, codec="int8" if rank == 0 else "fp16")
    return seen


def compress_job(rank: int, world_size: int, plan_cases: bool) -> dict:
    from hetcomm.compress import ErrorFeedback, chunk_counts, get_codec, weighted_allreduce

    ws = weights_for(world_size)
    out: dict = {"plain": {}, "ef": {}, "singleton": {}, "gloo": {}, "plan": {}}
    for name, n, block in cases_for(world_size):
        x = inputs_for(world_size, n)[rank]
        codec = get_codec(name, block=block)
        y = weighted_allreduce(x, ws, codec=codec)
        assert torch.equal(x, inputs_for(world_size, n)[rank]), "the input was modified"
        out["plain"][(name, n, block)] = (y, chunk_counts(n))

    # Error feedback: the same inputs EF_ROUNDS times, sums accumulated in float64.
    x = inputs_for(world_size, N, salt=1)[rank]
    for name in ("int8", "bf16"):
        for with_feedback in (True, False):
            feedback = ErrorFeedback() if with_feedback else None
            total = torch.zeros(N, dtype=torch.float64)
            for _ in range(EF_ROUNDS):
                total += weighted_allreduce(x, ws, codec=name, feedback=feedback).double()
            out["ef"][(name, with_feedback)] = total

    out["errors"] = _agreement_errors(rank, world_size, 999)
    # Still in step after the errors: the next call works and agrees everywhere.
    out["after_errors"] = weighted_allreduce(inputs_for(world_size, N)[rank], ws, codec="int8")

    # A one-rank group (every rank creates every group; each uses its own).
    singletons = [dist.new_group([r]) for r in range(world_size)]
    for name in CODEC_NAMES:
        x = inputs_for(1, 3001, salt=2 + rank)[0]
        out["singleton"][name] = weighted_allreduce(x, [0.3], codec=name, group=singletons[rank],
                                                    feedback=ErrorFeedback())

    if is_hetcomm():
        # The same calls over a gloo group: identical bytes for the quantised codecs.
        gloo = dist.new_group(backend="gloo")
        for name in CODEC_NAMES:
            out["gloo"][name] = weighted_allreduce(inputs_for(world_size, N)[rank], ws, codec=name, group=gloo)

    if plan_cases:
        import hetcomm
        from hetcomm.planner import Plan

        feedback = ErrorFeedback()
        x = inputs_for(world_size, N)[rank]
        weighted_allreduce(x, ws, codec="int8", feedback=feedback)         # under the uniform plan
        order, shares = ZERO_SHARE_PLAN[world_size]
        plan = Plan(order, shares)
        hetcomm.set_plan(plan)
        counts = chunk_counts(N)
        assert counts == plan.counts(N) and counts[0] == 0, counts
        for name in CODEC_NAMES:
            for n in (N, world_size - 1):
                x = inputs_for(world_size, n)[rank]
                out["plan"][(name, n)] = (weighted_allreduce(x, ws, codec=name), chunk_counts(n))
        x = inputs_for(world_size, N)[rank]
        out["plan"]["ef after plan change"] = (weighted_allreduce(x, ws, codec="int8", feedback=feedback),
                                               counts)
    return out


@functools.lru_cache(maxsize=None)
def job(world_size: int) -> list[dict]:
    return run_ranks(world_size, compress_job, BACKEND == "hetcomm")


def assert_identical(results: list[torch.Tensor], what: str) -> None:
    for r, y in enumerate(results[1:], start=1):
        assert y.dtype == torch.float32 and y.shape == results[0].shape, what
        if not torch.equal(y.view(torch.int32), results[0].view(torch.int32)):
            differ = int((y.view(torch.int32) != results[0].view(torch.int32)).sum())
            raise AssertionError(f"{what}: rank {r} differs from rank 0 in {differ} elements")


def assert_within(y: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (y.double().reshape(-1) - expected.reshape(-1)).abs()
    if not bool((err <= bound).all()):
        i = int(torch.argmax(err - bound))
        raise AssertionError(f"{what}: {int((err > bound).sum())} elements over the bound; [{i}] got "
                             f"{y.reshape(-1)[i].item()!r} exact {expected[i].item()!r} bound {bound[i].item():.3g}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_identical_on_every_rank_and_within_bound(world_size):
    from hetcomm.compress import get_codec, reduced_error_bound

    values = job(world_size)
    ws = weights_for(world_size)
    for case in cases_for(world_size):
        name, n, block = case
        results = [v["plain"][case][0] for v in values]
        counts = values[0]["plain"][case][1]
        assert all(v["plain"][case][1] == counts for v in values), case
        assert sum(counts) == n
        assert_identical(results, f"{case}")
        xs = inputs_for(world_size, n)
        bound = reduced_error_bound(xs, ws, get_codec(name, block=block), counts=counts)
        assert_within(results[0], exact_sum(xs, ws) if n else torch.zeros(0, dtype=torch.float64), bound,
                      f"{case}")
        if name == "int8" and n == N:
            # The quantised result is far from exact arithmetic but the bound is not vacuous.
            err = (results[0].double() - exact_sum(xs, ws)).abs()
            assert float((err / bound).max()) > 0.1, case
    assert_identical([v["after_errors"] for v in values], "the call after the errors")
    xs = inputs_for(world_size, N)
    assert_within(values[0]["after_errors"], exact_sum(xs, ws), reduced_error_bound(xs, ws, "int8"),
                  "the call after the errors")


@pytest.mark.parametrize("world_size", [2, 4])
def test_single_rank_group(world_size):
    from hetcomm.compress import reduced_error_bound

    for rank, v in enumerate(job(world_size)):
        x = inputs_for(1, 3001, salt=2 + rank)
        for name in CODEC_NAMES:
            assert_within(v["singleton"][name], exact_sum(x, [0.3]), reduced_error_bound(x, [0.3], name),
                          f"rank {rank} alone, {name}")


@hetcomm_only("compares a hetcomm group with a gloo group")
@pytest.mark.parametrize("world_size", [2, 4])
def test_same_bytes_as_gloo(world_size):
    from hetcomm.compress import reduced_error_bound

    values = job(world_size)
    ws, xs = weights_for(world_size), inputs_for(world_size, N)
    for name in CODEC_NAMES:
        het, gloo = values[0]["plain"][(name, N, 2048)][0], values[0]["gloo"][name]
        assert_identical([v["gloo"][name] for v in values], f"gloo {name}")
        if name == "fp32":  # two summation orders: both within the bound
            assert_within(gloo, exact_sum(xs, ws), reduced_error_bound(xs, ws, name), "gloo fp32")
        else:
            assert torch.equal(het, gloo), f"{name}: hetcomm and gloo groups differ"


@pytest.mark.parametrize("world_size", [2, 4])
def test_error_feedback_keeps_the_sum_within_one_round(world_size):
    from hetcomm.compress import reduced_error_bound

    values = job(world_size)
    ws, xs = weights_for(world_size), inputs_for(world_size, N, salt=1)
    exact = exact_sum(xs, ws)
    # Per round, outside the telescoping sum: the fp32 products and sums of the owner (P
    # roundings), the owner residual's add and subtraction, the sender's x + e and x' - d, and
    # the weights rounded to fp32: P + 5 roundings, each relative to at most Σ|w_r| |x_r| (the
    # residuals add 1/254 of it), and their underflow.
    magnitude = sum(abs(w) * x.double().abs() for w, x in zip(ws, xs))
    fp32_per_round = (world_size + 5) * 2.0 ** -24 * magnitude * 1.01 + 2.0 ** -140
    for name in ("int8", "bf16"):
        one_round = reduced_error_bound(xs, ws, name)
        with_ef = [v["ef"][(name, True)] for v in values]
        without = [v["ef"][(name, False)] for v in values]
        assert all(torch.equal(t, with_ef[0]) for t in with_ef), f"{name}: EF sums differ between ranks"
        err_ef = (with_ef[0] - EF_ROUNDS * exact).abs()
        err_plain = (without[0] - EF_ROUNDS * exact).abs()
        # The residuals are bounded like one round's errors of x + e (|e| <= max|x|/254 for
        # int8, 2^-8 |x| for bf16): 1% covers that growth.
        bound = 1.01 * one_round + EF_ROUNDS * fp32_per_round
        assert_within(with_ef[0], EF_ROUNDS * exact, bound, f"{name} with error feedback")
        # Without feedback the same error repeats every round: the sum leaves that bound, and
        # the mean of the results converges to the exact value only with feedback.
        assert bool((err_plain > bound).any()), f"{name}: the sum without feedback stays within one round"
        assert float(err_plain.max()) > 2 * float(err_ef.max()), \
            f"{name}: EF sum error {float(err_ef.max()):.3g}, plain {float(err_plain.max()):.3g}"
        assert float(err_ef.mean()) < float(err_plain.mean()) / 4, name


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_raises_on_bad_input(world_size):
    values = job(world_size)
    bad = [1, world_size - 1] if world_size > 2 else [1]
    for rank, v in enumerate(values):
        errors = v["errors"]
        assert "non-finite" in errors["non-finite"] and f"rank(s) {bad}" in errors["non-finite"], \
            f"rank {rank}: {errors['non-finite']}"
        if rank == 0:
            assert "float32" in errors["invalid"] and "torch.float64" in errors["invalid"], errors["invalid"]
        else:
            assert "rank(s) [0]" in errors["invalid"] and "invalid arguments" in errors["invalid"], errors["invalid"]
        assert f"rank {world_size - 1}: 998" in errors["lengths"] and "rank 0: 999" in errors["lengths"], \
            errors["lengths"]
        assert "disagree on the weights or the codec" in errors["weights"], errors["weights"]
        assert "[1]" in errors["weights"], errors["weights"]
        assert "disagree" in errors["codec"] and "[0]" in errors["codec"], errors["codec"]


def test_argument_errors_in_process():
    """Argument errors, shapes and a codec switch on a one-rank gloo group in this process."""
    from hetcomm.compress import ErrorFeedback, weighted_allreduce

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.ones(5)
        with pytest.raises(ValueError, match="2 weights for a group of 1 ranks"):
            weighted_allreduce(x, [1.0, 2.0])
        with pytest.raises(ValueError, match="weight of rank 0 is nan"):
            weighted_allreduce(x, [float("nan")])
        with pytest.raises(ValueError, match="weight of rank 0 is 1e"):
            weighted_allreduce(x, [1e300], finite_checked=True)
        with pytest.raises(ValueError, match="unknown codec"):
            weighted_allreduce(x, [1.0], codec="int2")
        with pytest.raises(ValueError, match=r"rank\(s\) \[0\] of 1 contains non-finite"):
            weighted_allreduce(torch.tensor([1.0, float("inf")]), [1.0])
        # Any shape; the result has x's shape and x is left alone.
        x = torch.arange(12, dtype=torch.float32).view(3, 4)
        y = weighted_allreduce(x, [0.5], codec="bf16")
        assert y.shape == (3, 4) and torch.equal(y, x * 0.5) and torch.equal(x, torch.arange(12.0).view(3, 4))
        assert weighted_allreduce(torch.zeros(0), [2.0]).shape == (0,)
        # Error feedback across a codec switch: the fp32 call folds the int8 residuals back in,
        # so the two results add up to twice the exact value up to fp32 rounding.
        feedback = ErrorFeedback()
        x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
        once = weighted_allreduce(x, [0.75], codec="int8", feedback=feedback)
        assert float((once - 0.75 * x).abs().max()) > 1e-3
        twice = once.double() + weighted_allreduce(x, [0.75], codec="fp32", feedback=feedback).double()
        assert float((twice - 1.5 * x.double()).abs().max()) < 1e-6
        assert feedback.sender_residual is None and feedback.owner_residual is None
    finally:
        dist.destroy_process_group()


@hetcomm_only("sets hetcomm ring plans")
@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_with_zero_share(world_size):
    from hetcomm.compress import reduced_error_bound
    from hetcomm.planner import Plan

    values = job(world_size)
    ws = weights_for(world_size)
    plan = Plan(*ZERO_SHARE_PLAN[world_size])
    for name in CODEC_NAMES:
        for n in (N, world_size - 1):
            results = [v["plan"][(name, n)][0] for v in values]
            counts = values[0]["plan"][(name, n)][1]
            assert counts == plan.counts(n) and counts[0] == 0, counts
            assert_identical(results, f"plan {name} n={n}")
            xs = inputs_for(world_size, n)
            assert_within(results[0], exact_sum(xs, ws), reduced_error_bound(xs, ws, name, counts=counts),
                          f"plan {name} n={n}")
    results = [v["plan"]["ef after plan change"][0] for v in values]
    assert_identical(results, "error feedback across a plan change")
    xs = inputs_for(world_size, N)
    # The second call with feedback: the sender residuals of the first (bounded in the uniform
    # plan's block layout) come back in, plus this call's errors in the new layout; the owner
    # residuals were dropped. 1% covers the residuals' share of the new block maxima.
    uniform = [N // world_size + (r < N % world_size) for r in range(world_size)]
    bound = 1.01 * (reduced_error_bound(xs, ws, "int8", counts=uniform)
                    + reduced_error_bound(xs, ws, "int8", counts=plan.counts(N)))
    assert_within(results[0], exact_sum(xs, ws), bound, "error feedback across a plan change")
