"""The one door to the compiled extension ``hetcomm._C``: no other module imports it.

The extension is loaded on first use, so that ``import hetcomm``, the planner and a gloo-only
benchmark never load it, and a missing or broken build fails where the engine is first needed
(creating a ``"hetcomm"`` group), naming the extension. Loading it needs torch (the extension
links against torch's libraries and uses its Python types), so :func:`extension` imports torch
first. Nothing here imports torch at module level.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any

_NAME = "hetcomm._C"


def extension():
    """The extension module, loaded now if this process has not loaded it yet."""
    module = sys.modules.get(_NAME)
    if module is None:
        import torch  # noqa: F401  (before the extension: it needs torch's libraries and types)
        if importlib.util.find_spec(_NAME) is None:
            raise ImportError("hetcomm: the compiled extension hetcomm._C is not built: run "
                              "`pip install --no-build-isolation -e .` in the source tree (README)")
        from hetcomm import _C as module
    return module


def loaded():
    """The extension module if this process has loaded it, else None (loads nothing)."""
    return sys.modules.get(_NAME)


def is_backend(obj: Any) -> bool:
    """Whether ``obj`` is a hetcomm backend object. Loads nothing: without the extension loaded,
    no hetcomm backend can exist."""
    module = loaded()
    return module is not None and isinstance(obj, module.ProcessGroupHetcomm)


@functools.cache
def engine_settings() -> dict[str, int]:
    """``hetcomm._C.engine_settings()``: the engine's constants and the settings it read from the
    environment (once per process, so the answer never changes and is kept)."""
    return dict(extension().engine_settings())


@functools.cache
def supported_devices() -> tuple[str, ...]:
    """The device types this build moves: ``("cpu", "cuda")`` for a CUDA build, else ``("cpu",)``.

    Known without loading the extension (torch.distributed needs the answer when the backend is
    registered, at ``import hetcomm``): setup.py records it beside the extension when it builds
    it (``hetcomm/_build_info.py``). An extension built otherwise is loaded and asked; with none
    built at all: CPU only, and creating a group says what is missing.
    """
    try:
        from hetcomm._build_info import WITH_CUDA
    except ImportError:
        if importlib.util.find_spec(_NAME) is None:
            return ("cpu",)
        WITH_CUDA = bool(extension().built_with_cuda())
    return ("cpu", "cuda") if WITH_CUDA else ("cpu",)


def store_seal_key(context: str) -> bytes | None:
    """The key that seals ``context``'s store values with the out-of-band secret
    (``hetcomm._C.store_seal_key``), or None when none is set: then the extension is not loaded
    (an elastic run over Gloo needs no build)."""
    import os
    if "HETCOMM_SECRET_FILE" not in os.environ and "HETCOMM_SECRET" not in os.environ:
        return None
    module = extension()
    if not hasattr(module, "store_seal_key"):
        raise ImportError("hetcomm: the compiled extension predates sealed elastic records: rebuild it "
                          "(`pip install --no-build-isolation -e .`)")
    try:
        return module.store_seal_key(context)
    except RuntimeError as e:                       # the engine's CommError: a secret it refuses
        raise ValueError(f"hetcomm: the out-of-band secret cannot be used: {e}") from e
