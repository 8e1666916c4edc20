"""Who is in an elastic DiLoCo run: heartbeats, arrivals and decisions on a c10d store.

The store (`hetcomm.store`, a TCPStore served outside the workers) is the only thing the workers
share besides their process group, and the only place where they agree on membership. Keys,
under ``hetcomm/ft/<job>/``:

* ``era``: the job's current era (a whole-job restart from checkpoints starts a new one). The
  keys from ``joins`` on live under ``era<n>/``, as do ``g<gen>/``, the rendezvous of each
  generation's process group; ``hb/`` and ``addr/`` do not (they name incarnations, unique in every era).
* ``addr/<who>``: where its liveness listener accepts connections ("" when it found no address
  the others can reach: the heartbeat alone then decides).
* ``hb/<who>``: a counter its worker adds to every ``heartbeat`` seconds. Observers judge it by
  their own clock (when they last saw it change), so the machines' clocks need not agree.
* ``joins`` (a counter) and ``join/<i>``: the i-th registration of a worker that wants in (a new
  worker, a restarted one, or one dropped while it was alive), as JSON.
* ``leave/<who>``: a worker that finished its data and left in good order.
* ``e<e>/arrive/<who>``: a member reached synchronisation attempt ("epoch") e.
* ``e<e>/decision``: who takes part in epoch e, written once with compare_set: the first proposal
  wins and every worker reads the same one. Its members' ranks are their order in it.
* ``e<e>/done`` (a counter) and ``e<e>/outcome``: the two-phase end of an epoch (``commit`` once
  every member has the reduced update, else ``abort: why``; again the first writer wins).
* ``latest``: a recent epoch, where a joiner starts looking; ``ended``: the run is over.

``who`` is an incarnation, ``<worker_id>#<nonce>``: a worker restarted under the same id is a new
incarnation, so its heartbeat cannot keep its dead predecessor looking alive.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

_PREFIX = "hetcomm ElasticDiLoCo"


class StoreUnreachable(RuntimeError):
    """The job's c10d store cannot be reached (its process died, or its machine is unreachable)."""


def connect(store: str | dist.Store, timeout: float) -> tuple[dist.Store, str]:
    """A client of ``store`` ("host:port" or a torch.distributed Store) and its address for messages."""
    if isinstance(store, str):
        host, sep, port = store.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{_PREFIX}: store must be 'host:port' or a torch.distributed.Store, got {store!r}")
        try:
            client = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise StoreUnreachable(f"{_PREFIX}: cannot reach the store at {store}: {e}") from e
        return client, store
    if not isinstance(store, dist.Store):
        raise TypeError(f"{_PREFIX}: store must be 'host:port' or a torch.distributed.Store, "
                        f"got {type(store).__name__}")
    address = f"{store.host}:{store.port}" if isinstance(store, dist.TCPStore) else type(store).__name__
    return store, address


class Keys:
    """The job's keys on one store client; every store failure becomes StoreUnreachable naming it."""

    def __init__(self, store: dist.Store, address: str, root: str) -> None:
        self.store, self.address, self.root = store, address, root

    def clone(self) -> "Keys":
        """Another connection to the same store (a TCPStore client is one socket: threads each
        get their own)."""
        try:
            return Keys(self._call("connect", self.store.clone), self.address, self.root)
        except (AttributeError, NotImplementedError):
            return self           # a store without clone (HashStore in tests): share it

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:           # DistNetworkError, DistStoreError are RuntimeErrors
            raise StoreUnreachable(f"{_PREFIX}: the store at {self.address} failed ({what}): {e} -- is the store "
                                   "process (python -m hetcomm.store) still running and reachable?") from e

    def set(self, key: str, value) -> None:
        self._call(f"set {key}", self.store.set, self.root + key, _dump(value))

    def get(self, key: str):
        return json.loads(self._call(f"get {key}", self.store.get, self.root + key))

    def has(self, key: str) -> bool:
        return bool(self._call(f"check {key}", self.store.check, [self.root + key]))

    def add(self, key: str, n: int) -> int:
        return int(self._call(f"add {key}", self.store.add, self.root + key, n))

    def first(self, key: str, value):
        """compare_set from nothing: the value that is there afterwards (ours if we were first)."""
        return json.loads(self._call(f"compare_set {key}", self.store.compare_set, self.root + key, "", _dump(value)))

    def counters(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        values = self._call("multi_get heartbeats", self.store.multi_get, [self.root + k for k in keys])
        return [int(v) if v else 0 for v in values]

    def under(self, sub: str) -> "Keys":
        """The same connection, keys under ``sub/``."""
        return Keys(self.store, self.address, f"{self.root}{sub}/")

    def set_timeout(self, seconds: float) -> None:
        self.store.set_timeout(datetime.timedelta(seconds=seconds))


def _dump(value) -> str:
    return json.dumps(value, sort_keys=True)


_LISTENER = object()       # selector data of the listening socket (a watched link's is its name)


class Pulse:
    """This worker's heartbeat, and which of the workers it watches are alive.

    A thread of its own (on its own store connection) adds to ``hb/<me>`` every ``interval``
    seconds and reads the watched counters: a worker whose counter has not changed for a while is
    *silent* (dead, frozen or cut off). Besides, every worker listens on a TCP port of its own
    (``addr/<me>`` on the store) and keeps a connection open to each worker it watches: when a
    watched process dies, its kernel closes that connection and the death is known at once
    (``silent`` is then infinite) instead of after the heartbeat timeout; a machine that vanishes
    or a cut link closes nothing, and falls back to the heartbeat. Connections are attempted
    without blocking the heartbeat (one short try per worker, again every few seconds). Any
    failure of the thread (the store's above all) is kept and raised by `check` on the training
    thread: every worker names the store within about ``interval`` of its death (plus the store
    client's timeout when the store's machine is unreachable rather than its process dead).
    """

    RETRY = 5.0            # seconds between connection attempts to a worker not reached yet

    def __init__(self, keys: Keys, me: str, interval: float) -> None:
        self._keys, self._me, self._interval = keys, me, interval
        self._lock = threading.Lock()
        self._watch: dict[str, tuple[int, float]] = {}     # who -> (last value, when it changed)
        self._dead: set[str] = set()                       # their liveness connection closed
        self._links: dict[str, socket.socket] = {}         # our connections to the watched
        self._tried: dict[str, float] = {}                 # when we last tried to connect
        self._unwatched: list[socket.socket] = []          # links `keep` dropped, closed by the thread
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        ip = _local_ip(keys.address)
        self._listener = socket.create_server((ip or "0.0.0.0", 0))
        try:
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
            # No address published when none reachable was found: the heartbeat alone decides.
            self._keys.set(f"addr/{me}", "%s:%d" % (ip, self._listener.getsockname()[1]) if ip else "")
            self._keys.add(f"hb/{me}", 1)                  # the keys exist before anyone watches them
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._run, name="hetcomm-elastic-pulse", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_beat:
                    self._beat()
                    next_beat = time.monotonic() + self._interval
                self._close_unwatched()
                self._connect()
                wait = max(0.0, min(0.2, next_beat - time.monotonic()))
                for key, _ in self._selector.select(wait):
                    self._readable(key.fileobj, key.data)
        except Exception as e:  # noqa: BLE001 - kept for the training thread, which raises it
            self._error = e
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()
            self._selector.close()

    def _beat(self) -> None:
        self._keys.add(f"hb/{self._me}", 1)
        with self._lock:
            names = list(self._watch)
        values = self._keys.counters([f"hb/{n}" for n in names])
        now = time.monotonic()
        with self._lock:
            for name, value in zip(names, values):
                if name in self._watch and self._watch[name][0] != value:
                    self._watch[name] = (value, now)

    def _close_unwatched(self) -> None:
        # Only this thread touches the selector: `keep` (training thread) hands sockets over.
        with self._lock:
            socks, self._unwatched = self._unwatched, []
        for sock in socks:
            self._selector.unregister(sock)
            sock.close()

    def _connect(self) -> None:
        """One short attempt at a liveness connection to each watched worker that has none."""
        now = time.monotonic()
        with self._lock:
            todo = [n for n in self._watch if n not in self._dead and n not in self._links
                    and now - self._tried.get(n, -math.inf) >= self.RETRY]
        for name in todo:
            self._tried[name] = now
            address = self._keys.get(f"addr/{name}")
            if not address:
                continue                          # it published none: the heartbeat decides
            host, port = address.rsplit(":", 1)
            try:
                sock = socket.create_connection((host, int(port)), timeout=0.2)
            except ConnectionRefusedError:
                with self._lock:
                    self._dead.add(name)          # its machine answers, its port does not: gone
                continue
            except OSError:
                continue                          # unreachable for now: the heartbeat decides
            sock.setblocking(False)
            with self._lock:
                if name in self._watch:
                    self._links[name] = sock
                    self._selector.register(sock, selectors.EVENT_READ, name)
                    continue
            sock.close()

    def _readable(self, sock: socket.socket, name) -> None:
        if name is _LISTENER:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.setblocking(False)               # kept open (closed by the kernel when we die)
            self._selector.register(conn, selectors.EVENT_READ, None)
            return
        try:
            data = sock.recv(1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return
        with self._lock:                          # EOF or reset
            if name is not None and self._links.get(name) is not sock:
                return                            # no longer watched: `keep` handed it over
            self._selector.unregister(sock)
            sock.close()
            if name is not None:                  # the watched process is gone
                del self._links[name]
                self._dead.add(name)

    def watch(self, names) -> None:
        """Watch these incarnations (their keys exist); from now, unless watched already."""
        now = time.monotonic()
        with self._lock:
            for name in names:
                if name != self._me and name not in self._watch:
                    self._watch[name] = (-1, now)

    def keep(self, names) -> None:
        """Stop watching everyone but ``names`` (and close their liveness connections)."""
        keep = set(names)
        with self._lock:
            for name in [n for n in self._watch if n not in keep]:
                del self._watch[name]
                self._tried.pop(name, None)
                self._dead.discard(name)
                sock = self._links.pop(name, None)
                if sock is not None:
                    self._unwatched.append(sock)

    def silent(self, name: str) -> float:
        """Seconds since ``name``'s heartbeat last changed (0 for this worker or the unwatched;
        infinite once its liveness connection closed)."""
        with self._lock:
            if name in self._dead:
                return math.inf
            entry = self._watch.get(name)
        return 0.0 if entry is None else time.monotonic() - entry[1]

    def check(self) -> None:
        """Raises what stopped the thread (StoreUnreachable when the store failed)."""
        if self._error is not None:
            if isinstance(self._error, StoreUnreachable):
                raise self._error
            raise RuntimeError(f"{_PREFIX}: the heartbeat thread failed: {self._error!r}") from self._error
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"{_PREFIX}: the heartbeat thread stopped")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 5)


def _local_ip(store_address: str) -> str:
    """The address other workers reach this one at: $HETCOMM_LISTEN_IP, else the local end of
    the route to the store ("" when there is none)."""
    if os.environ.get("HETCOMM_LISTEN_IP"):
        return os.environ["HETCOMM_LISTEN_IP"]
    host = store_address.rpartition(":")[0] or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return ""
