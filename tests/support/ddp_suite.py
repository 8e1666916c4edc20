"""The DDP suite: the same small MLP trained from the same seed on the same data, once on the
default group (the backend under test) and once on a gloo group, for each variant (plain DDP,
many buckets, the built-in hooks, find_unused_parameters, Join, hetcomm's weighted hooks).
Run on the CPU by tests/backend/test_ddp.py and on CUDA by test_cuda.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from hetcomm.train import hooks as weighted_hooks

from harness import Cases

# PowerSGD runs with one bucket here: with several buckets in flight gloo deadlocks (see
# test_powerSGD_many_buckets_in_flight_never_hangs).
WEIGHTED_HOOKS = {"weighted_allreduce_hook": weighted_hooks.weighted_allreduce_hook,
                  "weighted_fp16_hook": weighted_hooks.weighted_fp16_hook,
                  "weighted_bf16_hook": weighted_hooks.weighted_bf16_hook}
VARIANTS = ["plain", "many_buckets", "allreduce_hook", "fp16_compress_hook", "powerSGD_hook",
            "find_unused_parameters", "join_uneven_inputs", *WEIGHTED_HOOKS]
STEPS = 5
WORLD_SIZE = 2


class MLP(nn.Module):
    def __init__(self, with_unused_head: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        # Present in the module, never used in forward: DDP must be told to expect that.
        self.unused_head = nn.Linear(32, 4) if with_unused_head else None

    def forward(self, x):
        return self.head(self.body(x))


def batches(rank: int, count: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device))
            for _ in range(count)]


def samples_of(rank: int) -> int:
    """Per-rank batch of the weighted variants: uneven on purpose."""
    return 8 - 3 * (rank % 2)


def train(variant: str, rank: int, group, device: str = "cpu",
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Returns (initial, final) parameters of a model trained on ``group`` (None: default)."""
    torch.manual_seed(0)
    model = MLP(with_unused_head=variant == "find_unused_parameters").to(device)
    initial = [p.detach().clone() for p in model.parameters()]
    # 0.002 MB buckets split this model into several buckets in flight at once.
    small_buckets = variant in ("many_buckets", "powerSGD_hook_many_buckets")
    on_gpu = torch.device(device).type == "cuda"
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.002 if small_buckets else 25,
              find_unused_parameters=variant == "find_unused_parameters",
              device_ids=[torch.device(device).index] if on_gpu else None)
    weighted = None
    if variant == "allreduce_hook":
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    elif variant == "fp16_compress_hook":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif variant.startswith("powerSGD_hook"):
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif variant in WEIGHTED_HOOKS:
        weighted = weighted_hooks.SampleWeightState(group)
        ddp.register_comm_hook(weighted, WEIGHTED_HOOKS[variant])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    world_size = dist.get_world_size(group)

    def step(x, y):
        if weighted is not None:
            x, y = x[:samples_of(rank)], y[:samples_of(rank)]
            weighted.set_samples(len(x), sum(samples_of(r) for r in range(world_size)))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    if variant == "join_uneven_inputs":
        # Rank r has 3 + 2r batches; the rank that runs out first shadows the others' allreduces.
        with Join([ddp]):
            for x, y in batches(rank, 3 + 2 * rank, device):
                step(x, y)
    else:
        steps = STEPS + 1 if variant.startswith("powerSGD") else STEPS  # > start_powerSGD_iter
        for x, y in batches(rank, steps, device):
            step(x, y)
    return initial, [p.detach().cpu().clone() for p in model.parameters()]


def ddp_suite(rank: int, world_size: int, device: str = "cpu") -> dict[str, list[torch.Tensor]]:
    if device == "cuda":  # ranks share the GPUs there are
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    gloo = dist.new_group(backend="gloo")
    cases = Cases(rank)
    final = {}
    for variant in VARIANTS:
        with cases.case(variant, f"{variant}: backend under test vs gloo"):
            initial, mine = train(variant, rank, None, device)
            _, ref = train(variant, rank, gloo, device)
            final[variant] = mine
            moved = max(float((a - b.cpu()).abs().max()) for a, b in zip(mine, initial, strict=True))
            assert moved > 1e-4, f"training did not change the parameters (max change {moved})"
            for k, (a, b) in enumerate(zip(mine, ref, strict=True)):
                if not torch.allclose(a, b, rtol=1e-6, atol=1e-6):
                    raise AssertionError(f"parameter {k} differs from the gloo run by "
                                         f"{float((a - b).abs().max()):.3g}")
    return final
