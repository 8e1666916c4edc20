"""How long rank 0 takes to plan a new group, from 8 to 1,024 ranks, and how good the plan is.

    python benchmarks/plan_time.py [--ranks 8,32,64,128,256,1024] [--repeats 3] \
        [--json benchmarks/results/plan_time.json]

What is timed is what rank 0 runs at group creation once the links are known
(`hetcomm.topology.apply_model`): the group's levels (sites detected from the rates, hosts as
given) and `hetcomm.plan.plan_for_group` (snapping a measured model, the ring, the host or site
schedule, the crossover sizes); every other rank waits for it. The median of ``--repeats`` runs,
caches cleared before each.

Clusters (each given to the planner as a *measured-looking* model: every link and shared-link rate
times an independent factor in [0.9, 1.1], as a probe's error; the plan is then judged on the
exact model):

* ``slow NIC``: one rank per host, NICs of 25 Gbit/s, one of 2.5 Gbit/s;
* ``hosts of 8``: hosts of 8 ranks (shared memory inside), host NICs of 25 Gbit/s, one host's of
  2.5 Gbit/s;
* ``2 sites`` / ``4 sites``: the ranks split into equal sites (hosts of 8 inside from 16 ranks
  on), NICs of 10 Gbit/s, every site behind one 1 Gbit/s WAN uplink (which one cross-site flow
  also gets).

Beside the time: the plan's predicted time on the exact model against the cut bound
(`hetcomm.plan.cut_bound_seconds`, with the sites), both per byte of a large message (the
bandwidth terms: ``per_byte_over_bound``) and at 1 GiB with the latency terms
(``over_bound_1g``); and which schedule the plan uses.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from hetcomm.bench.records import command_line, write_document
from hetcomm.plan import (LinkModel, cut_bound_seconds, plan_for_group, predict_allreduce_seconds, site_plan_seconds_per_byte,
                          ring_seconds_per_byte, topology_from)
from hetcomm.plan import order as plan_order

GBIT = 1e9 / 8
GIB = 1 << 30


def cluster(kind: str, P: int) -> tuple[LinkModel, list[int], list[int], bool]:
    """(exact model, host labels, site labels, hosts share memory) of one benchmark cluster."""
    if kind == "slow NIC":
        nic = np.full(P, 25 * GBIT)
        nic[P // 3] = 2.5 * GBIT
        return LinkModel.from_nics(nic, reduce_bps=[5e9] * P), list(range(P)), [0] * P, False
    host_size = 8 if kind == "hosts of 8" or P >= 16 else 1
    hosts = [r // host_size for r in range(P)]
    H = max(hosts) + 1
    if kind == "hosts of 8":
        nic = np.full(H, 25 * GBIT)
        nic[H // 2] = 2.5 * GBIT
        model = LinkModel.from_levels(hosts, [0] * P, host_out=nic, host_in=nic, loopback=[80 * GBIT] * H,
                                      reduce_bps=[5e9] * P)
        return model, hosts, [0] * P, True
    S = 2 if kind == "2 sites" else 4
    sites = [r * S // P for r in range(P)]
    cross = np.full((S, S), 1 * GBIT)
    model = LinkModel.from_levels(hosts, sites, host_out=[10 * GBIT] * H, host_in=[10 * GBIT] * H,
                                  loopback=[80 * GBIT] * H, cross_site=cross, site_out=[1 * GBIT] * S,
                                  site_in=[1 * GBIT] * S, reduce_bps=[5e9] * P)
    return model, hosts, sites, host_size > 1


def measured_looking(model: LinkModel, rng: np.random.Generator) -> LinkModel:
    P = model.world_size
    noise = rng.uniform(0.9, 1.1, (P, P))
    uplinks = tuple((g, o * rng.uniform(0.9, 1.1), i * rng.uniform(0.9, 1.1)) for g, o, i in model.uplinks)
    reduce_bps = tuple(r * rng.uniform(0.9, 1.1) for r in model.reduce_bps)
    return LinkModel(bw=model.bw * noise + np.eye(P), reduce_bps=reduce_bps, alpha=model.alpha, uplinks=uplinks)


def plan_once(model: LinkModel, hosts: list[int], shared: bool):
    plan_order.best_plan.cache_clear()
    plan_order._uniform_evaluated.cache_clear()
    start = time.perf_counter()
    topology = topology_from(rates=model.bw, addresses=[str(h) for h in hosts] if len(set(hosts)) > 1 else None)
    plan = plan_for_group(model, topology, tuple(hosts) if shared else None, measured=True)
    return time.perf_counter() - start, plan, topology


def run(kind: str, P: int, repeats: int, seed: int) -> dict:
    exact, hosts, sites, shared = cluster(kind, P)
    noisy = measured_looking(exact, np.random.default_rng(seed))
    times, plan, topology = [], None, None
    for _ in range(repeats):
        seconds, plan, topology = plan_once(noisy, hosts, shared)
        times.append(seconds)
    site_labels = sites if len(set(sites)) > 1 else None
    bound_1g = cut_bound_seconds(exact, GIB, site_labels)
    per_byte = (site_plan_seconds_per_byte(plan.sites, exact) if plan.sites is not None
                else ring_seconds_per_byte(plan.order, plan.shares, exact))
    schedule = ("ring" if plan.sites is None else "hosts" if plan.sites.local_inner
                else "three-level" if plan.sites.three_level else "sites")
    return {"cluster": kind, "ranks": P, "seconds": statistics.median(times), "all_seconds": times,
            "schedule": schedule, "schedule_from_bytes": None if plan.sites is None else plan.sites.min_bytes,
            "sites_found": topology.num_sites, "per_byte_over_bound": per_byte * GIB / bound_1g,
            "over_bound_1g": predict_allreduce_seconds(plan, exact, GIB) / bound_1g, "bound_1g_seconds": bound_1g}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,32,64,128,256,1024")
    parser.add_argument("--clusters", default="slow NIC,hosts of 8,2 sites,4 sites")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'cluster':>11} {'ranks':>5} {'plan s':>7} {'schedule':>8} {'sites':>5} {'T/bound':>8} {'@1GiB':>7}", flush=True)
    for kind in args.clusters.split(","):
        for P in (int(p) for p in args.ranks.split(",")):
            if kind == "hosts of 8" and P < 16:
                continue
            row = run(kind, P, args.repeats, args.seed + P)
            rows.append(row)
            print(f"{kind:>11} {P:>5} {row['seconds']:>7.3f} {row['schedule']:>8} {row['sites_found']:>5} "
                  f"{row['per_byte_over_bound']:>8.3f} {row['over_bound_1g']:>7.3f}", flush=True)
    if args.json:
        write_document(args.json, {"benchmark": "plan_time", "repeats": args.repeats, "seed": args.seed, "rows": rows},
                       command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
