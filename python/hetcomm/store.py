"""A c10d store that lives outside the workers: ``python -m hetcomm.store --port 29400``.

The rendezvous store (a `torch.distributed.TCPStore`) holds a group's addresses and, unless
HETCOMM_SECRET_FILE or HETCOMM_SECRET is set (docs/security.md), its secret; by default it lives
inside a worker, which takes it along when it dies. Served from a process of its
own, on a machine that runs no worker, it outlives them (DiLoCo across sites, elastic jobs). It has
no authentication and listens on every interface, whatever ``--host`` says: firewall its port.

With torchrun (``--rdzv-conf is_host=false``), what happens when the store dies, and how to
restart: docs/diloco.md#a-store-outside-the-workers.
"""
from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading


def serve(host: str, port: int, *, timeout_s: float = 300.0, ready=None) -> None:
    """Serves a TCPStore on ``host:port`` (port 0: any free one) until SIGINT or SIGTERM.

    ``ready(port)`` is called once the store accepts connections."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready(store.port)
    while not stop.wait(1.0):
        pass
    del store


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hetcomm.store", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0", help="the store's address as printed for workers (TCPStore listens "
                                                     "on every interface whatever this says: firewall the port)")
    p.add_argument("--port", type=int, default=29400, help="TCP port (0: any free one, printed)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="the server's own timeout (clients set theirs in their TCPStore)")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in 0..65535, got {args.port}")

    def ready(port: int) -> None:
        print(f"hetcomm.store: serving a TCPStore on {args.host}:{port} (Ctrl-C or SIGTERM stops it)", flush=True)

    try:
        serve(args.host, args.port, timeout_s=args.timeout, ready=ready)
    except RuntimeError as e:               # e.g. the port is taken
        print(f"hetcomm.store: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
