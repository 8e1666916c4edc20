"""A store of its own for a test: ``python -m hetcomm.store`` in a process, as a user runs it
beside the workers of an elastic run."""
from __future__ import annotations

import select
import subprocess
import sys

import pytest


def start_store() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "hetcomm.store", "--host", "127.0.0.1", "--port", "0",
                             "--timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready:
        proc.kill()
        pytest.fail("python -m hetcomm.store printed nothing within 60 s")
    line = proc.stdout.readline()
    if "serving a TCPStore on 127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"python -m hetcomm.store did not start: {line}{proc.stdout.read()}")
    return proc, int(line.split("127.0.0.1:")[1].split()[0])
