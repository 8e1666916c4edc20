"""`hetcomm.ElasticDiLoCo`: DiLoCo in generations (`hetcomm.train.elastic.run`) with the arguments
of the elastic class that came before it, for the scripts written for it."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hetcomm.train.elastic.options import Elastic
from hetcomm.train.elastic.run import ElasticRun


class ElasticDiLoCo(ElasticRun):
    """``hetcomm.DiLoCo(model, inner_optimizer, membership=hetcomm.Elastic(store=..., ...), **options)``
    with rounds of ``steps`` steps (``local_steps="fixed"``), or of ``round_seconds`` seconds on
    every worker (``local_steps="time"``): the store, worker and liveness arguments go to
    `Elastic`, the others to DiLoCo (any other DiLoCo option, e.g. ``overlap=True``, may be passed
    too). ``early_join`` is accepted for the scripts that pass it and changes nothing: a worker
    that asks to join joins the round in progress (the members end their generation at the step
    they see it and carry the round into the next, to which the joiner contributes)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 store, worker_id: str | None = None, job: str = "diloco", steps: int = 50,
                 round_seconds: float | None = None,
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 weighting: str = "batch", compress: str = "fp32", block: int = 2048, min_workers: int = 1,
                 heartbeat: float = 2.0, timeout: float = 10.0, late_timeout: float = 600.0,
                 collective_timeout: float = 60.0, backend: str = "hetcomm", early_join: bool = True,
                 verbose: bool = True, **options) -> None:
        membership = Elastic(store=store, worker_id=worker_id, job=job, min_workers=min_workers, heartbeat=heartbeat,
                             timeout=timeout, late_timeout=late_timeout, collective_timeout=collective_timeout,
                             backend=backend, verbose=verbose)
        options.setdefault("local_steps", "fixed" if round_seconds is None else "time")
        super().__init__(model, inner_optimizer, membership=membership, outer_optimizer=outer_optimizer, steps=steps,
                         round_seconds=round_seconds, weighting=weighting, compress=compress, block=block, **options)
