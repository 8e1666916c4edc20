"""The glue between measured links and the installed plan (hetcomm.topology): pure parts only.

The probe and plan agreement across ranks are covered by tests/backend/test_plans.py.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
from hetcomm import planner  # noqa: E402

MB = 1e6


def nic_model(nics_mb_per_s: list[float]) -> planner.LinkModel:
    """A full-duplex NIC model: link i -> j runs at min(NIC_i, NIC_j)."""
    P = len(nics_mb_per_s)
    return planner.LinkModel(bw=[[min(nics_mb_per_s[i], nics_mb_per_s[j]) * MB for j in range(P)]
                                 for i in range(P)])


@pytest.mark.parametrize("slow_mb_per_s, expected_kb", [
    (11.7, 64),     # a measured 100 Mbit/s NIC: 58 KB in 5 ms, nearest power of two is 64 KB
    (5.0, 32),      # 25 KB: clamped to the 32 KB floor
    (9.0, 32),      # 45 KB is nearer 32 KB than 64 KB on a log scale (the midpoint is 45.25 KB)
    (48.0, 256),    # 240 KB
    (400.0, 1024),  # 2 MB: clamped to the 1 MB ceiling
])
def test_segment_bytes_is_the_nearest_power_of_two_to_5ms_on_the_slowest_link(slow_mb_per_s, expected_kb):
    model = nic_model([1000.0, 1000.0, 1000.0, slow_mb_per_s])
    plan = planner.make_plan(model, None, 0.0)
    assert planner.segment_bytes_for(plan, model) == expected_kb * 1024


def test_snap_measured_groups_rates_within_the_tolerance():
    P = 4
    bw = [[0.0] * P for _ in range(P)]
    fast = iter([101, 98, 84, 99, 99.5, 97.4])                 # MB/s, within 25% of one another
    slow = iter([11.7, 11.6, 11.6, 11.4, 11.3, 11.2])
    for i in range(P):
        for j in range(P):
            if i != j:
                bw[i][j] = (next(slow) if 3 in (i, j) else next(fast)) * MB
    snapped = planner.snap_measured(planner.LinkModel(bw=bw))
    rates = {snapped.bw[i][j] for i in range(P) for j in range(P) if i != j}
    assert len(rates) == 2, rates
    # Each group's median (of an even count: the lower middle one).
    assert min(rates) == pytest.approx(11.4 * MB) and max(rates) == pytest.approx(98 * MB)
    # The snapped model gives the exact plan of the declared cluster: the slow rank owns everything.
    assert planner.make_plan(snapped, None, 0.0).shares == pytest.approx((0.0, 0.0, 0.0, 1.0))


def test_snap_measured_keeps_rates_further_apart_than_the_tolerance():
    model = nic_model([100.0, 70.0, 40.0, 10.0])
    assert planner.snap_measured(model) == model


def test_a_new_default_group_forgets_the_measurements_of_the_old_world():
    """Global ranks name other processes after the default group is formed again (ElasticDiLoCo
    does it per generation): links measured by rank number before must not be reused then, or the
    old processes skip the probe that the new ones run (seen: a 60 s stall). Other groups reuse."""
    import datetime

    import torch.distributed as dist

    from hetcomm import topology

    topology._measured[(0, 1)] = "measured before"
    dist.init_process_group("hetcomm", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        assert (0, 1) not in topology._measured
        topology._measured[(0, 1)] = "measured by this world"
        sub = dist.new_group([0], backend="hetcomm")
        assert topology._measured[(0, 1)] == "measured by this world"
        dist.destroy_process_group(sub)
    finally:
        topology._measured.pop((0, 1), None)
        dist.destroy_process_group()
