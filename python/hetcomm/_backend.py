"""Registration of the ``"hetcomm"`` torch.distributed backend and access to its C++ object.

Registering loads nothing but torch.distributed: the compiled extension is loaded by the creator,
when the first hetcomm group is created (`hetcomm._engine`).
"""
from __future__ import annotations

import atexit
import datetime
import os
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from hetcomm import _engine

if TYPE_CHECKING:  # for the annotations only: the extension is loaded by _engine, when needed
    from hetcomm._C import ProcessGroupHetcomm

BACKEND_NAME = "hetcomm"
# torch's own default for non-NCCL groups; used when the creator is given no timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def _timeout_ms(timeout: Optional[datetime.timedelta]) -> int:
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    ms = int(timeout.total_seconds() * 1000)
    if ms <= 0:
        raise ValueError(f"hetcomm: the process group timeout must be positive, got {timeout}")
    return ms


@atexit.register
def _shut_down_all() -> None:
    """Shuts down the hetcomm groups the program did not destroy, while the interpreter still runs.

    Otherwise their threads are still there when Python finalizes: a completion thread that drops
    the last reference to a tensor then needs the GIL, which a finalizing interpreter no longer
    hands out (the thread is made to exit, unwinding through a destructor: std::terminate, seen as
    SIGABRT at exit after a failed collective). An idle group is shut down as
    destroy_process_group would; one with operations still queued or running is aborted, so that
    the exit never waits for their timeouts. Every group this process created is found (the C++
    side keeps a weak list): those torch registered, those whose creation failed after the
    backend was built (a planning error), and backends built directly. Then the threads that
    complete the futures of operations issued after a shutdown are given a moment to finish.
    """
    extension = _engine.loaded()
    if extension is None:  # never loaded: no group was created
        return
    try:
        extension.shutdown_live_groups_at_exit(5000)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _create_backend(dist_backend_opts, backend_options) -> "ProcessGroupHetcomm":
    """Extended-API creator: torch calls it in every process of a new group.

    Besides building the C++ backend it measures the links (or reads the declared ones) and
    installs the ring plan, since every rank of the group is here at the same time. The first
    group of a process loads what creation runs (hosts, the probe, the planner but its LP
    solver) and the extension, before the backend connects: every rank has them loaded before
    any link is measured.
    """
    from hetcomm.topology import configure_group

    timeout_ms = _timeout_ms(getattr(dist_backend_opts, "timeout", None))
    backend = _engine.extension().ProcessGroupHetcomm(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout_ms,
        os.environ.get("HETCOMM_LISTEN_IP", ""),
        # (empty for the default group, whose group ranks are the job's)
        list(getattr(dist_backend_opts, "global_ranks_in_group", None) or range(dist_backend_opts.group_size)),
    )
    configure_group(backend, getattr(dist_backend_opts, "global_ranks_in_group", None),
                    store=backend.sealed_store(), timeout_ms=timeout_ms)
    backend.forget_wait_pattern()
    return backend


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[datetime.timedelta]:
    """The operation timeout ``group`` (the default group when None) was created with, for the
    groups made from it (torch's ``new_group`` otherwise gives them its own default, 30 minutes):
    hetcomm's, or Gloo's; None where the backend does not tell."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            backend = getattr(backend, "wrapped_pg", backend)    # (TORCH_DISTRIBUTED_DEBUG=DETAIL)
            if hasattr(backend, "timeout_ms"):
                return datetime.timedelta(milliseconds=backend.timeout_ms())
            timeout = backend.options._timeout
        except Exception:  # noqa: BLE001 - no such device, or a backend without options: untold
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def supported_devices() -> list[str]:
    """The device types this build of hetcomm moves: ``["cpu", "cuda"]`` when it was compiled
    against a CUDA build of torch with nvcc present, else ``["cpu"]``. Does not load the
    extension (`hetcomm._engine.supported_devices`)."""
    return list(_engine.supported_devices())


def tls_available() -> tuple[bool, str]:
    """(True, "") when OpenSSL 3 can be loaded for HETCOMM_TLS, else (False, why not)."""
    return _engine.extension().tls_available()


def staging_host_bytes() -> int:
    """Bytes of host memory this process's hetcomm groups hold now to stage device tensors (pinned
    memory in a CUDA build): each group's staging slots (8 of ``HETCOMM_DEVICE_SLOT_BYTES`` per
    CUDA device it moved tensors of; under HETCOMM_DEBUG_EMULATE_DEVICE, the emulation's, from
    the group's creation) and a buffer for the largest message staged whole: for an allreduce
    across hosts or sites at most a piece (``HETCOMM_SITE_PIECE_BYTES``) or 4 MiB, whichever is
    larger. Not a
    collective; freed when a group is shut down, so 0 once every group is destroyed."""
    return int(_engine.extension().staging_host_bytes())


def register_backend() -> None:
    """Registers ``"hetcomm"`` with torch.distributed (idempotent; ``import hetcomm`` calls it).

    It registers for the device types of :func:`supported_devices`: a CPU-only build stays a
    CPU-only backend, so that torch picks another backend (or reports none) for CUDA tensors
    instead of handing them to a build that cannot move them.
    """
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # devices must be a list: a string would be iterated per character.
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=supported_devices())


def _hetcomm_backend(group: Optional[dist.ProcessGroup], caller: str) -> "ProcessGroupHetcomm":
    """``group``'s hetcomm backend object, or a RuntimeError that starts with ``caller``."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(f"{caller}: no default process group; call dist.init_process_group('hetcomm') first")
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError as e:  # a group with no CPU backend (NCCL only)
        raise RuntimeError(f"{caller}: the group has no CPU backend, so no hetcomm one "
                           f"(its backend is {dist.get_backend(pg)})") from e
    if not _engine.is_backend(backend):
        name = backend.name() if hasattr(backend, "name") else type(backend).__name__
        raise RuntimeError(f"{caller}: the group's backend is {name}, not hetcomm")
    return backend


def backend_or_none(group: Optional[dist.ProcessGroup] = None) -> Optional["ProcessGroupHetcomm"]:
    """The hetcomm backend object behind ``group``, or None when its CPU backend is another one or
    it has none (never raises, loads nothing)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no CPU backend (or no group): simply not hetcomm
        return None
    return backend if _engine.is_backend(backend) else None


def backend_of(group: Optional[dist.ProcessGroup] = None) -> "ProcessGroupHetcomm":
    """The hetcomm backend object behind ``group`` (default: the world group)."""
    return _hetcomm_backend(group, "hetcomm")


def stats(group: Optional[dist.ProcessGroup] = None) -> dict:
    """This rank's traffic in ``group`` (default: the world group), cumulative since the group was
    created. Not a collective: each rank reads its own counters. To measure an interval, subtract
    two snapshots (every field only grows).

    Keys:

    * ``rank``, ``world_size``: this rank's group rank and the group's size.
    * ``peers``: ``peers[i]`` is the global rank of group rank ``i``.
    * ``bytes_sent``, ``bytes_received``: lists indexed by the peer's group rank (this rank's own
      entry stays 0): every byte of hetcomm's messages that this rank wrote to or read from its
      sockets to that peer, collective and point-to-point alike, message headers included (a
      40-byte header on each message a collective step sends on a link, e.g. one per link for a
      ring allreduce; 24 bytes per point-to-point message). Not counted: the
      connection handshakes (a Hello and its acknowledgement once per connection), the liveness
      probes of point-to-point receives, and TCP/IP overhead. So, once both ranks have finished
      the operations, ``bytes_sent[b]`` on rank ``a`` equals ``bytes_received[a]`` on rank ``b``.
    * ``collectives``: collectives this rank ran (those that failed included; those refused because
      the group had already failed not), and ``collective_seconds``: the wall time spent running
      them (queueing excluded). ``collectives_on_caller_thread``: how many of them ran on the
      calling thread instead of the group's worker (small ones on one host, issued while the
      group was idle by a program that waited for its previous operation right away:
      ``HETCOMM_INLINE_BYTES`` and ``HETCOMM_INLINE_WINDOW_US`` in docs/environment.md).
    * ``p2p_sent_messages``, ``p2p_received_messages``: point-to-point messages wholly written and
      wholly read (``send``/``recv``, and the messages of ``monitored_barrier``). A message that
      arrives before its receive is posted counts when it arrives (its bytes too): the engine reads
      messages eagerly, so an interval can include point-to-point traffic from a peer that has
      run ahead of this rank. Collective bytes are read only while this rank runs the collective.
    * ``collectives_by_path``: how many collectives took each path: ``tcp`` (sockets only),
      ``shm`` (every rank of the group on this host: shared memory only), ``hierarchical``
      (allreduces with hosts as the inner level: shared memory inside each host, TCP between
      hosts), ``nccl`` / ``gloo`` (every rank of the group on this host, through torch's NCCL or
      Gloo as the host's inner level: ``HETCOMM_LOCAL``). ``shared_memory_bytes``:
      bytes this rank copied into its shared-memory slots (these never appear in ``bytes_sent``).
    * ``p2p_links``: the point-to-point links open now, both directions, by kind: ``tcp``,
      ``tls``, and ``shm`` (a ring in shared memory to a rank of this host, its TCP connection
      kept as the doorbell: ``HETCOMM_P2P_SHM_BYTES`` in docs/environment.md). Bytes through a
      ring count in ``bytes_sent`` and ``bytes_received`` as socket bytes do.

    * ``sites``, ``wan_bytes_sent``, ``wan_bytes_received`` (only when the group spans two or
      more sites, as its probe or ``HETCOMM_SITES`` found them): the site of every group rank and
      this rank's bytes to and from ranks of other sites, i.e. what crossed the WAN.

    The group's creation may already have moved bytes and run collectives (``hetcomm.probe``
    measuring links, and the trial of a measured plan against equal shares: docs/planner.md).
    A snapshot taken while operations run may hold part of their bytes and not yet their counts.
    """
    from hetcomm.topology import topology_of

    backend = _hetcomm_backend(group, "hetcomm.stats")
    pg = group if group is not None else dist.group.WORLD
    size = backend.size()
    out = {"rank": backend.rank(), "world_size": size,
           "peers": [dist.get_global_rank(pg, i) for i in range(size)]}
    out.update(backend.traffic())
    topology = topology_of(backend)
    if topology is not None and len(set(topology.sites)) > 1:
        sites = list(topology.sites)
        mine = sites[out["rank"]]
        out["sites"] = sites
        out["wan_bytes_sent"] = sum(b for b, s in zip(out["bytes_sent"], sites) if s != mine)
        out["wan_bytes_received"] = sum(b for b, s in zip(out["bytes_received"], sites) if s != mine)
    return out


def get_plan(group: Optional[dist.ProcessGroup] = None):
    """The plan the group's allreduces use (a `hetcomm.planner.Plan`): the ring, the site-aware
    schedule if any (``plan.sites``, a `hetcomm.plan.SitePlan`, used from
    ``plan.sites.min_bytes`` on) and the topology it was made for (``plan.topology``)."""
    from hetcomm.planner import Plan
    from hetcomm.plan import SitePlan
    from hetcomm.topology import topology_of

    backend = backend_of(group)
    order, shares, min_bytes, segment_bytes = backend.get_plan()
    site = backend.get_site_plan()
    if site is not None:
        groups, owners, block_shares, site_shares, site_min, site_seg, local_inner, hosts, holders = site
        site = SitePlan(tuple(map(tuple, groups)), tuple(map(tuple, owners)), tuple(block_shares), tuple(site_shares),
                        min_bytes=site_min, segment_bytes=site_seg, local_inner=local_inner,
                        hosts=tuple(map(tuple, hosts)), holders=tuple(map(tuple, holders)))
    return Plan(tuple(order), tuple(shares), min_bytes=min_bytes, segment_bytes=segment_bytes, sites=site,
                topology=topology_of(backend))


def set_plan(plan, group: Optional[dist.ProcessGroup] = None) -> None:
    """Installs a plan (a `hetcomm.planner.Plan`, with its site plan if it has one); every rank must
    set the same plan at the same point."""
    from hetcomm.topology import install_plan

    install_plan(backend_of(group), plan)


def probe(group: Optional[dist.ProcessGroup] = None):
    """Re-measures the group's links and reduce throughput, installs the resulting plan, returns the model.

    A collective: every rank of the group must call it.
    """
    from hetcomm.topology import probe_backend

    pg = group if group is not None else dist.group.WORLD
    return probe_backend(backend_of(group), dist.get_process_group_ranks(pg))


def link_model(group: Optional[dist.ProcessGroup] = None):
    """The `LinkModel` behind the group's plan (None if none was measured or declared)."""
    from hetcomm.topology import model_of

    return model_of(backend_of(group))


def monitored_barrier(group: Optional[dist.ProcessGroup] = None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for a hetcomm group (torch's own function refuses every
    backend but gloo; the group's ``monitored_barrier`` method reaches hetcomm's implementation).

    Rank 0 waits up to ``timeout`` (default: the group's timeout) for every other
    rank; a rank that does not arrive is named in rank 0's error (``wait_all_ranks``: all of them,
    else the first), and the others fail when rank 0 does not release them.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("hetcomm: no default process group; call dist.init_process_group('hetcomm') first")
    if timeout is None:  # torch's binding then passes "unset", and the group's timeout applies
        pg.monitored_barrier(wait_all_ranks=wait_all_ranks)
    else:
        pg.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks)


def listen_address(group: Optional[dist.ProcessGroup] = None) -> str:
    """This rank's listening address (``ip:port``) in ``group``."""
    return backend_of(group).listen_address()
