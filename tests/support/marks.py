"""Markers for tests that need something the machine may not have.

* ``hetcomm_only(reason)``: a test of hetcomm's own API or wire protocol; skipped when the suite
  runs against gloo (``HETCOMM_TEST_BACKEND=gloo``, which validates the tests themselves).
* ``needs_netns``: a test that builds a simulated cluster (``hetcomm.sim``: root, ``ip netns``,
  ``tc``, cgroups). It carries the ``sim`` marker, so ``-m "not sim"`` leaves it out. Where the
  machine cannot build namespaces it skips and says why -- unless ``HETCOMM_REQUIRE_SIM=1`` (set
  by ``scripts/test.sh``, so CI never turns a missing simulator into green skips), where it fails.
"""
from __future__ import annotations

import functools
import os
import secrets
import subprocess

import pytest

from harness import BACKEND


def hetcomm_only(reason: str):
    """Skip marker for tests of hetcomm's own API or wire protocol when running under gloo."""
    return pytest.mark.skipif(BACKEND != "hetcomm",
                              reason=f"hetcomm-only ({reason}); backend under test is {BACKEND}")


@functools.lru_cache(maxsize=None)
def netns_unavailable_reason() -> str | None:
    """None where this process can build a simulated cluster, else why not (asked once)."""
    if os.geteuid() != 0:
        return "needs root: hetcomm.sim creates network namespaces (ip netns) and cgroups"
    from hetcomm.sim import netns as sim_netns

    ip = sim_netns.find_tool("ip")
    if ip is None or sim_netns.find_tool("tc") is None:
        return "needs root and iproute2 (`ip`, `tc`): not found"
    name = f"hcsim-probe{secrets.token_hex(2)}"
    try:
        p = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            return f"needs root and a working `ip netns`: `ip netns add` failed: {p.stderr.strip()}"
    finally:
        subprocess.run([ip, "netns", "del", name], capture_output=True, timeout=30)
    return None


def sim_required() -> bool:
    return os.environ.get("HETCOMM_REQUIRE_SIM", "") not in ("", "0")


def _skip_or_fail_without_netns(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        reason = netns_unavailable_reason()
        if reason is not None:
            if sim_required():
                pytest.fail(f"HETCOMM_REQUIRE_SIM=1 but the simulator cannot run here: {reason}",
                            pytrace=False)
            pytest.skip(reason)
        return fn(*args, **kwargs)
    return wrapper


def needs_netns(fn):
    """Decorator: the test builds a simulated cluster (marker ``sim``; see the module docstring)."""
    return pytest.mark.sim(_skip_or_fail_without_netns(fn))
