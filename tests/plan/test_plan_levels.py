"""Tests of site and host detection (python/hetcomm/plan/levels.py): pure, exact, no processes.

Rates are in Mbit/s here: detection only compares ratios. Noise is multiplicative, every directed entry drawn independently from
[0.8, 1.2] times its true value (±20%), from seeded generators.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest

# (levels.py needs neither torch nor the extension: tests/backend/test_imports.py checks that plan/ stays
# so; the suite's process imports torch anyway, so loading it here by path saved nothing.)
from hetcomm.plan import levels as sites

Topology = sites.Topology
detect_sites = sites.detect_sites
parse_sites = sites.parse_sites
topology_from = sites.topology_from

SEEDS = range(200)


def layout_matrix(layout, intra=1000.0, inter=100.0):
    P = len(layout)
    return [[0.0 if i == j else intra if layout[i] == layout[j] else inter for j in range(P)] for i in range(P)]


def jittered(matrix, rng, jitter=0.2):
    return [[v * rng.uniform(1 - jitter, 1 + jitter) for v in row] for row in matrix]


def partition(labels):
    """The grouping itself, without its numbering."""
    groups = {}
    for rank, label in enumerate(labels):
        groups.setdefault(label, set()).add(rank)
    return {frozenset(g) for g in groups.values()}


# --- detect_sites on clean matrices -----------------------------------------------------------

@pytest.mark.parametrize("layout", [
    (0, 0, 1, 1),
    (0, 1, 0, 1),
    (0, 0, 1, 1, 2, 2),
    (0, 1, 2, 0, 1, 2),
    (0, 0, 0, 1),        # 3 + 1
    (0, 1, 1, 1),        # the lone rank is rank 0
    (0, 1, 1, 0, 0, 2, 2, 2),
])
def test_clean_layouts_are_recovered_exactly(layout):
    assert detect_sites(layout_matrix(layout)) == layout


def test_uniform_links_are_one_site():
    for P in (1, 2, 3, 5, 8):
        assert detect_sites(layout_matrix([0] * P)) == (0,) * P


def test_numbering_is_by_lowest_rank_whatever_the_layout_labels():
    assert detect_sites(layout_matrix([1, 1, 0, 0])) == (0, 0, 1, 1)
    assert detect_sites(layout_matrix([2, 0, 1, 0, 2, 1])) == (0, 1, 2, 1, 0, 2)


def test_sites_with_different_internal_rates_stay_apart():
    # Site {0,1} at 1000, site {2,3} at 200, 20 between: each site is fast relative to its own
    # links, though site 1's LAN is 5x slower than site 0's.
    m = layout_matrix([0, 0, 1, 1], intra=1000.0, inter=20.0)
    m[2][3] = m[3][2] = 200.0
    assert detect_sites(m) == (0, 0, 1, 1)


def test_links_within_the_ratio_are_one_site_and_beyond_it_are_not():
    m = layout_matrix([0, 0, 1, 1], intra=1000.0, inter=400.0)   # 2.5x < 3
    assert detect_sites(m) == (0, 0, 0, 0)
    assert detect_sites(m, ratio=2.0) == (0, 0, 1, 1)
    m = layout_matrix([0, 0, 1, 1], intra=1000.0, inter=300.0)   # 3.33x > 3
    assert detect_sites(m) == (0, 0, 1, 1)


def test_two_plus_one_plus_one():
    # The lone ranks 2 and 3 reach site {0,1} at 100 and each other at 10.
    m = layout_matrix([0, 0, 1, 2])
    m[2][3] = m[3][2] = 10.0
    assert detect_sites(m) == (0, 0, 1, 2)


def test_two_lone_ranks_joined_at_the_wan_rate_are_one_site():
    # Documented: indistinguishable from one site of two slow ranks.
    assert detect_sites(layout_matrix([0, 0, 1, 2])) == (0, 0, 1, 1)


def test_a_slow_nic_is_a_site_of_its_own():
    nics = [800.0, 800.0, 800.0, 100.0]
    m = [[0.0 if i == j else min(nics[i], nics[j]) for j in range(4)] for i in range(4)]
    assert detect_sites(m) == (0, 0, 0, 1)


# --- noise ------------------------------------------------------------------------------------

def test_uniform_links_with_20_percent_noise_are_one_site():
    for seed in SEEDS:
        rng = random.Random(seed)
        P = rng.randint(2, 8)
        assert detect_sites(jittered(layout_matrix([0] * P), rng)) == (0,) * P, seed


def test_links_spread_over_2x_with_20_percent_noise_are_one_site():
    # The guarantee at its edge: spread v = 2 times noise q = 1.5 is the default ratio 3.
    for seed in SEEDS:
        rng = random.Random(seed)
        P = rng.randint(2, 8)
        m = [[0.0 if i == j else 500.0 * 2 ** rng.random() for j in range(P)] for i in range(P)]
        assert detect_sites(jittered(m, rng)) == (0,) * P, seed


@pytest.mark.parametrize("layout", [
    (0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 1, 1, 2, 2), (0, 0, 0, 1), (0, 1, 1, 1, 0, 0, 2, 2),
])
def test_1000_vs_100_with_20_percent_noise_is_recovered_exactly(layout):
    for seed in SEEDS:
        rng = random.Random(seed)
        assert detect_sites(jittered(layout_matrix(layout), rng)) == layout, seed


def test_noisy_2_plus_1_plus_1_is_recovered_exactly():
    for seed in SEEDS:
        m = layout_matrix([0, 0, 1, 2])
        m[2][3] = m[3][2] = 10.0
        assert detect_sites(jittered(m, random.Random(seed))) == (0, 0, 1, 2), seed


def test_result_does_not_depend_on_rank_order():
    for seed in range(50):
        rng = random.Random(seed)
        layout = [rng.randrange(3) for _ in range(7)]
        m = jittered(layout_matrix(layout, inter=rng.choice([100.0, 300.0, 400.0])), rng)
        perm = list(range(7))
        rng.shuffle(perm)   # new rank k is old rank perm[k]
        permuted = [[m[perm[a]][perm[b]] for b in range(7)] for a in range(7)]
        got = detect_sites(m)
        got_permuted = detect_sites(permuted)
        assert partition(got_permuted) == {frozenset(perm.index(r) for r in g) for g in partition(got)}, seed
        assert detect_sites(m) == got   # and deterministic


# --- asymmetry, chains, unknown links ---------------------------------------------------------

def test_a_pair_is_as_fast_as_its_slower_direction():
    # Site 0 -> site 1 at 1000 (as fast as inside), back at 100: the pair is a 100 link.
    m = layout_matrix([0, 0, 1, 1])
    for i, j in itertools.product((0, 1), (2, 3)):
        m[i][j] = 1000.0
    assert detect_sites(m) == (0, 0, 1, 1)
    assert detect_sites([list(col) for col in zip(*m)]) == (0, 0, 1, 1)   # transposed


def test_chain_is_one_site():
    # a-b and b-c fast, a-c slow: single linkage is transitive.
    m = [[0.0, 1000.0, 100.0],
         [1000.0, 0.0, 1000.0],
         [100.0, 1000.0, 0.0]]
    assert detect_sites(m) == (0, 0, 0)
    # A chain through one fast cross link joins two clusters.
    m = layout_matrix([0, 0, 1, 1])
    m[1][2] = m[2][1] = 1000.0
    assert detect_sites(m) == (0, 0, 0, 0)


def test_one_measured_direction_is_enough():
    for seed in range(50):
        rng = random.Random(seed)
        full = jittered(layout_matrix([0, 1, 0, 1, 2]), rng)
        upper = [[full[i][j] if j > i else None for j in range(5)] for i in range(5)]
        lower = [[full[i][j] if j < i else 0.0 for j in range(5)] for i in range(5)]
        assert detect_sites(upper) == detect_sites(lower) == (0, 1, 0, 1, 2), seed


def test_a_rank_with_no_known_link_is_alone():
    m = layout_matrix([0, 0, 0, 0])
    for j in range(4):
        m[2][j] = m[j][2] = float("nan") if j % 2 else 0.0
    assert detect_sites(m) == (0, 0, 1, 0)


# --- hosts ------------------------------------------------------------------------------------

def test_loopback_between_processes_of_one_host_does_not_split_a_site():
    # Two hosts of two ranks each, one site: loopback at 10000, the LAN at 1000.
    hosts = ["h0", "h0", "h1", "h1"]
    m = [[0.0 if i == j else 10000.0 if hosts[i] == hosts[j] else 1000.0 for j in range(4)] for i in range(4)]
    assert detect_sites(m) == (0, 0, 1, 1)            # without hosts, each host looks like a site
    assert detect_sites(m, hosts=hosts) == (0, 0, 0, 0)


def test_two_sites_of_two_hosts_of_two_ranks():
    hosts = [0, 0, 1, 1, 2, 2, 3, 3]
    site = [0, 0, 0, 0, 1, 1, 1, 1]
    for seed in range(50):
        rng = random.Random(seed)
        m = [[0.0 if i == j else 10000.0 if hosts[i] == hosts[j] else 1000.0 if site[i] == site[j] else 100.0
              for j in range(8)] for i in range(8)]
        assert detect_sites(jittered(m, rng), hosts=hosts) == tuple(site), seed


def test_ranks_of_one_host_are_one_site_even_if_their_link_was_not_measured():
    m = layout_matrix([0, 0, 1, 1])
    m[0][1] = m[1][0] = 0.0
    assert detect_sites(m) == (0, 1, 2, 2)
    assert detect_sites(m, hosts=["a", "a", "b", "c"]) == (0, 0, 1, 1)


def test_hosts_from_addresses():
    topo = topology_from(layout_matrix([0, 0, 0, 0]), addresses=["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1"])
    assert topo.hosts == (0, 1, 0, 1)
    assert topo.sites == (0, 0, 0, 0)


# --- parse_sites ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("0,0,1,1", (0, 0, 1, 1)),
    ("a,a,b,b", (0, 0, 1, 1)),
    ("3,3,1,1", (0, 0, 1, 1)),
    ("x, y ,x,y", (0, 1, 0, 1)),
    ("1,01,+1,2", (0, 0, 0, 1)),
    ("7", (0,)),
])
def test_parse_sites(text, expected):
    assert parse_sites(text, len(expected)) == expected


@pytest.mark.parametrize("text, world_size, match", [
    ("0,0,1", 4, "3 site labels for 4 ranks"),
    ("0,0,1,1,2", 4, "5 site labels for 4 ranks"),
    ("0,,1,1", 4, "item 1 .* is empty"),
    ("0,0,1,", 4, "item 3 .* is empty"),
    ("", 2, "is empty"),
    ("  ", 2, "is empty"),
    ("0,1", 0, "positive integer"),
])
def test_parse_sites_errors(text, world_size, match):
    with pytest.raises(ValueError, match=match):
        parse_sites(text, world_size)


# --- topology_from ----------------------------------------------------------------------------

def test_declaration_wins_over_measurement():
    measured = layout_matrix([0, 0, 1, 1])
    assert topology_from(measured).sites == (0, 0, 1, 1)
    assert topology_from(measured, declared="b,a,b,a").sites == (0, 1, 0, 1)
    assert topology_from(measured, declared="  ").sites == (0, 0, 1, 1)   # blank: not declared
    assert topology_from(declared="0,0,0,5").sites == (0, 0, 0, 1)


def test_nothing_known_is_one_site():
    assert topology_from(addresses=["a", "b", "c"]) == Topology(sites=(0, 0, 0))


def test_host_split_by_a_declaration_is_an_error():
    with pytest.raises(ValueError, match=r"ranks 0 and 1 in different sites, but both are on host 10\.0\.0\.1"):
        topology_from(declared="0,1,1,1", addresses=["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3"])
    with pytest.raises(ValueError, match="ranks 1 and 3 are on one host"):
        Topology(sites=(0, 0, 1, 1), hosts=(0, 1, 2, 1))
    # Ranks of one host inside one declared site are fine.
    topo = topology_from(declared="0,0,1,1", addresses=["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert (topo.sites, topo.hosts) == ((0, 0, 1, 1), (0, 0, 1, 2))


def test_topology_from_errors():
    with pytest.raises(ValueError, match="number of ranks is unknown"):
        topology_from()
    with pytest.raises(ValueError, match="4 ranks but 3 addresses"):
        topology_from(layout_matrix([0, 0, 1, 1]), addresses=["a", "b", "c"])
    with pytest.raises(ValueError, match="3 site labels for 4 ranks"):
        topology_from(layout_matrix([0, 0, 1, 1]), declared="0,0,1")
    with pytest.raises(ValueError, match="rank 1 has no host address"):
        topology_from(addresses=["a", " "])


def test_rate_validation():
    with pytest.raises(ValueError, match=r"link 0 -> 1 must be finite and >= 0"):
        detect_sites([[0, -1], [1, 0]])
    with pytest.raises(ValueError, match=r"link 1 -> 0 must be finite and >= 0"):
        detect_sites([[0, 1], [math.inf, 0]])
    with pytest.raises(ValueError, match="must be 2x2; row 1 has 1 entries"):
        detect_sites([[0, 1], [1]])
    with pytest.raises(ValueError, match="ratio must be finite and > 1"):
        detect_sites(layout_matrix([0, 0]), ratio=1.0)
    with pytest.raises(ValueError, match="3 hosts given for 2 ranks"):
        detect_sites(layout_matrix([0, 0]), hosts=[0, 1, 2])
    assert detect_sites([[math.inf, 5.0], [5.0, math.inf]]) == (0, 0)   # the diagonal is ignored


# --- Topology ---------------------------------------------------------------------------------

def test_topology_helpers_and_describe():
    topo = Topology(sites=(5, 2, 5, 2, 9))
    assert topo.sites == (0, 1, 0, 1, 2)
    assert topo.hosts == (0, 1, 2, 3, 4)
    assert (topo.world_size, topo.num_sites, topo.num_hosts) == (5, 3, 5)
    assert [topo.site_members(s) for s in range(3)] == [(0, 2), (1, 3), (4,)]
    assert topo.describe() == "3 sites: {0,2} {1,3} {4}; hosts: one per rank"
    assert Topology(sites=(0, 0, 0), hosts=("x", "y", "x")).describe() == "1 site: {0,1,2}; hosts: {0,2} {1}"
    assert Topology(sites=(1, 1, 0)) == Topology(sites=(0, 0, 1), hosts=(0, 1, 2))
    with pytest.raises(ValueError, match="no site 3"):
        topo.site_members(3)
    with pytest.raises(ValueError, match="3 sites but 2 hosts"):
        Topology(sites=(0, 0, 1), hosts=(0, 1))


@pytest.mark.parametrize("seed", range(20))
def test_components_match_scipy(seed: int) -> None:
    """The breadth-first components (which spare every rank SciPy's import at creation) against
    SciPy's csgraph on random graphs, directed entries included (an edge either way joins)."""
    import numpy as np
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    from hetcomm.plan.levels import _components

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    adjacent = rng.random((n, n)) < rng.uniform(0.0, 0.08)
    _, want = connected_components(csr_matrix(adjacent), directed=True, connection="weak")
    got = _components(adjacent)
    # The same partition; each label the lowest vertex of its component.
    assert len(set(got)) == len(set(want.tolist()))
    for i in range(n):
        for j in range(n):
            assert (got[i] == got[j]) == (want[i] == want[j]), (i, j)
        assert got[i] == min(k for k in range(n) if want[k] == want[i])
