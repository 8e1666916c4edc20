"""How long rank 0 takes to choose the plan at group creation (topology.choose_plan), 8 ranks.

    python benchmarks/plan_time.py [--ranks 8] [--repeats 3] [--json benchmarks/results/plan_time.json]

Every other rank waits for this at group creation. Three kinds of measured-looking models, each
with +-10% noise on every link (a probe's error): one slow NIC, two sites joined by a slow link,
and fully random link rates, with finite reduce throughputs. Reports the median wall time of
`choose_plan` (the weighted plan and its crossover size) per model.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from hetcomm import planner
from hetcomm.topology import choose_plan


def models(P: int, seed: int) -> dict[str, planner.LinkModel]:
    rng = random.Random(seed)

    def noisy(x: float) -> float:
        return x * rng.uniform(0.9, 1.1)

    reduce_bps = tuple(noisy(2e9) for _ in range(P))
    nics = [125e6] * (P - 1) + [12.5e6]
    slow_nic = [[0.0 if i == j else noisy(min(nics[i], nics[j])) for j in range(P)] for i in range(P)]
    site = [0 if k < P // 2 else 1 for k in range(P)]
    sites = [[0.0 if i == j else noisy(125e6 if site[i] == site[j] else 12.5e6) for j in range(P)] for i in range(P)]
    rand = [[0.0 if i == j else rng.uniform(10e6, 1000e6) for j in range(P)] for i in range(P)]
    return {name: planner.LinkModel(bw=tuple(tuple(r) for r in bw), reduce_bps=reduce_bps)
            for name, bw in (("one slow NIC", slow_nic), ("two sites", sites), ("random links", rand))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name, model in models(args.ranks, seed=0).items():
        times = []
        for _ in range(args.repeats):
            planner.best_plan.cache_clear() if hasattr(planner.best_plan, "cache_clear") else None
            start = time.perf_counter()
            plan = choose_plan(model)
            times.append(time.perf_counter() - start)
        rows.append({"model": name, "ranks": args.ranks, "seconds": statistics.median(times),
                     "all_seconds": times, "min_bytes": plan.min_bytes, "order": list(plan.order)})
        print(f"{name:14s} {statistics.median(times):7.3f} s  (plan from {plan.min_bytes} B)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable, *sys.argv]), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
