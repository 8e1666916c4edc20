"""The wire formats of the compressed weighted allreduce, in pure torch (no torch.distributed).

* `get_codec` / `Codec`: fp32, bf16, fp16, int8 and int4 (one fp32 scale per block of 2048):
  encode, decode, and the bound on each round-trip error (`Codec.error_bound`);
* `reduced_error_bound`: the bound on the error of a whole reduction;
* `ErrorFeedback`: the residuals that error feedback carries from one call to the next.

The collective that moves these bytes is `hetcomm.compress.collective`.

Formats, error bounds (derived) and error feedback: docs/compression.md#codecs,
docs/compression.md#round-trip-error-of-one-element, docs/compression.md#error-feedback.
"""
from __future__ import annotations

import math
import struct
from typing import Optional, Sequence, Union

import torch

CODECS = ("fp32", "bf16", "fp16", "int8", "int4")
DEFAULT_BLOCK = 2048
_PREFIX = "hetcomm.compress"
_FP32_U = 2.0 ** -24                  # unit roundoff of fp32
_FP32_MAX = float(torch.finfo(torch.float32).max)
_UNDERFLOW = 2.0 ** -149              # per-operation absolute slack where results are subnormal
_INT_REL = 1.0 + 2.0 ** -13           # fp32 slack of the int8 / int4 bound (docs/compression.md)
_INT_ABS = 2.0 ** -136                # subnormal or zero scales


# --------------------------------------------------------------------------------------------
# Codecs
# --------------------------------------------------------------------------------------------

def _flat_fp32(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_PREFIX}: {what} takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{_PREFIX}: {what} takes float32, got {x.dtype}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{_PREFIX}: {what} takes a CPU or CUDA tensor, got one on {x.device}")
    return x.detach().reshape(-1).contiguous()


def _bytes_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` (uint8) reinterpreted as ``dtype``; copied first if its offset is misaligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if buf.storage_offset() % size:
        buf = buf.clone()
    return buf.view(dtype)


class Codec:
    """One wire format: ``encode`` fp32 -> bytes, ``decode`` bytes -> fp32, and the error bound.

    ``encode`` reads any fp32 tensor in row-major order as a flat vector; ``decode(buf, n)``
    returns a new 1-D fp32 tensor of n elements from ``encoded_bytes(n)`` bytes, on the device
    of ``buf`` (the codecs are torch operations: they run where their tensors are, the CPU or a
    GPU, and give the same bytes on both). Instances are
    immutable and compare equal by ``(name, block)``. Non-finite inputs are not checked here:
    they encode to meaningless bytes (`weighted_allreduce` checks them).
    """

    name: str = ""
    block: int = 0       # elements per int8 / int4 scale; 0 for the other formats

    def encoded_bytes(self, n: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _flat_fp32(x, f"{self.name} encode")
        out = torch.empty(self.encoded_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        self._encode_into(x, out)
        return out

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{_PREFIX}: {self.name} decode: n must be a non-negative int, got {n!r}")
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise TypeError(f"{_PREFIX}: {self.name} decode takes a 1-D uint8 tensor")
        if buf.numel() != self.encoded_bytes(n):
            raise ValueError(f"{_PREFIX}: {self.name} decode: {n} elements take {self.encoded_bytes(n)} "
                             f"bytes, got {buf.numel()}")
        out = torch.empty(n, dtype=torch.float32, device=buf.device)
        self._decode_into(buf.contiguous(), out)
        return out

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound (float64, flat) on ``|decode(encode(x)) - x|``.

        Derivation: docs/compression.md#round-trip-error-of-one-element.

        ``x`` may be any floating tensor: for float64 it is read as magnitudes and the bound of
        any fp32 vector with ``|y| <= |x|`` element-wise (int8, int4: with block maxima at most x's)
        is returned, which is how `reduced_error_bound` bounds the second quantisation.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{_PREFIX}: error_bound takes a floating-point tensor")
        return self._bound(x.detach().reshape(-1).to(device="cpu", dtype=torch.float64).abs())

    # Subclasses: write encoded bytes into / decode from slices of larger buffers.
    def _encode_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _decode_into(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _bound(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and (self.name, self.block) == (other.name, other.block)

    def __hash__(self) -> int:
        return hash((self.name, self.block))

    def __repr__(self) -> str:
        return f"get_codec({self.name!r}" + (f", block={self.block})" if self.block else ")")


class _Fp32Codec(Codec):
    name = "fp32"

    def encoded_bytes(self, n: int) -> int:
        return 4 * n

    def _encode_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x.view(torch.uint8))

    def _decode_into(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.uint8).copy_(buf)

    def _bound(self, a: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(a)


class _CastCodec(Codec):
    """bf16 / fp16: clamp to the largest finite value, then round to nearest even."""

    def __init__(self, name: str, dtype: torch.dtype, unit_roundoff: float, subnormal_half_gap: float):
        self.name = name
        self.dtype = dtype
        self.max_finite = float(torch.finfo(dtype).max)
        self.unit_roundoff = unit_roundoff
        self.subnormal_half_gap = subnormal_half_gap

    def encoded_bytes(self, n: int) -> int:
        return 2 * n

    def _encode_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        m = self.max_finite
        out.copy_(x.clamp(-m, m).to(self.dtype).view(torch.uint8))

    def _decode_into(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_bytes_as(buf, self.dtype))

    def _bound(self, a: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a * self.unit_roundoff + self.subnormal_half_gap, a - self.max_finite)


class _IntCodec(Codec):
    """Symmetric integers in [-levels, levels], one fp32 scale per block; layout
    ``[scales: 4 nb bytes][q]``. int8: q one byte per element. int4: two elements per byte,
    ``q + 8`` in the low nibble for the even element and in the high nibble for the odd one (an
    odd chunk's last high nibble holds 8, a zero)."""

    def __init__(self, name: str, levels: int, block: int):
        self.name = name
        self.levels = levels
        self.block = block

    def _blocks(self, n: int) -> int:
        return -(-n // self.block)

    def _q_bytes(self, n: int) -> int:
        return n if self.levels > 7 else (n + 1) // 2

    def encoded_bytes(self, n: int) -> int:
        return self._q_bytes(n) + 4 * self._blocks(n)

    def _encode_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n, L = x.numel(), self.block
        nb = self._blocks(n)
        if n == 0:
            return
        scales = torch.empty(nb, dtype=torch.float32, device=x.device)
        q = out[4 * nb:].view(torch.int8) if self.levels > 7 else torch.empty(n, dtype=torch.int8, device=x.device)
        full = n // L
        if full:
            self._quantise(x[:full * L].view(full, L), scales[:full], q[:full * L].view(full, L))
        if full * L < n:
            self._quantise(x[full * L:].view(1, -1), scales[full:], q[full * L:].view(1, -1))
        out[:4 * nb].copy_(scales.view(torch.uint8))
        if self.levels <= 7:                     # pack: q + 8 in [1, 15], two per byte
            packed = out[4 * nb:]
            u = q.add_(8).view(torch.uint8).bitwise_and_(15)   # the mask: never spill into the neighbour
            torch.bitwise_or(u[0::2][:n // 2], u[1::2].bitwise_left_shift(4), out=packed[:n // 2])
            if n % 2:
                packed[-1] = u[-1] | (8 << 4)

    def _quantise(self, xb: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> None:
        lo, hi = torch.aminmax(xb, dim=1)
        # (by a tensor: CUDA divides by a Python number as a multiplication by its reciprocal,
        # one bit off a true division for some maxima, and the GPU's bytes would differ)
        levels = torch.full((), float(self.levels), dtype=torch.float32, device=xb.device)
        torch.div(torch.maximum(hi, lo.neg()), levels, out=scales)
        # levels · fl(m / levels) can round past FLT_MAX (int8 at m = FLT_MAX): the next scale
        # down keeps every decoded value finite (q is clamped to ±levels below).
        over = torch.isinf(scales * float(self.levels))
        if bool(over.any()):
            scales.copy_(torch.where(over, torch.nextafter(scales, torch.zeros_like(scales)), scales))
        # A zero scale (all-zero block, or a maximum so small that m/levels underflows) divides by
        # 1 instead: q rounds to 0 and the block decodes to zeros.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        t = xb / divisor.unsqueeze(1)
        # Clamping matters only for subnormal scales (docs/compression.md#round-trip-error-of-one-element).
        q.copy_(t.round_().clamp_(-float(self.levels), float(self.levels)))

    def _decode_into(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        n, L = out.numel(), self.block
        nb = self._blocks(n)
        if n == 0:
            return
        scales = torch.empty(nb, dtype=torch.float32, device=out.device)
        scales.view(torch.uint8).copy_(buf[:4 * nb])
        if self.levels > 7:
            q = buf[4 * nb:].view(torch.int8)
        else:                                    # unpack the nibbles
            packed = buf[4 * nb:]
            u = torch.empty(2 * packed.numel(), dtype=torch.uint8, device=out.device)
            torch.bitwise_and(packed, 15, out=u[0::2])
            torch.bitwise_right_shift(packed, 4, out=u[1::2])
            q = u[:n].view(torch.int8).sub_(8)
        full = n // L
        if full:
            torch.mul(q[:full * L].view(full, L), scales[:full].unsqueeze(1), out=out[:full * L].view(full, L))
        if full * L < n:
            torch.mul(q[full * L:], scales[full], out=out[full * L:])

    def _bound(self, a: torch.Tensor) -> torch.Tensor:
        n, L = a.numel(), self.block
        nb = self._blocks(n)
        if n == 0:
            return a.clone()
        padded = torch.zeros(nb * L, dtype=torch.float64)
        padded[:n] = a
        per_block = padded.view(nb, L).amax(dim=1) / (2.0 * self.levels) * _INT_REL + _INT_ABS
        return per_block.repeat_interleave(L)[:n]


_CODEC_FACTORIES = {
    "fp32": lambda block: _Fp32Codec(),
    "bf16": lambda block: _CastCodec("bf16", torch.bfloat16, 2.0 ** -8, 2.0 ** -134),
    "fp16": lambda block: _CastCodec("fp16", torch.float16, 2.0 ** -11, 2.0 ** -25),
    "int8": lambda block: _IntCodec("int8", 127, block),
    "int4": lambda block: _IntCodec("int4", 7, block),
}


def get_codec(name: str, block: int = DEFAULT_BLOCK) -> Codec:
    """The codec called ``name`` (one of `CODECS`); ``block``: elements per int8 / int4 scale."""
    if name not in _CODEC_FACTORIES:
        raise ValueError(f"{_PREFIX}: unknown codec {name!r}; expected one of {CODECS}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{_PREFIX}: block must be a positive int, got {block!r}")
    return _CODEC_FACTORIES[name](block)


def _as_codec(codec: Union[str, Codec]) -> Codec:
    if isinstance(codec, Codec):
        return codec
    if isinstance(codec, str):
        return get_codec(codec)
    raise TypeError(f"{_PREFIX}: codec must be a name in {CODECS} or a Codec, got {type(codec).__name__}")


# --------------------------------------------------------------------------------------------
# Chunk layout and weights (shared with the collective)
# --------------------------------------------------------------------------------------------

def _equal_counts(n: int, world_size: int) -> list[int]:
    # What the planner's shares_to_counts gives for equal shares: the remainder to the lowest ranks.
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _offsets(counts: Sequence[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _fp32_value(w: float) -> float:
    return struct.unpack("<f", struct.pack("<f", w))[0]


def _check_weights(weights: Sequence[float], world_size: int) -> list[float]:
    try:
        ws = [float(w) for w in weights]
    except (TypeError, ValueError) as e:
        raise ValueError(f"weights must be a sequence of numbers ({e})") from None
    if len(ws) != world_size:
        raise ValueError(f"{len(ws)} weights for a group of {world_size} ranks")
    for r, w in enumerate(ws):
        if not math.isfinite(w) or abs(w) > _FP32_MAX:
            raise ValueError(f"the weight of rank {r} is {w!r}; weights must be finite float32 values")
    return ws


# --------------------------------------------------------------------------------------------
# Error feedback
# --------------------------------------------------------------------------------------------

class ErrorFeedback:
    """Quantisation residuals carried from one `weighted_allreduce` call to the next.

    ``sender_residual``: this rank's residual for its whole input (fp32, None until the first
    call). ``owner_residual``: the residual of the reduced chunk this rank owns. The update rules
    and when each is reset: docs/compression.md#error-feedback. One object per
    call site (one vector, one group); `reset` forgets both.
    """

    def __init__(self) -> None:
        self.sender_residual: Optional[torch.Tensor] = None
        self.owner_residual: Optional[torch.Tensor] = None
        self._owner_key: Optional[tuple] = None

    def reset(self) -> None:
        self.sender_residual = None
        self.owner_residual = None
        self._owner_key = None

    def _sender_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x + e`` as a new tensor the caller may overwrite (e dropped if its length differs)."""
        e = self.sender_residual
        if e is None or e.numel() != x.numel():
            return x.clone()
        return x + e

    def _owner_residual_for(self, key: tuple) -> Optional[torch.Tensor]:
        if self._owner_key != key:
            self.owner_residual, self._owner_key = None, key
        return self.owner_residual

    def __repr__(self) -> str:
        def norm(t: Optional[torch.Tensor]) -> str:
            if t is None:
                return "None"
            largest = float(t.abs().max()) if t.numel() else 0.0
            return f"{t.numel()} elements, max |e| {largest:.3g}"
        return f"ErrorFeedback(sender: {norm(self.sender_residual)}; owner: {norm(self.owner_residual)})"


# --------------------------------------------------------------------------------------------
# Error bound of a reduction
# --------------------------------------------------------------------------------------------

def reduced_error_bound(inputs: Sequence[torch.Tensor], weights: Sequence[float],
                        codec: Union[str, Codec] = "int8", *,
                        counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Per-element bound (float64, flat) on ``|weighted_allreduce(x_r) - Σ_r weights[r] x_r|``.

    ``inputs[r]``: rank r's input; ``counts``: the chunk sizes the call used (`chunk_counts` on
    the group; default equal chunks). For one call without error feedback; the derivation is in
    docs/compression.md#error-of-the-reduced-result. Pure: no communication.
    """
    codec = _as_codec(codec)
    P = len(inputs)
    if P == 0:
        raise ValueError(f"{_PREFIX}: reduced_error_bound needs at least one input")
    ws = _check_weights(weights, P)
    xs = [x.detach().reshape(-1).to(device="cpu", dtype=torch.float64).abs() for x in inputs]
    n = xs[0].numel()
    if any(a.numel() != n for a in xs):
        raise ValueError(f"{_PREFIX}: reduced_error_bound: inputs differ in length")
    counts = _equal_counts(n, P) if counts is None else [int(c) for c in counts]
    if len(counts) != P or sum(counts) != n or min(counts) < 0:
        raise ValueError(f"{_PREFIX}: reduced_error_bound: counts {counts} do not split {n} elements "
                         f"among {P} ranks")
    offsets = _offsets(counts)

    def chunked_bound(a: torch.Tensor) -> torch.Tensor:
        if codec.name == "fp32" or n == 0:
            return torch.zeros_like(a)
        return torch.cat([codec.error_bound(a[o:o + c]) for o, c in zip(offsets, counts)])

    gamma = P * _FP32_U / (1.0 - P * _FP32_U)
    underflow = P * _UNDERFLOW
    bound = torch.zeros(n, dtype=torch.float64)
    magnitude = torch.zeros(n, dtype=torch.float64)    # Σ_r |v_r| (|x_r| + e1_r)
    for a, w in zip(xs, ws):
        e1 = chunked_bound(a)
        v = _fp32_value(w)
        bound += abs(w - v) * (a + e1) + abs(v) * e1
        magnitude += abs(v) * (a + e1)
    bound += gamma * magnitude + underflow
    if codec.name != "fp32":
        bound += chunked_bound((1.0 + gamma) * magnitude + underflow)
    return bound
