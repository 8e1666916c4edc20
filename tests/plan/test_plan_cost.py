"""hetcomm.plan.cost: the cut capacity through laminar shared links (host NICs inside site
uplinks), against values worked out by hand. Pure: no processes.

Rates are in abstract units (the capacity comes back in the unit of the rates)."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from hetcomm.plan import LinkModel, cut_bound_seconds, cut_capacity, site_cuts


def layout(labels, intra=1000.0, inter=100.0):
    P = len(labels)
    return [[0.0 if i == j else intra if labels[i] == labels[j] else inter for j in range(P)] for i in range(P)]


def side(P, members):
    mask = np.zeros(P, dtype=bool)
    mask[list(members)] = True
    return mask


def test_site_cuts_two_sites_sum_their_crossing_links():
    # 0,0,1,1: four cross pairs of 100 each way.
    assert site_cuts(LinkModel(bw=layout([0, 0, 1, 1])), (0, 0, 1, 1)) == [(400.0, 400.0), (400.0, 400.0)]
    # Asymmetric: site 0 -> site 1 at 100 per pair, back at 50 per pair.
    m = layout([0, 1, 0, 1])
    for i in (0, 2):
        for j in (1, 3):
            m[j][i] = 50.0
    assert site_cuts(LinkModel(bw=m), (0, 1, 0, 1)) == [(400.0, 200.0), (200.0, 400.0)]


def test_site_cuts_unequal_and_three_sites_by_hand():
    # Sites {0,1,2} and {3}; rank 3 sends 10/20/30 to ranks 0/1/2 and receives 1/2/4 from them.
    m = layout([0, 0, 0, 1])
    m[3][0], m[3][1], m[3][2] = 10.0, 20.0, 30.0
    m[0][3], m[1][3], m[2][3] = 1.0, 2.0, 4.0
    assert site_cuts(LinkModel(bw=m), (0, 0, 0, 1)) == [(7.0, 60.0), (60.0, 7.0)]
    # Sites {0}, {1}, {2,3}: rates[i][j] = 10 * i + j + 1 off the diagonal.
    m = [[0.0 if i == j else 10.0 * i + j + 1 for j in range(4)] for i in range(4)]
    cuts = site_cuts(LinkModel(bw=m), (0, 1, 2, 2))
    assert cuts == [(2.0 + 3.0 + 4.0, 11.0 + 21.0 + 31.0), (11.0 + 13.0 + 14.0, 2.0 + 22.0 + 32.0),
                    (21.0 + 22.0 + 31.0 + 32.0, 3.0 + 4.0 + 13.0 + 14.0)]


def test_a_site_uplink_caps_what_crosses_but_not_what_stays_inside():
    # Sites {0,1} and {2,3}, LAN 1000, WAN links 100 each, site 0 behind a 150 uplink each way.
    model = LinkModel(bw=layout([0, 0, 1, 1]), uplinks=[((0, 1), 150.0, 150.0)])
    assert cut_capacity(model, side(4, (0, 1))) == 150.0
    # {0} -> {1,2,3}: the link to 1 stays inside the site (1000), the two to site 1 pass the uplink.
    assert cut_capacity(model, side(4, (0,))) == 1000.0 + 150.0
    # {0,2} -> {1,3}: 0 -> 1 inside site 0 (1000), 2 -> 3 inside site 1 (1000), 0 -> 3 leaves
    # site 0 (100, under its uplink), 2 -> 1 enters site 0 (100, under its in-uplink).
    assert cut_capacity(model, side(4, (0, 2))) == 2000.0 + 200.0


def test_host_nics_inside_a_site_uplink_nest():
    # Two sites of two hosts of two ranks: ranks 0-3 site 0 (hosts {0,1}, {2,3}), 4-7 site 1.
    # Loopback 10000, LAN 1000, WAN 1000 per pair; host NICs 300, site uplinks 400.
    P = 8
    host = [r // 2 for r in range(P)]
    bw = [[0.0 if i == j else 10000.0 if host[i] == host[j] else 1000.0 for j in range(P)] for i in range(P)]
    nics = [((2 * h, 2 * h + 1), 300.0, 300.0) for h in range(4)]
    ups = [(tuple(r for r in range(P) if r // 4 == s), 400.0, 400.0) for s in range(2)]
    model = LinkModel(bw=bw, uplinks=nics + ups)
    # Site 0 to site 1: two NICs of 300 (600) capped by the uplink (400).
    assert cut_capacity(model, side(P, range(4))) == 400.0
    # Host {0,1} to everything else: its NIC.
    assert cut_capacity(model, side(P, (0, 1))) == 300.0
    # Rank 0 to the rest: loopback to rank 1 (10000) plus its host NIC (300).
    assert cut_capacity(model, side(P, (0,))) == 10300.0
    # {0,1,4,5} (one host in each site) to {2,3,6,7}: each host's NIC 300 out, and the cross-site
    # part of each is also under the site uplinks: 300 + 300 in all (both hosts' NICs bind).
    assert cut_capacity(model, side(P, (0, 1, 4, 5))) == 600.0
    # The site plan moves N through each uplink: the bound is N over the uplink.
    assert cut_bound_seconds(model, 1000) == pytest.approx(1000 / 300.0)


def test_uplinks_must_nest():
    with pytest.raises(ValueError, match="overlap without one holding the other"):
        LinkModel(bw=layout([0, 0, 0]), uplinks=[((0, 1), 1.0, 1.0), ((1, 2), 1.0, 1.0)])
    # The same set twice keeps the smaller rate each way.
    model = LinkModel(bw=layout([0, 0, 0]), uplinks=[((0, 1), 5.0, 1.0), ((1, 0), 2.0, 3.0)])
    assert model.uplinks == (((0, 1), 2.0, 1.0),)


def test_shared_links_never_raise_a_cut_capacity():
    """Adding laminar shared links to a model can only lower every cut's capacity, and with
    infinite rates changes nothing: checked by brute force over every cut of random models."""
    rng = random.Random(21)
    for _ in range(60):
        P = rng.randint(2, 6)
        bw = [[0.0 if i == j else rng.uniform(1, 100) for j in range(P)] for i in range(P)]
        site = [rng.randrange(2) for _ in range(P)]
        host = [2 * site[r] + rng.randrange(2) for r in range(P)]
        groups = [tuple(r for r in range(P) if host[r] == h) for h in range(4)]
        groups += [tuple(r for r in range(P) if site[r] == s) for s in range(2)]
        ups = [(g, rng.uniform(1, 300), rng.uniform(1, 300)) for g in groups if g]
        free = LinkModel(bw=bw)
        shared = LinkModel(bw=bw, uplinks=ups)
        unlimited = LinkModel(bw=bw, uplinks=[(g, math.inf, math.inf) for g, _, _ in ups])
        for k in range(1, P):
            for members in itertools.combinations(range(P), k):
                mask = side(P, members)
                links = float(np.asarray(bw)[np.ix_(mask, ~mask)].sum())
                assert cut_capacity(free, mask) == pytest.approx(links)
                assert cut_capacity(unlimited, mask) == pytest.approx(links)
                assert cut_capacity(shared, mask) <= links + 1e-9


def max_flow(model: LinkModel, mask: np.ndarray) -> float:
    """The exact capacity of a cut: the largest flow from the ranks of ``mask`` to the others, one
    variable per crossing link, within its rate and every shared link's."""
    from scipy.optimize import linprog

    P = model.world_size
    links = [(a, b) for a in range(P) for b in range(P) if mask[a] and not mask[b]]
    rows, rhs = [], []
    for group, out_bps, in_bps in model.uplinks:
        g = set(group)
        for leaving, rate in ((True, out_bps), (False, in_bps)):
            if math.isfinite(rate):
                rows.append([1.0 if ((a in g and b not in g) if leaving else (b in g and a not in g)) else 0.0
                             for a, b in links])
                rhs.append(rate)
    res = linprog(-np.ones(len(links)), A_ub=np.array(rows) if rows else None, b_ub=rhs or None,
                  bounds=[(0.0, model.bw[a][b]) for a, b in links], method="highs")
    assert res.status == 0
    return -res.fun


def test_cut_capacity_is_never_below_the_exact_max_flow():
    """cut_capacity is an upper bound of what can cross a cut (so the cut bound is a valid lower
    bound of time): checked against the exact max flow on random laminar models."""
    rng = random.Random(5)
    for _ in range(40):
        P = rng.randint(2, 6)
        bw = [[0.0 if i == j else rng.uniform(1, 100) for j in range(P)] for i in range(P)]
        site = [rng.randrange(2) for _ in range(P)]
        host = [2 * site[r] + rng.randrange(2) for r in range(P)]
        groups = [tuple(r for r in range(P) if host[r] == h) for h in range(4)]
        groups += [tuple(r for r in range(P) if site[r] == s) for s in range(2)]
        model = LinkModel(bw=bw, uplinks=[(g, rng.uniform(1, 300), rng.uniform(1, 300)) for g in groups if g])
        for k in range(1, P):
            for members in itertools.combinations(range(P), k):
                mask = side(P, members)
                assert cut_capacity(model, mask) >= max_flow(model, mask) * (1 - 1e-9) - 1e-9


def test_link_models_survive_pickling():
    import pickle

    model = LinkModel(bw=layout([0, 0, 1]), reduce_bps=[1e9, 2e9, 3e9], alpha=1e-4,
                      uplinks=[((0, 1), 5.0, 6.0)])
    back = pickle.loads(pickle.dumps(model))
    assert back == model and hash(back) == hash(model)
    assert not back.bw.flags.writeable
    assert back.uplinks == model.uplinks
