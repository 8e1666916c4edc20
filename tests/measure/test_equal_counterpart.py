"""The pieces of the trial at creation that need no processes: the equal model the measured plan
is timed against (every class of link at its median, levels kept), which plans count as
different, the trial's size and its rule. Hand-computed cases."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetcomm import plan as planner
from hetcomm.measure.probe import _equal_pairs
from hetcomm.measure.schedule import model_from_rates
from hetcomm.measure.trial import MAX_TRIAL_BYTES, MIN_TRIAL_BYTES, keeps_measured, same_shares, trial_bytes

MB = 1e6


def test_the_equal_model_keeps_the_levels_and_evens_out_each_class() -> None:
    # 3 hosts of 2 ranks in 2 sites (hosts 0, 1 | host 2); host NIC units 0->1 and 1->0 measured.
    hosts, sites = (0, 0, 1, 1, 2, 2), (0, 0, 0, 0, 1, 1)
    rates = {("nic", 0, 1): 90 * MB, ("nic", 1, 0): 30 * MB,
             ("uplink", 0, "out"): 10 * MB, ("uplink", 1, "out"): 14 * MB}
    per_flow = {("loopback", 0): 900 * MB, ("loopback", 1): 500 * MB, ("loopback", 2): 700 * MB,
                ("cross", 0, 1): 9 * MB, ("cross", 1, 0): 13 * MB}
    reduce = [4e9, 2e9, 6e9, 4e9, 4e9, 8e9]
    measured = model_from_rates(hosts, sites, rates, per_flow, reduce, 1e-4)
    equal = model_from_rates(hosts, sites, rates, per_flow, reduce, 1e-4, equal=True)
    assert measured.bw[0, 2] != measured.bw[2, 0]
    # host NICs: out 90, 30 and in 30, 90 for hosts 0, 1; host 2 is its site: its NIC is its
    # uplink (14 out, 10 in). Their median is 30 (of 90, 30, 14, 30, 90, 10): 30 MB/s each.
    assert equal.bw[0, 2] == equal.bw[2, 0] == pytest.approx(30 * MB)
    # loopback: the median of 900, 500, 700
    assert equal.bw[0, 1] == equal.bw[2, 3] == pytest.approx(700 * MB)
    # the site uplinks stay a level of their own, at their median (12: of 10, 14, 14, 10)
    assert {(g, o, i) for g, o, i in equal.uplinks if len(g) == 2 and g[0] == 4} == {((4, 5), 12 * MB, 12 * MB)}
    assert len(equal.uplinks) == len(measured.uplinks)
    assert equal.reduce_bps == (4e9,) * 6


def test_the_pairs_counterpart_evens_out_same_host_same_site_and_cross_site_pairs_apart() -> None:
    bw = np.array([[0, 800, 90, 40], [700, 0, 110, 60], [95, 100, 0, 50], [45, 55, 52, 0]], dtype=float) * MB
    model = planner.LinkModel(bw=bw, reduce_bps=(1e9, 3e9, 2e9, 5e9),
                              uplinks=(((0, 1, 2), 20 * MB, 30 * MB), ((3,), 10 * MB, 40 * MB)))
    equal = _equal_pairs(model, hosts=(0, 0, 1, 2), sites=(0, 0, 0, 1))
    assert equal.bw[0, 1] == equal.bw[1, 0] == 750 * MB                      # same host
    assert {equal.bw[i, j] for i, j in [(0, 2), (2, 0), (1, 2), (2, 1)]} == {97.5 * MB}   # same site
    assert {equal.bw[i, 3] for i in range(3)} | {equal.bw[3, i] for i in range(3)} == {51 * MB}
    assert {o for _, o, _ in equal.uplinks} | {i for _, _, i in equal.uplinks} == {25 * MB}
    assert equal.reduce_bps == (2.5e9,) * 4


def test_plans_differ_only_by_who_carries_what() -> None:
    ring = planner.Plan((0, 1, 2, 3), (0.25,) * 4)
    assert same_shares(ring, dataclasses.replace(ring, min_bytes=1 << 20, segment_bytes=65536))
    assert not same_shares(ring, planner.Plan((0, 1, 2, 3), (0.5, 0.5, 0.0, 0.0)))
    assert not same_shares(ring, planner.Plan((0, 2, 1, 3), (0.25,) * 4))
    hp = planner.host_plan((0, 0, 1, 1))
    with_hosts = dataclasses.replace(ring, sites=hp)
    assert not same_shares(ring, with_hosts)
    assert same_shares(with_hosts, dataclasses.replace(ring, sites=dataclasses.replace(hp, segment_bytes=1 << 17)))
    assert not same_shares(with_hosts, dataclasses.replace(ring, sites=dataclasses.replace(hp, site_shares=(0.75, 0.25))))


def test_the_trial_size_follows_the_prediction_and_where_the_plans_differ() -> None:
    fast = planner.LinkModel.from_nics([100e9 / 8] * 4)      # 16 MB in well under 0.1 s
    slow = planner.LinkModel.from_nics([100e6 / 8] * 4)      # 2 MB take longer than 0.1 s
    ring = planner.Plan((0, 1, 2, 3), (0.4, 0.2, 0.2, 0.2))
    uniform = planner.uniform_plan(4)
    assert trial_bytes(ring, uniform, fast) == MAX_TRIAL_BYTES
    # 100 Mbit/s NICs: the ring is predicted at 0.08 s for 512 KB, 0.16 s for 1 MB
    assert trial_bytes(ring, uniform, slow) == 512 << 10
    # never below the floor, however slow the links
    crawl = planner.LinkModel.from_nics([1e6 / 8] * 4)
    assert trial_bytes(ring, uniform, crawl) == MIN_TRIAL_BYTES
    # weighted shares only from 4 MB on: the trial must be at least that large ...
    assert trial_bytes(dataclasses.replace(ring, min_bytes=3 << 20), uniform, slow) == 4 << 20
    # ... and no trial at all when they apply only above the largest trial size
    assert trial_bytes(dataclasses.replace(ring, min_bytes=MAX_TRIAL_BYTES + 1), uniform, slow) == 0
    # a site (host) plan takes every allreduce from its own min_bytes on: the ring's crossover
    # no longer matters
    hp = planner.host_plan((0, 0, 1, 1))
    hosts = dataclasses.replace(ring, min_bytes=64 << 20, sites=hp)
    # (its prediction is under 0.1 s up to 2 MB: the host plan crosses each NIC fewer times)
    assert trial_bytes(hosts, uniform, slow) == trial_bytes(dataclasses.replace(hosts, min_bytes=0), uniform, slow) \
        == 2 << 20
    # the same host plan on both sides, from 8 MB on, and the rings differ from 0 B: the trial
    # runs where the rings run (512 KB), not where the site plan starts
    late = dataclasses.replace(hp, min_bytes=8 << 20)
    assert trial_bytes(dataclasses.replace(ring, sites=late), dataclasses.replace(uniform, sites=late), slow) \
        == 512 << 10
    # the same ring on both sides, host shares differing from 4 MB on: the trial is at 4 MB
    skewed_hosts = dataclasses.replace(hp, site_shares=(0.75, 0.25), min_bytes=3 << 20)
    assert trial_bytes(dataclasses.replace(uniform, sites=skewed_hosts),
                       dataclasses.replace(uniform, sites=dataclasses.replace(hp, min_bytes=3 << 20)), slow) == 4 << 20
    # recursive doubling up to HETCOMM_SMALL_ALLREDUCE_BYTES runs alike for both plans
    small = dataclasses.replace(slow, small_allreduce_bytes=2 << 20)
    assert trial_bytes(ring, uniform, small) == 4 << 20


def test_the_trial_rule_needs_the_margin_in_the_median_and_most_pairs() -> None:
    # times in seconds of each pair: (measured, equal)
    assert keeps_measured([0.80, 0.85, 0.82], [1.0, 1.0, 1.0])         # 18% faster, 3 of 3
    assert keeps_measured([0.80, 1.20, 0.85], [1.0, 1.0, 1.0])         # 15% faster in the median, 2 of 3
    assert not keeps_measured([0.50, 0.85, 1.30], [0.4, 1.0, 1.2])     # median 15% faster, 1 of 3 only
    assert not keeps_measured([0.92, 0.93, 0.91], [1.0, 1.0, 1.0])     # 8%: within the margin
    assert not keeps_measured([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])        # a tie keeps equal shares
