"""The planner at scale (hetcomm.plan.order, .hierarchy, .choose): the level search against the
exhaustive search of every ring order on every host topology of up to 8 ranks, the structured
search against the cut bound on large clusters, and the number of LPs it takes. Pure: no
processes, no wall times (benchmarks/plan_time.py times it)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetcomm.plan import LinkModel, Topology, cut_bound_seconds, plan_for_group, site_plan_seconds_per_byte
from hetcomm.plan import order as plan_order
from hetcomm.plan.cost import ring_seconds_per_byte

GBIT = 1e9 / 8


def partitions(P: int):
    """Every partition of P ranks into groups, as labels numbered by lowest rank."""
    def grow(prefix, top):
        if len(prefix) == P:
            yield tuple(prefix)
            return
        for k in range(top + 2):
            yield from grow(prefix + [k], max(top, k))
    yield from grow([0], 0)


def host_model(hosts, sites, slow_host: int, slow_factor: float) -> LinkModel:
    h = np.asarray(hosts)
    H = int(h.max()) + 1
    nic = np.full(H, 10 * GBIT)
    nic[slow_host] /= slow_factor
    S = max(sites) + 1
    return LinkModel.from_levels(hosts, sites, host_out=nic, host_in=nic, loopback=[100 * GBIT] * H,
                                 cross_site=np.full((S, S), 1 * GBIT) if S > 1 else None,
                                 site_out=[1.5 * GBIT] * S if S > 1 else None,
                                 site_in=[1.5 * GBIT] * S if S > 1 else None)


def host_topologies():
    """Hosts of several ranks on up to 8 ranks (all of them up to 5 ranks, a fixed sample above:
    12 layouts of 6 and 7 ranks, 6 of 8, whose reference, every ring of 8 ranks, costs 4 s each),
    in one site or with their hosts alternating between two sites, one host slow."""
    rng = np.random.default_rng(8)
    out = []
    for P in range(2, 9):
        layouts = [h for h in partitions(P) if max(h) + 1 < P]
        if P > 5:
            layouts = [layouts[i] for i in sorted(rng.choice(len(layouts), 12 if P < 8 else 6, replace=False))]
        for hosts in layouts:
            H = max(hosts) + 1
            for two_sites in (False, True):
                sites = tuple(hosts[r] % 2 if two_sites and H > 1 else 0 for r in range(P))
                out.append((hosts, sites, int(rng.integers(H)), float(rng.choice([1.0, 2.0, 10.0]))))
    return out


@pytest.mark.parametrize("hosts, sites, slow_host, slow_factor", host_topologies())
def test_level_search_matches_every_order_on_host_topologies(hosts, sites, slow_host, slow_factor):
    """The ring over hosts (every order of the hosts, their ranks kept together, then a local
    search of the ranks: a fast host can be split around a slow one) is as fast as the best of
    every ring of the ranks, within 1%, as the planner predicts both."""
    model = host_model(hosts, sites, slow_host, slow_factor)
    plan_order.best_plan.cache_clear()
    fast = plan_order.best_plan(model, Topology(sites=sites, hosts=hosts))
    every = plan_order.best_plan(model, None, True)
    assert fast.predicted_bw_seconds_per_byte <= every.predicted_bw_seconds_per_byte * 1.01


@pytest.mark.parametrize("P", [16, 24])
def test_structured_search_matches_every_host_order(P):
    """Above 6 hosts the level search draws its orders from the structure: on hosts of 2 and 4
    with one slow host it finds what trying every order of the hosts finds."""
    rng = np.random.default_rng(P)
    for host_size in (2, 4):
        hosts = tuple(r // host_size for r in range(P))
        H = max(hosts) + 1
        model = host_model(hosts, (0,) * P, int(rng.integers(H)), 10.0)
        topology = Topology(sites=(0,) * P, hosts=hosts)
        plan_order.best_plan.cache_clear()
        fast = plan_order.best_plan(model, topology, False)
        search = plan_order.RingSearch(model)
        if H <= 8:
            every = plan_order.exhaustive_order(search, plan_order.level_units(P, topology))
            assert fast.predicted_bw_seconds_per_byte <= search.tau(every) / search.ref * 1.01 + 1e-18


def scale_cluster(kind: str, P: int) -> tuple[LinkModel, tuple, tuple, bool]:
    if kind == "slow rank NIC":
        nic = np.full(P, 25 * GBIT)
        nic[P // 3] = 2.5 * GBIT
        return LinkModel.from_nics(nic), tuple(range(P)), (0,) * P, False
    hosts = tuple(r // 8 for r in range(P))
    H = P // 8
    if kind == "hosts of 8, one slow":
        nic = np.full(H, 25 * GBIT)
        nic[H // 2] = 2.5 * GBIT
        return (LinkModel.from_levels(hosts, (0,) * P, host_out=nic, host_in=nic, loopback=[80 * GBIT] * H),
                hosts, (0,) * P, True)
    sites = tuple(r * 4 // P for r in range(P))
    model = LinkModel.from_levels(hosts, sites, host_out=[10 * GBIT] * H, host_in=[10 * GBIT] * H,
                                  loopback=[80 * GBIT] * H, cross_site=np.full((4, 4), GBIT),
                                  site_out=[GBIT] * 4, site_in=[GBIT] * 4)
    return model, hosts, sites, False


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["slow rank NIC", "hosts of 8, one slow", "4 sites of 256"])
def test_plans_at_1024_ranks_meet_the_bound(kind):
    """At 1,024 ranks, where the bound is tight, the plan's bandwidth time is within 5% of it."""
    model, hosts, sites, shared = scale_cluster(kind, 1024)
    plan_order.best_plan.cache_clear()
    topology = Topology(sites=sites, hosts=hosts)
    plan = plan_for_group(model, topology, hosts if shared else None, measured=False)
    per_byte = (site_plan_seconds_per_byte(plan.sites, model) if plan.sites is not None
                else ring_seconds_per_byte(plan.order, plan.shares, model))
    bound = cut_bound_seconds(model, 1 << 30, sites if len(set(sites)) > 1 else None) / (1 << 30)
    assert per_byte <= bound * 1.05
    if kind == "hosts of 8, one slow":
        assert plan.sites is not None and plan.sites.local_inner
    if kind == "4 sites of 256":
        assert plan.sites is not None and len(plan.sites.sites) == 4


@pytest.mark.parametrize("P", [64, 256, 1024])
def test_structured_search_takes_a_bounded_number_of_lps(P):
    """The number of LPs the ring search solves does not grow with the ranks: noisy links
    (every rate times [0.9, 1.1]) in 4 sites of hosts of 8."""
    model, hosts, sites, _ = scale_cluster("4 sites", P)
    rng = np.random.default_rng(P)
    noisy = LinkModel(bw=model.bw * rng.uniform(0.9, 1.1, (P, P)) + np.eye(P), uplinks=model.uplinks)
    search = plan_order.RingSearch(noisy)
    plan_order.structured_order(search, Topology(sites=sites, hosts=hosts))
    assert search.lps <= 2 + 2 * 6 + plan_order.REFINE_TRIES


def test_structured_orders_keep_levels_together():
    hosts = tuple(r // 4 for r in range(32))
    sites = tuple(0 if h in (0, 2, 5, 7) else 1 for h in hosts)
    model = LinkModel(bw=np.ones((32, 32)))
    level_orders = plan_order.structured_orders(model, Topology(sites=sites, hosts=hosts))[2:]
    for order in level_orders:
        assert order[0] == 0
        pairs = list(zip(order, order[1:] + order[:1]))
        assert sum(hosts[a] != hosts[b] for a, b in pairs) == 8
        assert sum(sites[a] != sites[b] for a, b in pairs) == 2


def test_exhaustive_over_units_prefers_the_natural_order_on_ties():
    hosts = (0, 1, 0, 1, 2, 2)
    model = host_model(hosts, (0,) * 6, 0, 1.0)
    order = plan_order.exhaustive_order(plan_order.RingSearch(model), plan_order.level_units(6, Topology(
        sites=(0,) * 6, hosts=hosts)))
    assert order == (0, 2, 1, 3, 4, 5)
    assert list(itertools.chain.from_iterable(plan_order.level_units(6, Topology(sites=(0,) * 6, hosts=hosts)))) == \
        [0, 2, 1, 3, 4, 5]
