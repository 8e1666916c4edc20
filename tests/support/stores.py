"""A store of its own for a test: ``python -m hetcomm.store`` in a process, as a user runs it
beside the workers of an elastic run (forked, see forked.py: it starts in a fraction of a second)."""
from __future__ import annotations

import os
import tempfile
import time

import pytest

import forked

READY = "serving a TCPStore on 127.0.0.1:"


def start_store(log_dir: str | None = None) -> tuple[forked.Forked, int]:
    """Starts the store on a free port; returns its process and the port."""
    log = os.path.join(log_dir or tempfile.mkdtemp(prefix="hetcomm-store-"), "store.log")
    proc = forked.start("hetcomm.store", ["--host", "127.0.0.1", "--port", "0", "--timeout", "20"], log)
    deadline = time.monotonic() + 60
    text = ""
    while READY not in text:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"python -m hetcomm.store did not start (exit {proc.poll()}): {text}")
        time.sleep(0.02)
        if os.path.exists(log):             # the store's process creates it
            with open(log) as f:
                text = f.read()
    return proc, int(text.split(READY)[1].split()[0])
