"""DiLoCo's state sharded over a worker's ranks (`hetcomm.train.diloco.shard`).

* Memory: per-rank bytes of DiLoCo's state for workers of 1, 2 and 4 ranks, measured as the
  distinct storages reachable from the object, whatever keeps them (`DiLoCo.state_bytes`, not a
  count the code keeps). Synchronous: exactly the hand-counted global parameters, momentum, start
  point and pseudo-gradient of the rank's share, plus the exchange's buffers. With everything
  that keeps a buffer: a worker of S ranks keeps at most 1.3x the single rank's state / S, plus
  the exchange's buffers. (torch.profiler's memory events cannot serve: they count frees of
  tensors allocated before the window, and miss the background thread.)
* Arithmetic: sharded runs compute what the replicated layout (``shard_state=False``) computes,
  exactly (float64), with overlap, staggered fragments, int8 and error feedback; workers of
  unequal sizes (a rank that holds no share); an FSDP2 model sharded over each worker computes
  what the same model in data parallelism computes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks

pytestmark = pytest.mark.usefixtures("backend_importable")

WIDTH = 128                      # a model of 2 x 128 x 128 weights: 33,024 elements
SHAPES = {"ranks": [0, 1, 2, 3], "pairs": [0, 0, 1, 1], "one": [0, 0, 0, 0]}
# The settings measured: synchronous fp32, and everything that keeps a buffer (overlap, two
# staggered fragments, int8 with error feedback).
SETTINGS = {"sync": {}, "overlap": {"overlap": True, "fragments": 2, "compress": "int8", "error_feedback": True}}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def measure(rank: int, world: int) -> list[dict]:
    import hetcomm

    out = []
    for name, labels in SHAPES.items():
        for setting, kwargs in SETTINGS.items():
            net = model()
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            g = torch.Generator().manual_seed(labels[rank])
            diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=2, workers=labels,
                                    overlap_steps=1 if kwargs else None, **kwargs)
            for _ in range(6):
                x = torch.randn(4, WIDTH, generator=g)
                nn.functional.mse_loss(net(x), x).backward()
                opt.step()
                opt.zero_grad()
                diloco.step(samples=4)
            out.append({"shape": name, "setting": setting, "walked": diloco.state_bytes(),
                        "held": diloco._layout.size if diloco._layout is not None else diloco._start.numel(),
                        "chunk": diloco._layout.chunk if diloco._layout is not None else 0,
                        "elements": sum(p.numel() for p in net.parameters())})
            diloco.finish()
    return out


def test_per_rank_state_shrinks_with_the_ranks_of_the_worker():
    per_rank = run_ranks(4, measure, timeout=300)
    for setting in SETTINGS:
        rows = {shape: [res for rows in per_rank for res in rows if res["setting"] == setting and res["shape"] == shape]
                for shape in SHAPES}
        single = rows["ranks"]
        n = single[0]["elements"]
        for res in single:
            assert res["held"] == n
            if setting == "sync":   # fp32 global parameters, momentum, start point, pseudo-gradient
                assert res["walked"] == 16 * n, res
        for shape, S in (("pairs", 2), ("one", 4)):
            assert sum(r["held"] for r in rows[shape]) == (4 // S) * n     # the shares tile each worker's model
            for res in rows[shape]:
                exchange = 4 * (S + 1) * res["chunk"]                          # send + S receive buffers (fp32)
                assert 0 < res["chunk"] <= (n + S - 1) // S
                if setting == "sync":
                    assert res["walked"] == 16 * res["held"] + exchange, (shape, res)
                bound = max(r["walked"] for r in single) / S * 1.3 + exchange
                assert res["walked"] <= bound, (setting, shape, res["walked"], bound)


def grouped_adamw(params):
    """Groups by dimension, as training scripts do (no weight decay for biases): the factory must
    see the parameters' shapes, not a rank's flat pieces of them."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=0.05, betas=(0.8, 0.9))


def train(rank: int, world: int, labels: list, settings: list[dict]) -> list[dict]:
    """Each configuration sharded and replicated, the same float64 data: worker w's ranks split
    its batch (their gradients averaged by the worker). The exchange in chunks of 7 elements
    (several per fragment and rank)."""
    import hetcomm
    import hetcomm.train.diloco.shard as shard_module

    shard_module.CHUNK = 7
    out = []
    for kwargs in settings:
        results = {}
        for shard in (None, False):
            torch.manual_seed(3)
            net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=3, workers=labels, shard_state=shard,
                                    outer_optimizer=grouped_adamw, **kwargs)
            worker = labels[rank]
            part, parts = labels[:rank].count(worker), labels.count(worker)
            for k in range(12):
                g = torch.Generator().manual_seed(100 * worker + k)
                x = torch.randn(12, 6, generator=g, dtype=torch.float64)
                x = x[part * 12 // parts:(part + 1) * 12 // parts]
                nn.functional.mse_loss(net(x), x[:, :3]).backward()
                opt.step()
                opt.zero_grad()
                diloco.step(samples=len(x))
            diloco.finish()
            results[shard] = {"global": [t.clone() for t in diloco.global_parameters()],
                              "history": [{k: h[k] for k in ("steps", "samples", "weights")} for h in diloco.history],
                              "sharded": diloco._layout is not None, "bytes": diloco.state_bytes(),
                              "held": diloco._layout.size if diloco._layout is not None else None,
                              "chunk": diloco._layout.chunk if diloco._layout is not None else None,
                              "groups": [len(g["params"]) for g in diloco.outer_optimizer.param_groups]}
        out.append(results)
    return out


SHARDED_SETTINGS = [{}, {"overlap": True, "overlap_steps": 1, "fragments": 3, "compress": "int8",
                         "error_feedback": True, "block": 8}]


@pytest.mark.parametrize("labels", [[0, 0, 1, 1], [0, 0, 1, 1, 1]], ids=["pairs", "unequal"])
def test_sharded_state_computes_what_the_replicated_state_computes(labels):
    per_rank = run_ranks(len(labels), train, labels, SHARDED_SETTINGS, timeout=300)
    for i, kwargs in enumerate(SHARDED_SETTINGS):
        for rank, res in enumerate(per_rank):
            sharded, replicated = res[i][None], res[i][False]
            assert sharded["sharded"] and not replicated["sharded"]
            assert len(sharded["groups"]) == 2 and sharded["chunk"] == 7, sharded
            assert sharded["history"] == replicated["history"], kwargs
            for a, b, c in zip(sharded["global"], replicated["global"], per_rank[0][i][False]["global"]):
                assert torch.equal(a, b) and torch.equal(b, c), (kwargs, rank)
    if len(labels) == 5:                # worker 1's third rank holds no share: no state beyond buffers
        idle = per_rank[4][0][None]
        exchange = 8 * (3 + 1) * idle["chunk"]           # float64, a worker of 3 ranks
        assert idle["held"] == 0 and idle["bytes"] <= exchange + 1024, idle


def train_fsdp(rank: int, world: int) -> list[dict]:
    """Workers [0, 0, 1, 1]: the model sharded with FSDP2 over each worker (a 2 x 2 mesh), against
    the same model in data parallelism (DiLoCo's gradient averaging), float64."""
    import hetcomm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("worker", "shard"))
    out = []
    # (fp32: int8's blocks would fall elsewhere in FSDP2's shards than in the replicated layout's)
    for kwargs in ({}, {"overlap": True, "fragments": 2, "overlap_steps": 1}):
        results = {}
        for fsdp in (True, False):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
            if fsdp:
                fully_shard(net, mesh=mesh["shard"])
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=3, workers=[0, 0, 1, 1],
                                    inner_sync=not fsdp, shard_state=None if fsdp else False, **kwargs)
            worker, half = rank // 2, rank % 2
            for k in range(9):
                g = torch.Generator().manual_seed(100 * worker + k)
                x = torch.randn(8, 6, generator=g, dtype=torch.float64)[4 * half:4 * half + 4]
                nn.functional.mse_loss(net(x), x[:, :3]).backward()
                opt.step()
                opt.zero_grad()
                diloco.step(samples=4)
            diloco.finish()
            glob = diloco.global_parameters()
            local = sum(g.to_local().numel() if fsdp else 0 for g in glob)
            results[fsdp] = {"global": [(g.full_tensor() if fsdp else g).clone() for g in glob],
                             "held": diloco._layout.size if fsdp else None, "local": local,
                             "model": [(p.full_tensor() if fsdp else p).detach().clone() for p in net.parameters()]}
        out.append(results)
    return out


def test_an_fsdp2_model_contributes_its_local_shards():
    per_rank = run_ranks(4, train_fsdp, timeout=300)
    n = 6 * 16 + 16 + 16 * 3 + 3
    for i in range(2):
        for res in per_rank:
            fsdp, ddp = res[i][True], res[i][False]
            assert fsdp["held"] == fsdp["local"] < n           # this rank's shards only
            for a, b, m in zip(fsdp["global"], ddp["global"], fsdp["model"]):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
                assert torch.equal(a, m)                        # the model holds the global parameters
        assert per_rank[0][i][True]["held"] + per_rank[1][i][True]["held"] == n


def mismatched(rank: int, world: int) -> dict:
    """A checkpoint of another share, and shard_state=True where it cannot hold."""
    import hetcomm

    errors = {}
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    diloco = hetcomm.DiLoCo(net, opt, workers=[0, 0, 1, 1], steps=1)
    states = [None] * world
    dist.all_gather_object(states, diloco.state_dict())
    diloco.finish()
    fresh = hetcomm.DiLoCo(net, opt, workers=[0, 0, 1, 1], steps=1)
    try:
        fresh.load_state_dict(states[rank ^ 1])        # the other rank of the worker: the other share
    except ValueError as e:
        errors["share"] = str(e)
    fresh.load_state_dict(states[(rank + 2) % 4])      # the same share of the other worker: resumes
    try:
        fresh.global_parameters()                       # this rank holds its share only
    except RuntimeError as e:
        errors["before_finish"] = str(e)
    whole = fresh.gather_global_parameters()            # every rank of the worker: a collective
    fresh.finish()
    errors["gathered"] = all(torch.equal(a, b) for a, b in zip(whole, fresh.global_parameters()))
    try:
        hetcomm.DiLoCo(net, opt, workers=[0, 1, 2, 3], shard_state=True)
    except ValueError as e:
        errors["single"] = str(e)
    try:
        hetcomm.DiLoCo(net, opt, workers=[0, 0, 1, 1], shard_state=True,
                       outer_optimizer=lambda ps: torch.optim.LBFGS(ps))
    except ValueError as e:
        errors["optimizer"] = str(e)
    return errors


def test_mismatched_shares_and_impossible_sharding_raise():
    for errors in run_ranks(4, mismatched, timeout=180):
        assert "same share" in errors.get("share", ""), errors
        assert "two or more ranks" in errors.get("single", ""), errors
        assert "element-wise" in errors.get("optimizer", ""), errors
        assert "gather_global_parameters" in errors.get("before_finish", ""), errors
        assert errors["gathered"] is True, errors


def failing_share(rank: int, world: int, mode: str) -> dict:
    """Workers [0, 0, 1, 1], sharded: the reduction of share 1 (ranks 1 and 3) fails at its second
    call and those ranks stay alive a while (a failure that is not a death). The ranks of share 0
    must raise at once, naming the other rank's failure, instead of waiting in the exchange of the
    replica for a rank that will never come."""
    import time

    import hetcomm
    from hetcomm.train import workers as workers_module

    real, calls = workers_module.Workers.reduce_range, {"n": 0}

    def flaky(self, delta, weights, **kwargs):
        calls["n"] += 1
        if self.local_rank == 1 and calls["n"] == 2:
            raise RuntimeError("simulated failure of share 1's cross link")
        return real(self, delta, weights, **kwargs)

    workers_module.Workers.reduce_range = flaky
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    kwargs = {"overlap": True, "fragments": 2} if mode == "staggered" else {}
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=2, workers=[0, 0, 1, 1], shard_state=True, **kwargs)
    g = torch.Generator().manual_seed(rank // 2)
    try:
        for _ in range(12):
            x = torch.randn(4, 16, generator=g)
            nn.functional.mse_loss(net(x), x).backward()
            opt.step()
            opt.zero_grad()
            diloco.step(samples=4)
        diloco.finish()
    except Exception as e:  # noqa: BLE001 - the outcome is the test's
        diloco.close()
        if "simulated" in str(e):
            time.sleep(3.0)               # alive: the others learn nothing from a closed connection
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


@pytest.mark.parametrize("mode", ["sync", "staggered"])
def test_a_share_whose_reduction_fails_fails_its_whole_worker_at_once(mode):
    res = run_ranks(4, failing_share, mode, timeout=120)
    for rank in (1, 3):
        assert "simulated failure" in (res[rank]["error"] or ""), res
    for rank in (0, 2):
        assert "another rank of this worker failed" in (res[rank]["error"] or ""), res


def half_failed_share(rank: int, world: int, mode: str) -> dict:
    """Workers [0, 0, 1, 1], sharded: rank 1's second reduction of its range completes (rank 3, in
    the same cross group, has its result) and then fails on rank 1 alone. Worker 1 has every range
    reduced and steps them; worker 0 must step none (rank 0's range reduced fine): a worker's ranks
    apply an outer step all together or not at all, so that every range of a worker holds the same
    count of outer steps after a failure (what an elastic run carries its state on from)."""
    import concurrent.futures

    import hetcomm
    from hetcomm.train import workers as workers_module

    real, calls, box = workers_module.Workers.reduce_range, {"n": 0}, {}

    def flaky(self, delta, weights, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:                        # (every rank: the state before this outer step)
            d = box["diloco"]
            box["before"] = (d._applied, [g.detach().clone() for g in d._global])
        out = real(self, delta, weights, **kwargs)
        if rank == 1 and calls["n"] == 2:
            raise RuntimeError("simulated failure after rank 1's reduction")
        return out

    workers_module.Workers.reduce_range = flaky
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    kwargs = {"sync": {}, "overlap": {"overlap": True}, "staggered": {"overlap": True, "fragments": 2}}[mode]
    diloco = hetcomm.DiLoCo(net, opt, local_steps="fixed", steps=2, workers=[0, 0, 1, 1], shard_state=True,
                            outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9), **kwargs)
    box["diloco"] = diloco
    g = torch.Generator().manual_seed(rank // 2)
    error = None
    for _ in range(12):
        x = torch.randn(4, 16, generator=g)
        nn.functional.mse_loss(net(x), x).backward()
        opt.step()
        opt.zero_grad()
        try:
            diloco.step(samples=4)
        except Exception as e:  # noqa: BLE001 - the outcome is the test's
            error = e
        jobs = [f for f in diloco._background_jobs() if f is not None]
        concurrent.futures.wait(jobs)               # (every rank the same calls: they stop alike)
        error = error or next((f.exception() for f in jobs if f.exception() is not None), None)
        if calls["n"] >= 2:
            break
    applied, before = box["before"]
    out = {"error": None if error is None else f"{type(error).__name__}: {error}",
           "applied": diloco._applied - applied,
           "moved": any(not torch.equal(a, b) for a, b in zip(before, diloco._global))}
    diloco.close()
    return out


@pytest.mark.parametrize("mode", ["sync", "overlap", "staggered"])
def test_a_worker_steps_its_ranges_all_together_or_not_at_all(mode):
    res = run_ranks(4, half_failed_share, mode, timeout=120)
    assert "simulated failure" in (res[1]["error"] or ""), res
    assert "another rank of this worker failed" in (res[0]["error"] or ""), res
    for rank in (0, 1):
        assert res[rank]["applied"] == 0 and not res[rank]["moved"], res
    for rank in (2, 3):
        assert res[rank]["error"] is None and res[rank]["applied"] == 1 and res[rank]["moved"], res
