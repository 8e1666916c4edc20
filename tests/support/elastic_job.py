"""An elastic DiLoCo job for the tests: workers (tests/support/elastic_worker.py, forked) around a store
of their own, and what the tests read back from them."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

import forked
from stores import start_store

DEADLINE = 180


class Run:
    def __init__(self, tmp_path: Path, job: str) -> None:
        self.out, self.job = tmp_path, job
        self.store, self.port = start_store(str(tmp_path))
        self.procs: list[tuple[str, forked.Forked]] = []

    def start(self, wid: str, *args: str, env: dict | None = None) -> forked.Forked:
        """Starts worker ``wid`` (tests/support/elastic_worker.py), forked: it is training within
        a fraction of a second, where a new interpreter took seconds."""
        log = self.out / f"{wid}.{len(self.procs)}.log"
        proc = forked.start("elastic_worker", ["--store", f"127.0.0.1:{self.port}", "--id", wid, "--job", self.job,
                                               "--out", str(self.out), *args],
                            log, env={"HETCOMM_PROBE": "0", **(env or {})})
        self.procs.append((wid, proc))
        return proc

    def wait_all(self) -> dict[str, list[int]]:
        codes: dict[str, list[int]] = {}
        deadline = time.monotonic() + DEADLINE
        for wid, proc in self.procs:
            try:
                codes.setdefault(wid, []).append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.close()
                pytest.fail(f"worker {wid} hung (still running after {DEADLINE} s)\n{self.logs()}")
        return codes

    def records(self, wid: str) -> list[dict]:
        path = self.out / f"{wid}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.out.glob("*.log")))

    def close(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.store.poll() is None:
            self.store.kill()
            self.store.wait()


def check_agreement(run: Run, ids, rounds: int, missing: set[int] = frozenset()) -> dict[int, int]:
    """Every report of a round has one fingerprint, and every round but ``missing`` is reported;
    returns round -> fingerprint."""
    prints: dict[int, set] = {}
    for wid in ids:
        for rec in run.records(wid):
            assert "error" not in rec, f"{wid}: {rec['error']}\n{run.logs()}"
            if "round" in rec:
                prints.setdefault(rec["round"], set()).add(rec["fp"])
    split = {r: fps for r, fps in prints.items() if len(fps) > 1}
    assert not split, f"workers hold different global parameters after rounds {split}\n{run.logs()}"
    assert sorted(prints) == [r for r in range(1, rounds + 1) if r not in missing], \
        f"rounds reported: {sorted(prints)}\n{run.logs()}"
    return {r: fps.pop() for r, fps in prints.items()}


def final(run: Run, wid: str) -> dict:
    ends = [rec for rec in run.records(wid) if "final" in rec]
    assert ends, f"{wid} did not finish\n{run.logs()}"
    return ends[-1]


def events(record: dict) -> tuple[set, set]:
    left = {w for e in record["membership"] for w in e.get("left", {})}
    joined = {w for e in record["membership"] if e["round"] > 0 for w in e.get("joined", [])}
    return left, joined


def wait_for(proc: forked.Forked, run: Run) -> None:
    try:
        proc.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        run.close()
        pytest.fail(f"the worker meant to die did not\n{run.logs()}")
