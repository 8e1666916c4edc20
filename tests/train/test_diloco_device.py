"""Where DiLoCo keeps its state (``state_device``, `hetcomm.train.diloco.shard.state_device`).

* The choice by hand: the model's device when its parameters lie on one, else the CPU; "cpu";
  "model" (an error when they lie on several); anything else refused. An elastic run takes
  None or "cpu" only.
* The same run with the state on the model's device and on the CPU: two ranks, int8 with error
  feedback, overlap with two staggered fragments moved τ steps after their trigger (a schedule
  that does not depend on timing). On the CPU (CI) both place it on the CPU and end bit for bit
  alike; on a GPU (scripts/gpu_check.sh, ``HETCOMM_REQUIRE_CUDA=1``) the state is on the GPU,
  every buffer of it, the ranks end bit-identical, and within float rounding of the run whose
  state is on the CPU (elementwise arithmetic may fuse differently on the GPU).
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
    assert state_device(meta, None) == torch.device("meta")            # the model's, wherever it is
    assert state_device(meta, "model") == torch.device("meta")
    assert state_device(meta, "cpu") == torch.device("cpu")
    assert state_device(cpu + meta, None) == torch.device("cpu")       # several devices: the CPU
    with pytest.raises(ValueError, match=r"lie on several devices \(cpu, meta\)"):
        state_device(cpu + meta, "model")
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


def train(rank: int, world: int, device: str, state_device) -> dict:
    import torch.nn as nn

    import hetcomm

    if device == "cuda":
        torch.cuda.set_device(0)                  # (one GPU: both ranks share it)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=4, compress="int8", error_feedback=True,
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
                        for t in (fb.sender_residual, fb.owner_residual) if t is not None})
    diloco.finish()
    return {"where": where, "residuals": residuals, "rounds": len(diloco.history),
            "global": [t.detach().cpu() for t in diloco.global_parameters()],
            "model": [p.detach().cpu() for p in net.parameters()]}


def _same_run_on(device: str) -> tuple[list[dict], list[dict]]:
    env = {"HETCOMM_LOCAL": "tcp"}
    return (run_ranks(2, train, device, None, env=env, timeout=240),
            run_ranks(2, train, device, "cpu", env=env, timeout=240))


def _check_ranks_agree(per_rank: list[dict]) -> None:
    for res in per_rank:
        assert res["rounds"] == 6, res["rounds"]
        for a, b, p in zip(per_rank[0]["global"], res["global"], res["model"]):
            assert torch.equal(a, b) and torch.equal(a, p)


def test_the_state_on_the_cpu_model_s_device():
    on_model, on_cpu = _same_run_on("cpu")
    _check_ranks_agree(on_model)
    for res in on_model + on_cpu:
        assert res["where"] == ["cpu"] and res["residuals"] == ["cpu"], res
    for a, b in zip(on_model[0]["global"], on_cpu[0]["global"]):
        assert torch.equal(a, b)


@needs_cuda
def test_the_state_on_the_gpu_and_on_the_cpu():
    on_gpu, on_cpu = _same_run_on("cuda")
    _check_ranks_agree(on_gpu)
    _check_ranks_agree(on_cpu)
    for res in on_gpu:
        assert res["where"] == ["cuda:0"] and res["residuals"] == ["cuda:0"], res
    for res in on_cpu:
        assert res["where"] == ["cpu"] and res["residuals"] == ["cpu"], res
    for a, b in zip(on_gpu[0]["global"], on_cpu[0]["global"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


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
