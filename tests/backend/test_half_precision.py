"""AVG of float16 and bfloat16 does not overflow where the average is representable (issue 22).

The sum of P values near a 16-bit format's largest finite value (float16: 65504, bfloat16:
3.39e38) is not representable, though their average is. hetcomm used to sum in the tensor's dtype
and divide at the end, so two ranks averaging 40000.0 in float16 got inf. Now every path either
sums all contributions in fp32 and divides before rounding once (shared memory), or divides each
rank's contribution by P before it enters a sum that travels in the tensor's dtype (ring hops,
recursive doubling, the site and host schedules, the staged device path; kernels/reduce.h).

Each job runs every check on one configuration of the engine:

* shm: every rank on this host, through shared memory (the default);
* tcp: HETCOMM_SHM=0: recursive doubling for the small messages, the ring for the large one;
* weighted: a plan with uneven shares (one of them zero) in a permuted ring order, every size on
  the ring (HETCOMM_SMALL_ALLREDUCE_BYTES=0);
* sites: a site plan over TCP (algorithms/hierarchical.h);
* hosts: hosts declared with HETCOMM_HOST_ID: shared memory inside each host, TCP between them;
* staged: an emulated device (HETCOMM_DEBUG_EMULATE_DEVICE), the ring staged segment by segment
  and the small messages staged whole; staged-whole: the ring staged whole; shm-device: the
  emulated device through shared memory.

Checks (float16 and bfloat16 each): every rank holding the same values, the largest finite one
among them, gets them back; mixed signs whose partial sums overflow the format; random values of
large magnitude against the exact average (float64), the same bits on every rank;
reduce_scatter_single and reduce with AVG; SUM still overflows to inf (no division applied to it);
AVG divides exactly once.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import Cases, run_suite

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("hetcomm's paths and plans")]

R = dist.ReduceOp
FAMILIES = ["near_max", "mixed_signs", "random", "reduce_scatter", "reduce", "sum_unchanged", "path"]
# Values near each format's largest finite value, and ordinary ones beside them.
NEAR_MAX = {
    torch.float16: [40000.0, 65504.0, -65504.0, 60000.0, -1.0, 0.0, 1.0 / 3.0],
    torch.bfloat16: [3e38, 3.3895313892515355e38, -3e38, 1e38, -1.0, 0.0, 1.0 / 3.0],
}
LARGE = 100_003  # 200 KB: the ring (with several chunks) rather than recursive doubling


def _sizes(ws: int) -> list[int]:
    return [1, 5 * ws + 1, 1031, LARGE]


def _tiled(values: list[float], n: int, dtype) -> torch.Tensor:
    base = torch.tensor(values, dtype=torch.float64)
    return base.repeat(-(-n // len(values)))[:n].to(dtype)


def _check_average(got: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
    """Finite where the inputs are, and within P roundings of the largest input's magnitude of the
    exact average: each contribution is rounded once when it is divided and the partial sums, at
    most that magnitude, once per addition."""
    ws = len(inputs)
    exact = torch.stack([x.double() for x in inputs]).mean(dim=0)
    scale = torch.stack([x.double().abs() for x in inputs]).amax(dim=0)
    eps = torch.finfo(got.dtype).eps
    got64 = got.double()
    assert bool(torch.isfinite(got64).all()), \
        f"{what}: {int((~torch.isfinite(got64)).sum())} of {got.numel()} results not finite, e.g. " \
        f"{got64[~torch.isfinite(got64)][:3].tolist()} (exact {exact[~torch.isfinite(got64)][:3].tolist()})"
    err = (got64 - exact).abs()
    tol = ws * eps * scale + torch.finfo(got.dtype).tiny
    if not bool((err <= tol).all()):
        i = int(torch.argmax(err - tol))
        raise AssertionError(f"{what}: {int((err > tol).sum())} elements off; worst [{i}] got {got64[i].item()} "
                             f"expected {exact[i].item()}")


def _same_on_every_rank(t: torch.Tensor, ws: int, what: str) -> None:
    gathered = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(gathered, t)
    for r, g in enumerate(gathered):
        assert torch.equal(g.view(torch.int16), t.view(torch.int16)), f"{what}: rank {r}'s bits differ"


def _install(setup: tuple) -> None:
    import hetcomm
    from hetcomm.planner import Plan

    kind, args = setup
    if kind == "plan":
        hetcomm.set_plan(Plan(*args))
    elif kind == "sites":
        hetcomm.backend_of().set_site_plan(*args, 0, 0)


def half_suite(rank: int, ws: int, setup: tuple, path: str) -> None:
    import hetcomm

    _install(setup)
    cases = Cases(rank)
    before = hetcomm.stats()["collectives_by_path"][path]
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for n in _sizes(ws):
            with cases.case("near_max", f"{name} n={n}"):
                x = _tiled(NEAR_MAX[dtype], n, dtype)
                t = x.clone()
                dist.all_reduce(t, op=R.AVG)
                _check_average(t, [x] * ws, f"AVG of {name} {NEAR_MAX[dtype][:2]}... on {ws} ranks")
                if dtype == torch.float16:  # the example: 40000.0, exactly, not inf
                    assert bool((t[x == 40000.0] == 40000.0).all()), f"40000 -> {t[x == 40000.0][:3].tolist()}"
            with cases.case("mixed_signs", f"{name} n={n}"):
                top = NEAR_MAX[dtype][1]
                # Ranks 0 and 1 hold +top, the others -top (and the second element swapped): the
                # partial sum of the first two overflows a 16-bit sum whatever comes after.
                signs = [1.0, 1.0, -1.0, -1.0][:ws]
                inputs = [_tiled([signs[r] * top, -signs[r] * top * 0.9, (-1) ** r * (r + 1) * top / 4], n, dtype)
                          for r in range(ws)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=R.AVG)
                _check_average(t, inputs, f"AVG of mixed signs, {name}")
        with cases.case("random", f"{name} n={LARGE}"):
            top = NEAR_MAX[dtype][1]
            inputs = [((torch.rand(LARGE, generator=torch.Generator().manual_seed(r), dtype=torch.float64) * 2 - 1)
                       * top).to(dtype) for r in range(ws)]
            t = inputs[rank].clone()
            dist.all_reduce(t, op=R.AVG)
            _check_average(t, inputs, f"AVG of random {name} up to {top}")
            _same_on_every_rank(t, ws, f"AVG of random {name}")
        for n in (1, 1031):
            with cases.case("reduce_scatter", f"{name} n={n} per rank"):
                inputs = [_tiled(NEAR_MAX[dtype], ws * n, dtype) * (1 if r % 2 == 0 else 0.5) for r in range(ws)]
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_single(out, inputs[rank].clone(), op=R.AVG)
                _check_average(out, [x[rank * n:(rank + 1) * n] for x in inputs], f"reduce_scatter AVG {name}")
            with cases.case("reduce", f"{name} n={n}"):
                x = _tiled(NEAR_MAX[dtype], n, dtype)
                t = x.clone()
                dist.reduce(t, dst=ws - 1, op=R.AVG)
                if rank == ws - 1:
                    _check_average(t, [x] * ws, f"reduce AVG {name}")
                else:
                    assert torch.equal(t, x), "a non-root input changed"
        with cases.case("sum_unchanged", name):
            top = NEAR_MAX[dtype][1]
            t = torch.full((1031,), top, dtype=dtype)
            dist.all_reduce(t)  # SUM: ws times the largest finite value is inf, as in torch
            assert bool(torch.isinf(t).all()) and bool((t > 0).all()), f"SUM of {top} x {ws}: {t[:3]}"
            t = torch.full((LARGE,), 1.5, dtype=dtype)
            dist.all_reduce(t)
            assert bool((t == 1.5 * ws).all()), f"SUM of 1.5 x {ws}: {t[:3]}"
            t = torch.full((LARGE,), 3.0, dtype=dtype)
            dist.all_reduce(t, op=R.AVG)  # divided once: 3.0, not 3.0 / ws
            assert bool((t == 3.0).all()), f"AVG of 3.0 on {ws} ranks: {t[:3]}"
    with cases.case("path", path):
        assert hetcomm.stats()["collectives_by_path"][path] > before, f"no collective took the {path} path"


NO_SHM = {"HETCOMM_SHM": "0", "HETCOMM_PROBE": "0"}
ON_PLAN = {**NO_SHM, "HETCOMM_SMALL_ALLREDUCE_BYTES": "0"}
EMULATED = {"HETCOMM_DEBUG_EMULATE_DEVICE": "1", "HETCOMM_PROBE": "0"}
# Uneven shares in a permuted ring order; one rank owns nothing.
WEIGHTED = {2: ((1, 0), (0.8, 0.2)), 3: ((2, 0, 1), (0.6, 0.0, 0.4)), 4: ((1, 3, 0, 2), (0.5, 0.0, 0.2, 0.3))}
# set_site_plan's (sites, block owners, block shares, site shares), as in test_hierarchical.py.
SITES = {
    2: ([[0], [1]], [[0, 1]], [1.0], [0.3, 0.7]),
    3: ([[0], [1], [2]], [[0, 1, 2]], [1.0], [0.25, 0.25, 0.5]),
    4: ([[0, 1], [2], [3]], [[0, 2, 3], [1, 2, 3]], [0.6, 0.4], [0.2, 0.3, 0.5]),
}
HOSTS = {3: "0,0,1", 4: "0,0,1,1"}
NONE = ("none", None)

CONFIGS = (
    [pytest.param(ws, NONE, {}, "shm", id=f"shm-{ws}") for ws in (2, 3, 4)]
    + [pytest.param(ws, NONE, NO_SHM, "tcp", id=f"tcp-{ws}") for ws in (2, 3, 4)]
    + [pytest.param(ws, ("plan", WEIGHTED[ws]), ON_PLAN, "tcp", id=f"weighted-{ws}") for ws in (2, 3, 4)]
    + [pytest.param(ws, ("sites", SITES[ws]), ON_PLAN, "tcp", id=f"sites-{ws}") for ws in (2, 3, 4)]
    + [pytest.param(ws, NONE, {"HETCOMM_HOST_ID": HOSTS[ws], "HETCOMM_PROBE": "0",
                                "HETCOMM_SMALL_ALLREDUCE_BYTES": "0", "HETCOMM_SHM_SLOT_BYTES": str(64 << 10)},
                    "hierarchical", id=f"hosts-{ws}") for ws in (3, 4)]
    + [pytest.param(3, NONE, {**EMULATED, **NO_SHM, "HETCOMM_DEVICE_HOST_REDUCE_BYTES": "0"}, "tcp", id="staged-3"),
       pytest.param(2, NONE, {**EMULATED, **NO_SHM}, "tcp", id="staged-whole-2"),
       pytest.param(4, NONE, {**EMULATED, "HETCOMM_HOST_ID": "0,0,0,1", "HETCOMM_SMALL_ALLREDUCE_BYTES": "0",
                              "HETCOMM_SITE_PIECE_BYTES": str(64 << 10)}, "hierarchical", id="hosts-device-4"),
       pytest.param(3, NONE, EMULATED, "shm", id="shm-device-3")]
)


@pytest.mark.parametrize("world_size,setup,env,path", CONFIGS)
def test_avg_of_16_bit_floats_does_not_overflow(world_size: int, setup: tuple, env: dict, path: str) -> None:
    report = run_suite(world_size, half_suite, setup, path, families=FAMILIES, env=env, timeout=300)
    for family in FAMILIES:
        report.assert_family(family)
