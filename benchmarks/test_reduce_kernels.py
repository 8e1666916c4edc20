"""Throughput of hetcomm's CPU reduce kernel (hetcomm._C.reduce_into: dst = op(dst, src)).

Each case reduces one 16 MiB tensor into another. GB/s counts the bytes the kernel touches,
3 x nbytes (read dst, read src, write dst), over the median time, and is stored in
``extra_info`` (so it lands in the --benchmark-json output). ``torch.Tensor.add_`` on float32, on one
thread like reduce_into, is a reference row: what a well vectorised memory-bound kernel reaches here.
"""
import pytest
import torch

NBYTES = 16 * 1024 * 1024

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int32, torch.int64, torch.int8, torch.uint8]
CASES = [(dt, op) for dt in FLOAT_DTYPES for op in ("sum", "max")]
CASES += [(dt, op) for dt in INT_DTYPES for op in ("sum", "max", "band")]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _make(dtype: torch.dtype, seed: int) -> torch.Tensor:
    numel = NBYTES // torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=g, dtype=dtype)


def _record_throughput(benchmark, nbytes: int) -> None:
    benchmark.extra_info["bytes_touched"] = 3 * nbytes
    stats = getattr(benchmark, "stats", None)  # None when timing is disabled
    if stats is not None:
        benchmark.extra_info["GB/s"] = round(3 * nbytes / stats.stats.median / 1e9, 2)


@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{_name(dt)}-{op}" for dt, op in CASES])
def test_reduce_into(benchmark, hetcomm_C, dtype, op):
    dst, src = _make(dtype, 0), _make(dtype, 1)
    benchmark.group = f"reduce {_name(dtype)}"
    benchmark.extra_info.update(dtype=_name(dtype), op=op, nbytes=dst.nbytes)
    # dst keeps accumulating across rounds: sums drift, which costs nothing (no subnormals arise).
    benchmark(hetcomm_C.reduce_into, dst, src, op)
    _record_throughput(benchmark, dst.nbytes)


@pytest.fixture
def one_torch_thread():
    """reduce_into runs on one thread; so does the reference (OpenMP threads on a busy machine
    also make torch's own timings erratic)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_torch_add_reference(benchmark, one_torch_thread):
    dst, src = _make(torch.float32, 0), _make(torch.float32, 1)
    benchmark.group = "reduce float32"
    benchmark.extra_info.update(dtype="float32", op="torch.add_", nbytes=dst.nbytes, threads=1)
    benchmark(dst.add_, src)
    _record_throughput(benchmark, dst.nbytes)
