"""Compressed weighted allreduce, for DiLoCo's outer synchronisation: the wire formats apart from
the collective that moves them.

* `codecs` — fp32, bf16, fp16, int8 and int4 (`CODECS`, `get_codec`): encode, decode and the bound
  on each round-trip error; the bound on a whole reduction's error (`reduced_error_bound`); the
  residuals of error feedback (`ErrorFeedback`). Pure torch, no torch.distributed.
* `collective` — `weighted_allreduce` (quantise once, sum in fp32 at each chunk's owner, quantise
  once more) and the chunk layout it uses on a group (`chunk_counts`).

::

    from hetcomm.compress import ErrorFeedback, weighted_allreduce
    reduced = weighted_allreduce(delta, weights, codec="int8", group=group, feedback=ErrorFeedback())

The public names of both are here (``hetcomm.compress.weighted_allreduce``). The training loops
call ``hetcomm.compress.weighted_allreduce`` through this package, so a replacement set here (as
tests do, to delay or fail a synchronisation) is the one they call.
"""
from hetcomm.compress.codecs import CODECS, DEFAULT_BLOCK, Codec, ErrorFeedback, get_codec, reduced_error_bound
from hetcomm.compress.collective import chunk_counts, weighted_allreduce

__all__ = [
    "CODECS",
    "Codec",
    "get_codec",
    "ErrorFeedback",
    "weighted_allreduce",
    "chunk_counts",
    "reduced_error_bound",
]
