"""A model's parameters as one flat vector and back (DiLoCo's global parameters travel so): on the
CPU, or on the device DiLoCo keeps its state on."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def fingerprint(flat: torch.Tensor) -> int:
    """52 bits of a hash of the exact bytes of ``flat`` (an integer a float64 carries exactly)."""
    digest = hashlib.blake2b(flat.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 12


_MIX = (0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64))    # (as signed 64-bit integers)


@torch.no_grad()
def additive_print(pieces: Sequence[torch.Tensor], starts: Sequence[int], chunk: int = 1 << 20) -> int:
    """A hash of the elements of ``pieces`` and their positions in a flat vector (piece k's
    first element at ``starts[k]``), modulo 2^64: the sum over the elements of a mix of the
    element's bits and its position. A vector cut into shares anywhere hashes to the sum of its
    shares' (mod 2^64), so that the ranks of a worker that each hold a share of the global
    parameters have the hash of the whole from one small all-reduce (`print_bits` makes 52 bits
    of it). Every element is hashed by its bits: -0.0 and 0.0 differ, so does every NaN."""
    total = 0
    for piece, start in zip(pieces, starts):
        flat = piece.detach().reshape(-1).cpu()
        if flat.element_size() not in (2, 4, 8):
            raise TypeError(f"additive_print: {flat.dtype} is not a floating-point dtype of 2, 4 or 8 bytes")
        bits_of = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        for x in range(0, flat.numel(), chunk):
            part = flat[x:x + chunk]
            h = part.view(bits_of).to(torch.int64)
            h = h + (torch.arange(start + x, start + x + part.numel(), dtype=torch.int64) + 1) * _MIX[0]
            h = h ^ ((h >> 31) & 0x1FFFFFFFF)
            h = h * _MIX[1]
            h = h ^ ((h >> 29) & 0x7FFFFFFFF)
            # (exact: each half of an element's hash < 2^32, and a chunk holds < 2^31 of them)
            total += int((h & 0xFFFFFFFF).sum()) + (int(((h >> 32) & 0xFFFFFFFF).sum()) << 32)
    return total % (1 << 64)


def print_bits(total: int) -> int:
    """52 bits of an `additive_print` (an integer a float64 carries exactly)."""
    return (total % (1 << 64)) >> 12


def split(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into one 1-D piece per tensor of ``params`` (views)."""
    return list(flat.split([p.numel() for p in params]))


@torch.no_grad()
def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensors' elements, concatenated on ``device`` (in ``dtype`` when given)."""
    return torch.cat([t.detach().reshape(-1).to(device, dtype or t.dtype) for t in tensors])


@torch.no_grad()
def load(params: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copies each source into its parameter (shapes as the parameters', devices and dtypes converted)."""
    for p, s in zip(params, sources):
        p.copy_(s.detach().view(p.shape))


class FlatParameters:
    """For classes that keep ``_params`` (the model's floating-point parameters), ``_global`` (the
    global parameters, on the device of the state) and ``_master`` (their dtype): the conversions
    between them; flat vectors on the device of ``_global``."""

    _params: list[torch.Tensor]
    _global: list[torch.Tensor]
    _master: torch.dtype

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return split(flat, self._params)

    def _flatten_model(self) -> torch.Tensor:
        return flatten(self._params, self._master, self._global[0].device)

    def _flatten_global(self) -> torch.Tensor:
        return flatten(self._global, device=self._global[0].device)

    def _load_global(self) -> None:
        load(self._params, self._global)

    def _load_flat(self, flat: torch.Tensor) -> None:
        load(self._params, self._split(flat))


@torch.no_grad()
def broadcast(params: Sequence[torch.Tensor], dtype: torch.dtype, *, src: int, group, bucket: int = 1 << 22) -> None:
    """Every rank's ``params`` become ``src``'s, sent in ``dtype`` (on the CPU), in buckets of about
    ``bucket`` elements (a tensor larger than a bucket goes alone): the transient memory is a
    bucket or the largest tensor, not the model."""
    import torch.distributed as dist

    i = 0
    while i < len(params):
        j, n = i + 1, params[i].numel()
        while j < len(params) and n + params[j].numel() <= bucket:
            n += params[j].numel()
            j += 1
        buf = flatten(params[i:j], dtype)
        dist.broadcast(buf, src=src, group=group)
        load(params[i:j], split(buf, params[i:j]))
        i = j
