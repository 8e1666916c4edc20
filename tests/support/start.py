"""How the harness starts a job's ranks (tests/support/harness.py): from a fork server that
imported torch and hetcomm once, or as fresh interpreters, and with the job's environment.

A forked rank takes its environment itself (`enter_process`); a spawned one gets the variables
in which the job differs set in this process while it starts (`environment_for`). A job that
sets a variable torch reads at import differently from the fork server's is spawned (`_context`).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import os
import threading

BACKEND: str = os.environ.get("HETCOMM_TEST_BACKEND", "hetcomm")


def enter_process(environ: dict, output: str) -> None:
    """What a process the harness starts does first, before it imports any code of the test: take
    the job's environment (a forked one starts with the fork server's; os.environ writes through
    to the C library's, which the extension reads) and send its stdout and stderr to ``output``
    (a forked one would otherwise write to whatever the fork server inherited)."""
    os.environ.clear()
    os.environ.update(environ)
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def exit_like_a_program() -> None:
    """What the interpreter does when a program ends, for a forked process (which multiprocessing
    ends in os._exit): join the threads that are not daemons (an executor's workers among them),
    then run the exit handlers (hetcomm shuts its groups down in one), in that order. The
    interpreter's finalization itself cannot be had in a fork: tests of it use fresh=True."""
    threading._shutdown()
    atexit._run_exitfuncs()


# Ranks are forked from a fork server that has imported torch and hetcomm once, instead of
# spawned as fresh interpreters that each import them again (about 2 s of a core per rank, which
# was most of the suite's time). Every rank is still a new process with its own state: the fork
# server never runs a rank's code, and it forks before any thread of ours exists (a library's
# thread pool, such as OpenBLAS's, is rebuilt in the child by its fork handlers).
# HETCOMM_TEST_START=spawn goes back to fresh interpreters.
START_METHOD = os.environ.get("HETCOMM_TEST_START", "forkserver")
# torch._dynamo: the first optimizer a process makes imports it (Optimizer.__init__ wraps its
# methods with torch._disable_dynamo), 1.5 s of a core in every rank that trains, otherwise.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "pytest", "harness", "values"]
# What a hetcomm group and the training tests load (the extension's settings are read from the
# environment on first use, in the rank, not when it is loaded).
HETCOMM_PRELOAD = ["hetcomm", "hetcomm._C", "hetcomm.topology", "hetcomm.train.diloco", "hetcomm.train.elastic"]


# Variables that torch, OpenMP or the C++ runtime read when torch is imported (the debug level of
# torch.distributed, its C++ log level and stack traces, thread pools): a job that sets one of
# them differently needs a fresh interpreter, since the fork server imported torch under its own.
_READ_AT_IMPORT = ("TORCH_", "PYTORCH_", "TORCHDYNAMO_", "TORCHINDUCTOR_", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA_", "NCCL_", "GLOO_", "LD_")
_SERVER_ENVIRON: dict[str, str] = {}


def _read_at_import(environ: dict) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(_READ_AT_IMPORT)}


@contextlib.contextmanager
def environment_for(ctx, environ: dict):
    """While a process of ``ctx`` is started: for a spawned interpreter, which reads some of its
    environment (torch's import) before any code of ours runs, the variables in which ``environ``
    differs from this process's, set here for the moment (only those: the job's TCPStore server
    thread of this process reads the environment meanwhile). A forked process takes its
    environment itself (enter_process), and the fork server keeps the one it started with."""
    if ctx.get_start_method() != "spawn":
        yield
        return
    changed = {k: os.environ.get(k) for k in set(environ) | set(os.environ) if environ.get(k) != os.environ.get(k)}
    for k in changed:
        if k in environ:
            os.environ[k] = environ[k]
        else:
            del os.environ[k]
    try:
        yield
    finally:
        for k, v in changed.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forkserver_is_private() -> bool:
    """Whether the fork server listens where only this user can connect: a socket file in a
    private directory. Before Python 3.9.16/3.10.9/3.11.1 it used an abstract socket any local
    user could reach (CVE-2022-42919), and the suite runs as root in CI: spawn there instead."""
    from multiprocessing import connection
    return not connection.arbitrary_address("AF_UNIX").startswith("\0")


def _context(environ: dict | None = None):
    """The context a job's ranks start from: the fork server, unless the job's environment
    differs from the server's in something read at import (then fresh interpreters)."""
    if START_METHOD == "forkserver" and not _forkserver_is_private():
        return multiprocessing.get_context("spawn")
    preload = PRELOAD + (HETCOMM_PRELOAD if BACKEND == "hetcomm" else [])
    if START_METHOD == "forkserver":
        if not _SERVER_ENVIRON:
            # What the server starts with (once), after what its preload sets on import, as
            # this process does once it imports the same (torch._dynamo sets
            # TORCHINDUCTOR_CACHE_DIR): not a difference a job made.
            for name in preload:
                importlib.import_module(name)
            _SERVER_ENVIRON.update(os.environ)
        if environ is not None and _read_at_import(environ) != _read_at_import(_SERVER_ENVIRON):
            return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(preload)  # takes effect when the server starts (once)
    return ctx
