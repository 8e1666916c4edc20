"""Shared pytest configuration for the hetcomm suite.

Tests mirror the package: tests/<package>/ holds the tests of python/hetcomm/<package>
(backend/ and transport/ those of the C++ backend through torch.distributed); tests/support/
holds the multi-process harness and the helpers several test modules share, and is put on
sys.path here (spawned ranks inherit it).

The backend under test is ``HETCOMM_TEST_BACKEND`` (default "hetcomm"). Running the suite with
``HETCOMM_TEST_BACKEND=gloo`` checks the tests themselves against PyTorch's reference backend;
tests that only make sense for hetcomm (its wire protocol, its Python API) skip under gloo and
say so.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))

# torch's TCPStore looks up the name of every peer that connects to it (its sockets are IPv6 with
# IPv4-mapped addresses, which /etc/hosts does not answer for, so the lookup goes to DNS). Where
# the resolver is unreachable or drops a query -- our CI machines' does, for about one connection
# in ten -- glibc waits its 5 s timeout, and a store connection made during group creation stalls
# that long: a test with a 5 s collective timeout then fails, and every other waits. One second,
# one attempt, for the tests and every process they start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

from harness import BACKEND  # noqa: E402


def pytest_report_header(config) -> str:
    return f"hetcomm tests: backend under test = {BACKEND!r} (HETCOMM_TEST_BACKEND)"


@pytest.fixture(scope="session")
def backend_importable() -> str:
    """Fails every test that uses it at once, with the import error, when hetcomm or its compiled
    extension cannot be imported (the multi-process test modules use it through ``pytestmark``).

    Checked in a separate interpreter so that a crash while loading the extension cannot take
    pytest down with it.
    """
    if BACKEND not in ("hetcomm", "gloo"):
        pytest.fail(f"HETCOMM_TEST_BACKEND={BACKEND!r}: expected 'hetcomm' or 'gloo'")
    if BACKEND == "hetcomm":
        # `import hetcomm` alone does not load the extension (the first group does): load it.
        code = "import hetcomm, hetcomm._engine as e; e.extension()"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            pytest.fail("`import hetcomm` or loading its extension failed (exit status "
                        f"{proc.returncode}):\n{proc.stderr[-3000:]}", pytrace=False)
    return BACKEND


@pytest.fixture
def backend() -> str:
    return BACKEND
