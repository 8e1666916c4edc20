"""HETCOMM_TLS: every collective and point-to-point path over TLS, refused certificates on both
sides, settings that differ across ranks, links between sites only, and what a capture of the
wire shows (root only: a raw socket on a simulated rank's veth, and on loopback).
"""
from __future__ import annotations

import datetime
import io
import os
import socket
import sys
import threading
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import free_port, run_ranks
from values import assert_same, pattern
from marks import needs_netns
from simrun import assert_clean

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("HETCOMM_TLS is hetcomm's")]

PG_TIMEOUT_S = 30.0


def _require_tls() -> None:
    import hetcomm

    ok, why = hetcomm.tls_available()
    if not ok:
        pytest.skip(f"OpenSSL 3 cannot be loaded here ({why}): TLS is unavailable")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> str:
    import shutil

    from hetcomm import tls_certs

    _require_tls()
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command-line tool (to make test certificates) is not installed")
    directory = str(tmp_path_factory.mktemp("certs"))
    # rank0-3 name the loopback address the ranks of these tests listen on (for
    # HETCOMM_TLS_VERIFY_NAME=host); "elsewhere" is the CA's certificate of another host.
    hosts = {**{f"rank{r}": ["127.0.0.1"] for r in range(4)}, "elsewhere": ["10.9.9.9", "node-9.example"]}
    tls_certs.make(directory, [*hosts], rogue=True, hosts=hosts)
    return directory


def _init(rank: int, world_size: int, port: Optional[int], env: dict[str, str],
          pg_timeout: float = PG_TIMEOUT_S) -> None:
    os.environ.update(env)
    import hetcomm  # noqa: F401

    # port None: the store at MASTER_ADDR:MASTER_PORT, hosted by rank 0 (a simulated cluster's)
    host = "127.0.0.1" if port is not None else os.environ["MASTER_ADDR"]
    port = port if port is not None else int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("hetcomm", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))


def _tls_env(certs: str, name: str, mode: str = "all") -> dict[str, str]:
    from hetcomm import tls_certs

    return tls_certs.env_for(certs, name, mode)


def everything_over_tls(rank: int, world_size: int, port: int, certs: str) -> list:
    _init(rank, world_size, port, _tls_env(certs, f"rank{rank}"))
    for n in (1, 1000, 3_000_000):  # recursive doubling, and the ring in several segments
        t = pattern(n, torch.float32, rank)
        dist.all_reduce(t)
        expected = sum(pattern(n, torch.float32, r) for r in range(world_size))
        torch.testing.assert_close(t, expected)
    b = pattern(500_000, torch.float32, 2) if rank == 2 else torch.empty(500_000)
    dist.broadcast(b, src=2)
    assert_same(b, pattern(500_000, torch.float32, 2), "broadcast")
    # Point-to-point: a ring, then receives from any source.
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(200_000)
    send = dist.isend(pattern(200_000, torch.float32, rank, salt=1), dst=nxt)
    dist.recv(got, src=prv)
    send.wait()
    assert_same(got, pattern(200_000, torch.float32, prv, salt=1), "ring")
    # Rank 0 hosts the store (init=None: tcp://): none may leave while another may still look a
    # peer's address up there for its point-to-point connection (one fresh-clone run in five:
    # rank 0 was done and gone while rank 1 was still connecting to rank 2).
    dist.barrier()
    from hetcomm import backend_of

    return backend_of(dist.group.WORLD).link_security()


def test_every_operation_works_over_tls(certs) -> None:
    security = run_ranks(3, everything_over_tls, free_port(), certs, init=None, timeout=180)
    for rank, links in enumerate(security):
        connected = [s for peer, s in enumerate(links) if peer != rank and s >= 0]
        assert connected and all(s == 1 for s in connected), (rank, links)


def rogue_rank(rank: int, world_size: int, port: int, certs: str) -> str:
    try:
        _init(rank, world_size, port, _tls_env(certs, "rogue" if rank == 1 else f"rank{rank}"))
        dist.all_reduce(torch.ones(10))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return str(e)
    return ""


def test_a_peer_with_a_certificate_from_another_ca_is_refused_on_both_sides(certs) -> None:
    results = run_ranks(2, rogue_rank, free_port(), certs, init=None, timeout=180)
    # Rank 1 connects to rank 0: rank 0 rejects rank 1's certificate, rank 1 rejects rank 0's.
    for rank, message in enumerate(results):
        assert "certificate" in message, (rank, message)
        assert "TLS" in message, (rank, message)


def tls_on_one_rank_only(rank: int, world_size: int, port: int, certs: str) -> str:
    try:
        _init(rank, world_size, port, _tls_env(certs, f"rank{rank}") if rank == 0 else {})
        dist.all_reduce(torch.ones(10))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return ""


def test_tls_on_some_ranks_only_fails_with_an_error_naming_the_setting(certs) -> None:
    results = run_ranks(2, tls_on_one_rank_only, free_port(), certs, init=None, timeout=180)
    for rank, message in enumerate(results):
        assert "HETCOMM_TLS" in message, (rank, message)


def verified_host(rank: int, world_size: int, port: int, certs: str, misnamed: int) -> str:
    env = {**_tls_env(certs, "elsewhere" if rank == misnamed else f"rank{rank}"), "HETCOMM_TLS_VERIFY_NAME": "host"}
    try:
        # Short: when one rank fails at creation, the other waits for it until this timeout.
        _init(rank, world_size, port, env, pg_timeout=5.0)
        t = torch.full((10,), float(rank + 1))
        dist.all_reduce(t)
        return f"sum {t[0].item():g}"
    except Exception as e:  # noqa: BLE001 - the error is the result
        return str(e)


@pytest.mark.parametrize("misnamed", [None, 1], ids=["names-its-host", "names-another-host"])
def test_verify_name_host_takes_certificates_that_name_the_rank_s_address(certs, misnamed) -> None:
    """HETCOMM_TLS_VERIFY_NAME=host end to end: certificates whose subjectAltName has the ranks'
    address work; a rank given the certificate of another host (signed by the same CA) is told at
    group creation that its own certificate does not name its address. The check between ranks,
    against a rogue that skips its own, is acted out in tests/cpp/test_tcp_mesh.cc."""
    results = run_ranks(2, verified_host, free_port(), certs, -1 if misnamed is None else misnamed, init=None,
                        timeout=180)
    if misnamed is None:
        assert results == ["sum 3", "sum 3"]
    else:
        message = results[misnamed]
        assert "HETCOMM_TLS_VERIFY_NAME=host" in message and "own certificate" in message, message
        assert "does not name 127.0.0.1" in message and "CN=elsewhere" in message, message
        assert "sum" not in results[1 - misnamed], results  # its peer never came


def inter_site(rank: int, world_size: int, port: int, certs: str, declared_by: str) -> list:
    env = _tls_env(certs, f"rank{rank}", "inter-site")
    if declared_by == "HETCOMM_SITE":
        env["HETCOMM_SITE"] = "ab"[rank // 2]     # each rank its own: published in the store
    else:
        env["HETCOMM_SITES"] = "a,a,b,b"          # every rank every site: the store plays no part
    env["HETCOMM_LOCAL"] = "tcp"  # every link on TCP, so that every pair has a link to look at
    _init(rank, world_size, port, env)
    # Every pair talks: an allgather of large tensors runs a ring, the send/recv covers the rest.
    out = [torch.empty(100_000) for _ in range(world_size)]
    dist.all_gather(out, pattern(100_000, torch.float32, rank))
    for r in range(world_size):
        assert_same(out[r], pattern(100_000, torch.float32, r), f"from rank {r}")
    from hetcomm import backend_of

    return backend_of(dist.group.WORLD).link_security()


@pytest.mark.parametrize("declared_by", ["HETCOMM_SITE", "HETCOMM_SITES"])
def test_inter_site_encrypts_exactly_the_links_between_sites(certs, declared_by: str) -> None:
    security = run_ranks(4, inter_site, free_port(), certs, declared_by, init=None, timeout=240)
    seen = 0
    for rank, links in enumerate(security):
        for peer, state in enumerate(links):
            if peer == rank or state < 0:
                continue
            seen += 1
            assert state == (1 if rank // 2 != peer // 2 else 0), (rank, peer, links)
    assert seen >= 4, security


# --- What the wire shows -------------------------------------------------------------------------

MARKER = 0x5A17C0DE  # an int32 bit pattern that cannot come from anything but the payload


def _marker_tensor(n: int) -> torch.Tensor:
    return torch.full((n,), MARKER, dtype=torch.int32).view(torch.float32)


class _Capture:
    """The TCP payloads seen on one interface while active, except the c10d store's (which is not
    authenticated and carries the group secret: the README's security section says so). A raw
    AF_PACKET socket, made in the namespace the caller is in: root only."""

    def __init__(self, ifname: str, store_port: int) -> None:
        self.store_port = store_port
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))  # ETH_P_ALL
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)  # drop no frame while Python copies
        self.sock.bind((ifname, 0))
        self.sock.settimeout(0.2)
        self.payload = bytearray()
        self.frames = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tcp_payload(self, frame: bytes) -> bytes:
        ip = frame[14:]  # veths and loopback both carry an Ethernet header
        if len(ip) < 20:
            return b""
        if ip[0] >> 4 == 4 and ip[9] == 6:
            tcp = ip[(ip[0] & 15) * 4:]
        elif ip[0] >> 4 == 6 and len(ip) >= 40 and ip[6] == 6:
            tcp = ip[40:]
        else:
            return b""
        if len(tcp) < 20:
            return b""
        ports = (int.from_bytes(tcp[0:2], "big"), int.from_bytes(tcp[2:4], "big"))
        if self.store_port in ports:
            return b""
        return tcp[(tcp[12] >> 4) * 4:]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                frame = self.sock.recv(262144)
            except OSError:
                continue
            self.frames += 1
            self.payload += self._tcp_payload(frame)

    def close(self) -> bytes:
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return bytes(self.payload)


def send_marker(rank: int, world_size: int, port: Optional[int], certs: str, mode: str) -> bytes:
    _init(rank, world_size, port, {} if mode == "off" else _tls_env(certs, f"rank{rank}"))
    dist.all_reduce(_marker_tensor(4096), op=dist.ReduceOp.MAX)
    if rank == 0:
        dist.send(_marker_tensor(4096), dst=1)
    else:
        dist.recv(torch.empty(4096), src=0)
    dist.barrier()
    # The backend's keys live under torch's prefix for the device, in the group's store.
    group = dist.distributed_c10d._get_default_store()
    for store in (dist.PrefixStore("cpu/", group), group):
        if store.check(["hetcomm/secret"]):
            return bytes(store.get("hetcomm/secret"))
    raise AssertionError("the group secret is not in the store under the prefixes tried")


# One rank of a simulated cluster (python -m hetcomm.sim) per process: MASTER_ADDR/PORT and RANK
# come from the simulator; the secret goes to a file for the test to look for on the wire.
MARKER_RANK = r'''
import os, sys
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], os.pardir, "support")]
import test_tls
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
secret = test_tls.send_marker(rank, world, None, sys.argv[2], sys.argv[3])
with open(os.path.join(sys.argv[4], f"secret{rank}"), "wb") as f:
    f.write(secret)
'''


def _assert_wire(wire: bytes, secret: bytes, mode: str) -> None:
    marker = MARKER.to_bytes(4, "little") * 16
    assert len(secret) == 16, secret
    assert len(wire) > 4 * 4096, f"the capture saw {len(wire)} bytes of hetcomm traffic: it captured nothing useful"
    assert secret not in wire, "the group secret crossed a link"  # the handshake only proves knowledge of it
    if mode == "off":
        assert marker in wire, "no payload in the clear without TLS: the capture missed the links"
    else:
        assert marker not in wire, "a payload pattern crossed the wire in the clear with HETCOMM_TLS=all"


@needs_netns
@pytest.mark.parametrize("mode", ["off", "all"])
def test_a_capture_on_a_simulated_link_shows_neither_the_secret_nor_with_tls_the_payload(certs, mode, tmp_path) -> None:
    """A raw socket on rank 0's veth (its hub-side end) of a two-rank simulated cluster: everything
    rank 0 sends or receives, except the store's connections, which rank 0 hosts. (A capture on
    loopback did the same for HETCOMM_TLS=all and was dropped as a duplicate.)"""
    from hetcomm.sim import SimCluster, SimSpec

    script = tmp_path / "marker_rank.py"
    script.write_text(MARKER_RANK)
    with SimCluster(SimSpec(nic_mbit=[1000, 1000]), log=lambda s: None) as cluster:
        rid = cluster.run_id
        with cluster.netns("hub"):
            capture = _Capture(cluster.hub_ports[0], cluster.master_port)
        try:
            out, err = io.StringIO(), io.StringIO()
            status = cluster.run([sys.executable, str(script), os.path.dirname(__file__), certs, mode, str(tmp_path)],
                                 {"OMP_NUM_THREADS": "1"}, timeout_s=180, stdout=out, stderr=err)
        finally:
            wire = capture.close()
        assert status == 0, out.getvalue() + err.getvalue()
    assert_clean(rid)
    assert capture.frames > 0
    _assert_wire(wire, (tmp_path / "secret1").read_bytes(), mode)
