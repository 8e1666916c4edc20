"""The multi-process harness itself (tests/support/harness.py): a job's ranks are forked from a
server that imported torch once, unless the job's environment differs from the server's in a
variable read at import (then fresh interpreters, about 3 s of a core each). A difference torch
made itself in the pytest process must not count as one: before, torch._dynamo's import set
TORCHINDUCTOR_CACHE_DIR here after the server's environment was taken, and every later job of the
suite was spawned (the parallel pass took 1,550 s instead of 555 s)."""
from __future__ import annotations

import os
import subprocess
import sys


def test_a_job_after_torch_dynamos_import_is_forked_as_before_it():
    support = os.path.join(os.path.dirname(__file__), "support")
    code = ("import os, harness\n"
            "before = harness._context(None).get_start_method()\n"
            "import torch._dynamo\n"
            "print(before, harness._context(dict(os.environ)).get_start_method())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([support, os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)            # as in a fresh pytest process
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.split()[-2:]
    assert after == before, out.stdout
