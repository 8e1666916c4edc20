"""Tests of the shared-uplink site model of the simulator (``--wan-mbit``, ``SimSpec.wan_mbit``).

Each site reaches the others through one WAN uplink per direction that all of its cross-site
flows share (the other site model, ``--inter-mbit``, gives every cross-site pair its own link).
The first group is pure: parsing, validation, the uplinks a spec implies, the ``tc`` plan and the
physical bound. The second builds clusters (root and ``ip netns``; skipped otherwise, saying why,
as in ``test_sim.py``) and checks what crosses the uplinks with the qdisc byte counters
(``SimCluster.uplink_bytes()``): counting bytes does not depend on how busy the 2-core machine is,
timing does, so rates are checked loosely and never alone.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import subprocess
import sys
import time

import pytest

from hetcomm.bench.analysis import (_planner_model, bound_seconds, cut_bound, one_way_capacity,
                                    physical_model)
from hetcomm.sim import SimCluster, SimError, SimSpec, TCP_GOODPUT_FRACTION
from hetcomm.sim import __main__ as sim_main
from hetcomm.sim import shaping
from hetcomm.sim.spec import effective_link_mbit, effective_uplinks
from marks import needs_netns
from simrun import FLOWS, assert_clean, assert_shaped, run_flows, uplink_delta

WAN_MBIT = 100.0
WAN_PAYLOAD_BPS = WAN_MBIT * 1e6 / 8 * TCP_GOODPUT_FRACTION   # 11.95 MB/s of TCP payload


def spec_of(*argv: str) -> SimSpec:
    return sim_main.spec_from_args(sim_main.build_parser().parse_args([*argv, "--", "true"]))


# ============================================================================================
# Pure: no root needed
# ============================================================================================

def test_wan_option_parses_validates_and_round_trips():
    spec = spec_of("--sites", "0,0,1,1", "--intra-mbit", "1000", "--wan-mbit", "100")
    assert (spec.sites, spec.intra_mbit, spec.inter_mbit, spec.wan_mbit) == ([0, 0, 1, 1], 1000, None, 100)
    assert spec.shaped and spec.per_link
    assert SimSpec.from_json(spec.to_json()) == spec
    assert "one shared WAN uplink per site, 100 Mbit/s each way" in spec.describe()
    # the uplinks alone are enough shaping for --sites; a spec written before the field loads
    assert SimSpec(sites=[0, 1], wan_mbit=50).shaped
    old = json.loads(SimSpec(sites=[0, 1], inter_mbit=5).to_json())
    del old["wan_mbit"]
    assert SimSpec.from_json(json.dumps(old)).wan_mbit is None
    # hetcomm.bench hands spec_from_args a namespace of its own, which may lack wan_mbit
    bench_args = argparse.Namespace(nic_mbit=None, link_mbit=None, sites="0,1", intra_mbit=None,
                                    inter_mbit="10", cpu_quota=None, latency_ms=0.0, nprocs=None,
                                    tcp_cc=None)
    assert sim_main.spec_from_args(bench_args).wan_mbit is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(nprocs=4, wan_mbit=100), r"wan_mbit \(--wan-mbit\) gives each site a shared uplink: it needs "
                                   r"sites \(--sites\)"),
    (dict(sites=[0, 0, 0], wan_mbit=100), r"needs at least two sites: sites \(--sites\) 0,0,0 is one site"),
    (dict(sites=[0, 1], wan_mbit=-5), r"wan_mbit = -5: must be positive"),
    (dict(sites=[0, 1]), r"sites \(--sites\) needs --intra-mbit, --inter-mbit and/or --wan-mbit"),
])
def test_wan_validation_messages(kwargs, message):
    with pytest.raises(SimError, match=message):
        SimSpec(**kwargs)


def test_wan_command_line_errors():
    with pytest.raises(SimError, match="--wan-mbit"):
        spec_of("--nprocs", "2", "--wan-mbit", "100")
    with pytest.raises(SimError, match="--wan-mbit: 'fast' is not a rate"):
        spec_of("--sites", "0,1", "--wan-mbit", "fast")
    assert "--wan-mbit R" in sim_main.build_parser().format_help()


def test_effective_uplinks_and_single_flow_rates():
    spec = SimSpec(sites=[0, 0, 1, 1, 2], intra_mbit=1000, inter_mbit=400, wan_mbit=100)
    assert effective_uplinks(spec) == [((0, 1), 12.5e6, 12.5e6), ((2, 3), 12.5e6, 12.5e6),
                                       ((4,), 12.5e6, 12.5e6)]
    assert effective_uplinks(SimSpec(sites=[0, 1], inter_mbit=100)) == []
    # one flow alone between sites gets min(inter, wan); within a site the uplink is not crossed
    eff = effective_link_mbit(spec)
    assert eff[0][1] == 1000 and eff[0][2] == 100 and eff[4][0] == 100
    # sites are listed in order of first appearance, whatever their labels
    assert SimSpec(sites=["b", "a", "b"], wan_mbit=10).site_groups() == [("b", (0, 2)), ("a", (1,))]
    # per-pair shaping at the sender stays what --inter-mbit asks: nothing across sites without it
    addrs = [f"10.0.0.{k + 1}" for k in range(4)]
    plan = [" ".join(c) for c in shaping.egress_plan(SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000,
                                                             wan_mbit=100), 0, "eth0", addrs)]
    assert [c for c in plan if "flowid" in c] == ["filter add dev eth0 parent 1: protocol ip prio 1 "
                                                  "u32 match ip dst 10.0.0.2/32 flowid 1:b"]
    assert shaping.egress_plan(SimSpec(sites=[0, 1], wan_mbit=100), 0, "eth0", addrs[:2]) == []


def test_uplink_tc_plan():
    """Out: a leaf per rank of the other sites; in: a leaf per rank of the site; all under one
    parent class at the uplink rate, so that the site's flows share it."""
    spec = SimSpec(sites=[0, 0, 1, 1], wan_mbit=100)
    addrs = [f"10.0.0.{k + 1}" for k in range(4)]
    out = [" ".join(c) for c in shaping.uplink_plan(spec, 0, "out", "o0", addrs)]
    assert out[:2] == ["qdisc add dev o0 root handle 1: htb default 2",
                       "class add dev o0 parent 1: classid 1:1 htb rate 100000kbit ceil 100000kbit "
                       "burst 25000 cburst 25000 quantum 200000"]
    assert [c.split()[-1] for c in out if c.startswith("filter")] == ["1:c", "1:d"]   # ranks 2, 3
    assert all(" ceil 100000kbit " in c for c in out if c.startswith("class"))
    into = [" ".join(c) for c in shaping.uplink_plan(spec, 0, "in", "i0", addrs)]
    assert [c.split()[-3] for c in into if c.startswith("filter")] == ["10.0.0.1/32", "10.0.0.2/32"]
    assert shaping.uplink_plan(SimSpec(sites=[0, 1], inter_mbit=100), 0, "out", "o0", addrs) == []


def test_bound_of_two_sites_is_n_over_one_uplink():
    sim = physical_model(SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000, wan_mbit=100))
    assert sim["bound_kind"] == "cut" and sim["bound_bytes_per_s"] == 12.5e6
    assert "{0,1}|{2,3}: N over the 100 Mbit/s uplink of site 0" in sim["bound_text"]
    assert bound_seconds(sim, 25_000_000) == pytest.approx(2.0)
    assert sim["uplinks"] == [
        {"site": 0, "ranks": [0, 1], "out_bytes_per_s": 12.5e6, "in_bytes_per_s": 12.5e6},
        {"site": 1, "ranks": [2, 3], "out_bytes_per_s": 12.5e6, "in_bytes_per_s": 12.5e6}]
    json.dumps(sim, allow_nan=False)
    # per-pair links too: the four 20 Mbit/s pairs (10 MB/s) are narrower than the uplink
    sim = physical_model(SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000, inter_mbit=20, wan_mbit=100))
    assert sim["bound_bytes_per_s"] == pytest.approx(10e6) and "over all its links" in sim["bound_text"]
    # the per-pair model alone: the sum of the crossing links (unchanged)
    assert physical_model(SimSpec(sites=[0, 0, 1, 1], inter_mbit=100))["bound_bytes_per_s"] == 50e6


def test_bound_of_three_sites():
    """Three sites of one rank, 100 Mbit/s uplinks: a site alone against the other two sends
    through its one uplink (12.5 MB/s) although two uplinks could receive: N over one uplink.
    Tighter still, with sites as nodes, 2(S-1) N = 4 N leave the sites through 3 uplinks: N over
    9.375 MB/s, the bound shown. With a slow link inside site 0 the cut {0}|{1,2,3} adds that
    link to the uplink."""
    sim = physical_model(SimSpec(sites=[0, 1, 2], wan_mbit=100))
    assert sim["bound_bytes_per_s"] == pytest.approx(12.5e6 * 3 / 4) and "sites as nodes" in sim["bound_text"]
    assert sim["bound_kind"] == "sites"
    inf = math.inf
    nic = [inf] * 4
    bw = [[inf if i == j else (8e6 if {i, j} == {0, 1} else 100e6) for j in range(4)] for i in range(4)]
    uplinks = [((0, 1), 12.5e6, 12.5e6), ((2,), 12.5e6, 12.5e6), ((3,), 12.5e6, 12.5e6)]
    assert one_way_capacity((0,), (1, 2, 3), nic, bw, uplinks) == (8e6 + 12.5e6, "out-uplinks", (0,))
    assert one_way_capacity((2, 3), (0, 1), nic, bw, uplinks) == (12.5e6, "in-uplinks", (0,))
    assert cut_bound(nic, bw, None, uplinks) == (12.5e6, (0, 1))


def test_uplinks_of_some_ranks_only():
    """Rank 2 behind no uplink: what it sends is limited by its links alone."""
    inf = math.inf
    bw = [[inf if i == j else 50e6 for j in range(3)] for i in range(3)]
    uplinks = [((0, 1), 10e6, 20e6)]
    # out of {0,1}: one 10 MB/s uplink; into {0,1} from 2: 20 MB/s uplink, or the links (100 MB/s)
    assert one_way_capacity((0, 1), (2,), [inf] * 3, bw, uplinks)[:2] == (10e6, "out-uplinks")
    assert one_way_capacity((2,), (0, 1), [inf] * 3, bw, uplinks)[:2] == (20e6, "in-uplinks")
    # {0,2} -> {1}: 2->1 enters 0's group (20 MB/s in), 0->1 stays inside it (50 MB/s)
    assert one_way_capacity((0, 2), (1,), [inf] * 3, bw, uplinks)[0] == 70e6


def test_uplinks_never_raise_a_cut_capacity():
    rng = random.Random(14)
    for _ in range(200):
        p = rng.randint(2, 7)
        nic = [rng.choice([math.inf, rng.uniform(1, 100)]) for _ in range(p)]
        bw = [[math.inf if i == j else rng.choice([math.inf, rng.uniform(1, 100)]) for j in range(p)]
              for i in range(p)]
        sites = [rng.randrange(3) for _ in range(p)]
        groups = [tuple(k for k in range(p) if sites[k] == s) for s in range(3)]
        uplinks = [(g, rng.uniform(1, 100), rng.uniform(1, 100)) for g in groups if g and rng.random() < 0.8]
        without = cut_bound(nic, bw, sites)[0]
        with_uplinks = cut_bound(nic, bw, sites, uplinks)[0]
        assert with_uplinks <= without
        # and so for every cut in each direction
        for k in range(1, p):
            for side in itertools.combinations(range(p), k):
                rest = tuple(j for j in range(p) if j not in side)
                assert (one_way_capacity(side, rest, nic, bw, uplinks)[0]
                        <= one_way_capacity(side, rest, nic, bw)[0])


def test_planner_model_gets_the_uplinks():
    """The planner's model of a shared-WAN cluster carries its uplinks (this test used to skip
    when LinkModel had no such field, which turned a regression into a skip; now it fails)."""
    sim = physical_model(SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000, wan_mbit=100))
    model = _planner_model(sim)
    assert model.uplinks == (((0, 1), 12.5e6, 12.5e6), ((2, 3), 12.5e6, 12.5e6))
    assert model.bw[0][2] == 12.5e6 and model.bw[0][1] == 125e6
    assert _planner_model(physical_model(SimSpec(sites=[0, 1], inter_mbit=100))).uplinks == ()


# ============================================================================================
# Real clusters: root + ip netns
# ============================================================================================

# Every rank: a group of BACKEND, a warm-up allreduce (connects every pair), then it waits until
# the test has read the counters; ITERS allreduces of a COUNT-element fp32 tensor, checked; waits
# again so that the counters are read before the group's teardown traffic.
ALLREDUCES = r'''
import os, sys, time
import torch, torch.distributed as dist
flags, iters, count, backend = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if backend == "hetcomm":
    import hetcomm
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
def mark(name): open(os.path.join(flags, f"{name}{rank}"), "w").close()
def wait(name):
    while not os.path.exists(os.path.join(flags, name)): time.sleep(0.01)
dist.init_process_group(backend)
if backend == "hetcomm":
    assert hetcomm.get_plan().sites is not None, hetcomm.get_plan()
x = torch.ones(count)
dist.all_reduce(x); dist.barrier()
mark("ready"); wait("go")
for _ in range(iters):
    x.fill_(rank + 1); dist.all_reduce(x)
assert bool((x == world * (world + 1) // 2).all()), x[:4]
mark("done"); wait("exit")
dist.destroy_process_group()
'''


def _wait_for(paths, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.02)


# hetcomm with the sites and links declared (so that no probe runs): its site plan.
DECLARED_SITES = {"HETCOMM_SITES": "0,0,1,1",
                  "HETCOMM_LINK_MBIT": "0,1000,100,100;1000,0,100,100;100,100,0,1000;100,100,1000,0"}


@needs_netns
@pytest.mark.parametrize("backend, per_allreduce, env", [("gloo", 1.5, {}), ("hetcomm", 1.0, DECLARED_SITES)])
def test_uplinks_carry_what_the_model_says(tmp_path, backend, per_allreduce, env):
    """gloo's ring 0>1>2>3>0 on sites 0,0,1,1 crosses the WAN on 1->2 and 3->0, each carrying
    2N(P-1)/P = 1.5N per allreduce: so does each site's out and in uplink (plus headers).
    hetcomm's site plan (hetcomm.plan.hierarchy: (1 + (S - 2) w) N out of each site) moves N."""
    iters, count = 3, 1 << 20                      # 4 MiB of fp32
    spec = SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000, wan_mbit=WAN_MBIT)
    script = tmp_path / "ring.py"
    script.write_text(ALLREDUCES)
    flags = tmp_path / "flags"
    flags.mkdir()
    with SimCluster(spec, log=lambda s: None) as cluster:
        rid = cluster.run_id
        hub_links = subprocess.run(["ip", "-n", cluster.hub_namespace, "-o", "link"],
                                   capture_output=True, text=True).stdout
        for name in cluster.site_bridges + cluster.uplink_out_ports + cluster.uplink_in_ports:
            assert f" {name}" in hub_links, hub_links
        assert cluster.rank_env(0)["HETCOMM_SIM_WAN_MBIT"] == "100"
        procs = cluster.launch([sys.executable, str(script), str(flags), str(iters), str(count), backend],
                               {"OMP_NUM_THREADS": "1", **env})
        try:
            _wait_for([flags / f"ready{k}" for k in range(4)], f"the {backend} group")
            time.sleep(0.2)                        # the warm-up's last ACKs
            before = cluster.uplink_bytes()
            (flags / "go").touch()
            _wait_for([flags / f"done{k}" for k in range(4)], "the allreduces")
            time.sleep(0.2)
            moved = uplink_delta(cluster.uplink_bytes(), before)
            (flags / "exit").touch()
            for r in procs:
                out, err = r.popen.communicate(timeout=60)
                assert r.popen.returncode == 0, err.decode()
        finally:
            for r in procs:
                if r.popen.poll() is None:
                    r.popen.kill()
    assert_clean(rid)
    payload = per_allreduce * 4 * count * iters
    wire = payload / TCP_GOODPUT_FRACTION          # 1514-byte frames per 1448 bytes of payload
    for site in (0, 1):
        for direction in ("out", "in"):
            got = moved[site][direction]
            assert 0.99 * wire <= got <= 1.08 * wire, (
                f"site {site} {direction}: {got} bytes, expected {wire:.0f} ({per_allreduce}N x {iters} of payload "
                f"= {payload:.0f}, plus headers): {moved}")
    # what leaves one site enters the other
    assert moved[0]["out"] == pytest.approx(moved[1]["in"], rel=0.005)
    assert moved[1]["out"] == pytest.approx(moved[0]["in"], rel=0.005)


@needs_netns
def test_uplink_limits_a_cross_site_flow_and_is_shared(tmp_path):
    """One flow 0->2 goes out through site 0's uplink and in through site 1's at the uplink rate;
    two flows out of site 0 at once (0->2, 1->3) share that uplink; a flow inside site 0 (0->1)
    crosses no uplink and runs faster than one. (Rates: at most the shaper's, at least half of
    it -- simrun.assert_shaped -- where ±20% did not hold on a loaded two-core machine; the bytes
    on the uplinks are counted exactly.)"""
    script = tmp_path / "flows.py"
    script.write_text(FLOWS)
    n = 6_000_000
    wire = n / TCP_GOODPUT_FRACTION
    spec = SimSpec(sites=[0, 0, 1, 1], intra_mbit=1000, wan_mbit=WAN_MBIT)
    with SimCluster(spec, log=lambda s: None) as cluster:
        rid = cluster.run_id
        (one,), moved = run_flows(cluster, script, f"0>2:{n}")
        assert one["bytes"] == n
        assert 0.99 * wire <= moved[0]["out"] <= 1.03 * wire, moved
        assert 0.99 * wire <= moved[1]["in"] <= 1.03 * wire, moved
        assert moved[1]["out"] < 0.05 * wire and moved[0]["in"] < 0.05 * wire, moved   # ACKs only
        rate = n / (one["t1"] - one["t0"])
        assert_shaped(rate, WAN_PAYLOAD_BPS, "one flow across the uplink")

        two, moved = run_flows(cluster, script, f"0>2:{n},1>3:{n}")
        assert sorted((r["src"], r["dst"], r["bytes"]) for r in two) == [(0, 2, n), (1, 3, n)]
        assert 0.99 * 2 * wire <= moved[0]["out"] <= 1.03 * 2 * wire, moved
        assert 0.99 * 2 * wire <= moved[1]["in"] <= 1.03 * 2 * wire, moved
        together = 2 * n / (max(r["t1"] for r in two) - min(r["t0"] for r in two))
        assert_shaped(together, WAN_PAYLOAD_BPS, "two flows across the uplink together")
        for r in two:   # each got about half while both ran: well below the uplink alone
            assert n / (r["t1"] - r["t0"]) < 0.8 * WAN_PAYLOAD_BPS, two

        (local,), moved = run_flows(cluster, script, f"0>1:{n}")
        assert local["bytes"] == n
        assert all(v < 50_000 for d in moved.values() for v in d.values()), moved
        assert n / (local["t1"] - local["t0"]) > 2 * WAN_PAYLOAD_BPS
    assert_clean(rid)
