"""hetcomm.plan.hierarchy: the site plan's cost model against hand-derived values, the choice
between the flat ring and the site plan, and the cut bound. Pure: no processes."""
from __future__ import annotations

import math

import pytest

from hetcomm import plan as site_planner
from hetcomm import planner, topology
from hetcomm.plan import LinkModel, SitePlan

MB = 1e6 / 8          # bytes/s in one Mbit/s
N = 16 << 20


def sites_model(labels, intra, inter, wan=None, alpha=0.0):
    P = len(labels)
    bw = [[(intra if labels[i] == labels[j] else inter) * MB for j in range(P)] for i in range(P)]
    uplinks = ()
    if wan is not None:
        uplinks = tuple((tuple(r for r in range(P) if labels[r] == s), wan * MB, wan * MB)
                        for s in sorted(set(labels)))
    return LinkModel(bw=bw, uplinks=uplinks, alpha=alpha, segment_bytes=64 << 10)


def test_two_interleaved_sites_per_byte_time_by_hand():
    # Sites {0,2} {1,3}, four blocks of 1/4, site shares 1/2: every cross-site link carries
    # 1/4 (1/2 + 1/2) = 1/4 N each way at 12.5 MB/s; ring links inside a site of two carry N at 125 MB/s.
    model = sites_model((0, 1, 0, 1), 1000, 100)
    plan = SitePlan(((0, 2), (1, 3)), ((0, 1), (0, 3), (2, 1), (2, 3)), (0.25,) * 4, (0.5, 0.5))
    loads = plan.link_loads()
    assert loads[(0, 2)] == pytest.approx(1.0) and loads[(2, 0)] == pytest.approx(1.0)
    for a, b in [(0, 1), (1, 0), (0, 3), (3, 0), (2, 1), (1, 2), (2, 3), (3, 2)]:
        assert loads[(a, b)] == pytest.approx(0.25)
    assert site_planner.site_plan_seconds_per_byte(plan, model) == pytest.approx(0.25 / (100 * MB))
    # predict = N T + (2 (m - 1) + 2) alpha + seg ((m - 1) mean(1/ring bw) + mean(1/cross bw))
    model_a = sites_model((0, 1, 0, 1), 1000, 100, alpha=1e-4)
    seg = 64 << 10
    by_hand = N * 0.25 / (100 * MB) + 4 * 1e-4 + seg * (1 / (1000 * MB) + 1 / (100 * MB))
    assert site_planner.predict_site_plan_seconds(plan, model_a, N) == pytest.approx(by_hand)
    # the flat uniform ring 0>1>2>3 crosses on every link: 1.5 N at 12.5 MB/s
    flat = planner.uniform_plan(4)
    assert planner.ring_seconds_per_byte(flat.order, flat.shares, model) == pytest.approx(1.5 / (100 * MB))


def test_shared_uplink_loads_by_hand():
    # Two sites behind 100 Mbit/s uplinks: the site plan moves N through each uplink each way; the
    # uniform ring 0>1>2>3 with sites {0,1} {2,3} crosses on 1->2 and 3->0, 1.5 N each.
    model = sites_model((0, 0, 1, 1), 1000, 10000, wan=100)
    plan = site_planner.best_site_plan(model, (0, 0, 1, 1))
    assert site_planner.site_plan_seconds_per_byte(plan, model) == pytest.approx(1.0 / (100 * MB))
    flat = planner.uniform_plan(4)
    assert planner.ring_seconds_per_byte(flat.order, flat.shares, model) == pytest.approx(1.5 / (100 * MB))
    # sites 0,1,0,1: the ring crosses on all four links, 3 N through each uplink
    model2 = sites_model((0, 1, 0, 1), 1000, 10000, wan=100)
    assert planner.ring_seconds_per_byte(flat.order, flat.shares, model2) == pytest.approx(3.0 / (100 * MB))
    # the LP spreads blocks over the cross pairs even though the uplink makes every split optimal
    assert len(plan.blocks) == 4


def test_three_sites_move_four_thirds_n_per_site():
    model = sites_model((0, 0, 1, 1, 2, 2), 1000, 10000, wan=100)
    plan = site_planner.best_site_plan(model, (0, 0, 1, 1, 2, 2))
    assert plan.site_shares == pytest.approx((1 / 3,) * 3)
    # out of a site: (1 + (S - 2) w) N = 4/3 N
    assert site_planner.site_plan_seconds_per_byte(plan, model) == pytest.approx((4 / 3) / (100 * MB))
    assert site_planner.cut_bound_seconds(model, N, (0, 0, 1, 1, 2, 2)) == pytest.approx(N * (4 / 3) / (100 * MB))


def test_sites_as_nodes_bound_sums_each_direction():
    # Three lone ranks whose uplinks are (out, in) = (1, 10), (10, 1), (1, 10) units: 4 N must
    # leave the sites through out-cuts summing to 12 and arrive through in-cuts summing to 21,
    # so N / 3 units; summing each site's slower direction (1 + 1 + 1) would claim 4 N / 3.
    unit = 100 * MB
    bw = [[0 if i == j else 1e12 for j in range(3)] for i in range(3)]
    model = LinkModel(bw=bw, uplinks=(((0,), unit, 10 * unit), ((1,), 10 * unit, unit), ((2,), unit, 10 * unit)))
    assert site_planner.cut_bound_seconds(model, N, (0, 1, 2)) == pytest.approx(max(4 * N / (12 * unit), N / unit))


def test_site_shares_follow_cut_capacity():
    # three single-rank sites behind uplinks of 300, 300 and 400: (1 + w_s) / C_s equal at
    # w = (0.2, 0.2, 0.6)
    bw = [[0 if i == j else 1e12 for j in range(3)] for i in range(3)]

    def shares(caps):
        model = LinkModel(bw=bw, uplinks=tuple(((k,), c * MB, c * MB) for k, c in enumerate(caps)))
        return site_planner.site_shares_for(model, [(0,), (1,), (2,)])

    assert shares((300, 300, 400)) == pytest.approx((0.2, 0.2, 0.6), abs=1e-8)
    # 100, 100, 400 cannot be equalised: the slow sites reduce nothing, the fast one everything,
    # and the slow sites' N / 100 is the best any w gives
    assert shares((100, 100, 400)) == pytest.approx((0.0, 0.0, 1.0), abs=1e-8)


def test_unequal_sites_need_no_root():
    model = sites_model((0, 0, 0, 1), 1000, 100)
    plan = site_planner.best_site_plan(model, (0, 0, 0, 1))
    # every rank of the big site owns a block paired with rank 3: three parallel WAN paths
    assert sorted(b[0] for b in plan.blocks) == [0, 1, 2]
    assert all(b[1] == 3 for b in plan.blocks)
    bound = site_planner.cut_bound_seconds(model, N)
    assert bound == pytest.approx(N / (300 * MB))
    assert N * site_planner.site_plan_seconds_per_byte(plan, model) == pytest.approx(bound)


def test_cut_bound_independent_and_shared():
    assert site_planner.cut_bound_seconds(sites_model((0, 1, 0, 1), 1000, 100), N) == pytest.approx(N / (400 * MB))
    assert site_planner.cut_bound_seconds(sites_model((0, 0, 1, 1), 1000, 10000, wan=100), N) == \
        pytest.approx(N / (100 * MB))
    # a uniform cluster: the slowest cut is one rank's three links
    assert site_planner.cut_bound_seconds(sites_model((0, 0, 0, 0), 1000, 1000), N) == pytest.approx(N / (3000 * MB))


def test_choice_flat_on_one_site_hierarchical_across_sites():
    uniform = sites_model((0, 0, 0, 0), 1000, 1000, alpha=1e-4)
    plan = planner.choose_plan(uniform, site_labels=(0, 0, 0, 0))
    assert plan.sites is None and plan.is_uniform
    two = sites_model((0, 1, 0, 1), 1000, 100, alpha=1e-4)
    plan = planner.choose_plan(two, site_labels=(0, 1, 0, 1))
    assert plan.sites is not None
    # from min_bytes on, predicted faster than the ring by the margin; just below, not
    n = plan.sites.min_bytes
    ring = planner.uniform_plan(4)
    assert site_planner.predict_site_plan_seconds(plan.sites, two, n) < \
        planner.predict_allreduce_seconds(ring, two, n) * (1 - planner.DECLARED_MIN_GAIN)
    if n // 2 > two.small_allreduce_bytes:
        assert not site_planner.predict_site_plan_seconds(plan.sites, two, n // 2) < \
            planner.predict_allreduce_seconds(ring, two, n // 2) * (1 - planner.DECLARED_MIN_GAIN)
    assert planner.predict_allreduce_seconds(plan, two, N) == pytest.approx(
        site_planner.predict_site_plan_seconds(plan.sites, two, N))


def test_hierarchical_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("HETCOMM_HIERARCHICAL", "0")
    plan = planner.choose_plan(sites_model((0, 1, 0, 1), 1000, 100), site_labels=(0, 1, 0, 1))
    assert plan.sites is None


def test_slow_nic_is_not_mistaken_for_a_fast_site():
    # 800/800/800/100 NICs: rank 3 looks like a site of its own, but its NIC is shared by all its
    # peers (LinkModel.from_nics makes each NIC an uplink), so the site plan moves no fewer bytes
    # per second than the LP ring: it is not chosen for large messages.
    model = LinkModel.from_nics([100e6, 100e6, 100e6, 12.5e6])
    site = site_planner.best_site_plan(model, (0, 0, 0, 1))
    ring = planner.best_plan(model)
    assert site_planner.site_plan_seconds_per_byte(site, model) == pytest.approx(
        planner.ring_seconds_per_byte(ring.order, ring.shares, model))
    plan = planner.choose_plan(model, site_labels=(0, 0, 0, 1))
    assert plan.sites is None


def test_plan_round_trips_through_the_broadcast_encoding():
    two = sites_model((0, 1, 0, 1), 1000, 100)
    plan = planner.choose_plan(two, site_labels=(0, 1, 0, 1))
    back = topology._decode_plan(topology._encode_plan(plan), 4, None)
    assert back.sites == plan.sites and back.order == plan.order and back.shares == plan.shares
    flat = topology._decode_plan(topology._encode_plan(planner.uniform_plan(4)), 4, None)
    assert flat.sites is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(sites=((0, 1), (1, 2)), blocks=((0, 1),), block_shares=(1.0,), site_shares=(1, 1)), "partition"),
    (dict(sites=((0,), (1,)), blocks=((1, 0),), block_shares=(1.0,), site_shares=(1, 1)), "one rank of each site"),
    (dict(sites=((0,), (1,)), blocks=((0, 1),), block_shares=(-1.0,), site_shares=(1, 1)), "block shares"),
    (dict(sites=((0,), (1,)), blocks=((0, 1),), block_shares=(1.0,), site_shares=(1,)), "site shares"),
    (dict(sites=((0,), (1,)), blocks=((0, 1),), block_shares=(math.nan,), site_shares=(1, 1)), "block shares"),
])
def test_site_plan_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SitePlan(**kwargs)
