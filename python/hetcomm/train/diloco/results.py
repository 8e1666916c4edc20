"""What `DiLoCo` reports: `Results.stats`, `timeline`, its workers and groups, and the bytes its
synchronisation sent (a mixin over DiLoCo's state)."""
from __future__ import annotations

import math

import torch.distributed as dist

from hetcomm.train.diloco.table import _hetcomm_bytes_sent


class Results:
    """The results of a `DiLoCo` run, agreed or this rank's own."""

    def stats(self) -> dict:
        """Totals agreed at the last synchronisation, one entry per worker (per rank when every
        worker is one rank), identical on every rank.

        ``wan_bytes``: bytes each worker's ranks sent to ranks of other workers on DiLoCo's groups
        (the measurements' exchange and the outer reduction; with workers from sites, what crossed
        the WAN; None on groups that are not hetcomm's), ``wan_bytes_per_round`` their sum over
        workers per round. ``workers``: the group ranks of each worker.
        """
        t = self._agreed_totals
        if not t:
            return {}
        wall = [c + i + s for c, i, s in zip(t["compute"], t["idle"], t["sync"])]
        known_wan = all(b is not None for b in t["wan"])
        return {
            "rounds": self._settled,
            "workers": [list(m) for m in self._workers.members],
            "steps": [round(x) for x in t["steps"]],
            "samples": [round(x) for x in t["samples"]],
            "compute_seconds": t["compute"],
            "idle_seconds": t["idle"],
            "sync_seconds": t["sync"],
            "bytes_sent": t["bytes"],
            "wan_bytes": t["wan"],
            "wan_bytes_per_round": (sum(t["wan"]) / self._settled if known_wan and self._settled else None),
            "compute_fraction": [c / w if w > 0 else 0.0 for c, w in zip(t["compute"], wall)],
        }

    @property
    def workers(self) -> list[list[int]]:
        """The group ranks of each worker (one list per worker, in the order of `history`'s columns)."""
        return [list(m) for m in self._workers.members]

    @property
    def worker_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's worker (None when every worker is one rank): for DDP
        or FSDP inside the worker, with ``inner_sync=False``."""
        return self._workers.worker_group

    def timeline(self) -> list[tuple[str, float, float]]:
        """This rank's (kind, start, end) intervals in wall-clock seconds (time.time()):
        ``compute``, ``idle`` and ``sync`` (on the background thread with overlap)."""
        return [(k, a + self._wall_offset, b + self._wall_offset) for k, a, b in self._timeline]

    def _outer_groups(self) -> list:
        """The groups DiLoCo's synchronisation uses (the default group as None)."""
        groups = [self._sync_group]
        if not self._workers.single:
            groups += [self._workers.cross_group, self._workers.gather_group]
        return list({id(g): g for g in groups}.values())

    def _bytes_sent(self) -> float:
        return math.fsum(_hetcomm_bytes_sent(g) for g in self._outer_groups())
