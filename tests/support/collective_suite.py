"""The collective suite: every collective, every dtype, awkward sizes, exact expected values.

``collective_suite(rank, world_size, device)`` runs every family of checks in one job (spawning
costs seconds, a small collective microseconds), recording each with ``harness.Cases``; inputs
follow ``x[i] = (i % period) * STRIDE + rank`` (see ``values.pattern``), so that every expected
result is exactly representable whatever the reduction order, and expected values are computed
with plain torch. Run on the CPU by tests/backend/test_collectives.py (shared memory and TCP),
test_staged.py (the staged device path), transport/test_shm.py (small slots), and on CUDA by
test_cuda.py.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import Cases, default_store, is_hetcomm
from values import (assert_close_avg, assert_same, expected_reduce, inputs_for, ops_for, pattern,
                   poison_like, reduce_op_names)

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
# 16 MiB of float32 and then some: large, and not divisible by 2, 3 or 4.
LARGE = 4 * 1024 * 1024 + 3

FAMILIES = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all",
    "all_to_all_single", "all_to_all_single_uneven", "send_recv", "send_recv_tags",
    "isend_irecv_both_ways", "barrier", "async_wait", "future_then", "future_callback_collective",
    "non_contiguous",
]
NEEDS_PEER = {"send_recv", "send_recv_tags", "isend_irecv_both_ways"}


def small_sizes(world_size: int) -> list[int]:
    # empty, one element, fewer elements than ranks, not divisible by the world size, medium.
    return sorted({0, 1, max(world_size - 1, 0), 5 * world_size + 1, 1031})


def shapes(world_size: int, large: bool = True) -> list[tuple[torch.dtype, int]]:
    cases = [(dt, n) for dt in DTYPES for n in small_sizes(world_size)]
    return cases + ([(torch.float32, LARGE)] if large else [])


def name(x) -> str:
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    return reduce_op_names().get(x, str(x))


def label(*parts) -> str:
    return " ".join(name(p) if isinstance(p, (torch.dtype, R.RedOpType)) else str(p)
                    for p in parts)


def per_peer(n: int, world_size: int) -> int:
    """Collectives that take a block per peer get LARGE / world_size per peer: 16 MiB in all."""
    return LARGE // world_size if n == LARGE else n


def split_sizes(src: int, dst: int, n: int, world_size: int) -> int:
    """How many elements rank src sends to rank dst in the uneven all_to_all: zeros included."""
    if n >= 1000:
        return n // world_size + (src + 2 * dst) % 3
    return (src + 2 * dst + n) % 4


# --------------------------------------------------------------------------------------------
# The job: runs in every rank
# --------------------------------------------------------------------------------------------

_DEVICE = torch.device("cpu")  # where this rank's collectives run (set by collective_suite)


def dev(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the suite's device: the tensor itself on the CPU, a copy on a GPU."""
    return t.to(_DEVICE)


def collective_suite(rank: int, world_size: int, device: str = "cpu") -> None:
    global _DEVICE
    if device == "cuda":
        # Ranks share the GPUs there are: with one GPU, every rank runs on it.
        _DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(_DEVICE)
    else:
        _DEVICE = torch.device(device)
    cases = Cases(rank)
    for check in (_all_reduce, _all_reduce_coalesced, _broadcast, _all_gather, _all_gather_coalesced,
                  _all_gather_into_tensor, _reduce_scatter, _reduce_scatter_tensor, _reduce,
                  _gather, _scatter, _all_to_all, _all_to_all_single, _send_recv,
                  _isend_irecv_both_ways, _barrier, _async, _non_contiguous,
                  _send_recv_tags_out_of_order):
        check(cases, rank, world_size)


def _all_reduce(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws):
        for op in ([R.SUM] if n == LARGE else ops_for(dtype)):
            with cases.case("all_reduce", label(op, dtype, f"n={n}")):
                inputs = [inputs_for(op, n, dtype, r) for r in range(ws)]
                t = dev(inputs[rank].clone())
                dist.all_reduce(t, op=op)
                if op == R.AVG:
                    assert_close_avg(t, expected_reduce(inputs, R.SUM), ws)
                else:
                    assert_same(t, expected_reduce(inputs, op))
    for shape in [(), (3, 4, 5), (7, 0)]:
        with cases.case("all_reduce", label("SUM float32 shape", shape)):
            inputs = [pattern(60, torch.float32, r)[:_numel(shape)].reshape(shape)
                      for r in range(ws)]
            t = dev(inputs[rank].clone())
            dist.all_reduce(t)
            assert_same(t, expected_reduce(inputs, R.SUM))


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _all_reduce_coalesced(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        for op in (R.SUM, R.MAX):
            with cases.case("all_reduce_coalesced", label(op, dtype, f"n={n},3,{ws + 2}")):
                sizes = [n, 3, ws + 2]
                per_rank = [[pattern(s, dtype, r, salt=k) for k, s in enumerate(sizes)]
                            for r in range(ws)]
                ts = [dev(t.clone()) for t in per_rank[rank]]
                dist.all_reduce_coalesced(ts, op=op)
                for k in range(len(sizes)):
                    assert_same(ts[k], expected_reduce([p[k] for p in per_rank], op), f"tensor {k}")


def _broadcast(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws):
        for root in ([ws - 1] if n == LARGE else range(ws)):
            with cases.case("broadcast", label(dtype, f"n={n} root={root}")):
                t = dev(pattern(n, dtype, rank))
                dist.broadcast(t, src=root)
                assert_same(t, pattern(n, dtype, root))


def _all_gather(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        expected = [pattern(n, dtype, r) for r in range(ws)]
        with cases.case("all_gather", label(dtype, f"n={n} out-of-place")):
            inp = dev(expected[rank].clone())
            outs = [dev(poison_like(e)) for e in expected]
            dist.all_gather(outs, inp)
            for r in range(ws):
                assert_same(outs[r], expected[r], f"output[{r}]")
            assert_same(inp, expected[rank], "input modified")
        with cases.case("all_gather", label(dtype, f"n={n} in-place (output[rank] is input)")):
            outs = [dev(poison_like(e)) for e in expected]
            outs[rank] = dev(expected[rank].clone())
            dist.all_gather(outs, outs[rank])
            for r in range(ws):
                assert_same(outs[r], expected[r], f"output[{r}]")


def _all_gather_coalesced(cases: Cases, rank: int, ws: int) -> None:
    # output_lists[r][k] is rank r's k-th input; one tensor empty, one 2-d, one of ws + 2.
    shapes_ = [(0,), (2, 3), (ws + 2,)]
    for dtype in (torch.float32, torch.int64, torch.float16, torch.bool):
        with cases.case("all_gather_coalesced", label(dtype, f"shapes {shapes_}")):
            def mine(r: int) -> list:
                return [pattern(_numel(sh), dtype, r, salt=k).reshape(sh) for k, sh in enumerate(shapes_)]
            ins = [dev(t) for t in mine(rank)]
            outs = [[dev(poison_like(t)) for t in mine(r)] for r in range(ws)]
            dist.all_gather_coalesced(outs, ins)
            for r in range(ws):
                for k, expected in enumerate(mine(r)):
                    assert_same(outs[r][k], expected, f"output_lists[{r}][{k}]")


def _all_gather_into_tensor(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws):
        expected = torch.cat([pattern(n, dtype, r) for r in range(ws)])
        with cases.case("all_gather_into_tensor", label(dtype, f"n={n} out-of-place")):
            inp = dev(pattern(n, dtype, rank))
            out = dev(poison_like(expected))
            dist.all_gather_into_tensor(out, inp)
            assert_same(out, expected)
            assert_same(inp, pattern(n, dtype, rank), "input modified")
        if n == LARGE:
            continue
        with cases.case("all_gather_into_tensor",
                        label(dtype, f"n={n} in-place (input is the output's own chunk)")):
            out = dev(poison_like(expected))
            own = out[rank * n:(rank + 1) * n]
            own.copy_(pattern(n, dtype, rank))
            dist.all_gather_into_tensor(out, own)
            assert_same(out, expected)


def _reduce_scatter_expected(op, n, dtype, rank, ws):
    return expected_reduce([inputs_for(op, n, dtype, r, salt=rank) for r in range(ws)], op)


def _reduce_scatter(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        for op in (R.SUM, R.MIN, R.MAX):
            with cases.case("reduce_scatter", label(op, dtype, f"n={n} out-of-place")):
                ins = [dev(inputs_for(op, n, dtype, rank, salt=j)) for j in range(ws)]
                expected = _reduce_scatter_expected(op, n, dtype, rank, ws)
                out = dev(poison_like(expected))
                dist.reduce_scatter(out, ins, op=op)
                assert_same(out, expected)
        with cases.case("reduce_scatter",
                        label(R.SUM, dtype, f"n={n} in-place (output is input[rank])")):
            ins = [dev(pattern(n, dtype, rank, salt=j)) for j in range(ws)]
            dist.reduce_scatter(ins[rank], ins, op=R.SUM)
            assert_same(ins[rank], _reduce_scatter_expected(R.SUM, n, dtype, rank, ws))


def _reduce_scatter_tensor(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws):
        large, n = n == LARGE, per_peer(n, ws)
        for op in ([R.SUM] if large else [R.SUM, R.MIN, R.MAX]):
            with cases.case("reduce_scatter_tensor", label(op, dtype, f"n={n} out-of-place")):
                inp = dev(torch.cat([inputs_for(op, n, dtype, rank, salt=j) for j in range(ws)]))
                original = inp.clone()
                expected = _reduce_scatter_expected(op, n, dtype, rank, ws)
                out = dev(poison_like(expected))
                dist.reduce_scatter_tensor(out, inp, op=op)
                assert_same(out, expected)
                assert_same(inp, original, "input modified")
        if large:
            continue
        with cases.case("reduce_scatter_tensor",
                        label(R.SUM, dtype, f"n={n} in-place (output is the input's own chunk)")):
            inp = dev(torch.cat([pattern(n, dtype, rank, salt=j) for j in range(ws)]))
            own = inp[rank * n:(rank + 1) * n]
            dist.reduce_scatter_tensor(own, inp, op=R.SUM)
            assert_same(own, _reduce_scatter_expected(R.SUM, n, dtype, rank, ws))


def _reduce(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        for root in range(ws):
            for op in (R.SUM, R.MAX):
                with cases.case("reduce", label(op, dtype, f"n={n} root={root}")):
                    inputs = [inputs_for(op, n, dtype, r) for r in range(ws)]
                    t = dev(inputs[rank].clone())
                    dist.reduce(t, dst=root, op=op)
                    if rank == root:  # non-roots' buffers are unspecified after reduce
                        assert_same(t, expected_reduce(inputs, op))


def _gather(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        expected = [pattern(n, dtype, r) for r in range(ws)]
        for root in range(ws):
            with cases.case("gather", label(dtype, f"n={n} root={root}")):
                inp = dev(expected[rank].clone())
                outs = [dev(poison_like(e)) for e in expected] if rank == root else None
                dist.gather(inp, outs, dst=root)
                if rank == root:
                    for r in range(ws):
                        assert_same(outs[r], expected[r], f"gather_list[{r}]")
                assert_same(inp, expected[rank], "input modified")


def _scatter(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        for root in range(ws):
            with cases.case("scatter", label(dtype, f"n={n} root={root}")):
                chunks = ([dev(pattern(n, dtype, root, salt=j)) for j in range(ws)]
                          if rank == root else None)
                expected = pattern(n, dtype, root, salt=rank)
                out = dev(poison_like(expected))
                dist.scatter(out, chunks, src=root)
                assert_same(out, expected)


def _all_to_all(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws, large=False):
        with cases.case("all_to_all", label(dtype, f"n={n} even")):
            ins = [dev(pattern(n, dtype, rank, salt=j)) for j in range(ws)]
            expected = [pattern(n, dtype, j, salt=rank) for j in range(ws)]
            outs = [dev(poison_like(e)) for e in expected]
            dist.all_to_all(outs, ins)
            for j in range(ws):
                assert_same(outs[j], expected[j], f"from rank {j}")


def _all_to_all_single(cases: Cases, rank: int, ws: int) -> None:
    for dtype, n in shapes(ws):
        n = per_peer(n, ws)
        with cases.case("all_to_all_single", label(dtype, f"n={n} per peer")):
            inp = dev(torch.cat([pattern(n, dtype, rank, salt=j) for j in range(ws)]))
            original = inp.clone()
            expected = torch.cat([pattern(n, dtype, j, salt=rank) for j in range(ws)])
            out = dev(poison_like(expected))
            dist.all_to_all_single(out, inp)
            assert_same(out, expected)
            assert_same(inp, original, "input modified")
        if n == per_peer(LARGE, ws):
            continue
        with cases.case("all_to_all_single_uneven", label(dtype, f"n={n}")):
            send = [split_sizes(rank, j, n, ws) for j in range(ws)]
            recv = [split_sizes(j, rank, n, ws) for j in range(ws)]
            inp = dev(torch.cat([pattern(send[j], dtype, rank, salt=j) for j in range(ws)]))
            expected = torch.cat([pattern(recv[j], dtype, j, salt=rank) for j in range(ws)])
            out = dev(poison_like(expected))
            dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
            assert_same(out, expected, f"send splits {send} recv splits {recv}")


def _send_recv(cases: Cases, rank: int, ws: int) -> None:
    if ws == 1:
        return
    for dtype, n in shapes(ws, large=False):
        # One ordered pair at a time; the other ranks sit it out.
        for src in range(ws):
            for dst in range(ws):
                if src == dst or rank not in (src, dst):
                    continue
                with cases.case("send_recv", label(dtype, f"n={n} {src}->{dst}")):
                    expected = pattern(n, dtype, src, salt=dst)
                    if rank == src:
                        dist.send(dev(expected.clone()), dst=dst)
                    else:
                        buf = dev(poison_like(expected))
                        dist.recv(buf, src=src)
                        assert_same(buf, expected)
    # Tagged messages on one pair, in order.
    if rank in (0, 1):
        peer = 1 - rank
        with cases.case("send_recv", "int32 tags 3 then 4, received in the same order"):
            a, b = pattern(100, torch.int32, 0, salt=3), pattern(50, torch.int32, 0, salt=4)
            if rank == 0:
                dist.send(dev(a.clone()), dst=peer, tag=3)
                dist.send(dev(b.clone()), dst=peer, tag=4)
            else:
                got_a, got_b = dev(poison_like(a)), dev(poison_like(b))
                dist.recv(got_a, src=peer, tag=3)
                dist.recv(got_b, src=peer, tag=4)
                assert_same(got_a, a, "tag 3")
                assert_same(got_b, b, "tag 4")


def _send_recv_tags_out_of_order(cases: Cases, rank: int, ws: int) -> None:
    """Receives posted in another order than the sends, told apart by tag (gloo matches by tag).

    Runs last: a backend that rejects this may close the pair's connection, and that must not
    be mistaken for a failure of the other point-to-point checks.
    """
    if ws == 1:
        return
    if rank in (0, 1):
        peer = 1 - rank
        with cases.case("send_recv_tags",
                        "rank 0 sends tag 7 then tag 5; rank 1 receives 5 then 7"):
            a, b = pattern(100, torch.int32, 0, salt=7), pattern(50, torch.int32, 0, salt=5)
            if rank == 0:
                works = [dist.isend(dev(a.clone()), dst=peer, tag=7),
                         dist.isend(dev(b.clone()), dst=peer, tag=5)]
                for w in works:
                    w.wait()
            else:
                got_b, got_a = dev(poison_like(b)), dev(poison_like(a))
                w5 = dist.irecv(got_b, src=peer, tag=5)
                w7 = dist.irecv(got_a, src=peer, tag=7)
                w5.wait()
                w7.wait()
                assert_same(got_b, b, "tag 5")
                assert_same(got_a, a, "tag 7")


def _isend_irecv_both_ways(cases: Cases, rank: int, ws: int) -> None:
    """Every rank posts all its sends before any receive: a backend whose send blocks until the
    peer receives deadlocks here (the harness deadline turns that into a failure)."""
    if ws == 1:
        return
    peers = [p for p in range(ws) if p != rank]
    # 16 MiB sent by every rank in all, several MiB per message: more than socket buffers hold.
    for dtype, n in [(torch.float32, LARGE // (ws - 1)), (torch.float16, 1031), (torch.int8, 5),
                     (torch.bool, 33), (torch.int64, 0)]:
        with cases.case("isend_irecv_both_ways", label(dtype, f"n={n} all pairs")):
            sends = [dist.isend(dev(pattern(n, dtype, rank, salt=p)), dst=p) for p in peers]
            bufs = {p: dev(poison_like(pattern(n, dtype, p, salt=rank))) for p in peers}
            recvs = [dist.irecv(bufs[p], src=p) for p in peers]
            for w in sends + recvs:
                w.wait()
            for p in peers:
                assert_same(bufs[p], pattern(n, dtype, p, salt=rank), f"from rank {p}")
    with cases.case("isend_irecv_both_ways",
                    "batch_isend_irecv float32 n=1031 ring both directions"):
        right, left = (rank + 1) % ws, (rank - 1) % ws
        from_left = dev(poison_like(pattern(1031, torch.float32, left, salt=1)))
        from_right = dev(poison_like(pattern(1031, torch.float32, right, salt=2)))
        ops = [dist.P2POp(dist.isend, dev(pattern(1031, torch.float32, rank, salt=1)), right),
               dist.P2POp(dist.isend, dev(pattern(1031, torch.float32, rank, salt=2)), left),
               dist.P2POp(dist.irecv, from_left, left),
               dist.P2POp(dist.irecv, from_right, right)]
        if ws == 2:  # left == right: keep the two messages on the pair in a known order by tag
            ops = [dist.P2POp(o.op, o.tensor, o.peer, tag=k % 2) for k, o in enumerate(ops)]
            ops[2], ops[3] = (dist.P2POp(dist.irecv, from_left, left, tag=0),
                              dist.P2POp(dist.irecv, from_right, right, tag=1))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert_same(from_left, pattern(1031, torch.float32, left, salt=1), "from the left")
        assert_same(from_right, pattern(1031, torch.float32, right, salt=2), "from the right")


def _barrier(cases: Cases, rank: int, ws: int) -> None:
    # Rank 0 writes a key *before* entering the barrier, after a pause; every rank must see the
    # key as soon as its barrier returns. A correct barrier always passes; a barrier that does
    # not wait for rank 0 fails (almost always, thanks to the pause).
    store = default_store()
    for round_ in range(3):
        with cases.case("barrier", f"round {round_}"):
            key = f"barrier_test_{round_}"
            if rank == 0:
                time.sleep(0.3)
                store.set(key, "1")
            dist.barrier()
            assert store.check([key]), "barrier returned before rank 0 had reached it"


def _async(cases: Cases, rank: int, ws: int) -> None:
    with cases.case("async_wait", "6 outstanding all_reduce float32, waited in reverse order"):
        inputs = [[pattern(1031, torch.float32, r, salt=k) for r in range(ws)] for k in range(6)]
        ts = [dev(inputs[k][rank].clone()) for k in range(6)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        for w in reversed(works):
            w.wait()
        for k in range(6):
            assert works[k].is_completed(), f"work {k} not completed after wait()"
            assert_same(ts[k], expected_reduce(inputs[k], R.SUM), f"tensor {k}")
    with cases.case("async_wait", "outstanding broadcast, all_gather, all_reduce MAX int64"):
        b = dev(pattern(77, torch.int64, rank))
        g_in = dev(pattern(9, torch.int64, rank))
        g_out = [torch.empty(9, dtype=torch.int64, device=_DEVICE) for _ in range(ws)]
        m_inputs = [pattern(33, torch.int64, r, salt=3) for r in range(ws)]
        m = dev(m_inputs[rank].clone())
        works = [dist.broadcast(b, src=ws - 1, async_op=True),
                 dist.all_gather(g_out, g_in, async_op=True),
                 dist.all_reduce(m, op=R.MAX, async_op=True)]
        for w in works:
            w.wait()
        assert_same(b, pattern(77, torch.int64, ws - 1), "broadcast")
        for r in range(ws):
            assert_same(g_out[r], pattern(9, torch.int64, r), f"all_gather[{r}]")
        assert_same(m, expected_reduce(m_inputs, R.MAX), "all_reduce MAX")
    with cases.case("future_then", "all_reduce SUM float32 then(callback) returning a value"):
        inputs = [pattern(1031, torch.float32, r) for r in range(ws)]
        expected = expected_reduce(inputs, R.SUM)
        t = dev(inputs[rank].clone())
        fut = dist.all_reduce(t, async_op=True).get_future()
        chained = fut.then(lambda f: float(f.value()[0].double().sum()))
        assert chained.wait() == float(expected.double().sum()), "callback saw the wrong tensor"
        value = fut.wait()
        assert isinstance(value, list) and len(value) == 1, \
            f"future value {type(value)} {value!r:.80}"
        assert_same(value[0], expected, "future value")
        assert_same(t, expected, "tensor")
        late = fut.then(lambda f: f.value()[0].numel())  # on an already completed future
        assert late.wait() == 1031
    with cases.case("future_callback_collective",
                    "a then() callback that runs a blocking all_reduce (what PowerSGD does)"):
        inputs = [pattern(1031, torch.float32, r) for r in range(ws)]
        once = expected_reduce(inputs, R.SUM)
        t = dev(inputs[rank].clone())

        def reduce_again(f):
            x = f.value()[0].clone()
            dist.all_reduce(x)
            y = x.clone()
            dist.all_reduce(y, async_op=True).get_future().wait()
            return y

        result = dist.all_reduce(t, async_op=True).get_future().then(reduce_again).wait()
        assert_same(result, once * ws * ws)


def _non_contiguous(cases: Cases, rank: int, ws: int) -> None:
    # hetcomm copies non-contiguous tensors (and copies results back into them): results must be
    # right, not an error. Gloo does the same, so the expectation is backend-independent.
    for dtype in (torch.float32, torch.int64, torch.float16, torch.uint8):
        bases = [pattern(15, dtype, r).reshape(3, 5) for r in range(ws)]
        with cases.case("non_contiguous", label(dtype, "all_reduce SUM on a transposed 3x5")):
            mine = dev(bases[rank].clone())
            t = mine.t()
            assert not t.is_contiguous()
            dist.all_reduce(t)
            expected = expected_reduce(bases, R.SUM)
            assert_same(t, expected.t(), "the transposed view")
            assert_same(mine, expected, "the storage under the view")
        if not is_hetcomm():
            # Gloo (torch 2.13) broadcasts numel() elements from data_ptr() of a strided slice,
            # i.e. the wrong elements, silently: a reference bug, not one to hold tests to.
            continue
        with cases.case("non_contiguous", label(dtype, "broadcast of a strided slice x[::2]")):
            full = dev(pattern(20, dtype, rank))
            view = full[::2]
            dist.broadcast(view, src=0)
            assert_same(view, pattern(20, dtype, 0)[::2], "the slice")
            assert_same(full[1::2], pattern(20, dtype, rank)[1::2], "elements between the slice")
        with cases.case("non_contiguous", label(dtype, "all_gather of a transposed input")):
            outs = [torch.empty(5, 3, dtype=dtype, device=_DEVICE) for _ in range(ws)]
            dist.all_gather(outs, dev(bases[rank]).t())
            for r in range(ws):
                assert_same(outs[r], bases[r].t().contiguous(), f"output[{r}]")


def family_params(world_sizes) -> list:
    """(world size, family) pairs as pytest params with ids like "3-all_reduce"; the
    point-to-point families need a peer."""
    return [pytest.param(ws, f, id=f"{ws}-{f}") for ws in world_sizes for f in FAMILIES
            if ws > 1 or f not in NEEDS_PEER]
