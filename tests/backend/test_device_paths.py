"""The device (staged) paths on the emulated device (HETCOMM_DEBUG_EMULATE_DEVICE=1: host memory
behind a queue thread, run as CUDA memory would be): the same checks that tests/backend/test_cuda.py
runs on a GPU (tests/support/device_suite.py).

* fp16 and bf16 AVG of values whose sum overflows the dtype stay finite and within one rounding
  of the float64 mean, on one host (shared memory; all over TCP) and across hosts (the host
  schedule, its pieces staged between hosts);
* the host staging memory a group holds after a long allreduce across hosts is bounded by its
  slots and one piece (HETCOMM_SITE_PIECE_BYTES), not by the message, and is 0 once the group is
  destroyed.
"""
from __future__ import annotations

import pytest

from device_suite import AVG_FAMILIES, large_avg_suite, staging_suite
from harness import run_suite
from marks import hetcomm_only

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("device staging")]

# The staged pipeline from 64 KB on (not 2 MB), so that a message of 100,000 fp16 takes it.
EMULATED = {"HETCOMM_DEBUG_EMULATE_DEVICE": "1", "HETCOMM_PROBE": "0", "HETCOMM_DEVICE_HOST_REDUCE_BYTES": "65536"}
PATHS = {
    "one-host-shm": (2, {}),
    "one-host-tcp": (2, {"HETCOMM_LOCAL": "tcp"}),
    "two-hosts-of-two": (4, {"HETCOMM_HOST_ID": "0,0,1,1"}),
}
_REPORTS: dict = {}


def _avg_report(path: str):
    if path not in _REPORTS:
        ws, env = PATHS[path]
        _REPORTS[path] = run_suite(ws, large_avg_suite, "cpu", (1000, 100_000), families=AVG_FAMILIES, timeout=240, pg_timeout=60,
                                   env={**EMULATED, **env})
    return _REPORTS[path]


@pytest.mark.parametrize("path,family", [pytest.param(p, f, id=f"{p}-{f}") for p in PATHS for f in AVG_FAMILIES])
def test_half_precision_avg_of_large_values_stays_finite_and_rounded(path: str, family: str) -> None:
    _avg_report(path).assert_family(family)


SLOTS = 4 * 16 * 1024    # the emulated device's staging slots (process_group_hetcomm.cc)
PIECE = 1 << 20          # HETCOMM_SITE_PIECE_BYTES below


def test_staging_memory_is_bounded_by_a_piece_and_freed_with_the_group() -> None:
    """Hosts {0,1} {2,3}: a 16 MiB allreduce in 1 MiB pieces holds the slots and one piece,
    exactly (a 16 MiB buffer, or no piece staged at all, would fail), and nothing once the group
    is destroyed."""
    env = {**EMULATED, "HETCOMM_HOST_ID": "0,0,1,1", "HETCOMM_SITE_PIECE_BYTES": str(PIECE)}
    report = run_suite(4, staging_suite, "cpu", 4 << 20, SLOTS + PIECE, True, families=["staging"], timeout=240,
                       pg_timeout=60, env=env)
    report.assert_family("staging")
    assert all(v is not None and v["after_destroy"] == 0 for v in report.values), report.values
