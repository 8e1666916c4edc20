"""Where DiLoCo keeps its state (``state_device``, `hetcomm.train.diloco.shard.state_device`).

* The choice by hand: the model's device when its parameters lie on one CUDA device, else the
  CPU; "cpu"; "model" (the CPU or one CUDA device, an error otherwise); anything else refused.
  The ranks agree: a rank on a GPU among ranks on the CPU keeps it on the CPU too (None), or
  all refuse ("model"); a rank that cannot place it fails every rank. An elastic run takes None
  or "cpu" only.
* The same run with the state on the model's device and on the CPU: two ranks, overlap with two
  staggered fragments moved τ steps after their trigger (a schedule that does not depend on
  timing), fp32 and int8 with error feedback; and two workers of two ranks, the state sharded
  over them, Adam, overlap without staggering. On the CPU (CI) both place it on the CPU and end
  bit for bit alike; on a GPU (scripts/gpu_check.sh, ``HETCOMM_REQUIRE_CUDA=1``) the state is
  on the GPU, every buffer of it and the outer optimizer's, the ranks end bit-identical, and
  close to the run whose state is on the CPU: fp32 within float rounding (elementwise arithmetic
  may fuse differently on the GPU), int8 within a few quantisation steps (a last bit flips a
  rounded value).
* On a GPU: every codec encodes to the same bytes on the GPU as on the CPU, and decodes them to
  the same values.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")

_CUDA = torch.cuda.is_available()
if not _CUDA and os.environ.get("HETCOMM_REQUIRE_CUDA") == "1":
    raise RuntimeError("HETCOMM_REQUIRE_CUDA=1 but torch.cuda.is_available() is False here")
needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")


def test_state_device_by_hand():
    from hetcomm.train.diloco.shard import state_device

    cpu = [torch.zeros(2), torch.zeros(3)]
    meta = [torch.empty(2, device="meta"), torch.empty(3, device="meta")]
    assert state_device(cpu, None) == torch.device("cpu")
    assert state_device(cpu, "model") == torch.device("cpu")
    assert state_device(meta, None) == torch.device("cpu")             # not CUDA (no float64 on MPS)
    assert state_device(meta, "cpu") == torch.device("cpu")
    assert state_device(cpu + meta, None) == torch.device("cpu")       # several devices: the CPU
    for params, where in ((meta, "meta"), (cpu + meta, "cpu, meta")):
        with pytest.raises(ValueError, match=f"needs the model's parameters on the CPU or on one CUDA device, they "
                                             f"lie on {where}"):
            state_device(params, "model")
    for bad in ("cuda", "gpu", 0, torch.device("cpu")):
        with pytest.raises(ValueError, match="state_device must be None, 'cpu' or 'model'"):
            state_device(cpu, bad)


def test_an_elastic_run_keeps_its_state_on_the_cpu():
    import hetcomm
    from hetcomm.train.elastic.options import check_options

    membership = hetcomm.Elastic(store="127.0.0.1:1")
    assert check_options(membership, {"state_device": "cpu"}, True, "fixed") is None
    assert check_options(membership, {"state_device": None}, True, "fixed") is None
    with pytest.raises(ValueError, match="an elastic run keeps DiLoCo's state on the CPU"):
        check_options(membership, {"state_device": "model"}, True, "fixed")


def construct_with(rank: int, world: int, options, rank1) -> str:
    """``options[rank]`` on each rank; rank 1's choice made ``rank1`` (a device, or an error) by
    a stand-in."""
    import hetcomm
    import hetcomm.train.diloco.loop as loop

    if rank == 1:
        def chosen(params, opt):
            if isinstance(rank1, Exception):
                raise rank1
            return torch.device(rank1)
        loop.state_device_of = chosen
    net = torch.nn.Linear(4, 4)
    try:
        diloco = hetcomm.DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), state_device=options[rank])
    except ValueError as e:
        return f"error: {e}"
    where = str(diloco._global[0].device)
    diloco.close()
    return where


def test_the_ranks_agree_on_where_the_state_lives():
    # rank 1 would keep it on a GPU, rank 0 on the CPU: both on the CPU (nothing touches the GPU)
    assert run_ranks(2, construct_with, [None, None], "cuda:0") == ["cpu", "cpu"]
    # "model" on any rank: every rank refuses (not one raising while the other goes on)
    for options in (["model", "model"], ["model", None], [None, "model"]):
        for message in run_ranks(2, construct_with, options, "cuda:0"):
            assert "state_device='model', but the models of ranks [1] are on a GPU" in message, (options, message)
    res = run_ranks(2, construct_with, ["model", "model"], ValueError("hetcomm DiLoCo: no place for it"))
    assert "could not place DiLoCo's state" in res[0] and "no place for it" in res[1], res


def train(rank: int, world: int, device: str, state_device, compress: str = "int8") -> dict:
    import torch.nn as nn

    import hetcomm

    if device == "cuda":
        torch.cuda.set_device(0)                  # (one GPU: both ranks share it)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=4, compress=compress, error_feedback=True,
                            overlap=True, overlap_steps=2, fragments=2, state_device=state_device)
    where = sorted({str(t.device) for t in [*diloco._global, diloco._start, *diloco._deltas,
                                             diloco._stream_delta, diloco._stream_scratch]})
    data = torch.Generator().manual_seed(rank)
    for _ in range(6 * 4):
        x = torch.randn(8, 16, generator=data).to(device)
        y = torch.randn(8, 4, generator=data).to(device)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        diloco.step(samples=8)
    residuals = sorted({str(t.device) for fb in diloco._feedback
                        for t in (fb.sender_residual, fb.owner_residual) if t is not None}
                       | {str(t.device) for state in diloco.outer_optimizer.state.values()
                          for t in state.values() if isinstance(t, torch.Tensor)})
    diloco.finish()
    return {"where": where, "residuals": residuals, "rounds": len(diloco.history),
            "global": [t.detach().cpu() for t in diloco.global_parameters()],
            "model": [p.detach().cpu() for p in net.parameters()]}


def train_sharded(rank: int, world: int, device: str, state_device) -> dict:
    """Workers [0, 0, 1, 1], the state sharded over each worker's ranks, Adam as the outer
    optimizer, fp32, overlap (one fragment)."""
    import torch.nn as nn

    import hetcomm

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=3, workers=[0, 0, 1, 1], shard_state=True,
                            overlap=True, overlap_steps=1, state_device=state_device,
                            outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    where = sorted({str(t.device) for t in [*diloco._global, diloco._start, *diloco._deltas]}
                   | {str(t.device) for state in diloco.outer_optimizer.state.values()
                      for t in state.values() if isinstance(t, torch.Tensor)})
    data = torch.Generator().manual_seed(rank // 2)       # a worker's ranks step on the same batches
    for _ in range(5 * 3):
        x = torch.randn(8, 16, generator=data).to(device)
        y = torch.randn(8, 4, generator=data).to(device)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        diloco.step(samples=8)
    where = sorted(set(where) | {str(t.device) for state in diloco.outer_optimizer.state.values()
                                 for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0})
    diloco.finish()
    return {"where": where, "residuals": where, "rounds": len(diloco.history),
            "global": [t.detach().cpu() for t in diloco.global_parameters()],
            "model": [p.detach().cpu() for p in net.parameters()]}


def _same_run_on(device: str, fn=train, world: int = 2, *args) -> tuple[list[dict], list[dict]]:
    env = {"HETCOMM_LOCAL": "tcp"}
    return (run_ranks(world, fn, device, None, *args, env=env, timeout=240),
            run_ranks(world, fn, device, "cpu", *args, env=env, timeout=240))


def _check_ranks_agree(per_rank: list[dict], rounds: int = 6) -> None:
    for res in per_rank:
        assert res["rounds"] == rounds, res["rounds"]
        for a, b, p in zip(per_rank[0]["global"], res["global"], res["model"]):
            assert torch.equal(a, b) and torch.equal(a, p)


def test_the_state_on_the_cpu_model_s_device():
    on_model, on_cpu = _same_run_on("cpu")
    _check_ranks_agree(on_model)
    for res in on_model + on_cpu:
        assert res["where"] == ["cpu"] and res["residuals"] == ["cpu"], res
    for a, b in zip(on_model[0]["global"], on_cpu[0]["global"]):
        assert torch.equal(a, b)


def test_sharded_workers_on_the_cpu_model_s_device():
    on_model, on_cpu = _same_run_on("cpu", train_sharded, 4)
    _check_ranks_agree(on_model, rounds=5)
    for res in on_model + on_cpu:
        assert res["where"] == ["cpu"], res
    for a, b in zip(on_model[0]["global"], on_cpu[0]["global"]):
        assert torch.equal(a, b)


# fp32: within float rounding; int8: a last bit may flip a rounded value, a quantisation step of
# about max|Δ| / 127 of a block (the parameters here are of order 0.3, Δ of order 0.05)
@needs_cuda
@pytest.mark.parametrize("compress,rtol,atol", [("fp32", 1e-5, 1e-6), ("int8", 0.0, 3e-3)])
def test_the_state_on_the_gpu_and_on_the_cpu(compress, rtol, atol):
    on_gpu, on_cpu = _same_run_on("cuda", train, 2, compress)
    _check_ranks_agree(on_gpu)
    _check_ranks_agree(on_cpu)
    for res in on_gpu:
        assert res["where"] == ["cuda:0"] and res["residuals"] == ["cuda:0"], res
    for res in on_cpu:
        assert res["where"] == ["cpu"] and res["residuals"] == ["cpu"], res
    for a, b in zip(on_gpu[0]["global"], on_cpu[0]["global"]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@needs_cuda
def test_sharded_workers_with_the_state_on_the_gpu():
    on_gpu, on_cpu = _same_run_on("cuda", train_sharded, 4)
    _check_ranks_agree(on_gpu, rounds=5)
    assert all(res["where"] == ["cuda:0"] for res in on_gpu), [res["where"] for res in on_gpu]
    assert all(res["where"] == ["cpu"] for res in on_cpu), [res["where"] for res in on_cpu]
    for a, b in zip(on_gpu[0]["global"], on_cpu[0]["global"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "int8", "int4"])
def test_a_codec_gives_the_same_bytes_on_the_gpu(name):
    from hetcomm.compress import get_codec

    codec = get_codec(name, block=64)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    x[::97] = 0.0
    on_cpu = codec.encode(x)
    on_gpu = codec.encode(x.cuda())
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
    back = codec.decode(on_gpu, x.numel())
    assert back.device.type == "cuda" and torch.equal(back.cpu(), codec.decode(on_cpu, x.numel()))
