"""Every collective, every dtype, awkward sizes, exact expected values, 1 to 4 ranks.

One job per world size runs every check (a job forms a group, a small collective takes
microseconds); each family of checks is then reported as its own test, e.g.
``test_collective[3-reduce_scatter]``, so a failure names the collective, and the message names
rank, op, dtype and size. Inputs follow ``x[i] = (i % period) * STRIDE + rank`` (see
``values.pattern``), chosen so that every expected result is exactly representable in its dtype
whatever the reduction order; expected values are computed with plain torch. The suite itself
is tests/support/collective_suite.py (test_cuda.py runs it on CUDA tensors).
"""
from __future__ import annotations

import pytest

from collective_suite import FAMILIES, NEEDS_PEER, collective_suite, family_params
from harness import is_hetcomm, run_suite

pytestmark = pytest.mark.usefixtures("backend_importable")

WORLD_SIZES = [1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# The tests: one job per world size, one test per (world size, family)
# --------------------------------------------------------------------------------------------

_REPORTS: dict[tuple, object] = {}
# The ranks of these jobs share one machine, so hetcomm runs their collectives through shared
# memory (test_shm.py); these world sizes run the suite once more over TCP (HETCOMM_SHM=0), the
# ring and recursive doubling that groups spread over hosts use (2: the all-to-all's one peer
# is both its send and its receive flow).
TCP_WORLD_SIZES = [2, 3, 4]


def _report(world_size: int, tcp: bool = False):
    if (world_size, tcp) not in _REPORTS:
        families = [f for f in FAMILIES if world_size > 1 or f not in NEEDS_PEER]
        _REPORTS[(world_size, tcp)] = run_suite(world_size, collective_suite, families=families,
                                                timeout=300, pg_timeout=60,
                                                env={"HETCOMM_SHM": "0"} if tcp else None)
    return _REPORTS[(world_size, tcp)]


@pytest.mark.parametrize("world_size,family", family_params(WORLD_SIZES))
def test_collective(world_size: int, family: str) -> None:
    _report(world_size).assert_family(family)


@pytest.mark.skipif(not is_hetcomm(), reason="HETCOMM_SHM is hetcomm's; gloo has no shared-memory path")
@pytest.mark.parametrize("world_size,family", family_params(TCP_WORLD_SIZES))
def test_collective_over_tcp(world_size: int, family: str) -> None:
    _report(world_size, tcp=True).assert_family(family)
