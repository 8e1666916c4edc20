"""State sharded over a worker's ranks, moved from one layout to another between generations of
an elastic run: the members that hold a range of the run's state send it to the members whose
share in the next generation covers it, point to point over the generation's group, in chunks,
with no rank ever holding more than its old share, its new share and a few chunks.

A *share* is what rank ``index`` of a worker of ``shards`` ranks keeps (`diloco.shard.Layout`):
range ``index`` of every fragment of the flat model (fragment f: elements [a_f, b_f), cut in
``shards`` contiguous ranges by `shard_bounds`); ``shards == 1`` is the whole state, ``index``
None nothing. Its elements lie end to end, in the model's order, as the layout's pieces do.

`plan` says who sends what: every range a destination needs comes from the sources whose share
covers it (its own, when it has it: a local copy), from all of them at once in parts when
several hold it, so that a joiner's downlink, not one holder's uplink, sets the pace.
It is computed alike on every rank from the same inputs, so every rank posts the same sends and
receives. `move` carries one field of the state (the global parameters, a tensor of the outer
optimizer's state) along a plan.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hetcomm.train.diloco.shard import CHUNK, _copy_range, _offsets
from hetcomm.train.workers import shard_bounds

Fragments = Sequence[tuple[int, int, int, int]]    # (first tensor, end tensor, first element, end element)
# Chunks in a window: every rank posts the sends and receives of the same window of the plan, then
# waits for the window before (two in flight; no rank waits for a message another posts later).
WINDOW = 16


def intervals(whole: Fragments, shards: int, index: int | None) -> list[tuple[int, int]]:
    """The flat model's element ranges [lo, hi) of a share, in order (empty ones left out)."""
    if index is None:
        return []
    if not 0 <= index < shards:
        raise ValueError(f"share {index} of {shards}")
    out = []
    for _, _, a, b in whole:
        bounds = shard_bounds(b - a, shards)
        lo, hi = a + bounds[index], a + bounds[index + 1]
        if hi > lo:
            out.append((lo, hi))
    return out


class Share:
    """A share's element ranges and where each lies in the share's own (local) order."""

    def __init__(self, whole: Fragments, shards: int, index: int | None) -> None:
        self.ranges = intervals(whole, shards, index)
        self._starts = [lo for lo, _ in self.ranges]
        self._local = _offsets(hi - lo for lo, hi in self.ranges)
        self.size = self._local[-1]

    def local(self, lo: int, hi: int) -> int:
        """Where [lo, hi), which lies inside one of the share's ranges, starts in the share."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or hi > self.ranges[i][1]:
            raise ValueError(f"elements [{lo}, {hi}) are not in this share")
        return self._local[i] + lo - self.ranges[i][0]

    def flat(self, at: int) -> int:
        """The flat model's element at position ``at`` of the share (``0 <= at < size``)."""
        if not 0 <= at < self.size:
            raise ValueError(f"position {at} is not in this share of {self.size} elements")
        i = bisect.bisect_right(self._local, at) - 1
        return self.ranges[i][0] + at - self._local[i]


def plan(sources: dict[int, tuple[int, int | None]], dests: dict[int, tuple[int, int | None]],
         whole: Fragments, split: int = CHUNK) -> list[tuple[int, int, int, int]]:
    """Moves (source rank, destination rank, lo, hi), each inside one range of its source's share
    and one of its destination's: every destination's share (``dests``: rank -> (shards,
    index)) from the shares of ``sources`` (the same). A destination copies what it holds itself
    (a move from another stops where the destination's own range begins); otherwise what it
    needs of a range comes from every source that holds that range at once, in contiguous parts
    of at least ``split`` elements (one part, from one source, when shorter), and the sources
    take turns by destination for the first part. Raises ValueError when no source holds
    elements some destination needs."""
    by_layout: dict[tuple[int, int | None], list[int]] = {}
    for rank in sorted(sources):
        by_layout.setdefault(sources[rank], []).append(rank)
    # Every source range once, with the ranks that hold it: (lo, hi, ranks).
    held = sorted((lo, hi, ranks) for layout, ranks in by_layout.items() for lo, hi in intervals(whole, *layout))
    starts = [lo for lo, _, _ in held]
    moves = []
    for d in sorted(dests):
        own = sorted(lo for lo, _, ranks in held if d in ranks)
        for x, y in intervals(whole, *dests[d]):
            turn = 0
            while x < y:
                # The ranges that hold x; the one that reaches furthest (fewest moves).
                i = bisect.bisect_right(starts, x)
                cover = [h for h in held[:i] if h[1] > x]
                if not cover:
                    missing = min((lo for lo in starts if lo > x), default=y)
                    raise ValueError(f"no member holds elements [{x}, {min(missing, y)}) of the run's state")
                lo, hi, ranks = max(cover, key=lambda h: (d in h[2], h[1]))
                end = min(hi, y)
                if d in ranks:
                    moves.append((d, d, x, end))
                else:
                    k = bisect.bisect_right(own, x)
                    if k < len(own):
                        end = min(end, own[k])
                    # (several sources at once: the destination's downlink, not one uplink, sets the pace)
                    parts = max(1, min(len(ranks), (end - x) // max(1, split)))
                    for i in range(parts):
                        moves.append((ranks[(d + turn + i) % len(ranks)], d, x + (end - x) * i // parts,
                                      x + (end - x) * (i + 1) // parts))
                x, turn = end, turn + 1
    return moves


def move(moves: Sequence[tuple[int, int, int, int]], *, dtype: torch.dtype, source: Share | None,
         held: Sequence[torch.Tensor] | None, dest: Share | None, into: Sequence[torch.Tensor] | None,
         group: dist.ProcessGroup | None = None, chunk: int = CHUNK,
         landed: Callable[[int, int, torch.Tensor], None] | None = None) -> None:
    """Collective over ``group`` (every rank with the same ``moves``, `plan`; ranks are the
    group's): this rank sends from ``held`` (its old share's tensors, end to end in the order of
    ``source``) what the moves take from it, and writes into ``into`` (its new share's, in the
    order of ``dest``) what they bring it, as ``dtype``, in chunks of at most ``chunk`` elements.
    ``landed(lo, at, values)``: called with every chunk written (its first element in the flat
    model, and in the new share), while the next chunks are on the wire: every element of the
    new share passes through it once."""
    me = dist.get_rank(group)
    held_at = _offsets(t.numel() for t in held) if held is not None else None
    into_at = _offsets(t.numel() for t in into) if into is not None else None
    # The moves' chunks taken in turn (the first chunk of every move, then the second...), so that
    # every pair of ranks has chunks in each window: the sources of a destination send at once.
    chunks = [[(s, d, x, min(x + chunk, hi)) for x in range(lo, hi, chunk)] for s, d, lo, hi in moves]
    pieces = [c[k] for k in range(max(map(len, chunks), default=0)) for c in chunks if k < len(c)]

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    def post(window) -> tuple[list, list]:
        works, arrived = [], []
        for s, d, x, y in window:
            if s == me:
                buf = torch.empty(y - x, dtype=dtype)
                at = source.local(x, y)
                _copy_range(held, held_at, at, at + y - x, buf, into=False)
                if d == me:
                    arrived.append((x, y, buf))
                else:
                    works.append(dist.isend(buf, peer(d), group=group))
            elif d == me:
                buf = torch.empty(y - x, dtype=dtype)
                works.append(dist.irecv(buf, peer(s), group=group))
                arrived.append((x, y, buf))
        return works, arrived

    def land(works, arrived) -> None:
        for work in works:
            work.wait()
        for x, y, buf in arrived:
            at = dest.local(x, y)
            _copy_range(into, into_at, at, at + y - x, buf, into=True)
            if landed is not None:
                landed(x, at, buf)

    # Two windows in flight: the next is posted before the last is waited for, so that the links
    # do not drain between windows (every rank posts them in the same order: a rank waits only for
    # what every peer posted before its own wait).
    last = None
    for w in range(0, len(pieces), WINDOW):
        posted = post(pieces[w:w + WINDOW])
        if last is not None:
            land(*last)
        last = posted
    if last is not None:
        land(*last)
