"""The option that makes `hetcomm.DiLoCo` elastic: ``membership=Elastic(store=...)`` (DiLoCo in
generations, `hetcomm.train.elastic.run`)."""
from __future__ import annotations

import dataclasses

from hetcomm.train.elastic.common import _PREFIX


@dataclasses.dataclass(frozen=True)
class Elastic:
    """Elastic membership for `hetcomm.DiLoCo` (``membership=Elastic(store=...)``).

    Args:
        store: the job's c10d store, ``"host:port"`` (`hetcomm.store`) or a torch.distributed Store.
        worker_id: this process's name in logs and records (default ``$HETCOMM_WORKER_ID``, else
            ``host:pid``); a restarted process may reuse it.
        worker: the DiLoCo worker this process is a rank of (default: its ``worker_id``, one rank
            per worker); the ranks of a worker of several ranks give it the same name.
        job: the run's name on the store (a new run needs a new one).
        min_workers: the first generation forms once this many processes have asked to join.
        heartbeat: seconds between heartbeats.
        timeout: a worker whose heartbeat has not changed for this long is dropped (at most 10 s
            by default, as INTELLECT-1's 2 s / 10 s).
        late_timeout: a live worker still missing from an epoch this long after the last change
            among the others (one arrived or was dropped) is dropped too (it rejoins when it
            gets there).
        collective_timeout: the generation group's operation timeout (a frozen peer).
        backend: the generation group's backend (``"hetcomm"`` or ``"gloo"``).
        verbose: print one line per membership change (they are in `stats` either way).
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


def check_options(membership: Elastic, fixed_only: dict, inner_sync: bool, local_steps) -> bool | None:
    """The checks of `ElasticRun`'s options that a fixed group's `DiLoCo` does not make (the
    fixed group's own, ``fixed_only``, refused or checked); returns ``shard_state``."""
    prefix = _PREFIX
    for name in fixed_only:
        if name in ("group", "workers", "clock"):
            raise ValueError(f"{prefix}: {name}= is not an option of an elastic run (the generations form their "
                             "groups; a worker is named by Elastic(worker=...))")
        if name == "state_device":
            if fixed_only[name] not in (None, "cpu"):
                raise ValueError(f"{prefix}: an elastic run keeps DiLoCo's state on the CPU (its epochs check and move "
                                 f"it there): state_device must be None or 'cpu', got {fixed_only[name]!r}")
        elif name != "shard_state":
            raise TypeError(f"{prefix}: unknown argument {name!r}")
    shard_state = fixed_only.get("shard_state")
    if shard_state is not None and not isinstance(shard_state, bool):
        raise TypeError(f"{prefix}: shard_state must be True, False or None, got {shard_state!r}")
    if not inner_sync:
        raise ValueError(f"{prefix}: inner_sync=False is not an option of an elastic run (its groups change with "
                         "every generation: DiLoCo averages a worker's gradients itself)")
    if not isinstance(local_steps, str):
        raise TypeError(f"{prefix}: local_steps must be 'fixed', 'speed' or 'time' in an elastic run (a policy "
                        "object cannot follow the changing workers)")
    worker = membership.worker
    if worker is not None and (not isinstance(worker, str) or not worker or "#" in worker):
        raise ValueError(f"{prefix}: Elastic(worker=) must be a non-empty name without '#', got {worker!r}")
    return shard_state
