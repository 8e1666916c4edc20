"""Sharded state moved between layouts (`hetcomm.train.elastic.reshard`): plans against
hand-computed cases, and moves over 4 ranks against the whole state they are shares of."""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from hetcomm.train.elastic.reshard import Share, intervals, plan

pytestmark = pytest.mark.usefixtures("backend_importable")

# A model of tensors of 10, 7 and 13 elements in two fragments: tensors 0-1 (17), tensor 2 (13).
SIZES = [10, 7, 13]
WHOLE = [(0, 2, 0, 17), (2, 3, 17, 30)]


def test_a_share_is_its_range_of_every_fragment():
    assert intervals(WHOLE, 2, 0) == [(0, 9), (17, 24)]
    assert intervals(WHOLE, 2, 1) == [(9, 17), (24, 30)]
    assert intervals(WHOLE, 1, 0) == [(0, 17), (17, 30)]
    assert intervals(WHOLE, 3, None) == []
    share = Share(WHOLE, 2, 1)
    assert share.size == 14 and share.local(9, 12) == 0 and share.local(24, 30) == 8
    with pytest.raises(ValueError):
        share.local(8, 10)


def test_plans_by_hand():
    pairs = {0: (2, 0), 1: (2, 1), 2: (2, 0), 3: (2, 1)}           # two workers of two ranks
    # The same layout again: every rank copies its own share.
    assert plan(pairs, pairs, WHOLE) == [(0, 0, 0, 9), (0, 0, 17, 24), (1, 1, 9, 17), (1, 1, 24, 30),
                                         (2, 2, 0, 9), (2, 2, 17, 24), (3, 3, 9, 17), (3, 3, 24, 30)]
    # One worker of four, from the pairs. Fragment 0's ranges of four are [0, 5) [5, 9) [9, 13)
    # [13, 17), fragment 1's [17, 21) [21, 24) [24, 27) [27, 30). Ranks 0 and 3 hold theirs (in
    # range 0, resp. 1, of the pairs); rank 1's come from range 0 (ranks 0 and 2: rank 2's turn),
    # rank 2's from range 1 (ranks 1 and 3: rank 1's).
    four = {r: (4, r) for r in range(4)}
    assert plan(pairs, four, WHOLE) == [(0, 0, 0, 5), (0, 0, 17, 21), (2, 1, 5, 9), (2, 1, 21, 24),
                                        (1, 2, 9, 13), (1, 2, 24, 27), (3, 3, 13, 17), (3, 3, 27, 30)]
    # Whole state for a joiner (rank 3 holds nothing) from one worker of two: both ranks send.
    moves = plan({0: (2, 0), 1: (2, 1)}, {3: (1, 0)}, WHOLE)
    assert moves == [(0, 3, 0, 9), (1, 3, 9, 17), (0, 3, 17, 24), (1, 3, 24, 30)]
    # Ranges that two sources hold, in parts of at least 4 elements: half from each, the first
    # half from the source whose turn it is (destination 2 of two holders: the first, rank 0).
    assert plan({0: (1, 0), 1: (1, 0)}, {2: (1, 0)}, WHOLE, split=4) == \
        [(0, 2, 0, 8), (1, 2, 8, 17), (0, 2, 17, 23), (1, 2, 23, 30)]
    # Shorter than two parts: one source ([24, 30), six elements, from rank 1 alone; [9, 17) in
    # two parts from ranks 1 and 3).
    assert plan(pairs, {4: (2, 1)}, WHOLE, split=4) == [(1, 4, 9, 13), (3, 4, 13, 17), (1, 4, 24, 30)]
    # A range nobody holds.
    with pytest.raises(ValueError, match=r"elements \[9, 17\)"):
        plan({0: (2, 0)}, {1: (1, 0)}, WHOLE)


def test_every_element_comes_from_a_rank_that_holds_it_once():
    layouts = [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (4, 3), (4, None)]
    for old, split in (({0: (2, 0), 1: (2, 1), 2: (3, 0), 3: (3, 1), 4: (3, 2)}, None), ({5: (1, 0)}, None),
                       ({0: (2, 0), 1: (2, 1), 2: (2, 0), 3: (1, 0)}, 1), ({0: (2, 0), 1: (2, 1), 2: (2, 0)}, 3)):
        for d, new in enumerate(layouts):
            moves = plan(old, {d: new}, WHOLE, **({} if split is None else {"split": split}))
            # the moves, in order, are the destination's elements in order, each once
            assert [e for _, _, x, y in moves for e in range(x, y)] == \
                [e for lo, hi in intervals(WHOLE, *new) for e in range(lo, hi)]
            for s, dest, x, y in moves:
                assert dest == d and x < y
                assert any(lo <= x and y <= hi for lo, hi in intervals(WHOLE, *old[s])), (s, x, y)


def reshard_ranks(rank: int, world: int) -> list:
    from hetcomm.train.elastic.reshard import Share, move, plan

    whole = torch.arange(30, dtype=torch.float64) * 1.5 - 7.0
    fields = [(torch.float64, whole), (torch.float32, (-whole).float())]

    def pieces(share: Share, values: torch.Tensor) -> list[torch.Tensor]:
        # a share kept as pieces cut at the tensors' boundaries, as a `Layout` keeps them
        flat = torch.cat([values[lo:hi] for lo, hi in share.ranges]) if share.ranges else values[:0].clone()
        return [flat[:3].clone(), flat[3:].clone()] if flat.numel() > 3 else [flat.clone()]

    out = []
    cases = [
        ({0: (2, 0), 1: (2, 1), 2: (2, 0), 3: (2, 1)}, {r: (4, r) for r in range(4)}),    # pairs -> one of four
        ({0: (2, 0), 1: (2, 1), 2: (2, 0), 3: (2, 1)}, {r: (1, 0) for r in range(4)}),    # -> whole everywhere
        ({2: (2, 0), 3: (2, 1)}, {0: (3, 0), 1: (3, 1), 2: (3, 2), 3: (3, None)}),       # survivors -> three
        ({1: (1, 0)}, {0: (2, 0), 1: (2, 1), 2: (2, 0), 3: (2, 1)}),                     # one whole -> pairs
    ]
    # (chunks of 4 in one window; chunks of 1 in windows of 16, two in flight, from ranges split
    # over every source that holds them)
    for (old, new), (chunk, split) in [(case, how) for case in cases for how in ((4, None), (1, 2))]:
        moves = plan(old, new, WHOLE, **({} if split is None else {"split": split}))
        got = []
        for dtype, values in fields:
            src = Share(WHOLE, *old[rank]) if rank in old else None
            dst = Share(WHOLE, *new[rank]) if rank in new else None
            held = pieces(src, values) if src is not None else None
            into = [torch.full_like(t, float("nan")) for t in pieces(dst, values)] if dst is not None else None
            # every element of the new share passes through ``landed`` once, at its flat and
            # share positions, with its value
            seen = torch.zeros(dst.size if dst is not None else 0, dtype=torch.int64)
            hooked = []

            def landed(lo, at, chunk_values):
                seen[at:at + chunk_values.numel()] += 1
                hooked.append(at == dst.local(lo, lo + chunk_values.numel())
                              and torch.equal(chunk_values, values[lo:lo + chunk_values.numel()]))
            move(moves, dtype=dtype, source=src, held=held, dest=dst, into=into, chunk=chunk, landed=landed)
            want = torch.cat([values[lo:hi] for lo, hi in dst.ranges]) if dst is not None and dst.ranges else None
            have = torch.cat([t.reshape(-1) for t in into]) if into is not None and dst.ranges else None
            got.append(want is None and have is None or (want is not None and have is not None
                                                         and torch.equal(want, have)))
            got.append(all(hooked) and bool((seen == 1).all()))
        out.append(got)
    return out


def test_moves_give_every_rank_its_new_share_exactly():
    for rank, per_case in enumerate(run_ranks(4, reshard_ranks, timeout=120)):
        assert all(all(fields) for fields in per_case), (rank, per_case)


def test_a_destination_copies_what_it_holds_even_beside_a_whole_holder():
    # rank 2 holds the second half of each fragment ([9, 17), [24, 30)); rank 0 the whole state
    moves = plan({0: (1, 0), 1: (2, 0), 2: (2, 1)}, {2: (1, 0)}, WHOLE)
    assert moves == [(0, 2, 0, 9), (2, 2, 9, 17), (0, 2, 17, 24), (2, 2, 24, 30)]


def test_announced_optimizer_keys_and_dtypes_from_a_peer_are_checked_before_use():
    """What the first holder announces of the outer optimizer's state (its keys, their kinds and
    dtypes) comes from a peer: a malformed list, a key twice, a dtype outside the fixed set (a
    name that `getattr(torch, ...)` would turn into a function), or one that disagrees with what
    this holder keeps, is a reason to refuse, named; `_dtype` never returns what is not a dtype."""
    from hetcomm.train.elastic.sharded import _MAX_KEYS, _bad_keys, _dtype

    p = torch.zeros(3)
    state = {p: {"exp_avg": torch.zeros(3), "step": torch.tensor(2.0)}}
    good = [["exp_avg", "tensor", "torch.float32"], ["step", "scalar", "torch.float32"]]
    assert _bad_keys(good, state, [p]) is None
    for keys, why in [("exp_avg", "malformed"), ([["a", "tensor"]], "malformed"),
                      ([["k", "tensor", "torch.float32"]] * (_MAX_KEYS + 1), "malformed"),
                      ([good[0], good[0]], "twice"), ([["x", "tensor", "load"]], "announced 'x'"),
                      ([["x", "tensor", "torch.Tensor"]], "announced 'x'"), ([["x", "code", "int"]], "announced 'x'"),
                      ([["exp_avg", "tensor", "torch.float64"]], "other than a torch.float64 tensor"),
                      ([["exp_avg", "scalar", "torch.float32"]], "other than one value")]:
        problem = _bad_keys(keys, state, [p])
        assert problem is not None and why in problem, (keys, problem)
    assert _dtype("torch.bfloat16") is torch.bfloat16
    for name in ["load", "torch.load", "Tensor", "", None, 3]:
        with pytest.raises(ValueError, match="as a dtype"):
            _dtype(name)
