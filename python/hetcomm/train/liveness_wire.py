"""What travels on an elastic run's liveness connections, and where a worker listens (`Pulse`'s
helpers): the addresses workers publish and learn, and the reports in the answers to pings."""
from __future__ import annotations

import os
import re
import socket


_ADDRESS = re.compile(r"([0-9A-Za-z.:%_-]{1,255}):([0-9]{1,5})")


def _address(raw: bytes) -> tuple[str, int] | None:
    """``"host:port"`` (JSON) as a worker publishes it (`Pulse`), or None for anything else (a
    store writer's: read without a JSON parser, whose nesting could exhaust the stack)."""
    text = raw.decode("ascii", "replace") if len(raw) <= 300 else ""
    match = _ADDRESS.fullmatch(text[1:-1]) if len(text) > 2 and text[0] == text[-1] == '"' else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        return None
    return match.group(1), int(match.group(2))


_DIGEST = re.compile(rb"-|[0-9a-f]{16}")


def _report(raw: bytes) -> tuple[int, int, bytes, bool]:
    """A pong's ``era:epoch:digest:stalled`` (numbers of at most 18 digits; the digest of the
    decision held, 16 hex digits, or ``-``; 1 where the answering worker's store thread is
    stalled, else 0), or (0, 0, b"-", True)."""
    era, epoch, digest, stalled = raw.split(b":") if raw.count(b":") == 3 else (b"", b"", b"", b"")
    if not (era.isdigit() and epoch.isdigit() and len(era) <= 18 and len(epoch) <= 18 and _DIGEST.fullmatch(digest)
            and stalled in (b"0", b"1")):
        return 0, 0, b"-", True
    return int(era), int(epoch), digest, stalled == b"1"


def _local_ip(store_address: str) -> str:
    """The address other workers reach this one at: $HETCOMM_LISTEN_IP, else the local end of
    the route to the store ("" when there is none)."""
    if os.environ.get("HETCOMM_LISTEN_IP"):
        return os.environ["HETCOMM_LISTEN_IP"]
    host = store_address.rpartition(":")[0]
    if not host:
        return ""                                  # a store with no address (HashStore, FileStore)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return ""
