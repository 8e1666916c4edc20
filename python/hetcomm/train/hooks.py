"""DDP communication hooks that weight each rank's gradient by the samples it processed.

With per-rank batches ``b_r`` of a global batch ``B`` and a per-rank mean loss, scaling each
rank's gradient by ``b_r / B`` and summing gives exactly the full-batch mean gradient; DDP's
default ``1 / world_size`` is right only when every ``b_r`` is equal::

    state = SampleWeightState(process_group)          # None: the default group
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    state.set_samples(len(x), global_batch_size)      # every step, before backward

A rank with no samples still runs forward and backward, with ``set_samples(0, B)``. The
derivation and the full usage: docs/training.md#why-proportional-batches-and-why-weight-by-samples.
"""
# No `from __future__ import annotations`: DDP.register_comm_hook compares the hooks' annotations
# with the objects dist.GradBucket and torch.futures.Future[torch.Tensor], not with strings.
from typing import List, Optional, Union

import torch
import torch.distributed as dist

__all__ = [
    "SampleWeightState",
    "weighted_allreduce_hook",
    "weighted_fp16_hook",
    "weighted_bf16_hook",
]


def _check_count(name: str, value: int) -> int:
    # bool is an int subclass; True as a sample count is a caller's bug, not 1 sample.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SampleWeightState: {name} must be an int, got {type(value).__name__} "
                        f"{value!r}")
    return value


class SampleWeightState:
    """The state of the weighted hooks: the process group and this step's sample counts.

    ``set_samples(local_samples, global_samples)`` must be called on every rank every step,
    before backward: the hooks use the most recent counts, and a count left over from an
    earlier step silently weights this step's gradient wrongly. All ranks must pass the same
    ``global_samples``; the hooks cannot check that without an extra collective.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.process_group = process_group
        self.local_samples: Optional[int] = None
        self.global_samples: Optional[int] = None

    def set_samples(self, local_samples: int, global_samples: int) -> None:
        """Records that this rank processes ``local_samples`` of ``global_samples`` this step.

        Raises ``ValueError`` unless ``0 <= local_samples <= global_samples`` and
        ``global_samples > 0``. Checked here, on the caller's thread, so that a bad count fails
        before backward rather than inside DDP's reducer.
        """
        local_samples = _check_count("local_samples", local_samples)
        global_samples = _check_count("global_samples", global_samples)
        if global_samples <= 0:
            raise ValueError(f"SampleWeightState.set_samples: global_samples must be > 0, got "
                             f"{global_samples} (rank {self._rank()})")
        if not 0 <= local_samples <= global_samples:
            raise ValueError(f"SampleWeightState.set_samples: local_samples must be in "
                             f"[0, global_samples={global_samples}], got {local_samples} "
                             f"(rank {self._rank()})")
        self.local_samples = local_samples
        self.global_samples = global_samples

    def agree_samples(self, local_samples: int) -> int:
        """Sums ``local_samples`` over the group, calls ``set_samples`` and returns the sum.

        A collective: every rank of the group must call it, in the same order relative to other
        collectives on the group, and outside DDP's forward/backward (call it before the forward
        pass). Cost: one blocking allreduce of one int64 per step, i.e. one latency of the
        group's slowest link (tens of microseconds on one host, typically 0.1-1 ms across
        hosts), which also makes every rank wait for the slowest to reach this point. Prefer
        ``set_samples`` with the global batch size of the agreed partition, which costs nothing.
        """
        local_samples = _check_count("local_samples", local_samples)
        if local_samples < 0:
            raise ValueError(f"SampleWeightState.agree_samples: local_samples must be >= 0, got "
                             f"{local_samples} (rank {self._rank()})")
        count = torch.tensor([local_samples], dtype=torch.int64, device=self._count_device())
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.process_group)
        global_samples = int(count.item())
        self.set_samples(local_samples, global_samples)
        return global_samples

    def weight(self) -> float:
        """This rank's weight ``local_samples / global_samples`` for the current step."""
        if self.local_samples is None or self.global_samples is None:
            raise RuntimeError(
                f"hetcomm weighted DDP hook on rank {self._rank()}: no sample counts; call "
                "state.set_samples(local_samples, global_samples) (or state.agree_samples("
                "local_samples)) every step before backward")
        return self.local_samples / self.global_samples

    def group(self) -> dist.ProcessGroup:
        """The group the hooks reduce over (the default group when none was given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _rank(self) -> Union[int, str]:
        if not dist.is_initialized():
            return "?"
        return dist.get_rank(self.process_group)

    def _count_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo, hetcomm and mixed "cpu:...,cuda:..." groups
        # take CPU tensors, which avoids a device round trip for one integer.
        if dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _scale_in_place(state: SampleWeightState, buffer: torch.Tensor) -> torch.Tensor:
    weight = state.weight()
    if weight == 0.0:
        # zero_(), not mul_(0): an empty batch's mean loss is NaN (0/0). The usual losses
        # still give zero parameter gradients (sums over no samples), but any term that uses
        # the loss's value (a learned scale, a log) makes them NaN, and NaN * 0 is NaN, which
        # would poison every rank's sum. A rank without samples contributes exact zeros.
        return buffer.zero_()
    return buffer.mul_(weight)


def _allreduce_into_bucket(state: SampleWeightState, hook: str, buffer: torch.Tensor,
                           wire: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """SUMs ``wire`` over the state's group; the future's value is ``buffer`` holding the sum.

    ``wire`` is either ``buffer`` itself (reduced in place, as DDP's ``allreduce_hook`` does) or
    a compressed copy that is cast back into ``buffer`` once the sum arrives.
    """
    group = state.group()

    def describe(e: Exception) -> RuntimeError:
        return RuntimeError(f"{hook}: allreduce SUM of {wire.numel()} {wire.dtype} elements on "
                            f"the {dist.get_backend(group)!r} group failed on rank "
                            f"{dist.get_rank(group)}: {e}")

    try:
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True)
    except Exception as e:  # e.g. a backend that rejects the wire dtype: say which and where
        raise describe(e) from e

    def finish(fut: torch.futures.Future[List[torch.Tensor]]) -> torch.Tensor:
        try:
            reduced = fut.value()[0]
        except Exception as e:
            raise describe(e) from e
        if wire is buffer:
            return reduced
        # Decompress in place: the future's value must be the bucket's buffer (DDP copies it
        # into the gradients), and reusing it keeps peak memory at one extra compressed copy.
        return buffer.copy_(reduced)

    return work.get_future().then(finish)


def weighted_allreduce_hook(state: SampleWeightState,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sample-weighted mean of the gradients: ``sum_r (b_r / B) * g_r`` over the state's group.

    Scales the bucket in place by ``local_samples / global_samples`` and allreduces it with SUM.
    With the loss a mean over each rank's own samples, the result is the gradient of the mean
    loss over the whole global batch (derivation:
    docs/training.md#why-proportional-batches-and-why-weight-by-samples).
    """
    buffer = bucket.buffer()
    _scale_in_place(state, buffer)
    return _allreduce_into_bucket(state, "weighted_allreduce_hook", buffer, buffer)


def _compressed_allreduce_hook(dtype: torch.dtype, hook: str, state: SampleWeightState,
                               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    # Scale in the gradient's dtype, then cast; not the other way round (as torch's
    # fp16_compress_hook does, dividing after the cast):
    # * one rounding to the wire format instead of two (cast, then a rounded multiply);
    # * w = b_r / B <= 1 shrinks the values before they meet the format's range, so a gradient
    #   above fp16's maximum (65504) whose weighted share fits is not sent as inf;
    # * the share w * g is what the wire must carry either way, so scaling first flushes
    #   nothing to zero that casting first would keep (and in fp16 the product of a rounded
    #   value and a rounded weight can only lose more).
    wire = _scale_in_place(state, buffer).to(dtype)
    return _allreduce_into_bucket(state, hook, buffer, wire)


def weighted_fp16_hook(state: SampleWeightState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``weighted_allreduce_hook`` with float16 on the wire.

    Scales by ``local_samples / global_samples`` in the gradient's dtype, casts to float16,
    allreduces SUM and casts the sum back into the bucket. Each element carries an error of
    about ``world_size * 2**-11`` times the sum of the ranks' weighted magnitudes (one rounding
    at the cast, one per addition on the way round the ring); weighted values below float16's
    smallest subnormal (6e-8) arrive as 0 and above 65504 as inf.
    """
    return _compressed_allreduce_hook(torch.float16, "weighted_fp16_hook", state, bucket)


def weighted_bf16_hook(state: SampleWeightState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``weighted_allreduce_hook`` with bfloat16 on the wire.

    As ``weighted_fp16_hook``, with float32's range but 8 significant bits: an error of about
    ``world_size * 2**-8`` of the summed magnitudes. gloo reduces bfloat16 on CPU (torch 2.13);
    a backend that rejects the dtype raises a RuntimeError naming the hook, the backend, the
    dtype and the rank.
    """
    return _compressed_allreduce_hook(torch.bfloat16, "weighted_bf16_hook", state, bucket)
