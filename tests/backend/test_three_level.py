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


def _three_level_suite(rank: int, ws: int, subgroup: list) -> dict:
    import hetcomm
    out = level_suite(rank, ws, "three")
    # A subgroup with some ranks of each host and site plans for itself.
    group = dist.new_group(subgroup)
    if rank in subgroup:
        sub = hetcomm.get_plan(group)
        assert sub.sites is not None and sub.sites.three_level, sub
        for n in (1, 1031, 300_007):
            t = torch.arange(n, dtype=torch.float64) * (rank + 1)
            dist.all_reduce(t, group=group)
            expected = torch.arange(n, dtype=torch.float64) * sum(r + 1 for r in subgroup)
            assert torch.equal(t, expected), (n, (t - expected).abs().max())
    dist.barrier()
    return out


@pytest.mark.parametrize("name,subgroup", [("2+1 hosts", [0, 2, 3, 4]), ("3+1 hosts", [0, 1, 3, 5]),
                                           ("1-rank hosts", [0, 1, 3])])
def test_three_level_allreduce(name: str, subgroup: list) -> None:
    hosts, sites = CLUSTERS[name]
    ws = len(hosts.split(","))
    report = run_suite(ws, _three_level_suite, subgroup, families=["all_reduce", "identical", "path"],
                       env=_env(hosts, sites, **SLOT_ENV), timeout=300)
    for family in ("all_reduce", "identical", "path"):
        report.assert_family(family)


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
        assert "shares memory with" in msg or "gave up" in msg or "lost" in msg, msg


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
