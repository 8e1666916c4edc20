"""The compressed weighted allreduce: quantise once, sum in fp32 at the chunk owner, quantise once more.

DiLoCo synchronises pseudo-gradients ``Δ_r`` (one flat fp32 tensor per rank, on the CPU or a GPU:
the codecs run there, and only the encoded bytes travel through the CPU) as a weighted sum
``Σ_r w_r Δ_r`` with weights every rank agreed on beforehand::

    reduced = weighted_allreduce(delta, weights, codec="int8", group=group, feedback=ErrorFeedback())

The result is bit-identical on every rank and within `reduced_error_bound` of the exact sum.
`chunk_counts` is the chunk layout on a group. The formats are `hetcomm.compress.codecs`.

The reduction step by step, its traffic and its checks: docs/compression.md#the-reduction,
docs/compression.md#traffic, docs/compression.md#checks; its error bound:
docs/compression.md#error-of-the-reduced-result.
"""
from __future__ import annotations

import contextlib
import hashlib
import struct
import threading
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from hetcomm._backend import backend_or_none, get_plan
from hetcomm.compress.codecs import (_PREFIX, Codec, ErrorFeedback, _as_codec, _check_weights, _equal_counts,
                                     _flat_fp32, _fp32_value, _offsets)


def chunk_counts(n: int, group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """Elements of an n-element vector owned by each rank of ``group`` (indexed by group rank).

    On a hetcomm group: ``hetcomm.get_plan(group).counts(n)``, the plan's shares (indexed by rank)
    apportioned exactly as the engine does; elsewhere equal chunks. Chunks are contiguous and laid
    out in rank order. The plan's ``min_bytes`` (below which the engine's ring falls back to
    uniform shares) does not apply here. Not a collective; every rank computes the same list.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{_PREFIX}: n must be a non-negative int, got {n!r}")
    world_size = dist.get_world_size(group)
    if backend_or_none(group) is not None:
        plan = get_plan(group)
        if plan.world_size != world_size:
            raise RuntimeError(f"{_PREFIX}: the group's plan is for {plan.world_size} ranks, the group "
                               f"has {world_size}")
        return plan.counts(n)
    return _equal_counts(n, world_size)


_OK, _NON_FINITE, _INVALID = 0, 1, 2


def _fingerprint(weights: list[float], codec: Codec) -> int:
    """A positive 56-bit digest of the settings every rank must share (0 is 'unknown')."""
    h = hashlib.blake2b(digest_size=7)
    h.update(struct.pack(f"<{len(weights)}d", *weights))
    h.update(f"{codec.name}/{codec.block}".encode())
    return int.from_bytes(h.digest(), "little") + 1


def _agree(status: int, numel: int, fingerprint: int, problem: Optional[str], rank: int, world_size: int,
           group: Optional[dist.ProcessGroup]) -> None:
    """One all_reduce(MAX) of a 3 x P table, each rank filling its own column; raises the same
    ValueError on every rank when some rank's input is non-finite or invalid or the ranks differ."""
    table = torch.zeros(3, world_size, dtype=torch.int64)
    table[0, rank] = status
    table[1, rank] = numel + 1          # 0: unknown (invalid input)
    table[2, rank] = fingerprint        # 0: unknown
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    statuses, numels, prints = table.tolist()
    invalid = [r for r in range(world_size) if statuses[r] == _INVALID]
    if invalid:
        if problem is not None:
            raise ValueError(f"{_PREFIX}.weighted_allreduce on rank {rank}: {problem} (ranks {invalid} of "
                             f"{world_size} passed invalid arguments; nothing was sent)")
        raise ValueError(f"{_PREFIX}.weighted_allreduce: rank(s) {invalid} of {world_size} passed invalid "
                         "arguments (their error says which); nothing was sent")
    bad = [r for r in range(world_size) if statuses[r] == _NON_FINITE]
    if bad:
        raise ValueError(f"{_PREFIX}.weighted_allreduce: the input of rank(s) {bad} of {world_size} contains "
                         "non-finite values (NaN or Inf); nothing was sent")
    if len(set(numels)) != 1:
        sizes = ", ".join(f"rank {r}: {numels[r] - 1}" for r in range(world_size))
        raise ValueError(f"{_PREFIX}.weighted_allreduce: the ranks' inputs differ in length ({sizes}); "
                         "nothing was sent")
    if len(set(prints)) != 1:
        groups: dict[int, list[int]] = {}
        for r, p in enumerate(prints):
            groups.setdefault(p, []).append(r)
        parts = " vs ".join(str(ranks) for ranks in groups.values())
        raise ValueError(f"{_PREFIX}.weighted_allreduce: the ranks disagree on the weights or the codec "
                         f"(ranks that agree: {parts}); nothing was sent")


# Phase boundaries of the reduction, for whoever paces its traffic on this thread
# (`hetcomm.train.diloco.pacing`): the all-to-all sends a chunk to every peer, the all-gather
# sends along the ring only, and a pacer spreads each phase's bytes over the links it used.
_phases = threading.local()


@contextlib.contextmanager
def phase_marks(hook):
    """Calls ``hook()`` at each phase boundary of the reductions this thread runs inside."""
    previous = getattr(_phases, "hook", None)
    _phases.hook = hook
    try:
        yield
    finally:
        _phases.hook = previous


def _phase_boundary() -> None:
    hook = getattr(_phases, "hook", None)
    if hook is not None:
        hook()


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the group's collectives take it: the CPU (a GPU's encoded bytes are copied)."""
    return t if t.device.type == "cpu" else t.cpu()


def _all_to_all_bytes(send: torch.Tensor, send_sizes: list[int], recv_each: int, world_size: int,
                      group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    if world_size == 1:
        return send
    recv = torch.empty(recv_each * world_size, dtype=torch.uint8)
    dist.all_to_all_single(recv, _on_host(send), [recv_each] * world_size, send_sizes, group=group)
    return recv.to(send.device)


def _all_gather_bytes(mine: torch.Tensor, sizes: list[int], rank: int, hetcomm_group: bool,
                      group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    world_size = len(sizes)
    if world_size == 1:
        return [mine]
    device, mine = mine.device, _on_host(mine)
    if hetcomm_group:  # unequal blocks, along the plan's ring
        outs = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        dist.all_gather(outs, mine, group=group)
        return [o.to(device) for o in outs]
    # gloo (and torch's other backends) insist on equal sizes: pad to the largest chunk.
    width = max(sizes)
    if width == 0:
        return [torch.empty(0, dtype=torch.uint8, device=device) for _ in sizes]
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    outs = [torch.empty(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(outs, padded, group=group)
    return [o[:s].to(device) for o, s in zip(outs, sizes)]


def weighted_allreduce(x: torch.Tensor, weights: Sequence[float], *, codec: Union[str, Codec] = "int8",
                       group: Optional[dist.ProcessGroup] = None, feedback: Optional[ErrorFeedback] = None,
                       finite_checked: bool = False) -> torch.Tensor:
    """``Σ_r weights[r] * x_r`` over the ranks of ``group``, moved in ``codec``'s format.

    A collective: every rank calls it with its own x (fp32, any shape, the same number of
    elements on every rank; on the CPU or a GPU: the codec's arithmetic runs there, and only
    the encoded bytes are copied to the CPU for the group's collectives and back) and the same ``weights`` (one per group rank) and codec. Returns a
    new fp32 tensor of x's shape, bit-identical on every rank, within `reduced_error_bound` of
    the exact sum (without ``feedback``). x is not modified. ``feedback``: carry quantisation
    residuals between calls (`ErrorFeedback`). ``finite_checked``: skip the agreement step
    (the caller guarantees finite inputs and equal lengths, weights and codecs on every rank).
    Raises ValueError (on every rank, unless ``finite_checked``) for non-finite or invalid
    inputs. The algorithm and its error bounds: docs/compression.md#the-reduction.
    """
    codec = _as_codec(codec)
    if feedback is not None and not isinstance(feedback, ErrorFeedback):
        raise TypeError(f"{_PREFIX}: feedback must be an ErrorFeedback or None, got {type(feedback).__name__}")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{_PREFIX}.weighted_allreduce: this process is not a member of the group")

    problem, flat, ws = None, None, None
    status, fingerprint = _INVALID, 0
    try:
        flat = _flat_fp32(x, "weighted_allreduce")
        ws = _check_weights(weights, world_size)
    except (TypeError, ValueError) as e:
        problem = str(e).removeprefix(f"{_PREFIX}: ")
        if finite_checked:
            raise ValueError(f"{_PREFIX}.weighted_allreduce on rank {rank}: {problem}") from None
    else:
        status = _OK if finite_checked or bool(torch.isfinite(flat).all()) else _NON_FINITE
        fingerprint = _fingerprint(ws, codec)
    if not finite_checked:
        _agree(status, -1 if flat is None else flat.numel(), fingerprint, problem, rank, world_size, group)
    assert flat is not None and ws is not None

    n = flat.numel()
    shape = x.shape
    dev = flat.device
    if n == 0:
        return torch.zeros(shape, dtype=torch.float32, device=dev)
    v = [_fp32_value(w) for w in ws]
    counts = chunk_counts(n, group)
    offsets = _offsets(counts)
    mine, my_offset = counts[rank], offsets[rank]
    owner_key = (n, world_size, rank, my_offset, mine)

    if codec.name == "fp32":
        # Native weighted sum: nothing is quantised. Residuals left from earlier calls with
        # another codec are folded in, so that feedback still telescopes across the switch.
        y = flat * v[rank] if feedback is None else feedback._sender_input(flat).mul_(v[rank])
        if feedback is not None:
            f = feedback._owner_residual_for(owner_key)
            if f is not None:
                y[my_offset:my_offset + mine] += f
            feedback.sender_residual = None
            feedback.owner_residual = None
        if world_size > 1:
            wire = _on_host(y)
            dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
            if wire is not y:
                y.copy_(wire)
        return y.view(shape)

    # 1-2. Encode each chunk of (x + sender residual) once; chunk c goes to rank c.
    x_send = flat if feedback is None else feedback._sender_input(flat)
    send_sizes = [codec.encoded_bytes(c) for c in counts]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=dev)
    byte_offsets = _offsets(send_sizes)
    for c in range(world_size):
        codec._encode_into(x_send[offsets[c]:offsets[c] + counts[c]],
                           send[byte_offsets[c]:byte_offsets[c] + send_sizes[c]])
    if feedback is not None:
        decoded = torch.empty(n, dtype=torch.float32, device=dev)
        for c in range(world_size):
            codec._decode_into(send[byte_offsets[c]:byte_offsets[c] + send_sizes[c]],
                               decoded[offsets[c]:offsets[c] + counts[c]])
        feedback.sender_residual = x_send.sub_(decoded)      # x_send is our own copy
    recv_each = send_sizes[rank]
    recv = _all_to_all_bytes(send, send_sizes, recv_each, world_size, group)

    # 3. The owner sums the weighted contributions in fp32, in rank order.
    s = torch.zeros(mine, dtype=torch.float32, device=dev)
    part = torch.empty(mine, dtype=torch.float32, device=dev)
    for r in range(world_size):
        if v[r] == 0.0:
            continue  # adds exact zeros (inputs are finite)
        codec._decode_into(recv[r * recv_each:(r + 1) * recv_each], part)
        s.add_(part, alpha=v[r])

    # 4. Encode the reduced chunk once (plus the owner residual), all-gather, everyone decodes.
    if feedback is not None:
        f = feedback._owner_residual_for(owner_key)
        if f is not None:
            s += f
    reduced = torch.empty(recv_each, dtype=torch.uint8, device=dev)
    codec._encode_into(s, reduced)
    if feedback is not None:
        codec._decode_into(reduced, part)
        feedback.owner_residual = s.sub_(part)
    _phase_boundary()
    chunks = _all_gather_bytes(reduced, send_sizes, rank, backend_or_none(group) is not None, group)
    out = torch.empty(n, dtype=torch.float32, device=dev)
    for c in range(world_size):
        codec._decode_into(chunks[c], out[offsets[c]:offsets[c] + counts[c]])
    return out.view(shape)
