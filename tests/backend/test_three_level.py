"""Three levels in one allreduce: ranks in hosts, hosts in sites (hetcomm.plan.hierarchy.three_level_plan,
csrc/algorithms/hierarchical.h with hosts).

Hosts are declared with HETCOMM_HOST_ID and sites with HETCOMM_SITES on this one machine (the ranks of
a "host" share memory, the others talk over TCP); with HETCOMM_PROBE=0 the group installs the
three-level plan with equal shares by itself. Checks:

* every dtype and op, sizes from empty to many slots, exact results, the same bits on every rank,
  the path counter, on unequal sites (2 hosts against 1, 3 hosts against 1) and unequal hosts (1 rank
  against 2);
* bytes, from the engine's per-peer counters against figures worked out here by hand: each direction
  of the WAN carries N per site (no byte crosses it twice), each host's NIC what the schedule must
  send, and no link inside a host carries anything;
* a subgroup with some ranks of each host and site gets its own three-level plan and exact sums;
* the planner (pure): layout invariants and its choice among the ring, host, site and three-level plans.

HETCOMM_SMALL_ALLREDUCE_BYTES=0 so that even one-element allreduces take the plan.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import collective_suite
from harness import run_ranks, run_suite
from level_suite import level_suite
from marks import hetcomm_only

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("three-level schedule")]

SLOT_ENV = {"HETCOMM_SHM_SLOT_BYTES": str(64 << 10)}
HEADERS = 8192        # 40-byte headers, one per message of a flow: a few dozen per link at most


def _env(hosts: str, sites: str, **extra: str) -> dict:
    return {"HETCOMM_HOST_ID": hosts, "HETCOMM_SITES": sites, "HETCOMM_PROBE": "0",
            "HETCOMM_SMALL_ALLREDUCE_BYTES": "0", **extra}


CLUSTERS = {
    # site 0: hosts {0,1} {2,3}; site 1: host {4,5}
    "2+1 hosts": ("0,0,1,1,2,2", "0,0,0,0,1,1"),
    # site 0: hosts {0} {1,2} {3}; site 1: host {4,5}: 3 hosts against 1, hosts of 1 and 2 ranks
    "3+1 hosts": ("0,1,1,2,3,3", "0,0,0,0,1,1"),
    # site 0: two hosts of one rank each; site 1: one host of two ranks
    "1-rank hosts": ("0,1,2,2", "0,0,1,1"),
}


def _three_level_suite(rank: int, ws: int, subgroup: list, sub_level: str) -> dict:
    import hetcomm
    from harness import Cases
    out = level_suite(rank, ws, "three")
    # A subgroup with some ranks of each host and site plans for itself (``sub_level``).
    cases = Cases(rank)
    group = dist.new_group(subgroup)
    if rank in subgroup:
        with cases.case("subgroup", f"{subgroup}: the {sub_level} plan, exact sums"):
            sub = hetcomm.get_plan(group)
            assert sub.sites is not None, sub
            assert sub.sites.three_level if sub_level == "three" else sub.sites.local_inner, sub
            for n in (1, 1031, 300_007):
                t = torch.arange(n, dtype=torch.float64) * (rank + 1)
                dist.all_reduce(t, group=group)
                expected = torch.arange(n, dtype=torch.float64) * sum(r + 1 for r in subgroup)
                assert torch.equal(t, expected), (n, (t - expected).abs().max())
    dist.barrier()
    return out


# Subgroups keep a host of two ranks (else no shared memory, and no host level to plan).
@pytest.mark.parametrize("name,subgroup,sub_level", [
    ("2+1 hosts", [0, 2, 3, 4], "three"),      # site 0: hosts {0} {2,3}; site 1: {4}
    ("3+1 hosts", [0, 1, 2, 5], "three"),      # site 0: hosts {0} {1,2}; site 1: {5}
    ("1-rank hosts", [0, 2, 3], "host")])      # one host per site: the host plan
def test_three_level_allreduce(name: str, subgroup: list, sub_level: str) -> None:
    hosts, sites = CLUSTERS[name]
    ws = len(hosts.split(","))
    families = ["all_reduce", "identical", "path", "subgroup"]
    report = run_suite(ws, _three_level_suite, subgroup, sub_level, families=families,
                       env=_env(hosts, sites, **SLOT_ENV), timeout=300)
    for family in families:
        report.assert_family(family)
    assert not report.job_problems, report.job_problems


def _every_collective(rank: int, ws: int) -> None:
    import hetcomm
    from harness import Cases
    with Cases(rank).case("three_levels", "the group installed the three-level plan"):
        assert hetcomm.get_plan().sites.three_level, hetcomm.get_plan()
    collective_suite.collective_suite(rank, ws)


_EVERY: dict = {}


@pytest.mark.parametrize("family", collective_suite.FAMILIES + ["three_levels"])
def test_every_collective_on_a_three_level_group(family: str) -> None:
    """The whole collective suite (tests/support/collective_suite.py: every collective, dtype and
    op, exact results) on a group whose allreduce takes three levels: the other collectives pass
    by the host level's shared memory to the point-to-point paths, and must not mind it. One job
    for every family (4 ranks: site 0 of hosts {0} and {1}, site 1 of host {2,3})."""
    if not _EVERY:
        hosts, sites = CLUSTERS["1-rank hosts"]
        _EVERY["report"] = run_suite(4, _every_collective, families=collective_suite.FAMILIES + ["three_levels"],
                                     env=_env(hosts, sites, **SLOT_ENV), timeout=400, pg_timeout=60)
    _EVERY["report"].assert_family(family)


def _weighted_three_sites(rank: int, ws: int) -> dict:
    """A hand-built plan: 3 sites, site 0 of hosts {0,1} and {2}, where host {2} owns nothing
    (y = 1, 0), site shares 0.2/0.3/0.5; pieces of 64 KB."""
    import hetcomm
    from hetcomm.plan.hierarchy import _three_level_layout
    sites, hosts = [[0, 1, 2], [3], [4]], [[0, 1], [2], [3], [4]]
    blocks, holders, shares = _three_level_layout(sites, hosts, [(1.0, 0.0), (1.0,), (1.0,)])
    assert all(b[0] in (0, 1) for b in blocks)      # the owners in site 0 are host {0,1}'s ranks
    hetcomm.backend_of().set_site_plan(sites, [list(b) for b in blocks], shares, [0.2, 0.3, 0.5], 0, 0, False,
                                       hosts, [list(h) for h in holders])
    before = hetcomm.stats()["bytes_sent"]
    out = {}
    for dtype in (torch.float64, torch.int32, torch.bfloat16):
        for n in (0, 1, 7, 1031, 500_009):
            t = (torch.arange(n, dtype=torch.float64) % 13 + rank).to(dtype)   # sums exact in bfloat16
            dist.all_reduce(t)
            expected = (torch.arange(n, dtype=torch.float64) % 13 * ws + sum(range(ws))).to(dtype)
            assert torch.equal(t, expected), (dtype, n)
    n = 1_000_000
    before = hetcomm.stats()["bytes_sent"]
    dist.all_reduce(torch.ones(n, dtype=torch.float64))
    after = hetcomm.stats()["bytes_sent"]
    out["sent"] = [after[p] - before[p] for p in range(ws)]
    out["bytes"] = n * 8
    return out


def test_three_sites_with_a_host_that_owns_nothing() -> None:
    """By hand: host {2} owns nothing, so it sends its whole buffer (N) to the owners in site 0 and
    gets N back, and no byte goes from it across sites. Sites cross-reduce as the site plan does:
    site k's owners send each other site t its piece (w_t of their blocks) and return their own
    (w_k): site k sends (1 - w_k) N + 2 w_k N across, 1.2 N, 1.3 N and 1.5 N. Headers: one per
    message, 40 bytes, and a message per piece of 64 KB and flow: under 1% of N."""
    results = run_ranks(5, _weighted_three_sites,
                        env={"HETCOMM_HOST_ID": "0,0,1,2,3", "HETCOMM_PROBE": "0",
                             "HETCOMM_SMALL_ALLREDUCE_BYTES": "0", "HETCOMM_SITE_PIECE_BYTES": str(64 << 10)})
    sent = [results[r]["sent"] for r in range(5)]
    N = results[0]["bytes"]
    site_of = [0, 0, 0, 1, 2]
    assert N <= sum(sent[2][b] for b in (0, 1)) <= 1.01 * N, sent[2]
    assert sum(sent[2][b] for b in (3, 4)) == 0, sent[2]
    for s, want in ((0, 1.2), (1, 1.3), (2, 1.5)):
        across = sum(sent[a][b] for a in range(5) for b in range(5) if site_of[a] == s != site_of[b])
        assert want * N - 64 <= across <= (want + 0.01) * N, (s, across, want * N)


def _bytes_sent(rank: int, ws: int, numel: int) -> dict:
    import hetcomm
    assert hetcomm.get_plan().sites.three_level
    before = hetcomm.stats()["bytes_sent"]
    t = torch.ones(numel)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((numel,), float(ws)))
    after = hetcomm.stats()["bytes_sent"]
    return {"sent": [after[p] - before[p] for p in range(ws)]}


def test_the_wan_carries_n_per_site_and_each_host_its_part() -> None:
    """2 + 1 hosts of 2 ranks. By hand, with N the buffer's bytes: the two sites exchange N each
    way (each site's owners send the other site's half of their blocks, N/2, and return the final
    own half, N/2). In site 0 each host owns half the site's blocks: it sends the other host the
    half it does not own (N/2) and the final half it owns (N/2), and carries half of the site's
    WAN traffic (N/2): 1.5 N out of each host of site 0. Site 1's one host sends N, all across."""
    hosts, sites = CLUSTERS["2+1 hosts"]
    host_of = [int(h) for h in hosts.split(",")]
    site_of = [int(s) for s in sites.split(",")]
    numel = 1_000_003
    N = numel * 4
    results = run_ranks(6, _bytes_sent, numel, env=_env(hosts, sites))
    sent = [results[r]["sent"] for r in range(6)]

    def total(pick) -> int:
        return sum(sent[a][b] for a in range(6) for b in range(6) if a != b and pick(a, b))

    for s in (0, 1):
        wan = total(lambda a, b: site_of[a] == s != site_of[b])
        assert N <= wan <= N + HEADERS, (s, wan, N)
    for h, want in ((0, 3 * N // 2), (1, 3 * N // 2), (2, N)):
        out = total(lambda a, b: host_of[a] == h != host_of[b])
        assert want - 8 <= out <= want + HEADERS, (h, out, want)
    assert total(lambda a, b: host_of[a] == host_of[b]) == 0  # shared memory inside hosts


def _mismatched(rank: int, ws: int) -> str:
    import hetcomm
    # Hosts 0,0,1,1 share memory; a plan that calls ranks 0 and 2 one host is refused at use.
    b = hetcomm.backend_of()
    b.set_site_plan([[0, 1, 2], [3]], [[0, 3], [2, 3]], [0.5, 0.5], [0.5, 0.5], 0, 0, False,
                    [[0, 2], [1], [3]], [[0, 1, 3], [2, 1, 3]])
    try:
        dist.all_reduce(torch.ones(1000))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_a_plan_whose_hosts_do_not_share_memory_fails_clearly() -> None:
    for msg in run_ranks(4, _mismatched, env={"HETCOMM_HOST_ID": "0,0,1,1", "HETCOMM_PROBE": "0",
                                               "HETCOMM_SMALL_ALLREDUCE_BYTES": "0"}):
        assert "of its host's inner level" in msg or "gave up" in msg or "lost" in msg, msg


# ------------------------------------------------------------------------------ the plan (pure)

def test_layout_every_host_holds_every_block_and_every_site_owns_it_once() -> None:
    from hetcomm.plan import three_level_plan
    assert three_level_plan([0, 0, 1, 1], [0, 1, 2, 3]) is not None      # hosts of one rank still nest
    assert three_level_plan([0, 0, 1, 1], [0, 0, 1, 1]) is None          # one host per site: the host plan
    assert three_level_plan([0, 0, 0, 0], [0, 0, 1, 1]) is None          # one site
    assert three_level_plan([0, 0, 1, 1], [0, 1, 1, 2]) is None          # host 1 spans two sites
    p = three_level_plan([0, 0, 0, 0, 1, 1], [0, 1, 1, 2, 3, 3])
    assert p.sites == ((0, 1, 2, 3), (4, 5)) and p.hosts == ((0,), (1, 2), (3,), (4, 5))
    assert sum(p.block_shares) == pytest.approx(1.0)
    for h, host in enumerate(p.hosts):
        held = [b[h] for b in p.holders]
        assert held == sorted(held)                                       # contiguous, in rank order
        for r in host:                                                    # equal parts inside a host
            assert sum(x for b, x in zip(p.holders, p.block_shares) if b[h] == r) == pytest.approx(1 / len(host))
    for b, owners in enumerate(p.blocks):
        for s, owner in enumerate(owners):
            assert owner in p.sites[s] and owner in p.holders[b]
    # Equal shares: each host of site 0 owns a third of the blocks, spread over its ranks (host 1's
    # two ranks a sixth each), and site 1's host all of them, half per rank.
    owned = {r: sum(x for o, x in zip(p.blocks, p.block_shares) if r in o) for r in range(6)}
    assert owned == pytest.approx({0: 1 / 3, 1: 1 / 6, 2: 1 / 6, 3: 1 / 3, 4: 1 / 2, 5: 1 / 2})


def _levels_model(hosts, sites, nic_mbit, wan_mbit):
    from hetcomm.planner import LinkModel
    H, S = max(hosts) + 1, max(sites) + 1
    nic = [m * 125e3 for m in nic_mbit]
    return LinkModel.from_levels(hosts, sites, host_out=nic, host_in=nic, loopback=[4e9] * H,
                                 site_out=[wan_mbit * 125e3] * S, site_in=[wan_mbit * 125e3] * S,
                                 reduce_bps=[4e9] * len(hosts), segment_bytes=65536, small_allreduce_bytes=65536)


def test_the_planner_takes_three_levels_when_the_wan_is_the_cut() -> None:
    """2 sites x 2 hosts x 2 ranks, NICs 1000 Mbit/s, WAN 100: the WAN cut is N / 12.5 MB/s. The
    three-level plan meets it (each site sends N across); so would the site plan, whose rings
    then cross loopback, and the tie goes to shared memory. A flat ring crosses the WAN with
    >= 1.5 N per direction, the host plan with 2 N (each host's pieces reach both remote hosts)."""
    from hetcomm.plan import choose_plan, host_plan
    from hetcomm.plan.cost import cut_bound_seconds, ring_seconds_per_byte, site_plan_seconds_per_byte
    hosts, sites = [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]
    model = _levels_model(hosts, sites, [1000] * 4, 100)
    plan = choose_plan(model, 0.05, sites, hosts)
    assert plan.sites is not None and plan.sites.three_level, plan
    n = 64 << 20
    bound = n / 12.5e6
    assert cut_bound_seconds(model, n, sites) == pytest.approx(bound)
    assert n * site_plan_seconds_per_byte(plan.sites, model) == pytest.approx(bound)
    assert n * site_plan_seconds_per_byte(host_plan(hosts, model), model) == pytest.approx(2 * bound)
    assert n * ring_seconds_per_byte(plan.order, plan.shares, model) >= 1.5 * bound * (1 - 1e-9)


def test_the_planner_keeps_the_host_plan_when_the_wan_is_not_the_cut() -> None:
    # WAN 10 Gbit/s: the hosts' NICs are the cut, and the host plan reaches every host directly.
    from hetcomm.plan import choose_plan
    hosts, sites = [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]
    plan = choose_plan(_levels_model(hosts, sites, [1000] * 4, 10_000), 0.05, sites, hosts)
    assert plan.sites is not None and plan.sites.local_inner, plan


def test_a_slow_host_nic_owns_less_only_when_it_is_the_limit() -> None:
    """Site 0 of three hosts, host 1's NIC 600 Mbit/s (75 MB/s); site 1 one host. A host of site 0
    sends (1 - y) N to the others (what it does not own), (k - 1) y N back (what it owns, final)
    and c y N across the WAN (c = 1 for two sites): (1 + 2 y) N for k = 3. With a 100 Mbit/s WAN
    the WAN is the cut (N / 12.5 MB/s) and equal shares meet it (host 1: (5/3) N / 75 MB/s, less),
    so they stay. With a 1 Gbit/s WAN the NICs limit: (1 + 2 y_h) / C_h equal with sum y = 1 gives
    T = 5 / 325 and y = (6/13, 1/13, 6/13) for C = (125, 75, 125)."""
    from hetcomm.plan import three_level_plan
    from hetcomm.plan.cost import site_plan_seconds_per_byte
    hosts, sites = [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 0, 0, 1, 1]
    for wan, y in ((100, (1 / 3, 1 / 3, 1 / 3)), (1000, (6 / 13, 1 / 13, 6 / 13))):
        model = _levels_model(hosts, sites, [1000, 600, 1000, 1000], wan)
        p = three_level_plan(sites, hosts, model, min_gain=0.05)
        got = [sum(x for o, x in zip(p.blocks, p.block_shares) if o[0] in (2 * h, 2 * h + 1)) for h in range(3)]
        assert got == pytest.approx(y, abs=1e-6), (wan, got)
        if wan == 1000:
            assert site_plan_seconds_per_byte(p, model) == pytest.approx(5 / 325 / 1e6), wan


@pytest.mark.parametrize("change,fragment", [
    ({"holders": ((1, 2, 4, 5),) * 2}, "one rank of each host"),               # rank 1 is not in host {2,3}
    ({"blocks": ((0, 4), (3, 5))}, "must hold it"),                              # owner 3 does not hold block 1
    ({"hosts": ((0, 1), (2, 4), (3,), (5,))}, "spans several sites"),
    ({"local_inner": True}, "exclude each other"),
    ({"holders": ((0, 2),) * 2}, "one rank of each host"),                      # one holder missing
    ({"blocks": ((1, 4), (0, 5)), "holders": ((1, 2, 4), (0, 2, 5))}, "contiguous"),   # rank 0's after rank 1's
    ({"hosts": ((0, 1), (2, 3), (4, 5), (5,))}, "partition"),
])
def test_malformed_three_level_plans_are_refused(change: dict, fragment: str) -> None:
    from hetcomm.plan import SitePlan
    good = dict(sites=((0, 1, 2, 3), (4, 5)), blocks=((0, 4), (2, 5)), block_shares=(0.5, 0.5),
                site_shares=(0.5, 0.5), hosts=((0, 1), (2, 3), (4, 5)), holders=((0, 2, 4), (0, 2, 5)))
    SitePlan(**good)
    with pytest.raises(ValueError, match=fragment):
        SitePlan(**{**good, **change})


def _engine_refusals(rank: int, ws: int) -> list:
    import hetcomm
    b = hetcomm.backend_of()
    sites, owners = [[0, 1, 2, 3], [4, 5]], [[0, 4], [2, 5]]
    bad = [  # (hosts, holders) the engine must refuse, each with a reason
        ([[0, 1], [2, 3], [4, 5]], [[1, 2, 4], [1, 2, 5]]),   # owner 0 does not hold block 0 (1 does)
        ([[0, 1], [2, 4], [3], [5]], [[0, 2, 3, 5], [0, 2, 3, 5]]),   # host {2,4} spans sites
        ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4]]),               # one holder list for two blocks
        ([[0, 1], [2, 3], [4, 5]], [[0, 3, 4], [0, 2, 5]]),    # host {2,3}: rank 3 then rank 2
        ([[1, 0], [2, 3], [4, 5]], [[0, 2, 4], [0, 2, 5]]),    # host ranks not ascending
        ([[0, 1], [2, 3], [4, 5]], [[0, 2, 7], [0, 2, 5]]),    # rank 7 does not exist
    ]
    out = []
    for hosts, holders in bad:
        try:
            b.set_site_plan(sites, owners, [0.5, 0.5], [0.5, 0.5], 0, 0, False, hosts, holders)
            out.append("accepted")
        except Exception as e:  # noqa: BLE001
            out.append(str(e))
    try:
        b.set_site_plan(sites, owners, [0.5, 0.5], [0.5, 0.5], 0, 0, True, [[0, 1], [2, 3], [4, 5]],
                        [[0, 2, 4], [0, 2, 5]])
        out.append("accepted")
    except Exception as e:  # noqa: BLE001
        out.append(str(e))
    return out


def test_the_engine_refuses_malformed_three_level_plans() -> None:
    messages = run_ranks(6, _engine_refusals, env={"HETCOMM_PROBE": "0"})[0]
    for msg, fragment in zip(messages, ["does not hold it", "spans two sites", "one holder list per block",
                                        "contiguous", "ascending", "not a rank of that host", "not both"]):
        assert fragment in msg, (fragment, msg)


def test_plans_survive_the_broadcast_encoding() -> None:
    from hetcomm import topology
    from hetcomm.plan import host_plan, three_level_plan
    from hetcomm.planner import uniform_plan
    import dataclasses
    for sp in (three_level_plan([0, 0, 0, 0, 1, 1], [0, 1, 1, 2, 3, 3]), host_plan([0, 0, 1, 1, 1, 2])):
        plan = dataclasses.replace(uniform_plan(6), sites=dataclasses.replace(sp, min_bytes=4096, segment_bytes=65536))
        assert topology._decode_plan(topology._encode_plan(plan), 6, None) == plan

