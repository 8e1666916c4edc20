"""Which simulated clusters exist on this machine: each run registers its owner's pid in
`REGISTRY_DIR` before it creates anything, so that `cleanup_stale` can remove what a run killed
with SIGKILL left behind (namespaces, cgroups) without touching a live run's."""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

from hetcomm.sim import netns as _netns
from hetcomm.sim.cgroups import find_cpu_hierarchy, remove_cgroup_tree
from hetcomm.sim.netns import Runner
from hetcomm.sim.spec import SimError

REGISTRY_DIR = "/run/hetcomm-sim"
PREFIX = "hcsim"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _remove_registry_dir_if_empty() -> None:
    try:
        os.rmdir(REGISTRY_DIR)  # fails (fine) while another run is registered
    except OSError:
        pass


def cleanup_stale(run_id: Optional[str] = None, *, force: bool = False,
                  log: Callable[[str], None] = print) -> int:
    """Removes the resources of dead runs (owner pid gone), or of ``run_id`` (``force``: even if
    its owner lives). Also removes ``hcsim-*`` namespaces/cgroups that no registry entry owns.
    Returns the number of runs cleaned."""
    _netns.check_prerequisites()
    ip, tc = _netns.find_tool("ip"), _netns.find_tool("tc")
    run = Runner(ip or "ip", tc or "tc")
    owners: dict[str, Optional[int]] = {}
    if os.path.isdir(REGISTRY_DIR):
        for fn in os.listdir(REGISTRY_DIR):
            if fn.endswith(".json"):
                rid = fn[:-5]
                try:
                    with open(os.path.join(REGISTRY_DIR, fn)) as f:
                        owners[rid] = int(json.load(f).get("pid"))
                except (OSError, ValueError, TypeError):
                    owners[rid] = None
    found: dict[str, dict[str, list[str]]] = {}
    for n in _netns.list_netns():
        parts = n.split("-")
        if len(parts) == 3 and parts[0] == PREFIX:
            found.setdefault(parts[1], {"ns": [], "cg": []})["ns"].append(n)
    roots = set()
    try:
        roots.add(find_cpu_hierarchy()[0])
    except SimError:
        pass
    for root in roots:
        for d in os.listdir(root):
            if d.startswith(PREFIX + "-") and os.path.isdir(os.path.join(root, d)):
                found.setdefault(d.split("-", 1)[1], {"ns": [], "cg": []})["cg"].append(
                    os.path.join(root, d))
    for rid in owners:
        found.setdefault(rid, {"ns": [], "cg": []})
    cleaned = 0
    for rid, res in sorted(found.items()):
        if run_id is not None and rid != run_id:
            continue
        owner = owners.get(rid)
        alive = owner is not None and _pid_alive(owner) and owner != os.getpid()
        if alive and not (force and run_id is not None):
            log(f"run {rid}: owner pid {owner} is alive; leaving it (name it and pass --force to remove)")
            continue
        # (no registry entry at all: a starting run writes its entry before it creates anything,
        # so such namespaces/cgroups are leftovers of a run that could not clean up)
        log(f"run {rid}: removing {len(res['ns'])} namespace(s), {len(res['cg'])} cgroup tree(s)")
        _netns.kill_netns_processes(run, res["ns"])
        for cg in res["cg"]:
            for d in remove_cgroup_tree(cg):
                log(f"  could not remove cgroup {d}")
        rank_ns = sorted(n for n in res["ns"] if not n.endswith("-hub"))
        for n in rank_ns + [n for n in res["ns"] if n.endswith("-hub")]:
            err = _netns.delete_netns(run, n)
            if err:
                log("  " + err)
        try:
            os.unlink(os.path.join(REGISTRY_DIR, f"{rid}.json"))
        except FileNotFoundError:
            pass
        cleaned += 1
    _remove_registry_dir_if_empty()
    return cleaned
