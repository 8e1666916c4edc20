"""Checks of the device (staged) paths that the emulated device runs in CI and a GPU runs for real:
half-precision AVG of values whose sum overflows the dtype, and the host staging memory a group
holds (bounded by a piece, 0 after destroy). Used by tests/backend/test_device_paths.py (emulated
device) and tests/backend/test_cuda.py (CUDA tensors, every inner level)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import Cases

# Half-precision values near the top of the range: the sum of two overflows the dtype, their
# average does not. (fp16's largest finite value is 65504, bfloat16's about 3.39e38.)
LARGE_SCALE = {torch.float16: 60000.0, torch.bfloat16: 3.0e38}
# One message reduced whole on the host and one long enough for the staged pipeline (more than
# HETCOMM_DEVICE_HOST_REDUCE_BYTES, 2 MB by default; the emulated device's tests lower it).
AVG_SIZES = [1000, 3 << 20]
AVG_FAMILIES = ["avg_" + str(d).replace("torch.", "") for d in LARGE_SCALE]


def device_for(device: str, rank: int) -> torch.device:
    """Rank r's device: GPU r mod the GPUs there are (with one GPU every rank shares it)."""
    if device == "cuda":
        d = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(d)
        return d
    return torch.device(device)


def _large_input(dtype: torch.dtype, n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input, the same on every rank that computes it: in [0.5, 1) x the scale,
    a few negative, so that signs and the overflow of the sum both show."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = (0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)) * LARGE_SCALE[dtype]
    x[::97] *= -1
    return x.to(dtype)


def large_avg_suite(rank: int, ws: int, device: str = "cpu", sizes=tuple(AVG_SIZES)) -> None:
    """AVG of fp16 and bf16 values whose sum overflows the dtype: every element finite and within
    rounding of the float64 mean of the same inputs. An AVG that divides each input before the
    sum, then adds in the dtype, rounds once per rank and step, each time by at most half a unit
    in the last place of a value no larger than the largest input: the bound is ws x eps x the
    largest |input| of the element (eps the dtype's machine epsilon), about ws units in the last
    place. A sum that overflowed, or a division by the wrong count, is far outside it."""
    dev = device_for(device, rank)
    cases = Cases(rank)
    for dtype in LARGE_SCALE:
        family = "avg_" + str(dtype).replace("torch.", "")
        for n in sizes:
            with cases.case(family, f"AVG of {n} {dtype} values near {LARGE_SCALE[dtype]:g}"):
                inputs = [_large_input(dtype, n, r) for r in range(ws)]
                t = inputs[rank].clone().to(dev)
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                got = t.cpu().double()
                mean = torch.stack([x.double() for x in inputs]).mean(0)
                assert torch.isfinite(got).all(), \
                    f"{int((~torch.isfinite(got)).sum())} of {n} results are not finite: the sum overflowed"
                largest = torch.stack([x.double().abs() for x in inputs]).amax(0)
                bound = ws * torch.finfo(dtype).eps * largest
                worst = int(((got - mean).abs() / bound).argmax())
                assert ((got - mean).abs() <= bound).all(), (
                    f"element {worst}: {got[worst].item()!r}, float64 mean {mean[worst].item()!r}, "
                    f"bound {bound[worst].item():.4g}")


def staging_suite(rank: int, ws: int, device: str, numel: int, bound: int, exact: bool = False) -> dict:
    """An allreduce of ``numel`` float32 elements; the host staging memory this process holds
    after it (at most ``bound`` bytes; with ``exact``, exactly: the emulated device's slots are
    held from the start, so only the whole bound shows that a piece was staged) and after the
    group is destroyed (none): it destroys the group itself (the harness then has nothing to
    destroy)."""
    import hetcomm
    dev = device_for(device, rank)
    cases = Cases(rank)
    held = after = -1
    with cases.case("staging", f"allreduce of {numel * 4 / 2**20:.0f} MiB: staging at most {bound} bytes"):
        t = torch.full((numel,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        total = float(ws * (ws + 1) // 2)
        assert t[0].item() == total and t[-1].item() == total and t[numel // 2].item() == total, \
            (t[0].item(), t[numel // 2].item(), t[-1].item())
        del t
        held = hetcomm.staging_host_bytes()
        assert (held == bound) if exact else (0 < held <= bound), f"{held} bytes of staging memory held, bound {bound}"
    dist.barrier()
    dist.destroy_process_group()
    with cases.case("staging", "no staging memory held once the group is destroyed"):
        after = hetcomm.staging_host_bytes()
        assert after == 0, f"{after} bytes of staging memory still held after destroy_process_group"
    return {"held": held, "after_destroy": after}
