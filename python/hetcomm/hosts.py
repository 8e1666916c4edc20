"""Hosts: which ranks of a group share a machine, and the shared memory between them.

At group creation (`hetcomm.topology.configure_group`) every rank of the group publishes its
host identity (`host_identity`: boot id, network namespace, ``/dev/shm``; ``HETCOMM_HOST_ID``
overrides it) and learns the hosts (`host_labels`); checks that every rank agrees on the hosts
and on the settings that shape the schedule (`check_agreement`); and sets up shared memory among
the ranks of each host, or another inner level (`setup_inner_levels`), or keeps the whole group
on TCP if any host cannot.

What a host is, what must agree and how the shared memory is laid out:
docs/hosts-and-sites.md#ranks-on-one-host-shared-memory-and-hosts-as-the-inner-level.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from typing import Optional, Sequence

import torch

from hetcomm.labels import renumber

log = logging.getLogger("hetcomm")

DEFAULT_SHM_BYTES = 64 << 20
DEFAULT_SLOT_BYTES = 256 << 10
_IDENTITY_BYTES = 32
_SETTING_BYTES = 96

_fallback_said = False


def host_identity() -> str:
    """This process's host: ``HETCOMM_HOST_ID`` (one label), else boot id + network namespace."""
    declared = os.environ.get("HETCOMM_HOST_ID", "").strip()
    if declared and "," not in declared:
        return "declared:" + declared
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "unknown-netns"
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "no-dev-shm"
    return f"{boot}/{netns}/{shm}"


def declared_labels(global_ranks: Sequence[int]) -> Optional[tuple[str, ...]]:
    """The per-global-rank form of ``HETCOMM_HOST_ID`` (``"0,0,1,1"``) for these ranks, else None."""
    text = os.environ.get("HETCOMM_HOST_ID", "").strip()
    if "," not in text:
        return None
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ValueError(f"hetcomm: HETCOMM_HOST_ID={text!r} has an empty label: give one host label per global "
                         f"rank, e.g. 0,0,1,1")
    if max(global_ranks) >= len(items):
        raise ValueError(f"hetcomm: HETCOMM_HOST_ID={text!r} labels {len(items)} ranks, but this group has global "
                         f"rank {max(global_ranks)}: give one host label per global rank of the job")
    return tuple("declared:" + items[r] for r in global_ranks)


def _allgather_rows(backend, row: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(row) for _ in range(backend.size())]
    backend.allgather([out], [row]).wait()
    return out


def _encode(text: str, nbytes: int) -> torch.Tensor:
    data = text.encode()[:nbytes]
    row = torch.zeros(nbytes, dtype=torch.uint8)
    if data:
        row[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return row


def _decode(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")


def _gather_identities(backend) -> tuple[str, ...]:
    digest = hashlib.sha256(host_identity().encode()).hexdigest()[:_IDENTITY_BYTES]
    found = tuple(_decode(row) for row in _allgather_rows(backend, _encode(digest, _IDENTITY_BYTES)))
    _identities[backend.listen_address()] = found
    return found


_identities: dict[str, tuple[str, ...]] = {}


def identities_of(backend) -> tuple[str, ...] | None:
    """The host identities (digests of `host_identity`) of the group's ranks, as `host_labels`
    gathered them at its creation; None before."""
    return _identities.get(backend.listen_address())


def host_labels(backend, global_ranks: Sequence[int]) -> tuple[tuple[int, ...], str]:
    """The host of every rank of the backend's group, numbered by lowest rank, and "" or why this
    rank's ``HETCOMM_HOST_ID`` is unusable (then the labels are the gathered identities'). A
    collective; the caller passes the error to `check_agreement` before raising it, so that a
    rank with a bad setting fails group creation on every rank, not alone."""
    global_ranks = tuple(int(r) for r in global_ranks)
    # Gathered even when declared: every rank must run the same collectives here, and a rank
    # started without the declaration (or with another) must reach `check_agreement`.
    identities = _gather_identities(backend)
    try:
        declared = declared_labels(global_ranks)
    except ValueError as e:
        return renumber(identities), str(e)
    return renumber(declared if declared is not None else identities), ""


def settings(labels: Sequence[int], error: str = "") -> dict[str, str]:
    """What every rank of a group must agree on: the hosts it computed (and whether its host
    setting was usable), and the settings that change the schedule or the layout of shared memory."""
    out = {"hosts": ",".join(map(str, labels)), "HETCOMM_HOST_ID is usable": "no: " + error if error else "yes"}
    out.update(environment_settings())
    return out


def environment_settings() -> dict[str, str]:
    """The environment variables that every rank of a group must set alike (unset reads as "")."""
    return {name: os.environ.get(name, "").strip() for name in _AGREED_VARIABLES}


_AGREED_VARIABLES = ("HETCOMM_SHM", "HETCOMM_LOCAL", "HETCOMM_SHM_BYTES", "HETCOMM_SHM_SLOT_BYTES",
                     "HETCOMM_SHM_SMALL_ALLREDUCE_BYTES", "HETCOMM_LINK_MBIT", "HETCOMM_SITES", "HETCOMM_PROBE",
                     "HETCOMM_HIERARCHICAL", "HETCOMM_SEGMENT_BYTES", "HETCOMM_SMALL_ALLREDUCE_BYTES",
                     "HETCOMM_SITE_PIECE_BYTES", "HETCOMM_TLS", "HETCOMM_JOB_ID")


def check_agreement(backend, values: dict[str, str]) -> None:
    """Raises ValueError on every rank unless every rank of the group passed the same ``values``
    (names and order must be the same everywhere; each value is compared in its first 96 bytes,
    or by a digest when longer). A collective."""
    def fit(v: str) -> str:
        return v if len(v.encode()) <= _SETTING_BYTES else "sha256:" + hashlib.sha256(v.encode()).hexdigest()[:64]

    names = list(values)
    row = torch.cat([_encode(fit(values[n]), _SETTING_BYTES) for n in names])
    table = [[_decode(r[k * _SETTING_BYTES:(k + 1) * _SETTING_BYTES]) for k in range(len(names))]
             for r in _allgather_rows(backend, row)]
    problems = []
    for k, name in enumerate(names):
        seen: dict[str, list[int]] = {}
        for rank, entries in enumerate(table):
            seen.setdefault(entries[k], []).append(rank)
        if len(seen) > 1:
            parts = [f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {v or '(unset)'!r}"
                     for v, r in seen.items()]
            what = "the hosts they computed" if name == "hosts" else name
            problems.append(f"{what} ({'; '.join(parts)})")
    if problems:
        raise ValueError("hetcomm: the ranks of this group disagree about " + ", and about ".join(problems) +
                         ": every rank of a job must be started with the same hetcomm settings")


def _int_env(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"hetcomm: {name}={text!r} is not a whole number of bytes") from None
    if value < 0:
        raise ValueError(f"hetcomm: {name}={text!r} must not be negative")
    return value


_HOST_LEVELS = ("shm", "gloo", "tcp")


def inner_level_choice() -> tuple[str, str]:
    """(level for host memory, level for CUDA tensors) from ``HETCOMM_LOCAL`` and ``HETCOMM_SHM``.

    Host memory: ``shm`` (hetcomm's shared memory, the default), ``gloo`` (torch's Gloo group over
    the host's ranks) or ``tcp`` (no inner level: every byte over TCP). CUDA tensors: ``nccl``
    (torch's NCCL group over the host's GPUs, asked for with ``HETCOMM_LOCAL=nccl``: shared memory
    then serves host memory, and group creation fails where a rank has no GPU of its own or no
    NCCL), else ``""``: CUDA tensors go as host memory does (through shared memory, staged; with
    ``gloo``, one-host groups send them over TCP). NCCL is not the default until it has run on GPUs.
    """
    local = os.environ.get("HETCOMM_LOCAL", "").strip().lower()
    if local not in ("", "nccl") + _HOST_LEVELS:
        raise ValueError(f"hetcomm: HETCOMM_LOCAL={local!r}: choose shm, nccl, gloo or tcp")
    if local == "nccl" and os.environ.get("HETCOMM_SHM", "1").strip() == "0":
        raise ValueError("hetcomm: HETCOMM_LOCAL=nccl keeps shared memory for host memory: unset HETCOMM_SHM=0, "
                         "or choose HETCOMM_LOCAL=gloo or tcp")
    tls = os.environ.get("HETCOMM_TLS", "").strip().lower()
    if local in ("gloo", "nccl") and tls not in ("", "0", "off", "none"):
        # Their rendezvous goes through the store and their connections are unauthenticated: a
        # store writer or a local process could join, read or crash them (docs/security.md).
        raise ValueError(f"hetcomm: HETCOMM_LOCAL={local} with HETCOMM_TLS={tls}: torch's {local} groups inside a "
                         f"host are not authenticated, so they would void what TLS promises; use shm or tcp")
    host = "tcp" if os.environ.get("HETCOMM_SHM", "1").strip() == "0" and local in ("", "shm") else (
        local if local in _HOST_LEVELS else "shm")
    return host, "nccl" if local == "nccl" else ""


def _nccl_device() -> str:
    """This rank's GPU for NCCL ("cuda:<uuid>": the physical GPU, whatever CUDA_VISIBLE_DEVICES
    numbers it, then "@<NCCL_HOSTID>" where that is set), or why there is none. Never raises:
    every rank must reach the exchange after it.

    NCCL refuses a GPU twice only among ranks it takes for one machine, by NCCL_HOSTID where set:
    ranks given distinct NCCL_HOSTIDs may share a GPU (NCCL then connects them as it connects
    machines, through its network transport), as on a test machine with one GPU."""
    try:
        if not torch.distributed.is_nccl_available():
            return "no NCCL in this torch"
        if not torch.cuda.is_available():
            return "no CUDA device"
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        nccl_host = os.environ.get("NCCL_HOSTID", "")
        return f"cuda:{getattr(props, 'uuid', torch.cuda.current_device())}" + (f"@{nccl_host}" if nccl_host else "")
    except Exception as e:  # noqa: BLE001 (a broken driver on one rank)
        return f"no usable CUDA device ({type(e).__name__})"


def _nccl_problem(devices: Sequence[str], labels: Sequence[int]) -> str:
    """Why NCCL cannot join the ranks of every host ("" when it can): a rank without it, or two
    ranks of a host on one GPU under one NCCL_HOSTID (NCCL refuses a communicator with a GPU twice
    on one machine; set each rank's device, torch.cuda.set_device, before creating the group)."""
    for rank, device in enumerate(devices):
        if not device.startswith("cuda:"):
            return f"rank {rank} has {device}"
    for rank, device in enumerate(devices):
        for other in range(rank):
            if labels[other] == labels[rank] and devices[other] == device:
                return f"ranks {other} and {rank} of one host are both on {device}"
    return ""


def _torch_group(kind: str, backend, labels: Sequence[int], store, timeout_ms: int):
    """torch's ``kind`` (gloo, nccl) process group over this rank's host, on its own store prefix
    (the group's incarnation and the host's lowest rank: a later group under the same store never
    meets this one's keys). Every rank of the host constructs it here, at the same point."""
    import datetime

    import torch.distributed as dist

    me = backend.rank()
    ranks = [r for r, label in enumerate(labels) if label == labels[me]]
    prefix = f"hetcomm/inner/{backend.incarnation()}/{kind}/{ranks[0]}/"
    sub = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(milliseconds=timeout_ms)
    if kind == "gloo":
        options = dist.ProcessGroupGloo._Options()
        # Its connections are made within a quarter of the group's timeout (at least 5 s, at most
        # all of it), then the group's applies: Gloo retries a connection to a peer whose own
        # construction failed for about five times this timeout, and the peer that knows why waits
        # meanwhile in the exchange of outcomes (setup_inner_levels), bounded by the group's.
        options._timeout = max(timeout / 4, min(timeout, datetime.timedelta(seconds=5)))
        # Loopback: the ranks of a host share its network namespace (they share /dev/shm and
        # the host identity includes the namespace), and Gloo's unauthenticated port stays off
        # the NICs.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(sub, ranks.index(me), len(ranks), options)
        group._set_default_timeout(timeout)
        return group
    options = dist.ProcessGroupNCCL.Options()
    # Later than hetcomm's own deadline, so that hetcomm fails the collective (and aborts NCCL)
    # before torch's watchdog, whose default on a timeout is to end the process.
    options._timeout = timeout + datetime.timedelta(seconds=max(60.0, timeout_ms / 1000))
    return dist.ProcessGroupNCCL(sub, ranks.index(me), len(ranks), options)


# What SealedStore's get says of a value that never opened (csrc/backend/sealed_store.cc): after
# 10 s of a value that keeps failing its seal, or at the store's timeout.
_AUTHENTICATION_FAILURE = "failed its authentication"


def setup_inner_levels(backend, labels: Sequence[int], store=None, timeout_ms: int = 300_000) -> bool:
    """The inner level of each host (`inner_level_choice`): shared memory or a Gloo group for host
    memory, and NCCL for CUDA tensors; True when the group's hosts have one. A collective.

    Every host tries; all ranks then learn every host's outcome, so that either all use their
    inner levels or none does (a host falling back alone would meet its peers on another path).
    """
    global _fallback_said
    counts: dict[int, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    if max(counts.values()) < 2:
        return False
    host, device = inner_level_choice()
    if host == "tcp":
        return False
    if store is None and (host == "gloo" or device == "nccl"):
        raise ValueError("hetcomm: a torch process group as a host's inner level needs the group's store")
    if device:
        # NCCL for CUDA tensors needs it on every rank, each rank of a host on its own GPU.
        devices = [_decode(r) for r in _allgather_rows(backend, _encode(_nccl_device(), 160))]
        problem = _nccl_problem(devices, labels)
        if problem:
            raise ValueError(f"hetcomm: HETCOMM_LOCAL=nccl, but {problem}")
    error = ""
    alone = counts[labels[backend.rank()]] == 1      # nothing to join on this host
    if host == "shm":
        # (a store that fails here breaks the group: attach_local raises, it does not fall back)
        error = backend.attach_local(list(labels), _int_env("HETCOMM_SHM_BYTES", DEFAULT_SHM_BYTES),
                                     _int_env("HETCOMM_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES))
    for kind, wanted in (("gloo", host == "gloo"), ("nccl", device == "nccl")):
        if error or alone or not wanted:
            continue
        try:
            group = _torch_group(kind, backend, labels, store, timeout_ms)
        except Exception as e:  # noqa: BLE001 - whatever the library raised (a garbage rendezvous
            # record from the store made Gloo raise MemoryError), every rank must reach the
            # exchange of outcomes below, or its peers wait there for it until the timeout
            error = f"{kind}: {type(e).__name__}: {e}"
            continue
        backend.attach_inner(list(labels), group, kind, kind == "nccl")
    try:
        reasons = [_decode(r) for r in _allgather_rows(backend, _encode(error, 256))]
    except Exception as e:  # noqa: BLE001 - a peer still inside the library, or gone
        if not error:
            raise
        # This rank knows why its host's level failed; that, not the exchange's timeout, is what
        # it must say (a peer can stay in Gloo's connection attempts past the group's timeout).
        raise RuntimeError(f"hetcomm: the inner level of rank {backend.rank()}'s host could not be formed: {error} "
                           f"(and the ranks could not agree on falling back: {e})") from e
    failed = [(rank, why) for rank, why in enumerate(reasons) if why]
    forged = [(rank, why) for rank, why in failed if _AUTHENTICATION_FAILURE in why]
    met_through_store = [(rank, why) for rank, why in failed if why.startswith(("gloo:", "nccl:"))]
    if forged or (met_through_store and backend.sealing()):
        # A rendezvous record that failed its seal, or with an out-of-band secret any failure of
        # a torch group to meet through the store (a store writer can also delete a record, or
        # stall the store): must fail the group rather than quietly push every host onto TCP.
        # (Shared memory meets through sealed records that raise when forged or missing; its own
        # failures, a full /dev/shm, still fall back with a warning.)
        backend.enable_local(False)
        said = "; ".join(f"rank {rank}: {why}" for rank, why in (forged or met_through_store))
        raise RuntimeError(f"hetcomm: the inner level of the hosts could not meet through the store ({said})")
    backend.enable_local(not failed)
    if failed and backend.rank() == 0 and not _fallback_said:
        _fallback_said = True
        rank, why = failed[0]
        print(f"[hetcomm WARN] the inner level of a host ({host}) cannot be used (rank {rank}: {why}); "
              f"the ranks of each host talk over TCP instead", file=sys.stderr, flush=True)
    return not failed
