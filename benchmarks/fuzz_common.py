"""What the two store fuzzers (`store_fuzz.py`: process groups; `elastic_store_fuzz.py`: elastic
runs) share: long-lived worker processes driven through a control store, the wait for each
trial's outcomes (ok, error, hang, crash), and the results file."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time


class Processes:
    """``count`` processes of ``script --worker <index> *args``, each logging to a file of its own,
    with or without ``secret`` as HETCOMM_SECRET; started again after a trial that hung or
    crashed (no state of a disturbed run carries over)."""

    def __init__(self, script: str, count: int, args: list[str], secret: str | None, logs: str,
                 up_timeout_s: float) -> None:
        self.script, self.count, self.args, self.secret = script, count, args, secret
        self.up_timeout = datetime.timedelta(seconds=up_timeout_s)
        self.procs: list[subprocess.Popen] = []
        self.logs = tempfile.mkdtemp(prefix=f"hetcomm-{logs}-fuzz-")

    def start(self, control) -> None:
        env = dict(os.environ)
        env.pop("HETCOMM_SECRET", None)
        env.pop("HETCOMM_SECRET_FILE", None)
        if self.secret is not None:
            env["HETCOMM_SECRET"] = self.secret
        env.setdefault("HETCOMM_PROBE", "0")
        for i in range(self.count):
            control.delete_key(f"up/{i}")
        self.procs = []
        for i in range(self.count):
            with open(os.path.join(self.logs, f"worker{i}.log"), "a") as log:
                self.procs.append(subprocess.Popen([sys.executable, self.script, "--worker", str(i), *self.args],
                                                   env=env, stdout=log, stderr=subprocess.STDOUT))
        control.wait([f"up/{i}" for i in range(self.count)], self.up_timeout)

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []

    def outcomes(self, control, trial: int, limit_s: float, poll_s: float) -> list[dict]:
        """Each process's outcome of ``trial`` (what it wrote at ``result/<trial>/<index>``), or
        ``crash`` (its process died first), or ``hang`` (nothing within ``limit_s``). An error
        is *clear* when it says ``hetcomm`` (the product's errors all do)."""
        found: dict[int, dict] = {}
        deadline = time.monotonic() + limit_s
        while len(found) < self.count and time.monotonic() < deadline:
            for i in range(self.count):
                if i not in found and control.check([f"result/{trial}/{i}"]):
                    found[i] = json.loads(control.get(f"result/{trial}/{i}"))
            for i, p in enumerate(self.procs):
                if p.poll() is not None and i not in found:
                    found[i] = {"status": "crash", "exitcode": p.returncode}
            time.sleep(poll_s)
        ordered = [found.get(i, {"status": "hang"}) for i in range(self.count)]
        for o in ordered:
            if o["status"] == "error":
                o["clear"] = "hetcomm" in o["message"]
        return ordered

    def stop(self, control) -> None:
        for i in range(self.count):
            control.set(f"go/{i}", "-1")
        time.sleep(0.5)
        self.kill()


def write_results(out: str, summary: dict, records: list[dict], party: str) -> None:
    """The summary and a record per trial (JSON Lines, hetcomm.bench.records), each cut short;
    the trials' records go to the gzip trace beside the summary (200 trials of the elastic
    fuzzer, with each worker's stop reason, came to 139 KB: over what a summary may be).
    ``party`` names the list of outcomes."""
    from hetcomm.bench.records import RESULT, RUN, record, write_with_trace

    summary = dict(summary)
    command = summary.pop("command")
    summary.pop("logs", None)
    rows = [record(RESULT, **{k: v for k, v in rec.items() if k not in ("mutations", party)},
                   mutations=[f"{m.get('key')}: {m.get('value', m.get('fuzzer_error'))}"[:60] for m in rec["mutations"]],
                   **{party: [{k: (v[:100] if isinstance(v, str) else v) for k, v in o.items()} for o in rec[party]]})
            for rec in records]
    write_with_trace(out, [record(RUN, summary), *rows], command, kinds=[RESULT], key=[])
