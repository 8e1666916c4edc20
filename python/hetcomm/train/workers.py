"""DiLoCo workers made of several ranks: a site (or a host) that trains one replica with synchronous
data parallelism inside and takes part in DiLoCo's rounds as one worker.

`Workers` holds the process groups and does the two things that change when a worker has several
ranks (`hetcomm.DiLoCo` does the rest): the round's table becomes one column per worker
(`Workers.aggregate`), and the outer reduction is spread over the worker's ranks, one shard each
across the WAN, then an all-gather over the LAN (`Workers.reduce`). Workers come from hetcomm's
sites by default (`labels_from_sites`).

The table, the sharded reduction and its traffic, and replicas inside a worker:
docs/diloco.md#sites-as-workers.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetcomm import compress as _compress
from hetcomm.labels import ranks_by_label, renumber

__all__ = ["Workers", "labels_from_sites", "resolve_labels", "resolve_members", "shard_bounds"]

_PREFIX = "hetcomm DiLoCo workers"


def labels_from_sites(group: dist.ProcessGroup | None) -> list[int] | None:
    """The site of every rank of ``group`` from hetcomm's topology, or None (not a hetcomm group,
    sites unknown, or a single site)."""
    try:
        if dist.get_backend(group) != "hetcomm":
            return None
        from hetcomm._backend import backend_of
        from hetcomm.topology import topology_of
        topology = topology_of(backend_of(group))
    except (RuntimeError, ValueError, ImportError, AttributeError):
        return None
    if topology is not None:
        sites = list(topology.sites)
    else:                          # no plan (HETCOMM_PROBE=0, one host): the declaration alone
        from hetcomm.topology import declared_sites
        text = declared_sites(backend_of(group))
        sites = [item.strip() for item in text.split(",")] if text else []
    return sites if len(set(sites)) >= 2 else None


def resolve_labels(workers, group: dist.ProcessGroup | None, world: int) -> list[int]:
    """One worker label per group rank, renumbered 0.. by lowest rank.

    ``workers``: ``"sites"`` (hetcomm's sites when there are two or more, else one worker per
    rank), ``"ranks"`` or None (one worker per rank), or a sequence of ``world`` labels.
    """
    if workers is None or workers == "ranks":
        labels: Sequence = range(world)
    elif workers == "sites":
        labels = labels_from_sites(group) or range(world)
        if len(set(labels)) < world and world != dist.get_world_size():
            # workers of several ranks need every rank of the job (new_group); a subgroup keeps
            # one worker per rank by default, and says so when asked for sites explicitly
            labels = range(world)
    elif isinstance(workers, str):
        raise ValueError(f"{_PREFIX}: workers must be 'sites', 'ranks' or one label per rank, got {workers!r}")
    else:
        labels = list(workers)
        if len(labels) != world:
            raise ValueError(f"{_PREFIX}: workers has {len(labels)} labels for a group of {world} ranks")
    return list(renumber(labels))


# The ranks of each worker, from its labels.
resolve_members = ranks_by_label


def shard_bounds(n: int, shards: int) -> list[int]:
    """``n`` elements in ``shards`` contiguous ranges of sizes that differ by at most one."""
    base, extra = divmod(n, shards)
    bounds = [0]
    for i in range(shards):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class Workers:
    """The workers of a DiLoCo group and their process groups (see the module doc).

    Construction is collective over the whole job (every rank of the default group calls it, the
    way `torch.distributed.new_group` requires). ``labels[r]`` is the worker of group rank r.
    ``background``: the outer reduction runs on a thread of its own (DiLoCo's overlap), so its
    all-gather gets a group of its own instead of sharing `worker_group` with the training loop.
    """

    def __init__(self, labels: Sequence[int], group: dist.ProcessGroup | None, *, backend: str | None = None,
                 worker_backend: str | None = None, background: bool = False) -> None:
        self.labels = list(labels)
        self.count = max(self.labels) + 1
        rank = dist.get_rank(group)
        self.index = self.labels[rank]                                  # this rank's worker
        self.members = resolve_members(self.labels)
        self.local_rank = self.members[self.index].index(rank)
        self.size = len(self.members[self.index])
        self.shards = min(len(m) for m in self.members)
        self.single = all(len(m) == 1 for m in self.members)
        self.worker_group: dist.ProcessGroup | None = None
        self.gather_group: dist.ProcessGroup | None = None
        self.agree_group: dist.ProcessGroup | None = None
        self.cross_group: dist.ProcessGroup | None = None
        self._cross_workers: list[int] = []                             # worker of each cross-group rank
        self._owned: list[dist.ProcessGroup] = []
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(len(self.labels))]
        if self.single:
            return
        if dist.get_world_size(group) != dist.get_world_size():
            raise ValueError(f"{_PREFIX}: workers of several ranks need the DiLoCo group to be the whole job "
                             f"(this group has {dist.get_world_size(group)} of {dist.get_world_size()} ranks)")
        glob = self.global_ranks
        backend = backend or dist.get_backend(group)
        worker_backend = worker_backend or backend

        def make(ranks: list[int], on: str) -> dist.ProcessGroup | None:
            g = dist.new_group(sorted(ranks), backend=on)      # every rank of the job, the same order
            mine = dist.get_rank() in ranks
            if mine:
                self._owned.append(g)
            return g if mine else None

        for members in self.members:
            g = make([glob[r] for r in members], worker_backend)
            if g is not None:
                self.worker_group = g
        # DiLoCo's own collectives inside the worker move CPU tensors: on the DiLoCo group's
        # backend (a worker_backend such as nccl is for the user's DDP and the gradient hook).
        # `agree_group` serves the training loop's thread, `gather_group` the synchronisation's.
        self.agree_group = self.worker_group
        if worker_backend != backend:
            for members in self.members:
                g = make([glob[r] for r in members], backend)
                if g is not None:
                    self.agree_group = g
        self.gather_group = self.agree_group
        if background:
            for members in self.members:
                g = make([glob[r] for r in members], backend)
                if g is not None:
                    self.gather_group = g
        for i in range(self.shards):
            ranks = [glob[m[i]] for m in self.members]
            g = make(ranks, backend)
            if g is not None:
                self.cross_group = g
                order = sorted(range(self.count), key=lambda k: glob[self.members[k][i]])
                self._cross_workers = order

    def destroy(self) -> None:
        """Destroys the groups only DiLoCo uses (not `worker_group`: the user's DDP may use it)."""
        for g in self._owned:
            if g is self.worker_group:
                continue
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError):
                pass
        self._owned = [self.worker_group] if self.worker_group is not None else []

    # ---- the table -------------------------------------------------------------------------

    def aggregate(self, table: list[list[float]], how: Sequence[str]) -> list[list[float]]:
        """Per-rank rows to per-worker rows: ``how[i]`` is ``sum``, ``max`` or ``min`` for row i."""
        if self.single:
            return table
        out = []
        for row, rule in zip(table, how):
            fn = {"sum": math.fsum, "max": max, "min": min}[rule]
            out.append([float(fn(row[r] for r in members)) for members in self.members])
        return out

    # ---- the outer reduction -----------------------------------------------------------------

    def reduce(self, delta: torch.Tensor, weights: Sequence[float], *, codec, feedback) -> torch.Tensor:
        """Σ_w weights[w] Δ_w, every rank of every worker alike (see the module doc), on the device
        of ``delta`` (the worker's gather goes through the CPU)."""
        n = delta.numel()
        bounds = shard_bounds(n, self.shards)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        mine = torch.zeros(longest, dtype=torch.float32)
        if self.local_rank < self.shards:
            a, b = bounds[self.local_rank], bounds[self.local_rank + 1]
            w = [weights[k] for k in self._cross_workers]
            mine[:b - a] = _compress.weighted_allreduce(delta[a:b], w, codec=codec, group=self.cross_group,
                                                        feedback=feedback, finite_checked=True)
        pieces = [torch.empty(longest, dtype=torch.float32) for _ in range(self.size)]
        dist.all_gather(pieces, mine, group=self.gather_group)
        return torch.cat([pieces[i][:bounds[i + 1] - bounds[i]] for i in range(self.shards)]).to(delta.device)

    def reduce_range(self, delta: torch.Tensor, weights: Sequence[float], *, codec, feedback) -> torch.Tensor:
        """Σ_w weights[w] Δ_w of this rank's range of the model (DiLoCo's sharded state): with the
        same range of every other worker, over this rank's cross group; nothing on a rank that
        holds no range (or an empty one: so do the others with that range)."""
        if self.local_rank >= self.shards or delta.numel() == 0:
            return delta.float()
        w = [weights[k] for k in self._cross_workers]
        return _compress.weighted_allreduce(delta, w, codec=codec, group=self.cross_group, feedback=feedback,
                                            finite_checked=True)

    def average_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Averages the gradients of ``params`` over the worker's ranks (missing ones count as 0)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.worker_group)
        flat /= self.size
        offset = 0
        for p, g in zip(params, grads):
            piece = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
            if p.grad is None:
                p.grad = piece.to(p.dtype).clone()
            else:
                p.grad.copy_(piece)

    def agree(self, over: bool) -> bool:
        """True if any rank of the worker says so (its ranks must end a round together)."""
        flag = torch.tensor([1.0 if over else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.agree_group)
        return bool(flag.item() > 0)

    def least(self, value: float) -> float:
        """The smallest of the worker's ranks' ``value``s."""
        flag = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.agree_group)
        return float(flag.item())

    def all_ok(self, ok: bool, *, background: bool) -> bool:
        """True if every rank of the worker says ``ok``: over the synchronisation's group from its
        background thread, else over the training loop's."""
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.gather_group if background else self.agree_group)
        return bool(flag.item() > 0)

    def all_have(self, have: bool) -> bool:
        """True if every rank of the worker has a batch for the next step."""
        flag = torch.tensor([1.0 if have else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.agree_group)
        return bool(flag.item() > 0)

    def diverged(self, fingerprints: Sequence[float], steps: Sequence) -> list[int]:
        """Workers whose ranks reported different pseudo-gradient sums or step counts (agreed rows;
        ``steps`` may hold tuples of counts that must all agree)."""
        if self.single:
            return []
        return [k for k, members in enumerate(self.members)
                if len({fingerprints[r] for r in members}) > 1 or len({steps[r] for r in members}) > 1]

    def inter_worker_bytes(self, groups: Sequence[dist.ProcessGroup | None]) -> float:
        """This rank's bytes sent to ranks of other workers on ``groups`` (hetcomm groups only; NaN
        if none is)."""
        from hetcomm._backend import stats

        total, known = 0.0, False
        mine = self.labels[self.global_ranks.index(dist.get_rank())]
        for g in groups:
            g = dist.group.WORLD if g is None else g
            try:
                if dist.get_backend(g) != "hetcomm":
                    continue
                s = stats(g)
            except (RuntimeError, ValueError):
                continue
            known = True
            for i, sent in enumerate(s["bytes_sent"]):
                peer = s["peers"][i]
                if self.labels[self.global_ranks.index(peer)] != mine:
                    total += sent
        return total if known else math.nan
