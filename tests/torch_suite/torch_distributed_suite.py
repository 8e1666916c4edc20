"""PyTorch's own ``DistributedTest`` suite (the one gloo and nccl run in PyTorch's CI), on hetcomm.

    python tests/torch_suite/torch_distributed_suite.py [-k PATTERN] [--world-size 2] [--json OUT]

Not part of ``pytest tests`` (about 6 s a test, several minutes in all): an occasional check that
real clients of the backend (DDP and its logging, subgroups, object collectives, point-to-point
from any source, monitored barriers, ...) work. It registers hetcomm as a plugin backend with the
features gloo has (``DistTestCases.backend_feature``: ddp, subgroup, plugin) before importing the
suite, as design.md section 5 describes, and runs it with unittest on CPU tensors. Tests the
suite itself skips (GPU-only, NCCL-only, "small world size", ...) count as skipped.

Exit status: 0 when nothing failed. ``--json`` writes the outcome of every test: one record per
line (hetcomm.bench.records), each with the command, a ``run`` header (``world_size``, ``torch``,
``counts``) then one ``result`` per test (``test``, ``outcome``, ``seconds``, ``detail``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import unittest

os.environ.setdefault("BACKEND", "hetcomm")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="hetcomm-torch-suite-"))

import hetcomm  # noqa: E402,F401  (registers the backend, also in the suite's spawned ranks)
import torch  # noqa: E402
from hetcomm.bench.records import write_document  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402

for feature in ("ddp", "subgroup", "plugin"):
    common_distributed.DistTestCases.backend_feature[feature].add(os.environ["BACKEND"])

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestHetcomm(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()  # as PyTorch's test_distributed_spawn.py does


class _Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        # PyTorch's TestCase.run replays startTest just before the outcome, so a test's time is
        # measured from the previous test's outcome (spawning the ranks included).
        self._start = time.monotonic()

    def _note(self, test, outcome: str, detail: str = "") -> None:
        self.outcomes[test.id().rsplit(".", 1)[-1]] = {
            "outcome": outcome, "seconds": round(time.monotonic() - self._start, 2), "detail": detail[-2000:]}
        self._start = time.monotonic()

    def addSuccess(self, test) -> None:
        super().addSuccess(test)
        self._note(test, "passed")

    def addFailure(self, test, err) -> None:
        super().addFailure(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err) -> None:
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason) -> None:
        super().addSkip(test, reason)
        self._note(test, "skipped", reason)


def outcome_rows(outcomes: dict) -> list[dict]:
    """One row per test: its name and outcome."""
    return [{"test": name, **outcome} for name, outcome in outcomes.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="pattern", action="append", default=None,
                        help="run only the tests whose name contains PATTERN (repeatable)")
    parser.add_argument("--json", default=None, help="write every test's outcome here")
    args = parser.parse_args()
    loader = unittest.TestLoader()
    if args.pattern:
        loader.testNamePatterns = [f"*{p}*" for p in args.pattern]
    suite = loader.loadTestsFromTestCase(TestHetcomm)
    runner = unittest.TextTestRunner(verbosity=2, resultclass=_Recorder)
    start = time.monotonic()
    result = runner.run(suite)
    counts = {k: sum(1 for o in result.outcomes.values() if o["outcome"] == k)
              for k in ("passed", "failed", "error", "skipped")}
    print(f"hetcomm on DistributedTest ({os.environ['WORLD_SIZE']} ranks): {counts} in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    if args.json:
        write_document(args.json, {"world_size": int(os.environ["WORLD_SIZE"]), "torch": torch.__version__,
                                   "counts": counts, "rows": outcome_rows(result.outcomes)},
                       " ".join([f"WORLD_SIZE={os.environ['WORLD_SIZE']}", "python", *sys.argv]))
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
