"""Per-rank CPU quotas with cgroups (v1 ``cpu`` controller, else cgroup v2 ``cpu.max``).

Layout: one directory per run, ``<cpu hierarchy>/hcsim-<id>``, with one child per rank,
``r<k>``. v1: ``cpu.cfs_period_us = P`` and ``cpu.cfs_quota_us = quota * P`` in the child
(P = 100000 µs unless the spec's ``cpu_period_ms`` says otherwise). v2: ``cpu.max = "<quota*P>
P"`` (the ``cpu`` controller is enabled in the
parents' ``cgroup.subtree_control`` first). A rank's process joins its cgroup before it execs
anything (see :meth:`CpuCgroups.wrap`), so everything it starts is throttled too.

Teardown SIGKILLs whatever is still in the cgroups, waits for them to empty and removes them.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional, Sequence

from hetcomm.sim.spec import SimError

PERIOD_US = 100000


def _mounts() -> list[tuple[str, str, list[str]]]:
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4:
                    mnt = parts[1].replace("\\040", " ")
                    out.append((mnt, parts[2], parts[3].split(",")))
    except OSError:
        pass
    return out


def find_cpu_hierarchy() -> tuple[str, int]:
    """(mount point, version) of the hierarchy that has the ``cpu`` controller: v1 first."""
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup" and "cpu" in opts:
            return mnt, 1
    for mnt, fstype, _ in _mounts():
        if fstype == "cgroup2":
            try:
                with open(os.path.join(mnt, "cgroup.controllers")) as f:
                    if "cpu" in f.read().split():
                        return mnt, 2
            except OSError:
                continue
    raise SimError("--cpu-quota needs the cgroup cpu controller: no cgroup v1 hierarchy with 'cpu' "
                   "and no cgroup2 hierarchy offering 'cpu' is mounted (see /proc/self/mounts)")


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


class CpuCgroups:
    """The CPU cgroups of one run: ``setup()``, ``procs_file(rank)``, ``teardown()``."""

    def __init__(self, run_name: str, quotas: Sequence[float], root: Optional[str] = None,
                 version: Optional[int] = None, period_us: int = PERIOD_US):
        self.quotas = list(quotas)
        self.period_us = int(period_us)
        if root is None:
            root, version = find_cpu_hierarchy()
        self.root = root
        self.version = version or 1
        self.base = os.path.join(root, run_name)
        self.dirs = [os.path.join(self.base, f"r{k}") for k in range(len(self.quotas))]
        self._created: list[str] = []

    def all_paths(self) -> list[str]:
        return [self.base] + self.dirs

    def procs_file(self, rank: int) -> str:
        return os.path.join(self.dirs[rank], "cgroup.procs")

    def setup(self) -> None:
        if self.version == 2:
            self._enable_cpu(self.root)
        self._mkdir(self.base)
        if self.version == 2:
            self._enable_cpu(self.base)
        for d, q in zip(self.dirs, self.quotas):
            self._mkdir(d)
            quota_us = max(1000, int(round(q * self.period_us)))
            try:
                if self.version == 1:
                    _write(os.path.join(d, "cpu.cfs_period_us"), str(self.period_us))
                    _write(os.path.join(d, "cpu.cfs_quota_us"), str(quota_us))
                else:
                    _write(os.path.join(d, "cpu.max"), f"{quota_us} {self.period_us}")
            except OSError as e:
                raise SimError(f"cannot set the CPU quota of {d}: {e}") from e

    def _mkdir(self, d: str) -> None:
        self._created.append(d)  # recorded first: teardown tolerates what never got made
        try:
            os.mkdir(d)
        except FileExistsError:
            raise SimError(f"cgroup {d} already exists "
                           "(a stale run? `python -m hetcomm.sim --cleanup`)") from None
        except OSError as e:
            raise SimError(f"cannot create cgroup {d}: {e}") from e

    @staticmethod
    def _enable_cpu(d: str) -> None:
        ctl = os.path.join(d, "cgroup.subtree_control")
        try:
            with open(ctl) as f:
                if "cpu" in f.read().split():
                    return
            _write(ctl, "+cpu")
        except OSError as e:
            raise SimError(f"cannot enable the cgroup v2 cpu controller in {ctl}: {e}") from e

    def cpu_stat(self, rank: int) -> dict[str, int]:
        """The kernel's CFS counters of rank's cgroup (cpu.stat: nr_periods, nr_throttled, and
        throttled_time in ns on v1 or throttled_usec on v2); {} when it cannot be read."""
        try:
            with open(os.path.join(self.dirs[rank], "cpu.stat")) as f:
                return {k: int(v) for k, v in (line.split() for line in f if len(line.split()) == 2)}
        except (OSError, ValueError):
            return {}

    def pids(self) -> list[int]:
        out: list[int] = []
        for d in self.dirs + [self.base]:
            out += _read_pids(os.path.join(d, "cgroup.procs"))
        return out

    def teardown(self, wait_s: float = 5.0) -> list[str]:
        """Kills what is left inside and removes the cgroups; returns the paths it could not remove."""
        return remove_cgroup_tree(self.base, wait_s)


def remove_cgroup_tree(base: str, wait_s: float = 5.0) -> list[str]:
    """SIGKILLs every process in ``base`` and its children, then rmdirs them (deepest first)."""
    if not os.path.isdir(base):
        return []
    dirs = []
    for dirpath, _dirnames, _ in os.walk(base):
        dirs.append(dirpath)
    dirs.sort(key=lambda d: d.count("/"), reverse=True)
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for d in dirs for p in _read_pids(os.path.join(d, "cgroup.procs"))]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    failed = []
    for d in dirs:
        for attempt in range(50):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                # EBUSY while killed tasks are still exiting
                if attempt == 49:
                    failed.append(d)
                else:
                    time.sleep(0.02)
    return failed
