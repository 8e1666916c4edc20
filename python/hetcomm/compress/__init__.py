"""Compressed weighted allreduce, for DiLoCo's outer synchronisation: the wire formats apart from
the collective that moves them.

* `codecs` — fp32, bf16, fp16, int8 and int4 (`CODECS`, `get_codec`), their error bounds and
  error feedback (`ErrorFeedback`). Pure torch, no torch.distributed.
* `collective` — `weighted_allreduce` and its chunk layout on a group (`chunk_counts`).

The public names of both are here (``hetcomm.compress.weighted_allreduce``). The training loops
call ``hetcomm.compress.weighted_allreduce`` through this package, so a replacement set here (as
tests do, to delay or fail a synchronisation) is the one they call. Design: docs/compression.md.
"""
from hetcomm.compress.codecs import CODECS, DEFAULT_BLOCK, Codec, ErrorFeedback, get_codec, reduced_error_bound
from hetcomm.compress.collective import chunk_counts, weighted_allreduce

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK",
    "Codec",
    "get_codec",
    "ErrorFeedback",
    "weighted_allreduce",
    "chunk_counts",
    "reduced_error_bound",
]
