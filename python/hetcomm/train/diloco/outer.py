"""The outer step of DiLoCo: the weights of the outer update, the default outer optimizer, and
one outer step computed aside (the start estimate of a round with overlap).

The derivation of the weights: docs/diloco.md#outer-weights; of the estimate:
docs/diloco.md#overlap-the-derivation.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

__all__ = ["WEIGHTINGS", "default_outer_optimizer", "outer_weights", "estimate_step", "PER_PARAMETER"]

_PREFIX = "hetcomm DiLoCo"
WEIGHTINGS = ("batch", "samples", "uniform", "normalized")


def default_outer_optimizer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def outer_weights(weighting: str, samples: Sequence[float], steps: Sequence[float]) -> list[float]:
    """The weights w_r of the outer update Δ = Σ_r w_r Δ_r (see the module doc).

    ``samples`` and ``steps`` are the agreed per-rank counts of the round. Ranks without steps
    (out of data, waiting for the others to finish) contribute nothing under every weighting
    (``uniform``: 1/P over the ranks with steps); if no rank processed a sample, the counts fall
    back to steps (a batch of one per step).
    """
    P = len(samples)
    if weighting == "uniform":
        active = sum(1 for t in steps if t > 0)
        return [1.0 / active if t > 0 else 0.0 for t in steps] if active else [1.0 / P] * P
    n = [float(s) for s in samples]
    if sum(n) <= 0:
        n = [float(t) for t in steps]
    total = sum(n)
    if total <= 0:
        return [0.0] * P
    p = [s / total for s in n]
    if weighting == "samples":
        return p
    if weighting == "batch":
        per_step = [x / t if t > 0 else 0.0 for x, t in zip(n, steps)]      # mean batch of each rank
        total_batch = sum(per_step)
        return [b / total_batch for b in per_step] if total_batch > 0 else [0.0] * P
    if weighting == "normalized":
        tau_eff = sum(pr * t for pr, t in zip(p, steps))
        return [pr * tau_eff / t if t > 0 else 0.0 for pr, t in zip(p, steps)]
    raise ValueError(f"{_PREFIX}: unknown weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")


# Outer optimizers whose step keeps per-parameter state only and skips parameters without a
# gradient: stepping the fragments one by one is one step (fragments > 1 allows these only).
PER_PARAMETER = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam,
                            torch.optim.RAdam, torch.optim.Adamax, torch.optim.Adagrad, torch.optim.RMSprop})


@torch.no_grad()
def estimate_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  outs: Sequence[torch.Tensor]) -> None:
    """One step of ``optimizer`` for ``params`` (all of its parameters, or with an optimizer of
    `PER_PARAMETER` any of them) with the flat gradients ``grads``, written into ``outs`` (flat,
    one per parameter, none of them a gradient); the optimizer and the parameters are left as
    they were. torch.optim.SGD in closed form, without copying its state; others on a scratch
    copy of these parameters' state only, so that a step of other parameters may run meanwhile
    (streamed fragments), or with any other optimizer on a copy of its whole state. No
    parameters (a rank with no share of them): nothing to do."""
    if not params:
        return
    if type(optimizer) is torch.optim.SGD:
        _sgd_step(optimizer, params, grads, outs)
    elif type(optimizer) in PER_PARAMETER:
        _scratch_step(optimizer, params, grads, outs)
    else:
        _whole_step(optimizer, params, grads, outs)


@torch.no_grad()
def _whole_step(optimizer, params, grads, outs) -> None:
    """One step of any optimizer, its state and the parameters restored after."""
    mine = {id(p) for p in params}
    if mine != {id(p) for g in optimizer.param_groups for p in g["params"]}:
        raise ValueError(f"{_PREFIX}: an outer step of some of the parameters needs an optimizer that treats each "
                         "parameter on its own")
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.view(p.shape).to(p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for p, o, old in zip(params, outs, saved):
        o.copy_(p.detach().reshape(-1))
        p.copy_(old)
    optimizer.load_state_dict(saved_state)


@torch.no_grad()
def _scratch_step(optimizer, params, grads, outs) -> None:
    """A per-parameter optimizer's step on copies: a new optimizer of its type over copies of
    ``params``, each in a group of its own with its group's settings and a copy of its state."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    scratch = type(optimizer)([{**{k: v for k, v in groups[id(p)].items() if k != "params"}, "params": [c]}
                               for p, c in zip(params, copies)])
    for p, c, g in zip(params, copies, grads):
        if p in optimizer.state:
            scratch.state[c] = copy.deepcopy(optimizer.state[p])
        c.grad = g.view(c.shape).to(c.dtype)
    scratch.step()
    for c, o in zip(copies, outs):
        o.copy_(c.detach().reshape(-1))


@torch.no_grad()
def _sgd_step(optimizer, params, grads, outs) -> None:
    """torch.optim.SGD's step for gradient Δ, computed aside: d = ±Δ (− to maximize) + λθ;
    b = μ b + (1 − τ) d (b = d on the first step); d = d + μ b (Nesterov) or b; θ − η d. As a
    step is affine in d given b, it is θ − η (a d + c b_old) with a, c from the settings, computed
    in place without temporaries: (1 − η a λ) θ ∓ η a Δ − η c b_old."""
    settings = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for g, d, o in zip(params, grads, outs):
        group = settings[id(g)]
        lr, mu, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
        old = optimizer.state.get(g, {}).get("momentum_buffer") if mu else None
        if not mu:
            a, c = 1.0, 0.0
        elif old is None:                                   # the first step: b = d
            a, c = (1.0 + mu if group["nesterov"] else 1.0), 0.0
        else:
            keep = 1.0 - group["dampening"]
            a, c = ((1.0 + mu * keep, mu * mu) if group["nesterov"] else (keep, mu))
        sign = -1.0 if group.get("maximize", False) else 1.0
        o.copy_(g.detach().reshape(-1))
        if wd:
            o.mul_(1.0 - lr * a * wd)
        o.add_(d, alpha=-lr * a * sign)
        if c:
            o.add_(old.reshape(-1), alpha=-lr * c)
