"""Differential tests: the backend under test and gloo, same seeded random inputs, same answers.

Each rank runs every collective twice, once on the default group (the backend under test) and
once on a gloo group over the same ranks, and compares. Integer and bool results, MIN/MAX and
pure data movement must agree bit for bit. Float sums, averages and products may differ in
rounding, because the two backends may add in different orders; they must agree within the
bound that any summation order satisfies:

    |a - b| <= 2 (P - 1) u sum_r |x_r|  <=  P * eps * sum_r |x_r|     (u = eps / 2)

computed per element from every rank's inputs (each rank can regenerate them from the seed).
Under HETCOMM_TEST_BACKEND=gloo this compares gloo with gloo, which checks the test itself.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from harness import Cases, run_suite
from values import reduce_op_names

pytestmark = pytest.mark.usefixtures("backend_importable")

R = dist.ReduceOp
SEED = 20240611
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
LARGE = 4 * 1024 * 1024 + 3
# 2 ranks add in one order only; 3 and 4 let the two backends' reduction orders differ.
WORLD_SIZES = [3, 4]
FAMILIES = ["all_reduce", "all_reduce_coalesced", "broadcast", "all_gather",
            "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather",
            "scatter", "all_to_all", "all_to_all_single", "send_recv"]


def sizes(world_size: int) -> list[int]:
    return sorted({0, 1, world_size - 1, 5 * world_size + 1, 1031})


def ops_for(dtype) -> list:
    if dtype == torch.bool:
        return [R.SUM, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def random_tensor(n: int, dtype, key: tuple, op=None) -> torch.Tensor:
    """Deterministic in ``key``: every rank can rebuild every other rank's input."""
    # crc32, not hash(): str hashes differ between processes (PYTHONHASHSEED).
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        base = torch.float64 if dtype == torch.float64 else torch.float32
        return torch.randn(n, generator=g, dtype=base).to(dtype)
    if op == R.PRODUCT:  # keep products inside the type: overflow is not the point here
        return torch.randint(-3 if dtype.is_signed else 0, 4, (n,), generator=g).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -2 ** 62), min(info.max, 2 ** 62)
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def assert_agree(got: torch.Tensor, ref: torch.Tensor, what: str, contributions=None,
                 op=None, world_size: int = 1) -> None:
    """Bitwise, or within the summation-order bound for float SUM/AVG/PRODUCT."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs gloo {ref.dtype}{tuple(ref.shape)}"
    rounding = got.dtype.is_floating_point and op in (R.SUM, R.AVG, R.PRODUCT)
    if not rounding:
        if torch.equal(got, ref):
            return
        wrong = (got != ref).reshape(-1).nonzero().reshape(-1)
        i = int(wrong[0])
        raise AssertionError(f"{what}: {wrong.numel()} of {ref.numel()} elements differ from gloo "
                             f"(bitwise); first [{i}] {got.reshape(-1)[i].item()} vs "
                             f"{ref.reshape(-1)[i].item()}")
    eps = torch.finfo(got.dtype).eps
    stacked = torch.stack([c.double() for c in contributions])
    if op == R.PRODUCT:
        scale = stacked.abs().prod(0)
    else:
        scale = stacked.abs().sum(0) / (world_size if op == R.AVG else 1)
    tol = 2 * world_size * eps * scale + torch.finfo(got.dtype).tiny
    err = (got.double() - ref.double()).abs()
    bad = err > tol
    if bool(bad.any()):
        i = int(torch.argmax((err - tol).reshape(-1)))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {ref.numel()} elements differ from gloo by more than "
            f"the summation-order bound; worst [{i}] {got.reshape(-1)[i].item()} vs "
            f"{ref.reshape(-1)[i].item()} (bound {tol.reshape(-1)[i].item():.3g})")


def name(x) -> str:
    return str(x).replace("torch.", "") if isinstance(x, torch.dtype) else reduce_op_names()[x]


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------

def differential_suite(rank: int, ws: int) -> None:
    gloo = dist.new_group(backend="gloo")
    cases = Cases(rank)

    def both(fn):
        """fn(group) -> list of tensors; returns (under test, gloo)."""
        return fn(None), fn(gloo)

    def compare(label, results, contributions=None, op=None):
        mine, ref = results
        assert len(mine) == len(ref)
        for k, (a, b) in enumerate(zip(mine, ref, strict=True)):
            assert_agree(a, b, f"{label} output {k}", contributions[k] if contributions else None,
                         op, ws)

    case_id = 0

    def inputs(n, dtype, key, op=None):
        return [random_tensor(n, dtype, (SEED, key, r), op) for r in range(ws)]

    for dtype in DTYPES:
        for n in sizes(ws) + ([LARGE] if dtype == torch.float32 else []):
            ops = [R.SUM] if n == LARGE else ops_for(dtype)
            for op in ops:
                case_id += 1
                lbl = f"{name(op)} {name(dtype)} n={n}"
                with cases.case("all_reduce", lbl):
                    xs = inputs(n, dtype, ("ar", case_id), op)

                    def ar(g, xs=xs, op=op):
                        t = xs[rank].clone()
                        dist.all_reduce(t, op=op, group=g)
                        return [t]
                    compare(lbl, both(ar), [xs], op)
            if n == LARGE:
                continue
            case_id += 1
            lbl = f"SUM {name(dtype)} n={n},7,{ws}"
            with cases.case("all_reduce_coalesced", lbl):
                parts = [inputs(m, dtype, ("arc", case_id, k)) for k, m in enumerate((n, 7, ws))]

                def arc(g, parts=parts):
                    ts = [p[rank].clone() for p in parts]
                    dist.all_reduce_coalesced(ts, op=R.SUM, group=g)
                    return ts
                compare(lbl, both(arc), parts, R.SUM)
            for root in {0, ws - 1}:
                case_id += 1
                lbl = f"{name(dtype)} n={n} root={root}"
                with cases.case("broadcast", lbl):
                    xs = inputs(n, dtype, ("bc", case_id))

                    def bc(g, xs=xs, root=root):
                        t = xs[rank].clone()
                        dist.broadcast(t, src=root, group=g)
                        return [t]
                    compare(lbl, both(bc))
                case_id += 1
                with cases.case("reduce", f"SUM {lbl}"):
                    xs = inputs(n, dtype, ("rd", case_id))

                    def rd(g, xs=xs, root=root):
                        t = xs[rank].clone()
                        dist.reduce(t, dst=root, op=R.SUM, group=g)
                        return [t] if rank == root else []
                    compare(f"SUM {lbl}", both(rd), [xs], R.SUM)
                case_id += 1
                with cases.case("gather", lbl):
                    xs = inputs(n, dtype, ("ga", case_id))

                    def ga(g, xs=xs, root=root):
                        outs = ([torch.empty(n, dtype=dtype) for _ in range(ws)]
                                if rank == root else None)
                        dist.gather(xs[rank].clone(), outs, dst=root, group=g)
                        return outs or []
                    compare(lbl, both(ga))
                case_id += 1
                with cases.case("scatter", lbl):
                    chunks = inputs(n, dtype, ("sc", case_id))  # the root's chunks, one per rank

                    def sc(g, chunks=chunks, root=root):
                        out = torch.empty(n, dtype=dtype)
                        dist.scatter(out, [c.clone() for c in chunks] if rank == root else None,
                                     src=root, group=g)
                        return [out]
                    compare(lbl, both(sc))
            case_id += 1
            lbl = f"{name(dtype)} n={n}"
            with cases.case("all_gather", lbl):
                xs = inputs(n, dtype, ("ag", case_id))

                def ag(g, xs=xs):
                    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
                    dist.all_gather(outs, xs[rank].clone(), group=g)
                    return outs
                compare(lbl, both(ag))
            with cases.case("all_gather_into_tensor", lbl):
                def agt(g, xs=xs):
                    out = torch.empty(ws * n, dtype=dtype)
                    dist.all_gather_into_tensor(out, xs[rank].clone(), group=g)
                    return [out]
                compare(lbl, both(agt))
            for op in ([R.SUM, R.MAX] if dtype != torch.bool else [R.MAX]):
                case_id += 1
                lbl = f"{name(op)} {name(dtype)} n={n}"
                # per_rank[r][j]: rank r's block for rank j
                per_rank = [[random_tensor(n, dtype, (SEED, "rs", case_id, r, j))
                             for j in range(ws)] for r in range(ws)]
                mine_contrib = [[per_rank[r][rank] for r in range(ws)]]
                with cases.case("reduce_scatter", lbl):
                    def rs(g, op=op, per_rank=per_rank):
                        out = torch.empty(n, dtype=dtype)
                        dist.reduce_scatter(out, [t.clone() for t in per_rank[rank]], op=op,
                                            group=g)
                        return [out]
                    compare(lbl, both(rs), mine_contrib, op)
                with cases.case("reduce_scatter_tensor", lbl):
                    def rst(g, op=op, per_rank=per_rank):
                        out = torch.empty(n, dtype=dtype)
                        dist.reduce_scatter_tensor(out, torch.cat(per_rank[rank]), op=op, group=g)
                        return [out]
                    compare(lbl, both(rst), mine_contrib, op)
            case_id += 1
            lbl = f"{name(dtype)} n={n} per peer"
            blocks = [random_tensor(n, dtype, (SEED, "a2a", case_id, rank, j)) for j in range(ws)]
            with cases.case("all_to_all", lbl):
                def a2a(g, blocks=blocks):
                    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
                    dist.all_to_all(outs, [b.clone() for b in blocks], group=g)
                    return outs
                compare(lbl, both(a2a))
            with cases.case("all_to_all_single", lbl):
                def a2as(g, blocks=blocks):
                    out = torch.empty(ws * n, dtype=dtype)
                    dist.all_to_all_single(out, torch.cat(blocks), group=g)
                    return [out]
                compare(lbl, both(a2as))
            send = [(rank * 3 + j * 5 + n) % 7 for j in range(ws)]
            recv = [(j * 3 + rank * 5 + n) % 7 for j in range(ws)]
            lbl = f"{name(dtype)} n={n} uneven send {send} recv {recv}"
            with cases.case("all_to_all_single", lbl):
                x = random_tensor(sum(send), dtype, (SEED, "a2au", case_id, rank))

                def a2au(g, x=x, send=send, recv=recv):
                    out = torch.empty(sum(recv), dtype=dtype)
                    dist.all_to_all_single(out, x.clone(), recv, send, group=g)
                    return [out]
                compare(lbl, both(a2au))
            case_id += 1
            lbl = f"{name(dtype)} n={n} ring"
            with cases.case("send_recv", lbl):
                x = random_tensor(n, dtype, (SEED, "p2p", case_id, rank))

                def ring(g, x=x):
                    right, left = (rank + 1) % ws, (rank - 1) % ws
                    out = torch.empty(n, dtype=dtype)
                    works = [dist.isend(x.clone(), dst=right, group=g),
                             dist.irecv(out, src=left, group=g)]
                    for w in works:
                        w.wait()
                    return [out]
                compare(lbl, both(ring))


# --------------------------------------------------------------------------------------------

_REPORTS: dict[int, object] = {}


def _report(world_size: int):
    if world_size not in _REPORTS:
        _REPORTS[world_size] = run_suite(world_size, differential_suite, families=FAMILIES,
                                         timeout=300, pg_timeout=60)
    return _REPORTS[world_size]


@pytest.mark.parametrize("world_size,family", [pytest.param(ws, f, id=f"{ws}-{f}")
                                               for ws in WORLD_SIZES for f in FAMILIES])
def test_matches_gloo(world_size: int, family: str) -> None:
    _report(world_size).assert_family(family)


def test_tolerance_is_tight_enough_to_catch_a_wrong_sum() -> None:
    """The float bound must not be so loose that a dropped contribution passes."""
    xs = [random_tensor(1031, torch.float16, (1, r)) for r in range(4)]
    exact = (xs[0].double() + xs[1].double() + xs[2].double() + xs[3].double()).to(torch.float16)
    reordered = ((xs[3] + xs[2]) + (xs[1] + xs[0]))
    assert_agree(reordered, exact, "reordered", xs, R.SUM, 4)
    dropped = xs[0] + xs[1] + xs[2]
    with pytest.raises(AssertionError, match="summation-order bound"):
        assert_agree(dropped, exact, "dropped", xs, R.SUM, 4)
