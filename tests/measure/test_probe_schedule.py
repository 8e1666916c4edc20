"""The level probe's schedule (hetcomm.measure.schedule) as a pure function: how many rounds it
takes for 8 to 4,096 ranks, that every link class the planner needs is measured, that its rounds
are well formed, and the model it builds from measured rates. No processes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetcomm.measure import schedule
from hetcomm.plan import cut_capacity


def layout(P: int, host_size: int, S: int) -> tuple[list[int], list[int]]:
    """Hosts of ``host_size`` ranks, the hosts split into S contiguous sites."""
    hosts = [r // host_size for r in range(P)]
    H = max(hosts) + 1
    sites = [min(S - 1, hosts[r] * S // H) for r in range(P)]
    return hosts, sites


def all_rounds(hosts, sites, declared):
    first = schedule.first_rounds(hosts, sites if declared else None)
    pairs = None if declared else [u.label[1:] for r in first if r.what == "nic" for u in r.units]
    later = schedule.site_rounds(hosts, sites, pairs) if len(set(sites)) > 1 else []
    return first + later


CONFIGS = [(P, h, S) for P in (8, 16, 64, 256, 1024, 4096) for h in (1, 4, 8) for S in (1, 2, 3, 4)
           if P // h >= S]


@pytest.mark.parametrize("P, host_size, S", CONFIGS)
@pytest.mark.parametrize("declared", [True, False])
def test_rounds_do_not_grow_with_the_ranks(P, host_size, S, declared):
    hosts, sites = layout(P, host_size, S)
    rounds = schedule.round_count(hosts, sites, declared)
    assert rounds == len(all_rounds(hosts, sites, declared))
    # loopback 1 + NIC rounds at most 4 + repair at most 1 + cross S - 1 + uplinks (1 or S)
    assert rounds <= 1 + schedule.MAX_NIC_ROUNDS + (0 if declared else 1) + (S - 1) + (S if S > 2 else 1)
    assert rounds + 1 <= 16          # with the confirmation round, when some NIC is in doubt
    # the same structure at 4x the ranks takes the same number of rounds once every site has
    # at least 4 hosts (the NIC shifts are then 1, 2 and 3)
    if P * 4 <= 4096 and P // host_size // S >= 4:
        bigger_hosts, bigger_sites = layout(P * 4, host_size, S)
        assert schedule.round_count(bigger_hosts, bigger_sites, declared) == rounds


def test_1024_ranks_in_hosts_of_8_take_at_most_16_rounds():
    for S in (1, 2, 3, 4):
        hosts, sites = layout(1024, 8, S)
        for declared in (True, False):
            assert schedule.round_count(hosts, sites, declared) <= 16
    hosts, sites = layout(1024, 8, 1)
    assert schedule.round_count(hosts, sites) == 4          # loopback + three NIC shifts
    assert schedule.round_count(hosts, sites, shared_memory=True) == 3
    assert len(schedule.pair_rounds(1024)) == 1023          # what probing every pair costs


@pytest.mark.parametrize("P, host_size, S", [c for c in CONFIGS if c[0] <= 1024])
def test_every_link_class_is_measured(P, host_size, S):
    hosts, sites = layout(P, host_size, S)
    for declared in (True, False):
        units = [u for r in all_rounds(hosts, sites, declared) for u in r.units]
        labels = {u.label for u in units}
        H = max(hosts) + 1
        site_of_host = {hosts[r]: sites[r] for r in range(P)}
        hosts_of_site = {s: {h for h in range(H) if site_of_host[h] == s} for s in range(S)}
        for h in range(H):
            if host_size > 1:
                assert ("loopback", h) in labels
            peers = hosts_of_site[site_of_host[h]] - {h}
            if peers:   # its NIC both ways, against a host of its own site
                assert any(lab[0] == "nic" and lab[1] == h and lab[2] in peers for lab in labels), (h, declared)
                assert any(lab[0] == "nic" and lab[2] == h and lab[1] in peers for lab in labels), (h, declared)
        if S > 1 and schedule.needs_site_rounds(hosts, sites):
            for s, t in itertools.permutations(range(S), 2):
                assert ("cross", s, t) in labels, (s, t)
            for s in range(S):
                assert ("uplink", s, "out") in labels
                if S > 2:
                    assert ("uplink", s, "in") in labels


@pytest.mark.parametrize("P, host_size, S", [(64, 4, 2), (64, 8, 4), (24, 1, 3), (10, 2, 1), (7, 1, 1)])
def test_rounds_are_well_formed(P, host_size, S):
    hosts, sites = layout(P, host_size, S)
    for rnd in all_rounds(hosts, sites, declared=False):
        flows = rnd.flows
        assert all(a != b for a, b in flows)
        assert len(set(flows)) == len(flows), rnd.what           # one flow per pair and round
        for unit in rnd.units:
            if unit.label[0] in ("nic", "loopback"):
                src_host, dst_host = (unit.label[1], unit.label[2]) if unit.label[0] == "nic" else (unit.label[1],) * 2
                assert all(hosts[a] == src_host and hosts[b] == dst_host for a, b in unit.flows)
                assert unit.one_clock
        if rnd.what == "nic":       # every host sends once and receives once
            senders = [u.label[1] for u in rnd.units]
            receivers = [u.label[2] for u in rnd.units]
            assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)


def test_nic_rounds_stay_inside_declared_sites_and_detect_interleaved_ones():
    hosts = list(range(8))
    sites = [0, 1, 0, 1, 0, 1, 0, 1]
    for rnd in schedule.nic_rounds(hosts, sites):
        assert all(sites[a] == sites[b] for a, b in rnd.flows)
    # undeclared: shift 2 pairs hosts of one site even when sites alternate, so detection sees them
    within = [u.label for r in schedule.nic_rounds(hosts) for u in r.units if sites[u.label[1]] == sites[u.label[2]]]
    assert {a for _, a, _ in within} == set(range(8))


def test_repair_round_gives_border_hosts_a_partner_of_their_own_site():
    # 8 hosts, sites 0-3 and 4-7, measured only with shift 4 (all across): everyone needs repair
    hosts = list(range(8))
    sites = [0] * 4 + [1] * 4
    repair = schedule.repair_round(hosts, sites, [(h, (h + 4) % 8) for h in range(8)])
    pairs = {u.label[1:] for u in repair.units}
    assert pairs == {(0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4)}
    # with shift 1 measured, only the border hosts (3 and 7) lack an out partner, 4 and 0 an in one
    repair = schedule.repair_round(hosts, sites, [(h, (h + 1) % 8) for h in range(8)])
    assert {u.label[1:] for u in repair.units} == {(3, 0), (7, 4)}


def test_slow_host_detected_as_its_own_site_needs_no_site_rounds():
    hosts, sites = list(range(8)), [0] * 7 + [1]
    assert not schedule.needs_site_rounds(hosts, sites)
    measured = [u.label[1:] for r in schedule.nic_rounds(hosts) for u in r.units]
    assert schedule.site_rounds(hosts, sites, measured) == []
    # declared, the NIC rounds stay inside the sites: the site rounds measure the lone host
    assert [r.what for r in schedule.site_rounds(hosts, sites, None)] == ["cross", "uplink"]
    assert schedule.needs_site_rounds(list(range(8)), [0] * 6 + [1] * 2)


def test_nic_estimate_ignores_partners_that_held_a_unit_back():
    assert schedule.nic_estimate(np.array([100.0, 0.0, 25.0, 98.0, 104.0])) == pytest.approx(100.0)
    assert schedule.nic_estimate(np.array([0.0, 0.0])) == 0.0


def test_model_from_rates_by_hand():
    # two sites: site 0 = hosts 0 (ranks 0, 1) and 1 (ranks 2, 3); site 1 = host 2 (ranks 4, 5)
    hosts = [0, 0, 1, 1, 2, 2]
    sites = [0, 0, 0, 0, 1, 1]
    rates = {("nic", 0, 1): 100.0, ("nic", 1, 0): 90.0, ("nic", 2, 0): 40.0, ("nic", 0, 2): 20.0,
             ("uplink", 0, "out"): 30.0, ("uplink", 1, "out"): 35.0}
    per_flow = {("loopback", 0): 1000.0, ("loopback", 1): 1000.0, ("loopback", 2): 800.0,
                ("cross", 0, 1): 25.0, ("cross", 1, 0): 28.0}
    model = schedule.model_from_rates(hosts, sites, rates, per_flow, [1e9] * 6, 1e-4)
    bw = model.bw
    assert bw[0][1] == 1000.0 and bw[4][5] == 800.0                  # loopback
    assert bw[0][2] == 100.0 and bw[2][0] == 90.0                    # NICs: host 0 out 100, host 1 out 90
    assert bw[4][0] == min(40.0, 28.0) and bw[0][4] == min(100.0, 25.0, 20.0)
    uplinks = dict(((g, (o, i)) for g, o, i in model.uplinks))
    assert uplinks[(0, 1, 2, 3)] == (30.0, 35.0)                     # what leaves site 0 enters site 1
    assert uplinks[(4, 5)] == (min(40.0, 35.0), min(20.0, 30.0))      # host 2 is site 1: its NIC and uplink
    assert model.alpha == 1e-4
    # the cut out of site 0: its uplink (30), but host 2's NIC takes in only 20
    side = np.array([True] * 4 + [False] * 2)
    assert cut_capacity(model, side) == pytest.approx(20.0)


def test_unmeasured_loopback_is_ten_times_the_fastest_nic():
    hosts, sites = [0, 0, 1, 1], [0, 0, 0, 0]
    model = schedule.model_from_rates(hosts, sites, {("nic", 0, 1): 50.0, ("nic", 1, 0): 60.0}, {}, [1e9] * 4, 0.0)
    assert model.bw[0][1] == model.bw[2][3] == 600.0
    assert schedule.loopback_round(hosts) is not None
    assert all(r.what != "loopback" for r in schedule.first_rounds(hosts, shared_memory=True))


def measured_hosts(hosts, sites, declared):
    """The hosts with an out- and an in-rate from some unit (NIC units, or their site's uplink)."""
    rounds = all_rounds(hosts, sites, declared)
    site_of_host = {hosts[r]: sites[r] for r in range(len(hosts))}
    out, into = set(), set()
    for rnd in rounds:
        for u in rnd.units:
            if u.label[0] == "nic":
                out.add(u.label[1])
                into.add(u.label[2])
            if u.label[0] == "uplink":     # a lone host's NIC is its site's uplink
                members = {h for h, s in site_of_host.items() if s == u.label[1]}
                other = {h for h, s in site_of_host.items() if s != u.label[1]}
                if len(members) == 1:
                    (out if u.label[2] == "out" else into).update(members)
                if len(set(sites)) == 2 and len(other) == 1:    # what leaves one site enters the other
                    into.update(other)
    return out, into


@pytest.mark.parametrize("hosts, sites", [
    ([0, 1, 2, 3], [0, 0, 0, 1]),                       # a lone host of a declared site
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]),
    ([0, 1, 2, 3, 4, 5], [0, 1, 2, 2, 2, 2]),
    (list(range(8)), [0] * 7 + [1]),
])
def test_every_host_of_several_gets_its_nic_measured(hosts, sites):
    H = max(hosts) + 1
    for declared in (True, False):
        out, into = measured_hosts(hosts, sites, declared)
        assert out == set(range(H)) and into == set(range(H)), (declared, out, into)


def test_a_lone_host_of_declared_sites_is_measured_by_the_site_rounds():
    rounds = all_rounds([0, 1, 2, 3], [0, 0, 0, 1], declared=True)
    assert any(r.what == "uplink" for r in rounds) and any(r.what == "cross" for r in rounds)
    # and the model takes its NIC from its uplink, not from anything faster
    rates = {("nic", 0, 1): 100.0, ("nic", 1, 2): 100.0, ("nic", 2, 0): 100.0, ("nic", 0, 2): 100.0,
             ("nic", 1, 0): 100.0, ("nic", 2, 1): 100.0, ("uplink", 0, "out"): 12.0, ("uplink", 1, "out"): 11.0}
    per_flow = {("cross", 0, 1): 12.0, ("cross", 1, 0): 11.0}
    model = schedule.model_from_rates([0, 1, 2, 3], [0, 0, 0, 1], rates, per_flow, [1e9] * 4, 0.0)
    assert model.bw[3][0] == 11.0 and model.bw[0][3] == 12.0


def test_a_nic_left_unmeasured_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="nothing measured the NIC of host 2"):
        schedule.model_from_rates([0, 1, 2], [0, 0, 0], {("nic", 0, 1): 10.0, ("nic", 1, 0): 10.0}, {}, [1e9] * 3, 0.0)


def test_confirm_round_pins_down_nics_whose_partners_were_all_slower():
    # 8 hosts, 0-3 at 5, 4-7 at 10 (numbered together): after the shifted rings host 4 only
    # received from slow hosts and host 7 only sent to slow ones.
    nic = [5.0] * 4 + [10.0] * 4
    rates = {}
    for rnd in schedule.nic_rounds(list(range(8))):
        for u in rnd.units:
            a, b = u.label[1:]
            rates[u.label] = min(nic[a], nic[b])
    assert schedule.nic_estimate(schedule.host_pair_rates(8, rates)[:, 4]) == 5.0     # wrong
    confirm = schedule.confirm_round(list(range(8)), None, rates)
    pairs = [u.label[1:] for u in confirm.units]
    senders = [a for a, _ in pairs]
    receivers = [b for _, b in pairs]
    assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
    for a, b in pairs:
        rates[("nic", a, b)] = min(nic[a], nic[b])
    pair = schedule.host_pair_rates(8, rates)
    assert [schedule.nic_estimate(pair[h]) for h in range(8)] == nic
    assert [schedule.nic_estimate(pair[:, h]) for h in range(8)] == nic
    # uniform NICs: nothing in doubt, no round
    uniform = {label: 10.0 for label in rates}
    assert schedule.confirm_round(list(range(8)), None, uniform) is None
