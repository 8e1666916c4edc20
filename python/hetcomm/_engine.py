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
import struct
import sys
from typing import Any, Optional

_NAME = "hetcomm._C"


def extension():
    """The extension module, loaded now if this process has not loaded it yet."""
    module = sys.modules.get(_NAME)
    if module is None:
        import torch  # noqa: F401  (before the extension: it needs torch's libraries and types)
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

    Read from the extension's file without loading it (torch.distributed needs the answer when
    the backend is registered, at ``import hetcomm``): a CUDA build links the CUDA runtime and
    torch's CUDA libraries (setup.py's CUDAExtension, CMake's ``HETCOMM_WITH_CUDA``), a CPU-only
    build none of them. Where the file cannot be read that way, the loaded extension answers.
    With no extension built at all: CPU only, and creating a group says what is missing.
    """
    spec = importlib.util.find_spec(_NAME)
    if spec is None:
        return ("cpu",)
    needed = _needed_libraries(spec.origin) if spec.origin else None
    if needed is None:
        cuda = bool(extension().built_with_cuda())
    else:
        cuda = any(name.startswith(("libcudart", "libc10_cuda", "libtorch_cuda")) for name in needed)
    return ("cpu", "cuda") if cuda else ("cpu",)


def _needed_libraries(path: str) -> Optional[list[str]]:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF shared object (what ``objdump -p``
    lists as NEEDED), read from its program headers and dynamic section; None if ``path`` is not
    such a file."""
    try:
        with open(path, "rb") as f:
            header = f.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4:6] != b"\x02\x01":
                return None
            (phoff,) = struct.unpack_from("<Q", header, 32)
            phentsize, phnum = struct.unpack_from("<HH", header, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            loads, dynamic = [], None
            for k in range(phnum):
                kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", table, k * phentsize)
                if kind == 1:                      # PT_LOAD: maps file offsets to addresses
                    loads.append((vaddr, offset, filesz))
                elif kind == 2:                    # PT_DYNAMIC
                    dynamic = (offset, filesz)
            if dynamic is None:
                return None
            f.seek(dynamic[0])
            entries = f.read(dynamic[1])
            needed, strtab, strsz = [], None, None
            for tag, value in struct.iter_unpack("<qQ", entries[:len(entries) // 16 * 16]):
                if tag == 0:                       # DT_NULL
                    break
                if tag == 1:                       # DT_NEEDED: an offset into the string table
                    needed.append(value)
                elif tag == 5:                     # DT_STRTAB (an address)
                    strtab = value
                elif tag == 10:                    # DT_STRSZ
                    strsz = value
            where = [offset + strtab - vaddr for vaddr, offset, size in loads
                     if strtab is not None and vaddr <= strtab < vaddr + size]
            if not where or strsz is None:
                return None
            f.seek(where[0])
            strings = f.read(strsz)
    except (OSError, struct.error):
        return None
    return [strings[k:strings.index(b"\0", k)].decode(errors="replace") for k in needed]
