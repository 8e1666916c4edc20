"""DiLoCo's loss by grouping of the ranks into workers and by variant, on local ranks (no
simulator, no root).

Runs ``examples/train_diloco.py`` under torchrun (gloo, 4 ranks by default) with the `fixed`
policy, so that every configuration takes the same inner steps on the same samples and each run
is deterministic (with overlap too, given ``--overlap-steps``): only the grouping (``--workers``),
the variant (``--variants``: sets of example flags) and the example flags given after ``--``
differ. Each ``--groupings`` entry is a value of the example's ``--workers`` (``ranks``: every rank
a worker; ``a,a,b,b``: two workers of two ranks, data parallel inside; ``a,a,a,a``: one worker,
plain data parallelism with an outer step on top)::

    python benchmarks/diloco_local.py --groupings 'ranks;a,a,b,b' --variants \\
        '--outer-momentum 0.9 --outer-lr 0.7;--outer-momentum 0 --outer-lr 1.0;--outer-momentum 0.5 --outer-lr 0.5'
    python benchmarks/diloco_local.py --groupings ranks --variants \\
        ';--overlap --overlap-steps 4 --early-weight 1;--overlap --overlap-steps 4 --early-weight 0.5'

The JSON file holds one record per line (hetcomm.bench.records): a ``run`` header (``example_args``,
``mean_final_loss`` per configuration, ``ratios`` of each one's mean loss to the first's),
then one ``result`` per run (``grouping``, ``variant``, ``seed``, the example's summary without its
per-round history, and ``example_command``). Configurations are named ``grouping`` or
``grouping | variant``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from hetcomm.bench.records import RESULT, RUN, command_line, record, write_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_diloco.py")


def run_one(grouping: str, variant: str, seed: int, args: argparse.Namespace, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nprocs),
               "--master-port", str(args.master_port), EXAMPLE, "--backend", "gloo", "--local-steps", "fixed",
               "--steps", str(args.steps), "--samples", str(args.samples), "--seed", str(seed),
               "--workers", grouping, *shlex.split(variant), *extra, "--json", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"diloco_local: {shlex.join(cmd)} ran past --timeout {args.timeout:g} s") from None
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise SystemExit(f"diloco_local: {shlex.join(cmd)} failed (exit {proc.returncode}):\n{tail}")
        with open(out) as f:
            summary = json.load(f)
    for key in ("history", "timelines", "argv"):
        summary.pop(key, None)
    summary["example_command"] = shlex.join(cmd[:-2])
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groupings", default="ranks;a,a,b,b;a,a,a,a",
                   help="';'-separated values of the example's --workers (default 'ranks;a,a,b,b;a,a,a,a')")
    p.add_argument("--variants", default="",
                   help="';'-separated sets of example flags, each run against every grouping (default: one, empty)")
    p.add_argument("--seeds", default="1,2", help="comma-separated seeds (each run is deterministic)")
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="H, the same for every worker (the `fixed` policy)")
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--master-port", type=int, default=29561)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    groupings = [g for g in args.groupings.split(";") if g]
    variants = [v.strip() for v in args.variants.split(";")] if args.variants else [""]
    configs = [(g, v, g if not v else f"{g} | {v}") for g in groupings for v in variants]
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    for seed in seeds:                       # interleaved: machine noise hits every configuration alike
        for grouping, variant, name in configs:
            res = run_one(grouping, variant, seed, args, extra)
            print(f"diloco_local: seed {seed}, {name}: {res['rounds']} rounds, "
                  f"held-out loss {res['final_loss']:.3f}", flush=True)
            results.append(record(RESULT, res, grouping=grouping, variant=variant, config=name, seed=seed))
    means = {name: statistics.mean(r["final_loss"] for r in results if r["config"] == name) for _, _, name in configs}
    base = configs[0][2]
    ratios = {f"mean_final_loss_{name}_over_{base}": means[name] / means[base] for _, _, name in configs[1:]}
    for name, m in means.items():
        print(f"diloco_local: {name}: mean held-out loss {m:.3f}", flush=True)
    for k, v in ratios.items():
        print(f"diloco_local: {k} = {v:.3f}", flush=True)
    if args.json:
        header = record(RUN, example_args=extra, steps=args.steps, samples=args.samples, nprocs=args.nprocs,
                        mean_final_loss=means, ratios=ratios)
        write_records(args.json, [header, *results], command_line([sys.argv[0], *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
