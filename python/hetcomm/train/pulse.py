"""A worker's heartbeat in an elastic run (`Pulse`): a thread that counts ``hb/<me>`` up on the
store, reads the counters of the workers it watches, keeps a liveness connection to each (a
dead process's kernel closes it, so its death is known at once) and keeps the job's era key from
being set back (`Pulse.hold`). Split from `hetcomm.train.membership`, whose `Keys` it uses."""
from __future__ import annotations

import errno
import hmac
import json
import math
import os
import re
import selectors
import socket
import threading
import time

from hetcomm.train.membership import _PREFIX, Keys, StoreUnreachable


_ADDRESS = re.compile(r"([0-9A-Za-z.:%_-]{1,255}):([0-9]{1,5})")


def _address(raw: bytes) -> tuple[str, int] | None:
    """``"host:port"`` (JSON) as a worker publishes it (`Pulse`), or None for anything else (a
    store writer's: read without a JSON parser, whose nesting could exhaust the stack)."""
    text = raw.decode("ascii", "replace") if len(raw) <= 300 else ""
    match = _ADDRESS.fullmatch(text[1:-1]) if len(text) > 2 and text[0] == text[-1] == '"' else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        return None
    return match.group(1), int(match.group(2))


PROBE_SLOTS = 4            # `probe/<slot>` keys a member's heartbeat echoes
_LISTENER = object()       # selector data of the listening socket (a watched link's is its name)


class Pulse:
    """This worker's heartbeat, and which of the workers it watches are alive.

    A thread of its own (on its own store connection) counts ``hb/<me>`` up every ``interval``
    seconds and reads the watched counters: a worker whose counter has not changed for a while is
    *silent* (dead, frozen or cut off). Besides, every worker listens on a TCP port of its own
    (``addr/<me>`` on the store) and keeps a connection open to each worker it watches; the
    listener greets every connection with its incarnation's name, so a connection counts only
    once the right worker answered (a stranger on a reused port, or an address that leads to
    another machine, is not taken for it). When a watched process dies, its kernel closes that
    connection and the death is known at once (``silent`` is then infinite) instead of after the
    heartbeat timeout; a machine that vanishes, a cut link, a port that refuses (a firewall's
    REJECT looks the same as a dead process) or a worker never reached fall back to the
    heartbeat. Connections are made without blocking (the heartbeat never waits for one).
    A worker is *confirmed* alive once its connection answered or its counter changed while
    watched. Any failure of the thread (the store's above all) is kept and raised by `check` on
    the training thread: every worker names the store within about ``interval`` of its death
    (plus the store client's timeout when the store's machine is unreachable rather than its
    process dead).
    """

    RETRY = 5.0            # seconds between connection attempts to a worker not reached yet
    GREETING = 5.0         # seconds a connection may take to be established and greeted
    WATCHERS = 512         # connections of watchers kept at most (a flood beyond is refused)

    MEMORY = 4096          # incarnations whose highest heartbeat and death are remembered

    def __init__(self, keys: Keys, me: str, interval: float, memory: tuple[dict, dict] | None = None) -> None:
        self._keys, self._me, self._interval = keys, me, interval
        self._lock = threading.Lock()
        # What outlives a watch (`keep` ends it; a worker's next incarnation takes it over:
        # `memory`): each incarnation's highest heartbeat seen, and those whose verified connection
        # closed. A store writer who replays old sealed values to a fresh watch must not make a
        # dead worker look alive (from its highest value on, only a higher one is a beat).
        highest, gone, *known = memory or ({}, {})
        self._highest: dict[str, int] = dict(highest)
        self._gone: dict[str, int] = dict(gone)            # (a dict: the oldest is forgotten first)
        # Shared with the training thread (under the lock):
        self._watch: dict[str, tuple[int, float]] = {}     # who -> (last value, when it changed)
        self._dead: set[str] = set()                       # their verified connection closed
        self._confirmed: set[str] = set()                  # answered, or their counter moved
        self._linked: set[str] = set()                     # their liveness connection answered and is open
        self._held: dict[str, int] = {}                    # job key -> the number it is kept at, at least
        self._reports: dict[int, int] = {}                 # era -> the newest epoch a pong said decided
        # who -> its liveness address as its generation's group gave it (`learn`): no store
        # writer can forge or hide these; the store's `addr/<who>` only where none is known
        self._known: dict[str, bytes] = dict(known[0]) if known else {}
        self._error: Exception | None = None
        # The thread's own:
        self._links: dict[str, tuple[socket.socket, str, float, bytes]] = {}  # who -> sock, state, since, greeting
        self._tried: dict[str, float] = {}                 # when we last tried to connect
        self._challenges: dict[str, bytes] = {}            # who -> what we asked it to seal (a secret)
        self._asked: dict[socket.socket, bytes] = {}       # watchers' connections not answered yet
        self._watchers: dict[socket.socket, float] = {}    # watchers' connections -> since when
        self._member_of = 0                                # the era this worker is a member of (echoes)
        self._echoed: dict[int, bytes] = {}                # probe slot -> the nonce last echoed there
        self._read_at = time.monotonic()                   # when the watched counters were last read
        self._answered: dict[str, float] = {}              # who -> when its link last answered a ping
        self._drained_at = time.monotonic()                # when this thread last read its connections
        self._pings: dict[str, list[tuple[bytes, float]]] = {}   # who -> the last pings its link may answer, when sent
        self._fresh: dict[str, float] = {}                 # who -> when the newest ping it answered was sent
        self._heard: dict[socket.socket, bytes] = {}       # a watcher's connection -> its partial line
        # `alarm`: (names, seconds, callback) armed, fired at most once
        self._alarm: tuple[frozenset, float, object] | None = None
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        ip = _local_ip(keys.address)
        self._listener = socket.create_server((ip or "0.0.0.0", 0))
        try:
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
            # No address published when none reachable was found: the heartbeat alone decides.
            self._address = json.dumps("%s:%d" % (ip, self._listener.getsockname()[1]) if ip else "").encode()
            self._keys.set_bytes(f"addr/{me}", self._address)
            self._beats = 1
            self._keys.set(f"hb/{me}", self._beats)          # the keys exist before anyone watches them
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
                self._prune()
                self._connect()
                wait = max(0.0, min(0.2, next_beat - time.monotonic()))
                for key, events in self._selector.select(wait):
                    self._event(key.fileobj, key.data, events)
                with self._lock:
                    self._drained_at = time.monotonic()   # (answers that came before this are read)
        except Exception as e:  # noqa: BLE001 - kept for the training thread, which raises it
            self._error = e
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()
            self._selector.close()

    def _beat(self) -> None:
        # Set, not added: a store writer's garbage under the key would make the store's `add`
        # fail and close this connection; a set overwrites it.
        self._ping()
        self._beats += 1
        self._keys.set(f"hb/{self._me}", self._beats)
        with self._lock:
            names, held = list(self._watch), list(self._held.items())
        for key, n in held:
            self._keys.at_least(key, n, sealed=True)
        # A member keeps `era<n>/echo` there (the era has begun: nobody may write its first
        # decision again). A worker that asks whether an era is alive writes fresh nonces under
        # `probe/<slot>` (a slot of its own choosing, PROBE_SLOTS of them: several may ask at
        # once); every member's heartbeat copies each new one to `era<n>/echo/<slot>` (a
        # replayed heartbeat cannot). It puts its liveness address back if a store writer
        # removed it.
        era = self._member_of
        if era:
            if self._keys.peek_bytes(f"era{era}/echo") is None:
                self._keys.set_bytes(f"era{era}/echo", b"member")
            for slot in range(PROBE_SLOTS):
                probe = self._keys.peek_bytes(f"probe/{slot}")
                if probe is not None and len(probe) <= 64 and probe != self._echoed.get(slot):
                    self._keys.set_bytes(f"era{era}/echo/{slot}", probe)
                    self._echoed[slot] = probe
        if self._keys.peek_bytes(f"addr/{self._me}") != self._address:
            self._keys.set_bytes(f"addr/{self._me}", self._address)
        now = time.monotonic()                     # (the values are at least as new as the request)
        values = self._keys.counters([f"hb/{n}" for n in names])
        slow = time.monotonic() - now > self._interval
        with self._lock:
            for name, value in zip(names, values):
                entry = self._watch.get(name)
                # From the first number seen, only upwards: a store writer can put back an older
                # sealed value, or garbage (-2, never a baseline).
                if entry is not None and value > entry[0] and value >= 0:
                    if entry[0] != -1:
                        self._confirmed.add(name)         # it moved while we watched
                    self._watch[name] = (value, now)
                    self._remember(self._highest, name, value)
            self._read_at = now
        if not slow:                               # (a read that took that long: everyone would look silent)
            self._sound_alarm()

    def _ping(self) -> None:
        """Asks every verified link to answer (`_pong`): its answer in time shows that the
        worker's heartbeat thread runs, which the store's counter cannot prove when a store
        writer holds it back (with a secret the answer is sealed: nobody else can give it)."""
        for name, (sock, state, _, _) in list(self._links.items()):
            if state != "verified":
                continue
            nonce = os.urandom(16).hex().encode()
            try:
                if sock.send(b"?" + nonce + b"\n") != 34:
                    self._drop_link(name)             # (a line cut in two: not proof of death; made again)
                    continue
            except OSError:
                continue                              # (full: asked again next beat; a reset closes it: `_event`)
            self._pings[name] = (self._pings.get(name, []) + [(nonce, time.monotonic())])[-4:]   # (a slow answer still counts)

    def _pong(self, name: str, line: bytes) -> None:
        """A line from a verified link: the answer to one of the last pings (once), or ignored.
        It says which era's member the worker is and the newest epoch it holds decided there
        (`reported`), sealed with the nonce."""
        nonce, _, rest = line.removeprefix(b"!").partition(b" ")
        report, _, mac = rest.partition(b" ")
        asked = self._pings.get(name, [])
        which = next((i for i, (n, _) in enumerate(asked) if n == nonce), None)
        if line.startswith(b"!") and which is not None \
                and hmac.compare_digest(mac, self._keys.mac(f"pulse-pong/{name}", nonce + b" " + report).hex().encode()):
            sent = asked[which][1]
            self._pings[name] = asked[which + 1:]                  # (each answer counts once)
            era, epoch = _report(report)
            with self._lock:
                self._answered[name] = time.monotonic()
                self._fresh[name] = max(sent, self._fresh.get(name, sent))
                if era and self._keys.sealed:           # (unsealed, anyone could say anything: not kept)
                    self._reports[era] = max(epoch, self._reports.get(era, 0))

    def _sound_alarm(self) -> None:
        """After a read: the armed `alarm`'s callback, on a thread of its own (the heartbeat must
        not wait for it), when one of its workers is `quiet` too long."""
        with self._lock:
            armed = self._alarm
        if armed is None:
            return
        names, seconds, callback = armed
        # (not the dead: their connections closed, and so do the collectives with them)
        quiet = sorted((self.silent(n), n) for n in names if self.quiet(n, seconds) and not math.isinf(self.silent(n)))
        if not quiet:
            return
        with self._lock:
            if self._alarm is not armed:
                return                                    # (disarmed meanwhile)
            self._alarm = None
        silent, name = quiet[-1]
        threading.Thread(target=callback, args=(name, silent), name="hetcomm-elastic-alarm", daemon=True).start()

    def _drop_link(self, name: str) -> None:
        sock = self._links.pop(name)[0]
        self._challenges.pop(name, None)
        self._pings.pop(name, None)
        with self._lock:
            self._linked.discard(name)
            self._answered.pop(name, None)
            self._fresh.pop(name, None)
        self._selector.unregister(sock)
        sock.close()

    def _prune(self) -> None:
        """Closes links to workers no longer watched, and attempts that took too long."""
        now = time.monotonic()
        with self._lock:
            watched = set(self._watch)
        for name, (_, state, since, _) in list(self._links.items()):
            if name not in watched or (state != "verified" and now - since > self.GREETING):
                self._drop_link(name)
        for sock in [c for c in self._asked if now - self._watchers[c] > self.GREETING]:
            self._close_watcher(sock)             # no challenge in time: not a worker's watcher

    def _close_watcher(self, sock: socket.socket) -> None:
        self._asked.pop(sock, None)
        self._heard.pop(sock, None)
        self._watchers.pop(sock, None)
        self._selector.unregister(sock)
        sock.close()

    def _connect(self) -> None:
        """Starts a connection (without waiting for it) to each watched worker that has none."""
        now = time.monotonic()
        with self._lock:
            todo = [n for n in self._watch if n not in self._dead and n not in self._links
                    and now - self._tried.get(n, -math.inf) >= self.RETRY]
        for name in todo:
            self._tried[name] = now
            with self._lock:
                known = self._known.get(name)
            # (a get of a key not there waits for the store's timeout: the heartbeat would stop)
            raw = known or self._keys.peek_bytes(f"addr/{name}") or b""   # none, or not the worker's: the heartbeat decides
            address = _address(raw)
            if address is None:
                continue                          # none (or no address): the heartbeat decides
            try:
                # (numeric only: resolving a name a store writer chose could stall this thread)
                family, kind, proto, _, target = socket.getaddrinfo(*address, type=socket.SOCK_STREAM,
                                                                    flags=socket.AI_NUMERICHOST)[0]
                sock = socket.socket(family, kind, proto)
            except (OSError, UnicodeError):
                continue
            sock.setblocking(False)
            code = sock.connect_ex(target)
            if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                sock.close()                      # refused at once: the heartbeat decides
                continue
            self._links[name] = (sock, "connecting", now, b"")
            self._selector.register(sock, selectors.EVENT_WRITE, name)

    def _event(self, sock: socket.socket, name, events: int) -> None:
        if name is _LISTENER:
            try:
                conn, _ = sock.accept()
            except OSError:
                time.sleep(0.05)                  # out of descriptors (a flood): no busy loop
                return
            if len(self._watchers) >= self.WATCHERS:
                conn.close()                      # a flood: the watchers already here stay
                return
            try:
                conn.setblocking(False)           # kept open (closed by the kernel when we die)
                if self._keys.sealed:
                    self._asked[conn] = b""       # greeted once it sent its challenge
                else:
                    conn.send(f"{self._me}\n".encode())
            except OSError:
                conn.close()
                return
            self._selector.register(conn, selectors.EVENT_READ, None)
            self._watchers[conn] = time.monotonic()
            return
        if name is None:                          # a connection of a worker that watches us
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data and self._answer(sock, data):
                return
            self._close_watcher(sock)
            return
        entry = self._links.get(name)
        if entry is None or entry[0] is not sock:
            return
        _, state, since, greeting = entry
        if state == "connecting":
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._drop_link(name)             # refused or unreachable: the heartbeat decides
                return
            if self._keys.sealed:
                # With a secret, the worker proves who it is: it seals our challenge with its name
                # (a stranger that greets with the name, or replays a greeting, is not taken for it).
                self._challenges[name] = os.urandom(32).hex().encode()
                try:
                    # (sealed too: the worker keeps only watchers that hold the secret)
                    sock.send(self._challenges[name] + b" " + self._keys.mac("pulse-watcher", self._challenges[name]).hex().encode() + b"\n")
                except OSError:
                    self._drop_link(name)
                    return
            self._links[name] = (sock, "greeting", since, b"")
            self._selector.modify(sock, selectors.EVENT_READ, name)
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if state == "greeting":
            greeting += data
            if not data or b"\n" in greeting:
                if hmac.compare_digest(greeting.split(b"\n", 1)[0],
                                       self._greeting(name, self._challenges.get(name, b""))):
                    self._links[name] = (sock, "verified", since, b"")
                    with self._lock:
                        self._confirmed.add(name)
                        self._linked.add(name)
                        self._answered[name] = time.monotonic()
                else:
                    self._drop_link(name)         # closed early, or someone else: not proof of death
            elif len(greeting) > 1024:
                self._drop_link(name)
            else:
                self._links[name] = (sock, state, since, greeting)
            return
        if data:
            pending = greeting + data
            *lines, rest = pending.split(b"\n")
            for line in lines:
                self._pong(name, line)
            if len(rest) > 1024:
                self._drop_link(name)             # not a worker's answers (not proof of death either)
            else:
                self._links[name] = (sock, state, since, rest)
            return
        self._drop_link(name)                     # EOF or reset on a verified link: it is gone
        with self._lock:
            if name in self._watch:
                self._dead.add(name)
                self._remember(self._gone, name, 1)

    def _greeting(self, name: str, challenge: bytes) -> bytes:
        """What worker ``name`` greets a watcher with: its name, and with a secret the seal of the
        watcher's challenge under a key that names it."""
        mac = self._keys.mac(f"pulse/{name}", challenge)
        return name.encode() + (b" " + mac.hex().encode() if mac else b"")

    def _answer(self, sock: socket.socket, data: bytes) -> bool:
        """Data from a watcher: with a secret, its challenge first (answered once); then its pings
        (`_ping`): the newest of each read answered with its nonce, this worker's era and the newest
        epoch it holds decided there (``!nonce era:epoch mac``, sealed with a secret). False when
        the connection is to be closed (a challenge that is not one, a line too long)."""
        if sock not in self._asked:
            *lines, rest = (self._heard.pop(sock, b"") + data).split(b"\n")
            # (only the newest ping is answered: a watcher that floods gets one answer a read)
            nonce = next((line[1:] for line in reversed(lines) if line.startswith(b"?") and len(line) == 33), None)
            if nonce is not None:
                with self._lock:
                    era = self._member_of
                    epoch = self._held.get(f"era{era}/latest", 0) if era else 0
                report = b"%d:%d" % (era, epoch)
                try:
                    sock.send(b"!" + nonce + b" " + report + b" "
                              + self._keys.mac(f"pulse-pong/{self._me}", nonce + b" " + report).hex().encode() + b"\n")
                except BlockingIOError:
                    pass                              # (a watcher that does not read: it asks again)
                except OSError:
                    return False
            if len(rest) > 64:
                return False
            self._heard[sock] = rest
            return True
        got = self._asked.pop(sock) + data
        if b"\n" not in got:
            self._asked[sock] = got
            return len(got) <= 129
        challenge, _, mac = got.split(b"\n", 1)[0].partition(b" ")
        if len(challenge) != 64 or not hmac.compare_digest(mac, self._keys.mac("pulse-watcher", challenge).hex().encode()):
            return False                          # not a watcher that holds the secret
        try:
            sock.send(self._greeting(self._me, challenge) + b"\n")
        except OSError:
            return False
        return True

    def watch(self, names) -> None:
        """Watch these incarnations (their keys exist); from now, unless watched already."""
        now = time.monotonic()
        with self._lock:
            for name in names:
                if name != self._me and name not in self._watch:
                    self._watch[name] = (self._highest.get(name, -1), now)
                    if name in self._gone:
                        self._dead.add(name)

    def memory(self) -> tuple[dict, dict, dict]:
        """What this worker's next incarnation's `Pulse` takes over (``memory=``): the highest
        heartbeats, the deaths, and the liveness addresses learnt (`learn`)."""
        with self._lock:
            return dict(self._highest), dict(self._gone), dict(self._known)

    @classmethod
    def _remember(cls, memory: dict[str, int], name: str, value: int) -> None:
        """Keeps ``name`` at ``value`` at least (re-inserted: the newest), the oldest forgotten
        beyond MEMORY."""
        memory[name] = max(value, memory.pop(name, value))
        while len(memory) > cls.MEMORY:
            memory.pop(next(iter(memory)))

    def member_of(self, era: int) -> None:
        """From now on, answer probes (`_beat`) and pings (`_answer`: the era, and the newest epoch
        held decided there) as a member of ``era``; 0: of none."""
        with self._lock:
            if era != self._member_of:
                self._echoed = {}
            self._member_of = era

    def hold(self, key: str, n: int) -> None:
        """Keep the job's (sealed) number ``key`` at ``n`` at least, from the next beat on: a
        store writer who sets it back or deletes it sees it put back within a beat."""
        if n < 1:
            return                                # (nothing to hold: not joined yet)
        with self._lock:
            self._held[key] = max(n, self._held.get(key, n))

    def reported(self, era: int) -> int:
        """The newest epoch of ``era`` that a worker answering a ping said it holds decided (0:
        none). With a secret the answer is sealed under the ping's nonce: a store writer who
        deletes an epoch's records cannot hide it, nor can anyone replay it."""
        with self._lock:
            return self._reports.get(era, 0)

    def keep(self, names) -> None:
        """Stop watching everyone but ``names`` (the thread closes their connections)."""
        keep = set(names)
        with self._lock:
            for name in [n for n in self._watch if n not in keep]:
                del self._watch[name]
                self._dead.discard(name)
                self._confirmed.discard(name)

    def silent(self, name: str) -> float:
        """Seconds for which the reads of ``name``'s heartbeat saw no change: from when it last
        changed (or was first watched) to the last read, not to now, so that this process's own
        stall (frozen, or starved of the CPU) does not count as the others' silence. 0 for this
        worker or the unwatched; infinite once its liveness connection closed."""
        with self._lock:
            if name in self._dead:
                return math.inf
            entry, read_at = self._watch.get(name), self._read_at
        return 0.0 if entry is None else max(0.0, read_at - entry[1])

    def quiet(self, name: str, seconds: float) -> bool:
        """Whether ``name`` has given no sign of life for more than ``seconds``: silent on the store
        (`silent`) and, where its liveness connection is verified, without an answer to a ping
        for as long (a live worker whose counter a store writer holds back still answers; with a
        secret the answers are sealed). Dead: quiet."""
        if self.silent(name) <= seconds:
            return False
        with self._lock:
            answered = self._answered.get(name) if name in self._linked else None
            drained = self._drained_at
        # (to when this thread last read the connections: answers it has not read yet count)
        return answered is None or min(time.monotonic(), drained) - answered > seconds

    def alarm(self, names, seconds: float, callback) -> None:
        """Arms a one-shot alarm: ``callback(name, silent)`` runs (on a thread of its own) after
        the first read of the store (one that took less than a heartbeat: a stalled store makes
        everyone look silent) that finds one of ``names`` (watched, not dead) `quiet` for more
        than ``seconds``. ``names`` None disarms it."""
        with self._lock:
            self._alarm = None if names is None else (frozenset(names) - {self._me}, float(seconds), callback)

    @property
    def address(self) -> bytes:
        """This worker's liveness address as it publishes it (JSON ``"host:port"``; ``""`` when it
        found none reachable)."""
        return self._address

    def learn(self, addresses: dict[str, bytes]) -> None:
        """Liveness addresses of other workers from an authenticated source (their generation's
        process group, `Generation._share_liveness`): used before the store's from now on, so that
        a store writer who keeps the published ones deleted or forged no longer keeps this worker
        from connecting (and from the answers that say a member lives, or which epoch it holds
        decided). What does not parse as an address is ignored; at most MEMORY are kept."""
        with self._lock:
            for name, raw in addresses.items():
                if name != self._me and _address(raw) is not None:
                    self._known.pop(name, None)
                    self._known[name] = raw
            while len(self._known) > self.MEMORY:
                self._known.pop(next(iter(self._known)))

    def answered_since(self, name: str, since: float) -> bool:
        """Whether ``name`` answered a ping this thread sent at or after ``since`` (monotonic): its
        report (`reported`) is then no older than that."""
        with self._lock:
            return self._fresh.get(name, -math.inf) >= since

    def linked(self, name: str) -> bool:
        """Whether ``name``'s liveness connection answered (with a secret: proved who it is) and
        is open now: positive evidence that it lives, which no store writer can give."""
        with self._lock:
            return name in self._linked

    def confirmed(self, name: str) -> bool:
        """Whether ``name`` (watched) has shown it lives: its connection answered, or its
        heartbeat moved while watched. This worker itself always has."""
        with self._lock:
            return name == self._me or (name in self._confirmed and name not in self._dead)

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


def _report(raw: bytes) -> tuple[int, int]:
    """A pong's ``era:epoch`` (both at most 18 digits), or (0, 0)."""
    era, sep, epoch = raw.partition(b":")
    if not (sep and era.isdigit() and epoch.isdigit() and len(era) <= 18 and len(epoch) <= 18):
        return 0, 0
    return int(era), int(epoch)


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
