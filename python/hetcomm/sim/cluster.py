"""``SimCluster``: build a simulated cluster, run ranks in it, tear it down on every exit path.

::

    from hetcomm.sim import SimSpec, SimCluster
    spec = SimSpec(nic_mbit=[800, 800, 800, 100], cpu_quota=[1, 0.5, 0.25, 0.25])
    with SimCluster(spec) as cluster:
        status = cluster.run([sys.executable, "train.py"])

Only SIGKILL of the simulator leaves resources behind (``python -m hetcomm.sim --cleanup``
removes them). The clean-up guarantees, signal by signal: docs/simulator.md#clean-up.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence, Union

from hetcomm.sim import netns as _netns
from hetcomm.sim import shaping
from hetcomm.sim.cgroups import CpuCgroups, find_cpu_hierarchy
from hetcomm.sim.counters import Counters
from hetcomm.sim.launcher import (RankProcess, RunResult, SimInterrupted, binary_writer, start_pump,
                                  stop_ranks, supervise)
from hetcomm.sim.netns import RANK_IFNAME, Runner, enter_netns
from hetcomm.sim.registry import PREFIX, REGISTRY_DIR, _remove_registry_dir_if_empty
from hetcomm.rates import format_matrix, format_rate
from hetcomm.sim.spec import (AUTO_TCP_CC, SimError, SimSpec, choose_tcp_cc, effective_bandwidth,
                              effective_link_mbit)

DEFAULT_MASTER_PORT = 29500

Command = Union[Sequence[str], Callable[[int], Sequence[str]]]


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


class SimCluster(Counters):
    """One simulated cluster (docs/simulator.md).

    Attributes after :meth:`setup`: ``run_id``, ``subnet``, ``addresses`` (rank k's IPv4),
    ``hub_address`` (the bridge in the hub namespace), ``namespaces`` (per rank),
    ``hub_namespace``, ``master_addr``/``master_port``; with shared uplinks (``spec.wan_mbit``)
    also ``site_bridges``, ``uplink_out_ports`` and ``uplink_in_ports`` (per site, in the order
    of ``spec.site_groups()``; :mod:`hetcomm.sim.netns` has the layout).

    Hosts (``spec.hosts``): the network built is ``spec.network_spec()``, one *node* per host:
    ``node_namespaces``, ``node_addresses`` and ``hub_ports`` are per host, and a rank's
    ``namespaces[k]``/``addresses[k]`` are its host's, shared with the host's other ranks (they
    reach each other over the namespace's loopback, unshaped; they reach other hosts through
    the host's one shaped veth pair). Without hosts every rank is its own node, as before.
    """

    def __init__(self, spec: SimSpec, *, run_id: Optional[str] = None,
                 master_port: int = DEFAULT_MASTER_PORT, allow_oversubscribe: bool = False,
                 handle_signals: bool = True, verbose: bool = False,
                 log: Optional[Callable[[str], None]] = None):
        spec.validate()
        self.spec = spec
        self.world_size = spec.world_size
        # the network as built: one node (namespace, veth pair, address) per host
        self.net = spec.network_spec()
        self.node_of = [spec.host_of(k) for k in range(self.world_size)]
        self.master_port = int(master_port)
        self.allow_oversubscribe = allow_oversubscribe
        self.handle_signals = handle_signals
        self._log_fn = log
        self.verbose = verbose
        if run_id is not None and not re.fullmatch(r"[a-z0-9]{1,6}", run_id):
            raise SimError(f"run id {run_id!r}: 1 to 6 lower-case letters or digits")
        self.run_id = run_id
        self._up = False
        self._torn_down = False
        self._netns_names: list[str] = []
        self._cgroups: Optional[CpuCgroups] = None
        self._launched: list[RankProcess] = []
        self._registered = False
        self._saved_handlers: dict[int, object] = {}
        self._deferred: list[int] = []
        self._atexit = False
        self.last_result: Optional[RunResult] = None
        self._run: Optional[Runner] = None

    # ------------------------------------------------------------------------------ naming
    def log(self, msg: str) -> None:
        if self._log_fn is not None:
            self._log_fn(msg)
        else:
            sys.stderr.write(f"[hetcomm.sim] {msg}\n")
            sys.stderr.flush()

    def _names(self, run_id: str) -> None:
        self.run_id = run_id
        self.hub_namespace = f"{PREFIX}-{run_id}-hub"
        nodes = self.net.world_size
        kind = "r" if self.spec.hosts is None else "h"   # rank k's, or host k's, namespace
        self.node_namespaces = [f"{PREFIX}-{run_id}-{kind}{n}" for n in range(nodes)]
        self.namespaces = [self.node_namespaces[n] for n in self.node_of]
        self.bridge = f"hc{run_id}br"
        self.hub_ports = [f"hc{run_id}p{n}" for n in range(nodes)]
        sites = range(len(self.net.site_groups())) if self.net.wan_mbit is not None else range(0)
        self.site_bridges = [f"hc{run_id}s{n}" for n in sites]
        self.uplink_out_ports = [f"hc{run_id}o{n}" for n in sites]
        self.uplink_in_ports = [f"hc{run_id}i{n}" for n in sites]
        v = int(run_id, 36) if run_id else 0
        a, b = 16 + (v >> 8) % 224, v % 256  # 10.16.0.0 - 10.239.255.0: any /24, it is private
        self.subnet = f"10.{a}.{b}.0/24"
        self.node_addresses = [f"10.{a}.{b}.{n + 1}" for n in range(nodes)]
        self.addresses = [self.node_addresses[n] for n in self.node_of]
        self.hub_address = f"10.{a}.{b}.254"
        self.master_addr = self.addresses[0]
        self.cgroup_name = f"{PREFIX}-{run_id}"
        self.registry_file = os.path.join(REGISTRY_DIR, f"{run_id}.json")

    def _claim_id(self) -> str:
        """Chooses the run id and claims it atomically by creating its registry entry (O_EXCL),
        so two concurrent runs can never build (or tear down) the same names."""
        given = self.run_id
        for _ in range(1 if given is not None else 100):
            self._names(given if given is not None else secrets.token_hex(3))
            stem = f"{PREFIX}-{self.run_id}-"
            if any(n.startswith(stem) for n in _netns.list_netns()):
                continue
            if self._write_registry():
                return self.run_id
        if given is not None:
            raise SimError(f"run id {given!r} is in use (namespaces or registry entry exist); "
                           f"`python -m hetcomm.sim --cleanup {given}` if it is stale")
        raise SimError("could not find a free run id")  # pragma: no cover

    # ------------------------------------------------------------------------------ set up
    def __enter__(self) -> "SimCluster":
        self.setup()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.teardown(reraise_deferred=exc_type is None)

    def setup(self) -> "SimCluster":
        if self._up:
            return self
        ip, tc = _netns.check_prerequisites()
        self._check_quotas()
        self._run = Runner(ip, tc, verbose=self.verbose, log=self.log)
        self._install_signal_handlers()
        if not self._atexit:
            atexit.register(self._atexit_teardown)
            self._atexit = True
        self._up = True
        try:
            self._claim_id()
            self._build_network()
            if self.spec.cpu_quota is not None:
                self._cgroups = CpuCgroups(self.cgroup_name, self.spec.cpu_quota,
                                           period_us=int(round(self.spec.cpu_period_ms * 1000)))
                self._cgroups.setup()
        except BaseException:
            self.teardown(reraise_deferred=False)
            raise
        return self

    def _check_quotas(self) -> None:
        q = self.spec.cpu_quota
        if q is None:
            return
        cores = _usable_cores()
        total = sum(q)
        if total > cores + 1e-9:
            msg = (f"the CPU quotas sum to {total:g} cores but this machine has {cores}: the ranks "
                   f"would compete for cores and no rank would get its quota")
            if not self.allow_oversubscribe:
                raise SimError(msg + " (pass --allow-oversubscribe / allow_oversubscribe=True to run anyway)")
            self.log("warning: " + msg)
        find_cpu_hierarchy()  # fail early and clearly when no cpu controller exists

    def _write_registry(self) -> bool:
        """Creates ``/run/hetcomm-sim/<id>.json``; False if it already exists (id taken)."""
        cg_paths = []
        if self.spec.cpu_quota is not None:
            root, _ = find_cpu_hierarchy()
            cg_paths = [os.path.join(root, self.cgroup_name)]
        record = {"pid": os.getpid(), "started": time.time(), "run_id": self.run_id,
                  "namespaces": self.node_namespaces + [self.hub_namespace], "cgroups": cg_paths,
                  "spec": json.loads(self.spec.to_json())}
        for attempt in range(5):
            os.makedirs(REGISTRY_DIR, exist_ok=True)
            try:
                with open(self.registry_file, "x") as f:
                    self._registered = True
                    json.dump(record, f)
                return True
            except FileExistsError:
                return False
            except FileNotFoundError:  # another run's teardown removed the empty directory
                if attempt == 4:
                    raise
        return False  # pragma: no cover

    def _build_network(self) -> None:
        run = self._run
        assert run is not None
        hub = self.hub_namespace

        def add_ns(name: str) -> None:
            # Recorded first, so an interrupt during `ip netns add` still tears it down; the id
            # is ours (registry claimed), so the name cannot belong to another run.
            self._netns_names.append(name)
            run(["ip", "netns", "add", name], what="creating a network namespace")
            run(["ip", "-n", name, "link", "set", "lo", "up"])

        def add_bridge(name: str, what: str) -> None:
            run(["ip", "-n", hub, "link", "add", name, "type", "bridge", "forward_delay", "0",
                 "stp_state", "0"], what=f"creating {what}")
            run(["ip", "-n", hub, "link", "set", name, "up"])

        add_ns(hub)
        add_bridge(self.bridge, "the hub bridge")
        run(["ip", "-n", hub, "addr", "add", f"{self.hub_address}/24", "dev", self.bridge])
        # Shared uplinks: a bridge per site, joined to the hub (core) bridge by a veth pair
        # whose two ends stay in the hub; all of the site's cross-site frames cross that pair.
        net = self.net
        node_bridge = [self.bridge] * net.world_size
        for n, (label, nodes, out_port, in_port) in enumerate(self._uplinks()):
            add_bridge(self.site_bridges[n], f"site {label}'s bridge")
            run(["ip", "-n", hub, "link", "add", out_port, "type", "veth", "peer", "name", in_port],
                what=f"creating site {label}'s uplink")
            run(["ip", "-n", hub, "link", "set", out_port, "master", self.site_bridges[n]])
            run(["ip", "-n", hub, "link", "set", in_port, "master", self.bridge])
            for port in (out_port, in_port):
                run(["ip", "-n", hub, "link", "set", port, "up"])
            for k in nodes:
                node_bridge[k] = self.site_bridges[n]
        # One namespace and veth pair per node: a rank, or a host whose ranks all live in it.
        for k in range(net.world_size):
            ns = self.node_namespaces[k]
            add_ns(ns)
            port = self.hub_ports[k]
            run(["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", RANK_IFNAME,
                 "netns", ns], what=f"creating {self._node_name(k)}'s veth pair")
            run(["ip", "-n", hub, "link", "set", port, "master", node_bridge[k]])
            run(["ip", "-n", hub, "link", "set", port, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.node_addresses[k]}/24", "dev", RANK_IFNAME])
            run(["ip", "-n", ns, "link", "set", RANK_IFNAME, "up"])
        self._set_tcp_congestion_control()
        # The shaping plans see the nodes as their ranks (net is the spec itself without hosts).
        for k in range(net.world_size):
            for args in shaping.egress_plan(net, k, RANK_IFNAME, self.node_addresses):
                self._tc(self.node_namespaces[k], args, f"shaping {self._node_name(k)}'s egress")
            for args in shaping.ingress_plan(net, k, self.hub_ports[k]):
                self._tc(hub, args, f"shaping {self._node_name(k)}'s ingress")
        for n, (label, _, out_port, in_port) in enumerate(self._uplinks()):
            for direction, dev in (("out", out_port), ("in", in_port)):
                for args in shaping.uplink_plan(net, n, direction, dev, self.node_addresses):
                    self._tc(hub, args, f"shaping site {label}'s uplink ({direction})")

    def _node_name(self, node: int) -> str:
        """``rank k``, or ``host h (ranks 0,1)`` with hosts: a namespace's name in messages."""
        if self.spec.hosts is None:
            return f"rank {node}"
        ranks = [k for k, n in enumerate(self.node_of) if n == node]
        return f"host {node} (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})"

    def _set_tcp_congestion_control(self) -> None:
        """Resolves spec.tcp_cc (auto, host or a name) to the algorithm in use, sets it in every
        namespace and records it in self.spec, which the ranks, the summary and reports read."""
        requested = self.spec.tcp_cc
        host, available, allowed = _netns.tcp_congestion_control_state()
        name, write, note = choose_tcp_cc(requested, host, available, allowed)
        if write:
            try:
                for ns in self.node_namespaces + [self.hub_namespace]:
                    _netns.set_tcp_congestion_control(ns, name)
            except _netns.SharedTcpCcError as error:
                if requested != AUTO_TCP_CC:
                    raise
                name, note = host, f"TCP {host}, the host's: {error}"
        if note:
            self.log(note)
        self.spec = dataclasses.replace(self.spec, tcp_cc=name or None)
        self.net = self.spec.network_spec()

    def _tc(self, ns: str, args: list[str], what: str) -> None:
        assert self._run is not None
        proc = self._run(["tc", "-n", ns] + args, check=False)
        if proc.returncode != 0:
            err = (proc.stderr or proc.stdout).strip()
            if "netem" in args and ("unknown" in err.lower() or "No such file" in err):
                raise SimError(f"--latency-ms needs the netem qdisc (CONFIG_NET_SCH_NETEM), which this "
                               f"kernel lacks: `tc {' '.join(args)}`: {err}")
            raise SimError(f"{what}: `tc -n {ns} {' '.join(args)}` failed: {err}")
        if proc.stderr.strip() and self.verbose:
            self.log(proc.stderr.strip())

    # ------------------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[sig] = signal.signal(sig, _raise_interrupted)

    def _restore_signal_handlers(self) -> None:
        for sig, h in self._saved_handlers.items():
            signal.signal(sig, h)  # type: ignore[arg-type]
        self._saved_handlers = {}

    # ------------------------------------------------------------------------------ tear down
    def _atexit_teardown(self) -> None:
        if self._up:
            self.teardown(reraise_deferred=False)

    def teardown(self, reraise_deferred: bool = True) -> None:
        """Removes everything this cluster created (idempotent). Never raises for leftovers;
        it reports them (and keeps the registry entry for ``--cleanup``)."""
        if not self._up:
            return
        main = threading.current_thread() is threading.main_thread()
        deferring: dict[int, object] = {}
        if main:
            def defer(signum, frame):
                self._deferred.append(signum)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                deferring[sig] = signal.signal(sig, defer)
        try:
            problems = self._teardown_resources()
        finally:
            self._up = False
            if main:
                for sig, h in deferring.items():
                    signal.signal(sig, h)  # type: ignore[arg-type]
                self._restore_signal_handlers()
            if self._atexit:
                atexit.unregister(self._atexit_teardown)
                self._atexit = False
        if problems:
            self.log("teardown left resources behind (`python -m hetcomm.sim --cleanup "
                     f"{self.run_id}` retries): " + "; ".join(problems))
        if self._deferred and reraise_deferred:
            sig = self._deferred[0]
            self._deferred = []
            if sig == signal.SIGINT:
                raise KeyboardInterrupt
            raise SimInterrupted(sig)

    def _teardown_resources(self) -> list[str]:
        run = self._run or Runner()
        problems: list[str] = []
        names = list(self._netns_names)
        # Ranks we started: kill their process groups and reap them. This also catches a rank
        # that has not yet joined its cgroup or namespace (so the sweeps below would miss it).
        for r in self._launched:
            r.signal_group(signal.SIGKILL)
        for r in self._launched:
            try:
                r.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                problems.append(f"rank {r.rank} (pid {r.pid}) did not die")
            r.poll()
        self._launched = []
        try:
            _netns.kill_netns_processes(run, names)
        except Exception as e:  # noqa: BLE001 - keep tearing down
            problems.append(f"killing processes: {e}")
        if self._cgroups is not None:
            try:
                problems += [f"cgroup {d}" for d in self._cgroups.teardown()]
            except Exception as e:  # noqa: BLE001
                problems.append(f"cgroups: {e}")
        # rank namespaces first (their eth0 dies with them, and with it the hub-side peer); the
        # hub's own bridges and uplink veth pairs (both ends in the hub) die with the hub
        for name in [n for n in names if n != getattr(self, "hub_namespace", None)] + \
                    [n for n in names if n == getattr(self, "hub_namespace", None)]:
            try:
                err = _netns.delete_netns(run, name)
            except Exception as e:  # noqa: BLE001
                err = f"{name}: {e}"
            if err:
                problems.append(err)
        self._netns_names = []
        if not problems and self._registered:
            try:
                os.unlink(self.registry_file)
            except FileNotFoundError:
                pass
            except OSError as e:
                problems.append(f"registry {self.registry_file}: {e}")
            self._registered = False
            _remove_registry_dir_if_empty()
        return problems

    # ------------------------------------------------------------------------------ ranks
    def rank_env(self, rank: int) -> dict[str, str]:
        """The variables a rank gets (on top of the caller's environment).

        Matrices are rows joined by ``;`` (row = sender). ``HETCOMM_SIM_NIC_MBIT``: per-rank NIC
        Mbit/s (``inf`` = unshaped); ``HETCOMM_SIM_LINK_MBIT``: the configured per-link matrix
        (from ``--sites`` or ``--link-mbit``; empty without; diagonal 0);
        ``HETCOMM_SIM_EFFECTIVE_MBIT``: min(NIC_i, link_ij, NIC_j), and the uplink rate between
        sites with shared uplinks (what one flow alone gets; diagonal 0);
        ``HETCOMM_SIM_BW_BYTES``: the same in bytes/s as :func:`effective_bandwidth` gives it
        (diagonal ``inf``); ``HETCOMM_SIM_WAN_MBIT``: the rate of every site's shared uplink
        in each direction (empty without); ``HETCOMM_SIM_SPEC``: the whole :class:`SimSpec` as
        JSON (``SimSpec.from_env()``).

        With hosts (``spec.hosts``): ``HETCOMM_SIM_HOSTS`` (the host of every rank, renumbered;
        empty without), ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` the rank's place in its host and the
        host's size, ``GROUP_RANK`` the host, as torchrun sets them; ``HETCOMM_SIM_ADDRS`` gives
        each rank its host's address (shared by the host's ranks: listen on port 0, or on ports
        that differ per rank) and ``HETCOMM_SIM_NIC_MBIT`` its host's NIC. Without hosts
        ``LOCAL_RANK`` = ``RANK``, ``LOCAL_WORLD_SIZE`` = ``WORLD_SIZE``, ``GROUP_RANK`` = 0.
        ``HETCOMM_HOST_ID`` is never set: hetcomm finds the hosts itself (boot id and network
        namespace, ``hetcomm.hosts.host_identity``).
        """
        self._require_up()
        p = self.world_size
        spec = self.spec
        links = spec.links()
        bw = effective_bandwidth(spec)
        if spec.hosts is None:
            local_rank, local_size, group_rank = rank, p, 0
        else:
            group_rank = spec.hosts[rank]
            mates = [k for k in range(p) if spec.hosts[k] == group_rank]
            local_rank, local_size = mates.index(rank), len(mates)
        return {
            "RANK": str(rank), "WORLD_SIZE": str(p),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(group_rank),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "HETCOMM_SIM": "1",
            "HETCOMM_SIM_ID": self.run_id or "",
            "HETCOMM_SIM_SPEC": spec.to_json(),
            "HETCOMM_SIM_NIC_MBIT": ",".join(format_rate(spec.nic(k)) for k in range(p)),
            "HETCOMM_SIM_LINK_MBIT": format_matrix(links) if links is not None else "",
            "HETCOMM_SIM_SITES": ",".join(map(str, spec.sites)) if spec.sites is not None else "",
            "HETCOMM_SIM_WAN_MBIT": format_rate(spec.wan_mbit) if spec.wan_mbit is not None else "",
            "HETCOMM_SIM_EFFECTIVE_MBIT": format_matrix(effective_link_mbit(spec)),
            "HETCOMM_SIM_BW_BYTES": ";".join(",".join("inf" if v == float("inf") else f"{v:.0f}"
                                                      for v in row) for row in bw),
            "HETCOMM_SIM_CPU_QUOTA": (",".join(f"{q:g}" for q in spec.cpu_quota)
                                      if spec.cpu_quota is not None else ""),
            "HETCOMM_SIM_LATENCY_MS": f"{spec.latency_ms:g}",
            "HETCOMM_SIM_ADDRS": ",".join(self.addresses),
            "HETCOMM_SIM_HUB_ADDR": self.hub_address,
            "HETCOMM_SIM_IFNAME": RANK_IFNAME,
            "HETCOMM_SIM_NETNS": self.namespaces[rank],
            "HETCOMM_SIM_HOSTS": ",".join(map(str, spec.hosts)) if spec.hosts is not None else "",
        }

    def command_for(self, rank: int, cmd: Sequence[str]) -> list[str]:
        """The argv that runs ``cmd`` as rank ``rank``: join its cgroup, enter its namespace, exec.

        ``ip netns exec`` execs ``cmd`` in place (same pid), in a private mount namespace where
        ``/sys`` shows the rank's own interfaces. The cgroup is joined by a ``sh`` that then
        execs, before the namespace switch (which hides ``/sys/fs/cgroup``).
        """
        self._require_up()
        assert self._run is not None
        argv = [self._run.ip, "netns", "exec", self.namespaces[rank]] + list(cmd)
        if self._cgroups is not None:
            argv = ["/bin/sh", "-c", 'echo $$ > "$1" || exit 125; shift; exec "$@"', "hcsim-cgroup",
                    self._cgroups.procs_file(rank)] + argv
        return argv

    def launch(self, cmd: Command, env: Optional[Mapping[str, str]] = None, *,
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd: Optional[str] = None,
               **popen_kwargs) -> list[RankProcess]:
        """Starts ``cmd`` once per rank and returns the processes (not waited for).

        ``cmd`` is an argv list, or a function ``rank -> argv``. Each rank's environment is ours,
        updated with :meth:`rank_env`, then with ``env`` (so a caller can point ``MASTER_ADDR``
        and ``MASTER_PORT`` at a store it hosts in the hub, see :meth:`netns`). Unless given:
        ``PYTHONUNBUFFERED=1``; ``GLOO_SOCKET_IFNAME=eth0`` (Gloo would otherwise resolve the
        hostname to 127.0.0.1 inside the namespace and advertise an address no peer can reach);
        with CPU quotas ``OMP_NUM_THREADS = ceil(quota)`` (a rank sees every core of the
        machine but may only use its quota; more threads only make it throttle). Ranks run in
        their own sessions (``killpg(pid)`` reaches everything they start).
        """
        self._require_up()
        procs: list[RankProcess] = []
        try:
            for k in range(self.world_size):
                argv = list(cmd(k) if callable(cmd) else cmd)
                if not argv:
                    raise SimError("empty command")
                full_env = dict(os.environ)
                full_env.setdefault("PYTHONUNBUFFERED", "1")
                full_env.setdefault("GLOO_SOCKET_IFNAME", RANK_IFNAME)
                if self.spec.cpu_quota is not None:
                    # as many compute threads as the rank has cores (torch would use them all)
                    threads = max(1, math.ceil(self.spec.cpu_quota[k]))
                    full_env.setdefault("OMP_NUM_THREADS", str(threads))
                full_env.update(self.rank_env(k))
                if env:
                    full_env.update(env)  # explicit wins, e.g. MASTER_ADDR of a store in the hub
                popen = subprocess.Popen(self.command_for(k, argv), env=full_env,
                                         stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                         cwd=cwd, start_new_session=True, **popen_kwargs)
                procs.append(RankProcess(k, popen))
                self._launched.append(procs[-1])
        except BaseException:
            stop_ranks(procs, signal.SIGKILL, 1.0, self.log)
            raise
        return procs

    def run(self, cmd: Command, env: Optional[Mapping[str, str]] = None, *, grace_s: float = 30.0,
            timeout_s: Optional[float] = None, kill_wait_s: float = 5.0, prefix_output: bool = True,
            stdout=None, stderr=None, cwd: Optional[str] = None) -> int:
        """Runs ``cmd`` once per rank, waits for all, returns the worst exit status.

        See :mod:`hetcomm.sim.launcher` for the failure rules (grace period, termination,
        statuses). With ``prefix_output`` each line a rank writes goes to ``stdout``/``stderr``
        (default: ours) as ``[rank k] line``. ``self.last_result`` keeps the details.
        """
        out = stdout if stdout is not None else sys.stdout
        err = stderr if stderr is not None else sys.stderr
        if prefix_output:
            procs = self.launch(cmd, env, cwd=cwd)
            wout, werr = binary_writer(out), binary_writer(err)
            pumps = []
            for r in procs:
                prefix = f"[rank {r.rank}] ".encode()
                pumps.append(start_pump(r.popen.stdout, prefix, wout))
                pumps.append(start_pump(r.popen.stderr, prefix, werr))
        else:
            procs = self.launch(cmd, env, cwd=cwd, stdout=stdout, stderr=stderr)
            pumps = []
        result = supervise(procs, grace_s=grace_s, timeout_s=timeout_s, kill_wait_s=kill_wait_s,
                           log=self.log, pumps=pumps)
        self.last_result = result
        return result.status

    # ------------------------------------------------------------------------------ helpers
    def netns(self, where: Union[str, int] = "hub"):
        """Context manager: the calling thread enters the hub (``"hub"``) or a rank's namespace.

        E.g. ``with cluster.netns("hub"): store = TCPStore(cluster.hub_address, 0, ...)`` hosts
        a store every rank reaches at ``HETCOMM_SIM_HUB_ADDR``.
        """
        self._require_up()
        name = self.hub_namespace if where == "hub" else self.namespaces[int(where)]
        return enter_netns(name)

    def describe(self) -> str:
        self._require_up()
        if self.spec.hosts is None:
            where = ", ".join(f"rank {k} {a}" for k, a in enumerate(self.addresses))
        else:
            where = ", ".join(f"{self._node_name(n)} {a}" for n, a in enumerate(self.node_addresses))
        lines = [f"run {self.run_id}: {self.spec.describe()}",
                 f"subnet {self.subnet}: {where}"
                 + f"; hub {self.hub_address}; MASTER_ADDR={self.master_addr} MASTER_PORT={self.master_port}"]
        if self.spec.shaped:
            eff = effective_link_mbit(self.spec)
            lines.append("effective link Mbit/s (row sends to column): " + format_matrix(eff))
        if self.site_bridges:
            lines.append(f"shared uplinks, {format_rate(self.spec.wan_mbit)} Mbit/s each way: " + "; ".join(
                f"site {label} (ranks {','.join(map(str, ranks))}) out {out_port} in {in_port}"
                for (label, ranks), (_, _, out_port, in_port) in zip(self.spec.site_groups(),
                                                                     self._uplinks())))
        return "\n".join(lines)

    def _require_up(self) -> None:
        if not self._up:
            raise SimError("the simulated cluster is not set up (use `with SimCluster(spec) as c:`)")


def _raise_interrupted(signum, frame):
    raise SimInterrupted(signum)


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
