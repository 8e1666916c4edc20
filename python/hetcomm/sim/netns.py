"""Network namespaces, the hub bridge and veth pairs of a simulated cluster (``ip``/``tc``).

One namespace per rank (``hcsim-<id>-r<k>``, or per host, ``hcsim-<id>-h<n>``) with one ``eth0``,
joined by a bridge in a hub namespace (``hcsim-<id>-hub``); with shared WAN uplinks, one bridge
per site joined to a core bridge by a veth pair. ``<id>`` is chosen per run, so that concurrent
runs never collide. Veth peers are created directly in the rank's namespace, so the root
namespace's interfaces, routes and addresses are never touched.

Every name and address: docs/simulator.md#namespaces-bridges-and-names.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Iterator, Optional, Sequence

from hetcomm.sim.spec import SimError

NETNS_DIR = "/run/netns"
RANK_IFNAME = "eth0"

_TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin", "/bin", "/usr/bin")


def find_tool(name: str) -> Optional[str]:
    path = shutil.which(name)
    if path:
        return path
    for d in _TOOL_DIRS:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def check_prerequisites() -> tuple[str, str]:
    """Root and iproute2: returns the paths of ``ip`` and ``tc``, or raises :class:`SimError`."""
    if os.geteuid() != 0:
        raise SimError("hetcomm.sim needs root: it creates network namespaces (ip netns) and cgroups")
    ip, tc = find_tool("ip"), find_tool("tc")
    missing = [n for n, p in (("ip", ip), ("tc", tc)) if p is None]
    if missing:
        raise SimError(f"hetcomm.sim needs the iproute2 commands `ip` and `tc`; not found: "
                       f"{', '.join(missing)} (install iproute2, e.g. `apt-get install iproute2`)")
    assert ip and tc
    return ip, tc


class Runner:
    """Runs ``ip``/``tc`` commands, optionally echoing them (``verbose``), raising on failure."""

    def __init__(self, ip: str = "ip", tc: str = "tc", verbose: bool = False, log=None):
        self.ip, self.tc = ip, tc
        self.verbose = verbose
        self.log = log

    def __call__(self, argv: Sequence[str], *, check: bool = True,
                 what: str = "") -> subprocess.CompletedProcess:
        argv = list(argv)
        if argv[0] == "ip":
            argv[0] = self.ip
        elif argv[0] == "tc":
            argv[0] = self.tc
        if self.verbose and self.log:
            self.log("+ " + " ".join([os.path.basename(argv[0])] + argv[1:]))
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=60)
        if check and proc.returncode != 0:
            cmd = " ".join([os.path.basename(argv[0])] + argv[1:])
            raise SimError(f"{what + ': ' if what else ''}`{cmd}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
        return proc


def netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_pids(run: Runner, name: str) -> list[int]:
    proc = run(["ip", "netns", "pids", name], check=False)
    if proc.returncode != 0:
        return []
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def kill_netns_processes(run: Runner, names: Sequence[str], wait_s: float = 3.0) -> None:
    """SIGKILLs every process still inside the namespaces ``names`` (so they can be destroyed)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for n in names if netns_exists(n) for p in netns_pids(run, n)]
        pids = [p for p in pids if p != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def delete_netns(run: Runner, name: str) -> Optional[str]:
    """Deletes namespace ``name``; returns an error message or None."""
    if not netns_exists(name):
        return None
    proc = run(["ip", "netns", "del", name], check=False)
    if proc.returncode != 0 and netns_exists(name):
        return f"ip netns del {name}: {proc.stderr.strip()}"
    return None


# --------------------------------------------------------------------------------------------
# Switching the calling thread into a namespace (for a store or a probe hosted by the launcher)
# --------------------------------------------------------------------------------------------

_CLONE_NEWNET = 0x40000000
_libc = None
_setns_lock = threading.Lock()


def _setns(fd: int) -> None:
    global _libc
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, _CLONE_NEWNET)
        return
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def enter_netns(name: str) -> Iterator[None]:
    """Moves the *calling thread* into network namespace ``name`` for the ``with`` block.

    Sockets created inside the block stay in that namespace for their whole life (a server
    created here keeps serving from there, and threads started here inherit the namespace), so
    a launcher can host e.g. a ``TCPStore`` on the hub address that every rank can reach. Other
    threads of the process are not affected.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


TCP_CC_SYSCTL = "/proc/sys/net/ipv4/tcp_congestion_control"
TCP_CC_AVAILABLE = "/proc/sys/net/ipv4/tcp_available_congestion_control"
TCP_CC_ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


class SharedTcpCcError(SimError):
    """The kernel has one TCP congestion control setting for all namespaces (before 4.15)."""


def _read_words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


def tcp_congestion_control_state() -> tuple[str, list[str], list[str]]:
    """(the host's default, the available algorithms, those a namespace may select)."""
    host = _read_words(TCP_CC_SYSCTL)
    return (host[0] if host else ""), _read_words(TCP_CC_AVAILABLE), _read_words(TCP_CC_ALLOWED)


def set_tcp_congestion_control(name: str, algorithm: str) -> None:
    """Makes ``algorithm`` the default TCP congestion control of namespace ``name``.

    The sysctl is per namespace since Linux 4.15 (a new namespace starts with the host's
    value); in a namespace other than the host's the kernel accepts only the algorithms of
    ``tcp_allowed_congestion_control``, root or not. Raises :class:`SimError` naming what this
    kernel allows when it refuses, and :class:`SharedTcpCcError` when the write reached this
    process's own namespace instead (an older kernel with one global setting), after putting
    the old value back.
    """
    with open(TCP_CC_SYSCTL) as f:
        ours = f.read().strip()
    with enter_netns(name):
        try:
            with open(TCP_CC_SYSCTL, "w") as f:
                f.write(algorithm)
            with open(TCP_CC_SYSCTL) as f:
                now = f.read().strip()
        except OSError as error:
            _, available, allowed = tcp_congestion_control_state()
            raise SimError(f"TCP congestion control {algorithm!r}: the kernel refused it in a network "
                           f"namespace ({error.strerror}); available here: {', '.join(available) or 'unknown'}; "
                           f"a namespace may select only {', '.join(allowed) or 'none'} "
                           f"(net.ipv4.tcp_allowed_congestion_control). Leave --tcp-cc unset for the "
                           f"best of those, or --tcp-cc host to keep the host's default") from None
    if now != algorithm:
        raise SimError(f"TCP congestion control {algorithm!r}: namespace {name} reports {now!r}")
    with open(TCP_CC_SYSCTL) as f:
        leaked = f.read().strip() != ours
    if leaked:
        with open(TCP_CC_SYSCTL, "w") as f:
            f.write(ours)
        raise SharedTcpCcError("this kernel has one TCP congestion control for all namespaces (before "
                               "Linux 4.15): the simulator will not change the host's; pass --tcp-cc host")
