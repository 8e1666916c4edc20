"""A c10d store that lives outside the workers: ``python -m hetcomm.store --port 29400``.

The rendezvous store (a `torch.distributed.TCPStore`) is where ranks find each other and where
hetcomm keeps a group's addresses and secret. By default it lives inside a worker (the process of
rank 0, or torchrun's agent on the first node), so a worker that dies takes it along and every
other worker loses its rendezvous. For runs that must survive their workers (DiLoCo across sites,
elastic jobs), serve it from a process of its own on a machine that does not run workers::

    python -m hetcomm.store --port 29400                       # on the store's machine
    torchrun --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint STORE_HOST:29400 \\
        --rdzv-conf is_host=false ... train.py                 # on every worker machine

(``is_host=false``: torchrun's agents rendezvous through this store instead of hosting their own.)
Mind that torchrun (torch 2.13) then still serves the workers' *process-group* store from the first
node's agent (``TORCHELASTIC_USE_AGENT_STORE``): the rendezvous outlives node 0, the group's store
does not. For groups whose store outlives every worker, initialise torch.distributed yourself:
``dist.TCPStore(STORE_HOST, 29400, is_master=False)`` and ``init_process_group(..., store=...)``.

The store has no authentication and holds hetcomm's group secrets (see the README's security
section): it listens on every interface, whatever ``--host`` says, so keep its port behind a
firewall that admits only the job's machines.

What happens when the store dies: groups already formed keep working (collectives do not use it),
but every later store operation (a new group, a rendezvous, a key) raises
``torch.distributed.DistNetworkError`` (a RuntimeError: "Connection was likely closed. Did the
remote server shutdown or crash?") at once, or within the store's timeout when the store's machine
is unreachable; torchrun's agents stop the job; `hetcomm.ElasticDiLoCo` (which drops and
re-admits workers through this store) raises `StoreUnreachable` naming it on every worker. Restart
the store and the job from checkpoints (`hetcomm.DiLoCo.state_dict`, `ElasticDiLoCo.state_dict`).
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
