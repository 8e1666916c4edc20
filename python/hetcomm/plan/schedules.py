"""The schedules the engine runs, as data: `Plan` (the ring, and optionally a `SitePlan`).

A `Plan` is what the engine's ``set_plan(order, shares)`` takes: ``order[p]`` is the rank at ring
position p (it sends to ``order[p+1]``, indices mod P) and ``shares[r]`` the fraction of the
buffer rank r owns (fully reduces during the reduce-scatter). A `SitePlan` is what
``set_site_plan`` takes: the hierarchical schedule over sites or hosts
(``csrc/algorithms/hierarchical.h``; its cost model is derived in `hetcomm.plan.hierarchy`).

Both know the load they put on every link, in bytes per byte of buffer (`ring_loads`,
`SitePlan.load_arrays`): the cost model (`hetcomm.plan.cost`) turns loads into time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # only annotates Plan.topology; levels imports nothing from here
    from hetcomm.plan.levels import Topology


def shares_to_counts(total: int, shares: Sequence[float]) -> list[int]:
    """Python twin of ``sharesToCounts`` (csrc/algorithms/ring_schedule.cc), same float operations.

    ``exact_i = total * (s_i / sum(s))``; each gets ``floor(exact_i)`` (capped so the running sum
    never exceeds ``total``); the rest goes one element at a time in order of decreasing
    fractional part (stable: ties to the lower index), cycling, skipping zero shares.
    """
    if int(total) != total or total < 0:
        raise ValueError(f"hetcomm planner: element count must be a non-negative integer, got {total!r}")
    total = int(total)
    if not len(shares):
        raise ValueError("hetcomm planner: no shares")
    ssum = 0.0
    for s in shares:
        if not (s >= 0 and math.isfinite(s)):
            raise ValueError("hetcomm planner: shares must be finite and non-negative")
        ssum += s
    if not ssum > 0:
        raise ValueError("hetcomm planner: shares sum to zero")
    counts = [0] * len(shares)
    remainders: list[tuple[float, int]] = []
    assigned = 0
    for i, s in enumerate(shares):
        exact = float(total) * (s / ssum)
        fl = math.floor(exact)
        counts[i] = min(int(fl), total - assigned)
        assigned += counts[i]
        remainders.append((exact - fl, i))
    remainders.sort(key=lambda item: -item[0])  # stable, like std::stable_sort with '>'
    k = 0
    while assigned < total:
        idx = remainders[k][1]
        if shares[idx] > 0:
            counts[idx] += 1
            assigned += 1
        k = (k + 1) % len(remainders)
    return counts


def ring_loads(order: Sequence[int], shares: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src, dst, load)`` of every ring link, load in bytes per byte of buffer.

    The reduce-scatter sends every chunk around the ring once, starting at its owner's successor,
    so link A -> B carries every chunk except A's own; the all-gather starts each chunk at its
    owner, so A -> B carries every chunk except B's own: ``2 - o_A - o_B`` (shares normalised).
    """
    o = np.asarray(shares, dtype=np.float64)
    o = o / math.fsum(o)
    src = np.asarray(order, dtype=np.int64)
    dst = np.roll(src, -1)
    return src, dst, 2.0 - o[src] - o[dst]


@dataclass(frozen=True)
class SitePlan:
    """The engine's ``set_site_plan`` arguments (derivation in `hetcomm.plan.hierarchy`).

    * ``sites``: each site's ranks in the order of its ring;
    * ``blocks``: the buffer is cut into blocks laid out back to back; ``blocks[b][s]`` is block
      b's owner in site s, and ``block_shares[b]`` its fraction of the buffer;
    * ``site_shares``: every block is cut again into one piece per site; piece k
      (``site_shares[k]`` of the block) is reduced across sites by the block's owner in site k;
    * ``local_inner``: the sites are the group's hosts and the steps inside each run through
      shared memory (`hetcomm.plan.hierarchy.host_plan`); the intra-host links then carry nothing.
    * ``hosts`` and ``holders`` (three levels, `hetcomm.plan.hierarchy.three_level_plan`): the
      hosts inside the sites (each host's ranks ascending) and ``holders[b][h]``, the rank of host
      h that holds block b after the host's reduce-scatter (shared memory); block b's owner in a
      site is its holder in one host of that site, to which the site's other holders send it.
    """

    sites: tuple[tuple[int, ...], ...]
    blocks: tuple[tuple[int, ...], ...]
    block_shares: tuple[float, ...]
    site_shares: tuple[float, ...]
    min_bytes: int = 0
    segment_bytes: int = 0
    local_inner: bool = False
    hosts: tuple[tuple[int, ...], ...] = ()
    holders: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        sites = tuple(tuple(int(r) for r in site) for site in self.sites)
        blocks = tuple(tuple(int(r) for r in owners) for owners in self.blocks)
        P = sum(len(s) for s in sites)
        if not sites or sorted(r for s in sites for r in s) != list(range(P)) or any(not s for s in sites):
            raise ValueError(f"hetcomm site plan: sites {sites} must partition the ranks 0..{P - 1}")
        site_of = np.empty(P, dtype=np.int64)
        for k, s in enumerate(sites):
            site_of[list(s)] = k
        if not blocks or len(blocks) != len(self.block_shares):
            raise ValueError(f"hetcomm site plan: {len(blocks)} blocks and {len(self.block_shares)} block shares")
        owners = np.asarray(blocks, dtype=np.int64) if all(len(b) == len(sites) for b in blocks) else None
        if owners is None or owners.min() < 0 or owners.max() >= P or \
                not (site_of[owners] == np.arange(len(sites))[None, :]).all():
            bad = next(b for b, o in enumerate(blocks)
                       if len(o) != len(sites) or any(not 0 <= r < P or site_of[r] != k for k, r in enumerate(o)))
            raise ValueError(f"hetcomm site plan: block {bad}'s owners {blocks[bad]} must be one rank of each site, "
                             "in site order")
        if len(self.site_shares) != len(sites):
            raise ValueError(f"hetcomm site plan: {len(self.site_shares)} site shares for {len(sites)} sites")
        for what, shares in (("block", self.block_shares), ("site", self.site_shares)):
            if not all(math.isfinite(float(x)) and float(x) >= 0 for x in shares) or not sum(shares) > 0:
                raise ValueError(f"hetcomm site plan: {what} shares must be finite, >= 0 and not all zero")
        hosts = tuple(tuple(int(r) for r in host) for host in self.hosts)
        holders = tuple(tuple(int(r) for r in held) for held in self.holders)
        if hosts or holders:
            self._check_hosts(hosts, holders, blocks, site_of)
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "holders", holders)
        object.__setattr__(self, "sites", sites)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "block_shares", tuple(float(x) for x in self.block_shares))
        object.__setattr__(self, "site_shares", tuple(float(x) for x in self.site_shares))

    def _check_hosts(self, hosts, holders, blocks, site_of: np.ndarray) -> None:
        P = len(site_of)
        if self.local_inner:
            raise ValueError("hetcomm site plan: local_inner and hosts exclude each other (hosts are three levels)")
        if sorted(r for h in hosts for r in h) != list(range(P)) or any(list(h) != sorted(h) or not h for h in hosts):
            raise ValueError(f"hetcomm site plan: hosts {hosts} must partition the ranks 0..{P - 1}, each ascending")
        host_of = np.empty(P, dtype=np.int64)
        for k, h in enumerate(hosts):
            host_of[list(h)] = k
            if len({int(site_of[r]) for r in h}) != 1:
                raise ValueError(f"hetcomm site plan: host {k} ({h}) spans several sites")
        if len(holders) != len(blocks) or any(len(held) != len(hosts) for held in holders):
            raise ValueError(f"hetcomm site plan: holders must name one rank of each host for each of the "
                             f"{len(blocks)} blocks")
        for b, held in enumerate(holders):
            if any(not 0 <= r < P or host_of[r] != k for k, r in enumerate(held)):
                raise ValueError(f"hetcomm site plan: block {b}'s holders {held} must be one rank of each host")
            if b and any(r < prev for r, prev in zip(held, holders[b - 1])):
                raise ValueError(f"hetcomm site plan: each rank's blocks must be contiguous, in its host's rank "
                                 f"order (block {b})")
            if any(held[host_of[r]] != r for r in blocks[b]):
                raise ValueError(f"hetcomm site plan: block {b}'s owners {blocks[b]} must hold it in their hosts")

    @property
    def three_level(self) -> bool:
        return bool(self.hosts)

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.sites)

    def site_of(self) -> list[int]:
        out = [0] * self.world_size
        for k, site in enumerate(self.sites):
            for r in site:
                out[r] = k
        return out

    def chunk_shares(self) -> list[float]:
        """Each rank's fraction of the buffer in its site's ring (its blocks' shares summed)."""
        return self._chunks.tolist()

    @functools.cached_property
    def _chunks(self) -> np.ndarray:
        x = np.asarray(self.block_shares) / math.fsum(self.block_shares)
        out = np.zeros(self.world_size)
        np.add.at(out, np.asarray(self.blocks, dtype=np.int64), x[:, None])
        return out

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, load)`` per directed link the schedule uses, in bytes per byte of buffer.

        Ring link a -> b inside a site of m >= 2 ranks: ``2 - o_a - o_b`` (not with
        ``local_inner`` or hosts). Link between owners r (site s) and q (site t) of block b: ``x_b (w_s +
        w_t)`` each way, summed over the blocks they both own. Three levels: the holder of block b
        in a host and b's owner in the site, when they differ, carry ``x_b`` each way (the site
        reduce one way, the final block the other)."""
        return self._loads

    @functools.cached_property
    def _loads(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        S = len(self.sites)
        P = self.world_size
        o = self._chunks
        srcs, dsts, vals = [], [], []
        if self.hosts:
            held = np.asarray(self.holders, dtype=np.int64)                  # (B, H)
            owners = np.asarray(self.blocks, dtype=np.int64)                 # (B, S)
            site_of = np.asarray(self.site_of())
            x = np.asarray(self.block_shares) / math.fsum(self.block_shares)
            for h, host in enumerate(self.hosts):
                owner = owners[:, site_of[host[0]]]
                away = held[:, h] != owner
                for a, b in ((held[away, h], owner[away]), (owner[away], held[away, h])):
                    srcs.append(a)
                    dsts.append(b)
                    vals.append(x[away])
        elif not self.local_inner:
            for site in self.sites:
                if len(site) > 1:
                    a = np.asarray(site, dtype=np.int64)
                    b = np.roll(a, -1)
                    srcs.append(a)
                    dsts.append(b)
                    vals.append(2.0 - o[a] - o[b])
        x = np.asarray(self.block_shares) / math.fsum(self.block_shares)
        w = np.asarray(self.site_shares) / math.fsum(self.site_shares)
        owners = np.asarray(self.blocks, dtype=np.int64)
        for s in range(S):
            for t in range(S):
                if s != t:
                    srcs.append(owners[:, s])
                    dsts.append(owners[:, t])
                    vals.append(x * (w[s] + w[t]))
        key = np.concatenate(srcs) * P + np.concatenate(dsts)
        uniq, inverse = np.unique(key, return_inverse=True)
        load = np.zeros(len(uniq))
        np.add.at(load, inverse, np.concatenate(vals))
        return uniq // P, uniq % P, load

    def link_loads(self) -> dict[tuple[int, int], float]:
        """`load_arrays` as a dict ``{(src, dst): load}``."""
        src, dst, load = self.load_arrays()
        return {(int(a), int(b)): float(v) for a, b, v in zip(src, dst, load)}

    def reduce_loads(self) -> list[float]:
        """Bytes each rank reduces per byte of buffer: the site ring's ``1 - o_pred`` plus
        ``(S - 1) w_s o_r`` from the other sites; three levels: ``(k_s - 1) o_r`` from the site's
        other k_s - 1 hosts instead of the ring. (With local_inner or hosts the host's
        reduce-scatter adds ``(m - 1)`` times the rank's held part in shared memory, at memory
        speed, which no link rate describes: left out like its copies.)"""
        S = len(self.sites)
        wt = math.fsum(self.site_shares)
        o = self._chunks
        out = np.zeros(self.world_size)
        for k, site in enumerate(self.sites):
            a = np.asarray(site, dtype=np.int64)
            if self.hosts:
                k_s = sum(1 for h in self.hosts if h[0] in site)
                ring = (k_s - 1) * o[a]
            else:
                ring = 1.0 - o[np.roll(a, 1)] if len(site) > 1 and not self.local_inner else 0.0
            out[a] = ring + (S - 1) * self.site_shares[k] / wt * o[a]
        return out.tolist()


@dataclass(frozen=True)
class Plan:
    """A ring order and per-rank shares, as the engine's ``set_plan(order, shares)`` takes them.

    ``order[p]``: the rank at ring position p (it sends to ``order[p+1]``). ``shares[r]``: rank r's
    fraction of the buffer. ``predicted_bw_seconds_per_byte``: ``max(T_bw, T_reduce) / N`` under the
    model the plan was made for (``None`` for a plan built without one); its inverse is the
    predicted algorithm bandwidth for large messages. ``min_bytes``: smaller allreduces use
    uniform shares instead. ``segment_bytes``: the largest pipeline segment for this plan (the engine's
    adaptive size applies below it; 0: no cap). ``sites``: the hierarchical schedule for allreduces of at least
    ``sites.min_bytes``, and ``topology`` the sites and hosts it was made for; None: the ring at
    every size.
    """

    order: tuple[int, ...]
    shares: tuple[float, ...]
    predicted_bw_seconds_per_byte: Optional[float] = None
    min_bytes: int = 0
    segment_bytes: int = 0
    sites: Optional[SitePlan] = None
    topology: Optional["Topology"] = None

    def __post_init__(self) -> None:
        order = tuple(int(r) for r in self.order)
        shares = tuple(float(s) for s in self.shares)
        P = len(order)
        if P == 0 or sorted(order) != list(range(P)):
            raise ValueError(f"hetcomm planner: plan order {order} is not a permutation of 0..{P - 1}")
        if len(shares) != P:
            raise ValueError(f"hetcomm planner: a plan for {P} ranks needs {P} shares, got {len(shares)}")
        for r, s in enumerate(shares):
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"hetcomm planner: share of rank {r} must be finite and >= 0, got {s!r}")
        if not sum(shares) > 0:
            raise ValueError("hetcomm planner: plan shares must not all be zero")
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "shares", shares)

    @property
    def world_size(self) -> int:
        return len(self.order)

    @property
    def is_uniform(self) -> bool:
        """True for the engine's default plan: identity order, equal shares."""
        return (self.order == tuple(range(self.world_size)) and len(set(self.shares)) == 1
                and self.sites is None)

    def counts(self, numel: int) -> list[int]:
        """Elements owned by each rank (indexed by rank) for a buffer of ``numel`` elements.

        Bit-for-bit what the engine computes: ``sharesToCounts`` applied to the shares in
        ring-position order (floor, then the remainder by largest fractional part, ties to the
        lower *position*, never to a zero share), mapped back to ranks. Sums to ``numel``.
        """
        by_position = shares_to_counts(numel, [self.shares[r] for r in self.order])
        out = [0] * self.world_size
        for pos, rank in enumerate(self.order):
            out[rank] = by_position[pos]
        return out
