"""Running commands on a simulated cluster (``python -m hetcomm.sim``) from a test, and checking
that the run left nothing behind (namespaces, cgroups, registry entries)."""
from __future__ import annotations

import io
import json
import os
import re
import secrets
import subprocess
import sys
import time

SIM_TIMEOUT_S = 90  # per sim run: python + `import hetcomm` (torch) per process on 2 busy cores

RANK_JSON = re.compile(r"^\[rank (\d+)\] (\{.*\})\s*$")


def new_run_id() -> str:
    return "t" + secrets.token_hex(2) + secrets.choice("abcdef")


def sim_argv(run_id: str, args: list[str], cmd: list[str]) -> list[str]:
    return [sys.executable, "-m", "hetcomm.sim", "--run-id", run_id, *args, "--", *cmd]


def run_sim(args: list[str], cmd: list[str], timeout: float = SIM_TIMEOUT_S):
    """Runs ``cmd`` on a cluster built from ``args``; the CompletedProcess, with ``elapsed`` and
    ``run_id`` added. Asserts that the run cleaned up after itself."""
    rid = new_run_id()
    t0 = time.monotonic()
    proc = subprocess.run(sim_argv(rid, args, cmd), capture_output=True, text=True, timeout=timeout)
    proc.elapsed = time.monotonic() - t0
    proc.run_id = rid
    assert_clean(rid)
    return proc


def rank_json(stdout: str) -> dict[int, list[dict]]:
    """The JSON objects each rank printed as ``[rank R] {...}`` lines, by rank."""
    out: dict[int, list[dict]] = {}
    for line in stdout.splitlines():
        m = RANK_JSON.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(json.loads(m.group(2)))
    return out


def assert_clean(run_id: str) -> None:
    from hetcomm.sim import netns as sim_netns
    from hetcomm.sim.cgroups import find_cpu_hierarchy
    from hetcomm.sim.registry import REGISTRY_DIR

    left_ns = [n for n in sim_netns.list_netns() if n.startswith(f"hcsim-{run_id}-")]
    assert not left_ns, f"namespaces left behind: {left_ns}"
    root, _ = find_cpu_hierarchy()
    assert not os.path.exists(os.path.join(root, f"hcsim-{run_id}")), "cgroup left behind"
    assert not os.path.exists(os.path.join(REGISTRY_DIR, f"{run_id}.json")), "registry entry left"
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert f"hcsim-{run_id}-" not in p.stdout


def uplink_delta(after: dict, before: dict) -> dict:
    return {site: {d: after[site][d] - before[site][d] for d in ("out", "in")} for site in after}


# Flows "src>dst:bytes,..." all at once: senders connect, wait for the common start time, send;
# receivers print what they got and when its first and last byte arrived (CLOCK_MONOTONIC is
# the same clock in every namespace).
FLOWS = r'''
import json, os, socket, sys, threading, time
rank = int(os.environ["RANK"]); addrs = os.environ["HETCOMM_SIM_ADDRS"].split(",")
port0 = int(os.environ["MASTER_PORT"]) + 1
flows = [(int(f.split(">")[0]), int(f.split(">")[1].split(":")[0]), int(float(f.split(":")[1])))
         for f in sys.argv[1].split(",")]
start_at = float(sys.argv[2])
def receive(src, listener):
    c, _ = listener.accept()
    got, t0, buf = 0, None, bytearray(1 << 20)
    while True:
        k = c.recv_into(buf)
        if not k: break
        t0 = t0 or time.monotonic()
        got += k
    t1 = time.monotonic()
    c.sendall(b"k")
    print(json.dumps({"src": src, "dst": rank, "bytes": got, "t0": t0, "t1": t1}))
def send(dst, n, port):
    for _ in range(500):
        try: c = socket.create_connection((addrs[dst], port)); break
        except OSError: time.sleep(0.02)
    time.sleep(max(0.0, start_at - time.monotonic()))
    c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR); c.recv(1)
threads = []
for src, dst, n in flows:
    if dst == rank:
        s = socket.socket(); s.bind((addrs[rank], port0 + src)); s.listen(1)
        threads.append(threading.Thread(target=receive, args=(src, s)))
    if src == rank:
        threads.append(threading.Thread(target=send, args=(dst, n, port0 + src)))
for t in threads: t.start()
for t in threads: t.join()
'''


def run_flows(cluster, script, flows: str) -> tuple[list[dict], dict]:
    """Runs the flows on ``cluster``; returns the receivers' records and the uplink byte deltas."""
    out, err = io.BytesIO(), io.BytesIO()
    before = cluster.uplink_bytes()
    start_at = time.monotonic() + 2.0              # after every rank's python has started
    status = cluster.run([sys.executable, str(script), flows, repr(start_at)], stdout=out, stderr=err,
                         timeout_s=60)
    moved = uplink_delta(cluster.uplink_bytes(), before)
    assert status == 0, err.getvalue().decode()
    records = [r for rs in rank_json(out.getvalue().decode()).values() for r in rs]
    assert len(records) == len(flows.split(",")), out.getvalue().decode()
    return records, moved


def assert_shaped(rate: float, want: float, what: str = "", slack: float = 1.2) -> None:
    """A rate measured through a shaped link: at most ``slack`` x the shaped rate (token-bucket
    bursts allow a little more), which holds however busy the machine is, since load can only
    slow a flow; and at least half of it, which catches a shaper set to the wrong rate without
    asking a loaded two-core machine to keep within 20% of the wire (it did not always)."""
    assert rate <= slack * want, f"{what}: {rate / 1e6:.2f} MB/s through a link shaped to {want / 1e6:.2f}"
    assert rate >= 0.5 * want, f"{what}: {rate / 1e6:.2f} MB/s, under half of the shaped {want / 1e6:.2f}"
