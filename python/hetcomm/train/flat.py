"""A model's parameters as one flat CPU vector and back (DiLoCo's global parameters travel so)."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def fingerprint(flat: torch.Tensor) -> int:
    """52 bits of a hash of the exact bytes of ``flat`` (an integer a float64 carries exactly)."""
    digest = hashlib.blake2b(flat.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 12


def split(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into one 1-D piece per tensor of ``params`` (views)."""
    return list(flat.split([p.numel() for p in params]))


@torch.no_grad()
def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors' elements, concatenated on the CPU (in ``dtype`` when given)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", dtype or t.dtype) for t in tensors])


@torch.no_grad()
def load(params: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copies each source into its parameter (shapes as the parameters', devices and dtypes converted)."""
    for p, s in zip(params, sources):
        p.copy_(s.detach().view(p.shape))


class FlatParameters:
    """For classes that keep ``_params`` (the model's floating-point parameters), ``_global`` (the
    global parameters, CPU) and ``_master`` (their dtype): the conversions between them."""

    _params: list[torch.Tensor]
    _global: list[torch.Tensor]
    _master: torch.dtype

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return split(flat, self._params)

    def _flatten_model(self) -> torch.Tensor:
        return flatten(self._params, self._master)

    def _flatten_global(self) -> torch.Tensor:
        return flatten(self._global)

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
