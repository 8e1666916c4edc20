"""``python -m hetcomm.sim [shaping options] -- CMD ARGS...`` (see ``--help``)."""
from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import Optional, Sequence

from hetcomm.rates import RateError, parse_matrix, parse_rate, parse_rate_list
from hetcomm.sim.cluster import DEFAULT_MASTER_PORT, SimCluster
from hetcomm.sim.registry import cleanup_stale
from hetcomm.sim.launcher import SimInterrupted
from hetcomm.sim.spec import DEFAULT_TCP_CC, MAX_RANKS, SimError, SimSpec, parse_float_list

EXIT_USAGE = 2

EPILOG = """\
what is shaped where:
  --nic-mbit R_k    rank k's NIC, both directions: HTB on eth0 in rank k's namespace (egress;
                    one class per destination under a parent class at the NIC rate, so ACKs
                    do not queue behind bulk data, as with a host's fq_codel) and tbf on its
                    bridge port in the hub namespace (ingress).
  --sites/--link-mbit
                    per directed link, at the sender: the same HTB classes (u32 on the
                    destination address), each with ceil = min(link, NIC); the receiver's NIC
                    tbf still applies on its ingress.
  --wan-mbit R      the other site model: each site (--sites) reaches the other sites through
                    one shared WAN uplink, R Mbit/s out and R in; all of its cross-site flows
                    share it. A bridge per site in the hub namespace, joined to a core bridge by
                    a veth pair shaped (HTB) on both ends. Combines with --intra-mbit (within a
                    site) and --inter-mbit (each cross-site pair, on top); --inter-mbit alone
                    gives every cross-site pair its own link instead.
  --hosts LIST      several ranks per host: the ranks of a host share one namespace, address
                    and veth pair, so --nic-mbit (one rate for every host, one per host, or one
                    per rank equal within a host) shapes the host's NIC for all of them, both
                    directions (one --cpu-quota value, likewise, every rank's); they talk over
                    the namespace's loopback, unshaped. Combines with --cpu-quota (per rank),
                    --latency-ms and --sites + --wan-mbit (each host in one site); not with
                    --link-mbit, --intra-mbit or --inter-mbit. hetcomm finds the hosts itself
                    (boot id + network namespace); HETCOMM_HOST_ID is not set.
  A single flow i->j gets min(NIC_i, link_ij, NIC_j, and R between sites); TCP payload ~95.6%
  of that (ranks of one host: loopback, unshaped).
  --tcp-cc NAME     every namespace's TCP congestion control. Unless given: cubic, mainline
                    Linux's default, so results do not depend on the host's own setting; where
                    the kernel lets namespaces select only tcp_allowed_congestion_control and
                    cubic is not in it, reno; else the host's. The run summary says which.

environment of each rank:
  RANK WORLD_SIZE LOCAL_RANK(=RANK) LOCAL_WORLD_SIZE(=WORLD_SIZE) GROUP_RANK(=0)
  (with --hosts: the rank's place in its host, the host's size, the host) MASTER_ADDR(rank 0's
  address) MASTER_PORT
  HETCOMM_SIM=1 HETCOMM_SIM_NIC_MBIT HETCOMM_SIM_LINK_MBIT HETCOMM_SIM_EFFECTIVE_MBIT
  HETCOMM_SIM_BW_BYTES HETCOMM_SIM_CPU_QUOTA HETCOMM_SIM_LATENCY_MS HETCOMM_SIM_SITES
  HETCOMM_SIM_WAN_MBIT HETCOMM_SIM_HOSTS
  HETCOMM_SIM_ADDRS(per rank; ranks of a host share one) HETCOMM_SIM_HUB_ADDR HETCOMM_SIM_IFNAME(eth0) HETCOMM_SIM_SPEC(json)
  HETCOMM_SIM_ID; unless already set: PYTHONUNBUFFERED=1, GLOO_SOCKET_IFNAME=eth0 and, with
  --cpu-quota, OMP_NUM_THREADS=ceil(quota).

exit status: 0 if every rank exited 0, else the worst status of the ranks that failed on their
own (killed by signal n = 128+n); 124 on --timeout; 128+n when the simulator got signal n;
2 for usage and setup errors. Everything is removed on every exit path except SIGKILL of the
simulator itself: `python -m hetcomm.sim --cleanup` removes what dead runs left.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hetcomm.sim",
        description="Run CMD once per rank in a simulated heterogeneous cluster: a network "
                    "namespace per rank behind a shaped veth, and a CPU quota per rank. Needs root.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("cluster")
    g.add_argument("--nic-mbit", metavar="LIST", help="per-rank NIC rate in Mbit/s, e.g. 800,800,800,100 "
                   "('inf' = unshaped); sets the world size (with --hosts: one per host, or per rank)")
    g.add_argument("--hosts", metavar="LIST", help="host of each rank, e.g. 0,0,1,1: the ranks of a host "
                   "share one network namespace and NIC and talk over loopback; sets the world size")
    g.add_argument("--nprocs", type=int, help="world size (when no list gives it; a one-item list is "
                   "then used for every rank)")
    g.add_argument("--link-mbit", metavar="MATRIX", help="directed PxP link rates in Mbit/s, rows "
                   "separated by ';' (row = sender), e.g. '0,800,100;800,0,100;100,100,0', or a file")
    g.add_argument("--sites", metavar="LIST", help="site of each rank, e.g. 0,0,1,1")
    g.add_argument("--intra-mbit", metavar="R", help="rate between ranks of the same site")
    g.add_argument("--inter-mbit", metavar="R", help="rate between ranks of different sites, each "
                   "pair on its own link")
    g.add_argument("--wan-mbit", metavar="R", help="one shared WAN uplink per site, R Mbit/s in each "
                   "direction, that all of the site's cross-site traffic crosses (needs --sites "
                   "with at least two sites)")
    g.add_argument("--cpu-quota", metavar="LIST", help="per-rank CPU quota in cores, e.g. 1,1,0.5,0.25 "
                   "(cgroup cpu controller); must sum to at most the number of cores")
    g.add_argument("--cpu-period-ms", type=float, default=100.0, metavar="MS",
                   help="CFS period of the CPU quotas (default 100): a shorter one throttles in shorter "
                        "pieces, so a rank's network thread waits less for its next share")
    g.add_argument("--allow-oversubscribe", action="store_true",
                   help="only warn when the quotas sum to more than the cores")
    g.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added on each rank's "
                   "egress (needs netem in the kernel)")
    g.add_argument("--tcp-cc", metavar="NAME", default=None,
                   help="TCP congestion control in every namespace (default: cubic, mainline Linux's "
                        "default, whatever the host uses, else the best this kernel lets a namespace "
                        "select; 'host' keeps the host's)")
    r = p.add_argument_group("run")
    r.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                   help=f"MASTER_PORT (default {DEFAULT_MASTER_PORT}; rank 0's namespace is private, "
                        "so it is always free there)")
    r.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="after a rank fails, seconds the others may still run (default 30)")
    r.add_argument("--timeout", type=float, metavar="S", help="terminate every rank after S seconds")
    r.add_argument("--kill-wait", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM (or the forwarded signal) and SIGKILL (default 5)")
    r.add_argument("--run-id", metavar="ID", help="names the run's namespaces/cgroups (1-6 lower-case "
                   "letters/digits; default random)")
    r.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank k]")
    r.add_argument("--show-tc", action="store_true", help="print tc statistics after the run")
    r.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")
    r.add_argument("-v", "--verbose", action="store_true", help="echo every ip/tc command")
    c = p.add_argument_group("maintenance")
    c.add_argument("--cleanup", nargs="?", const="", metavar="ID",
                   help="remove namespaces/cgroups left by runs whose process is gone (or run ID)")
    c.add_argument("--force", action="store_true", help="with --cleanup ID: even if its owner lives")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...: the command every rank runs")
    return p


def _labels(text: str, what: str = "--sites") -> list:
    """Comma-separated labels: integers where they are ones (ASCII digits), else the text."""
    out = []
    for s in text.replace(" ", "").split(","):
        if s == "":
            raise SimError(f"{what}: empty item")
        out.append(int(s) if re.fullmatch(r"-?[0-9]+", s) else s)
    if len(out) > MAX_RANKS:
        raise SimError(f"{what}: {len(out)} items; the simulator makes at most {MAX_RANKS} ranks")
    return out


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    """The cluster the options describe; a malformed option raises SimError naming it."""
    try:
        return _spec_from_args(args)
    except RateError as e:
        raise SimError(str(e)) from None


def _spec_from_args(args: argparse.Namespace) -> SimSpec:
    hosts = getattr(args, "hosts", None)  # hetcomm.bench's namespace may not carry it
    # One value of a per-rank list applies to every rank: as many as --nprocs, else --hosts names.
    n = args.nprocs if args.nprocs is not None else (len(_labels(hosts, "--hosts")) if hosts else None)
    if n is not None and not 1 <= n <= MAX_RANKS:     # before a value is repeated n times
        raise SimError(f"--nprocs {n}: the simulator makes 1 to {MAX_RANKS} ranks")

    def bcast(xs):
        if xs is not None and n is not None and len(xs) == 1 and n > 1:
            return xs * n
        return xs

    nic = bcast(parse_rate_list(args.nic_mbit, "--nic-mbit")) if args.nic_mbit else None
    quota = bcast(parse_float_list(args.cpu_quota, "--cpu-quota")) if args.cpu_quota else None
    period = getattr(args, "cpu_period_ms", 100.0)   # hetcomm.bench's namespace may not carry it
    if quota is None and period != 100.0:
        raise SimError("--cpu-period-ms sets the period of the CPU quotas: it needs --cpu-quota")
    wan = getattr(args, "wan_mbit", None)  # hetcomm.bench's namespace may not carry it
    return SimSpec(
        nic_mbit=nic,
        link_mbit=parse_matrix(args.link_mbit) if args.link_mbit else None,
        sites=_labels(args.sites) if args.sites else None,
        intra_mbit=parse_rate(args.intra_mbit, "--intra-mbit") if args.intra_mbit else None,
        inter_mbit=parse_rate(args.inter_mbit, "--inter-mbit") if args.inter_mbit else None,
        wan_mbit=parse_rate(wan, "--wan-mbit") if wan else None,
        cpu_quota=quota,
        cpu_period_ms=period,
        latency_ms=args.latency_ms,
        nprocs=args.nprocs,
        tcp_cc=tcp_cc_arg(getattr(args, "tcp_cc", None)),
        hosts=_labels(hosts, "--hosts") if hosts else None,
    )


def tcp_cc_arg(text: Optional[str]) -> Optional[str]:
    """--tcp-cc: None (not given) -> the default, 'host' -> None (inherit the host's)."""
    if text is None:
        return DEFAULT_TCP_CC
    text = text.strip()
    return None if text == "host" else text


def _err(msg: str) -> None:
    sys.stderr.write(f"hetcomm.sim: error: {msg}\n")
    sys.stderr.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]

    if args.cleanup is not None:
        try:
            n = cleanup_stale(args.cleanup or None, force=args.force,
                              log=lambda s: print(f"[hetcomm.sim] {s}", file=sys.stderr))
        except SimError as e:
            _err(str(e))
            return EXIT_USAGE
        print(f"[hetcomm.sim] cleaned {n} run(s)", file=sys.stderr)
        return 0
    if not cmd:
        parser.error("no command: give it after `--`, e.g. `python -m hetcomm.sim --nprocs 2 -- hostname`")
    try:
        spec = spec_from_args(args)
    except SimError as e:
        _err(str(e))
        return EXIT_USAGE

    # Ctrl-C: KeyboardInterrupt even if SIGINT was ignored by whoever started us; SIGTERM/SIGHUP:
    # SimInterrupted. Either unwinds through SimCluster.__exit__, which removes everything.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)
    log = (lambda s: None) if args.quiet else (lambda s: (sys.stderr.write(f"[hetcomm.sim] {s}\n"),
                                                           sys.stderr.flush()))
    try:
        with SimCluster(spec, run_id=args.run_id, master_port=args.master_port,
                        allow_oversubscribe=args.allow_oversubscribe, verbose=args.verbose,
                        log=log) as cluster:
            for line in cluster.describe().splitlines():
                log(line)
            status = cluster.run(cmd, grace_s=args.grace, timeout_s=args.timeout,
                                 kill_wait_s=args.kill_wait, prefix_output=not args.no_prefix)
            if args.show_tc:
                sys.stdout.write(cluster.tc_show() + "\n")
            res = cluster.last_result
            if res is not None and status != 0:
                log("statuses by rank: " + ", ".join(
                    f"{k}:{s}{'(terminated)' if t else ''}"
                    for k, (s, t) in enumerate(zip(res.statuses, res.terminated_by_sim))))
        log(f"run {cluster.run_id} removed; exit status {status}")
        return status
    except SimInterrupted as e:
        log(f"interrupted by {signal.Signals(e.signum).name}; everything removed")
        return e.exit_status
    except KeyboardInterrupt:
        log("interrupted by SIGINT; everything removed")
        return 128 + signal.SIGINT
    except SimError as e:
        _err(str(e))
        return EXIT_USAGE


def _raise(signum, frame):
    raise SimInterrupted(signum)


if __name__ == "__main__":
    sys.exit(main())
