"""Where a failure lands, swept: three elastic DiLoCo workers (tests/support/elastic_worker.py),
w0's K-th reduction raising right after it returned (``--die K:behind-call``: the others apply
it; K counts the reductions that returned in w0's process), for every K, with each feature set.
Every run must end on every worker with the same global parameters after every round and at the
end, nobody dropped, and every step a worker took counted in exactly one round it reports (its
own, the one it received, or the one it carried on) and in exactly one reduction of each fragment
that the state went through (``--log-reductions``: `assert_each_step_reduced_once`); with
``-linear`` features, the final global parameters equal a float64 sum of those reductions. A run that fired nothing (w0 returned
fewer than K reductions) says so; the summary counts the runs that fired.

Usage::

    python benchmarks/elastic_carry_sweep.py [--calls 1-13] [--repeats 1] [--rounds 6] [--json FILE]
                                             [--features time-int8-overlap-staggered,...]

A run of 6 rounds has about 13 reductions: a larger K fires nothing (the line says so). Before
48ff24e the last round's synchronous boundary lost steps (counted in no round) for K around
10-12, where the failure lands in the last round (docs/elastic.md, "A round carried on";
benchmarks/results/elastic_carry_sweep*.json)."""
from __future__ import annotations

import argparse
import itertools
import shutil
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("python", "tests/support", "tests/train"):
    sys.path.insert(0, os.path.join(ROOT, sub))


def _calls(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


# ... and a model whose steps move each replica by a constant (fp32, a window's steps kept whole):
# the final global parameters are checked against a float64 sum of the reductions applied
LINEAR = ["--linear", "--linear-parts", "2", "--early-weight", "1"]


def _features(name: str) -> tuple[list[str], bool]:
    from test_elastic_run import FEATURES
    base, linear = (name[:-len("-linear")], True) if name.endswith("-linear") else (name, False)
    return FEATURES[base] + (LINEAR if linear else []), linear


def one(features: str, k: int, rounds: int) -> dict:
    from elastic_job import Run, check_agreement, events, final
    from test_elastic_run import assert_each_step_reduced_once, steps_recorded

    where = Path(tempfile.mkdtemp(prefix="carry-sweep-"))
    out = {"features": features, "k": k, "problems": [], "steps": {}}
    ids = ["w0", "w1", "w2"]
    run = None
    try:
        run = Run(where, f"sweep{k}")
        args, linear = _features(features)
        common = ["--run", "--rounds", str(rounds), "--steps", "4", "--min-workers", "3", "--log-reductions", *args]
        for w in ids:
            run.start(w, *common, *(["--die", f"{k}:behind-call"] if w == "w0" else []))
        try:
            out["codes"] = run.wait_all()
        except BaseException as e:  # noqa: BLE001 - pytest.fail (a hang) is a BaseException: a row, not the end
            if isinstance(e, KeyboardInterrupt):
                raise
            out["problems"].append(f"hung or failed to wait: {str(e)[:200]}")
            return out
        if any(c != [0] for c in out["codes"].values()):
            out["problems"].append("a worker did not end with 0")
        try:
            prints = check_agreement(run, ids, rounds)
            for w in ids:
                if final(run, w)["final"] != prints[rounds]:
                    out["problems"].append(f"{w}: its final parameters are not the last round's")
            if events(final(run, "w1"))[0]:
                out["problems"].append("a worker was dropped")
        except (AssertionError, KeyError) as e:
            out["problems"].append(f"agreement: {str(e)[:200]}")
        for w in ids:
            try:
                taken, recorded = final(run, w)["steps_taken"], steps_recorded(run, w)
            except (AssertionError, KeyError) as e:
                out["problems"].append(f"{w}: no final record ({str(e)[:100]})")
                continue
            out["steps"][w] = [recorded, taken]
            if recorded != taken:
                out["problems"].append(f"{w}: {recorded} of {taken} steps recorded")
        try:                                  # every step once in each fragment's reductions (and float64)
            assert_each_step_reduced_once(run, ids, linear)
        except (AssertionError, KeyError, OSError, ValueError) as e:
            out["problems"].append(f"reductions: {str(e)[:300]}")
        logs = "\n".join(p.read_text() for p in sorted(where.glob("*.log")))      # (whole: `Run.logs` cuts)
        out["fired"] = "injected: this rank fails right after the reduction" in logs
        out["held_out"] = "of it that the state holds already" in logs
        out["dropped"] = "steps in it are dropped" in logs
        return out
    finally:
        if run is not None:
            run.close()
        if not out["problems"]:
            shutil.rmtree(where, ignore_errors=True)
        else:
            out["dir"] = str(where)          # (kept for a look)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", default="1-13", help="the K swept: 1-13, or 3,5,10-12")
    p.add_argument("--repeats", type=int, default=1, help="each K this many times")
    p.add_argument("--features", default="time-int8-overlap-staggered,fixed-fp32-overlap-staggered,"
                   "fixed-fp32-overlap-staggered-linear", help="FEATURES of tests/train/test_elastic_run.py; "
                   "NAME-linear: NAME with a model whose steps move by a constant (float64 reference)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", default=None, help="write a record per run (hetcomm.bench.records)")
    args = p.parse_args()
    rows, begin = [], time.time()
    for repeat, features, k in itertools.product(range(args.repeats), args.features.split(","), _calls(args.calls)):
        row = one(features, k, args.rounds)
        rows.append({"repeat": repeat, **row})
        print(f"{features} K={k}: {'ok' if not row['problems'] else '; '.join(row['problems'])}"
              f"{' (fired)' if row.get('fired') else ' (not fired: w0 returned fewer reductions)'}"
              f"{', held out' if row.get('held_out') else ''}{', dropped' if row.get('dropped') else ''}", flush=True)
    bad = [r for r in rows if r["problems"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} runs ok in {time.time() - begin:.0f} s")
    if args.json:
        from hetcomm.bench.records import RESULT, RUN, record, write_records
        command = "python benchmarks/elastic_carry_sweep.py " + " ".join(sys.argv[1:])
        import subprocess
        commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                                text=True).stdout.strip()
        summary = record(RUN, runs=len(rows), ok=len(rows) - len(bad), seconds=round(time.time() - begin),
                         fired=sum(bool(r.get("fired")) for r in rows), calls=args.calls, repeats=args.repeats,
                         features=args.features, rounds=args.rounds, commit=commit)
        write_records(args.json, [summary, *[record(RESULT, **r) for r in rows]], command)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
