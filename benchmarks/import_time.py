"""What `import hetcomm` costs beyond torch: the median over N runs of `python -X importtime -c
"import hetcomm"` (hetcomm's cumulative microseconds minus torch's, which it imports), and which
heavy modules the import loaded.

Usage::

    python benchmarks/import_time.py [--tree PATH] [--runs 5]

``--tree``: a source tree whose ``python/`` directory is put first on the path (with its built
extension), e.g. a worktree of an older commit to compare against; default: the installed hetcomm.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HEAVY = ("torch", "hetcomm._C", "hetcomm.train", "scipy", "numpy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=None)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = os.path.join(os.path.abspath(args.tree), "python")
    beyond, total = [], []
    for _ in range(args.runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import hetcomm"], capture_output=True,
                             text=True, env=env, cwd="/").stderr
        cumulative = {}
        for line in err.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", line)
            if m:
                cumulative[m.group(3)] = int(m.group(2))
        total.append(cumulative["hetcomm"])
        beyond.append(cumulative["hetcomm"] - cumulative.get("torch", 0))
    loaded = subprocess.run([sys.executable, "-c", f"import sys, hetcomm; print(hetcomm.__file__, "
                             f"[m for m in {HEAVY!r} if m in sys.modules])"],
                            capture_output=True, text=True, env=env, cwd="/").stdout.strip()
    print(f"import hetcomm: {statistics.median(total)} us in all, {statistics.median(beyond)} us beyond torch "
          f"(median of {args.runs}; min {min(beyond)}, max {max(beyond)}); {loaded}")


if __name__ == "__main__":
    main()
