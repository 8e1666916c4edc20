"""`hetcomm.ElasticDiLoCo`: DiLoCo in generations (`hetcomm.train.elastic.run`) with the arguments
of the elastic class that came before it, for the scripts written for it."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from hetcomm.train.elastic.options import Elastic
from hetcomm.train.elastic.run import ElasticRun


class ElasticDiLoCo(ElasticRun):
    """``hetcomm.DiLoCo(model, inner_optimizer, membership=hetcomm.Elastic(store=..., ...), **options)``
    with rounds of ``steps`` steps (``local_steps="fixed"``), or of ``round_seconds`` seconds on
    every worker (``local_steps="time"``): ``worker_id``, ``worker``, ``job``, ``min_workers``,
    ``heartbeat``, the timeouts, ``backend`` and ``verbose`` go to `Elastic`, the others to DiLoCo
    (any other DiLoCo option, e.g. ``overlap=True``, may be passed too).

    What changed from the per-round class this replaced (12-05): DiLoCo's options, ``steps``
    included, are part of the configuration every worker shares (a worker with other ``steps`` is
    refused, naming it; ``local_steps="speed"`` or ``"time"`` set each worker's own count);
    `history` records name the generation's ``workers`` (not ``members``) and hold DiLoCo's
    fields; `stats` holds the epochs' idle and sync seconds and per generation its DiLoCo's
    `stats`. ``early_join`` is accepted and changes nothing (``False`` warns): a worker that asks
    to join joins the round in progress (the members end their generation at the step they see
    it and carry the round into the next, to which the joiner contributes), except in the run's
    last round and in a round a join has already cut (docs/elastic.md)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 store, worker_id: str | None = None, worker: str | None = None, job: str = "diloco", steps: int = 50,
                 round_seconds: float | None = None,
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 weighting: str = "batch", compress: str = "fp32", block: int = 2048, min_workers: int = 1,
                 heartbeat: float = 2.0, timeout: float = 10.0, late_timeout: float = 600.0,
                 collective_timeout: float = 60.0, backend: str = "hetcomm", early_join: bool = True,
                 verbose: bool = True, **options) -> None:
        if not early_join:
            warnings.warn("ElasticDiLoCo(early_join=False) changes nothing since it runs DiLoCo in generations: a "
                          "worker that asks to join joins the round in progress", FutureWarning, stacklevel=2)
        membership = Elastic(store=store, worker_id=worker_id, worker=worker, job=job, min_workers=min_workers,
                             heartbeat=heartbeat, timeout=timeout, late_timeout=late_timeout,
                             collective_timeout=collective_timeout, backend=backend, verbose=verbose)
        options.setdefault("local_steps", "fixed" if round_seconds is None else "time")
        super().__init__(model, inner_optimizer, membership=membership, outer_optimizer=outer_optimizer, steps=steps,
                         round_seconds=round_seconds, weighting=weighting, compress=compress, block=block, **options)
