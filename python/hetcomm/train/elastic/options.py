"""The option that makes `hetcomm.DiLoCo` elastic: ``membership=Elastic(store=...)`` (DiLoCo in
generations, `hetcomm.train.elastic.run`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Elastic:
    """Elastic membership for `hetcomm.DiLoCo` (``membership=Elastic(store=...)``).

    Args:
        store: the job's c10d store, ``"host:port"`` (`hetcomm.store`) or a torch.distributed Store.
        worker_id: this process's name in logs and records (default ``$HETCOMM_WORKER_ID``, else
            ``host:pid``); a restarted process may reuse it.
        worker: the DiLoCo worker this process is a rank of (default: its ``worker_id``, one rank
            per worker); the ranks of a worker of several ranks give it the same name.
        job, min_workers, heartbeat, timeout, late_timeout, collective_timeout, backend, verbose:
            as `hetcomm.ElasticDiLoCo` (``min_workers`` counts processes).
    """
    store: object
    worker_id: str | None = None
    worker: str | None = None
    job: str = "diloco"
    min_workers: int = 1
    heartbeat: float = 2.0
    timeout: float = 10.0
    late_timeout: float = 600.0
    collective_timeout: float = 60.0
    backend: str = "hetcomm"
    verbose: bool = True
