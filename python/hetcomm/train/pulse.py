"""A worker's heartbeat in an elastic run (`Pulse`): a thread that counts ``hb/<me>`` up on the
store, reads the counters of the workers it watches and keeps the job's era key from being set
back (`Pulse.hold`), and one that keeps a liveness connection to each watched worker (a dead
process's kernel closes it, so its death is known at once: `hetcomm.train.pulse_links`). Split
from `hetcomm.train.membership`, whose `Keys` it uses."""
from __future__ import annotations

import json
import math
import selectors
import socket
import threading
import time

from hetcomm.train.liveness_wire import _address, _local_ip
from hetcomm.train.pulse_links import _LISTENER, Links
from hetcomm.train.membership import _PREFIX, Keys, StoreUnreachable


PROBE_SLOTS = 4            # `probe/<slot>` keys a member's heartbeat echoes


class Pulse(Links):
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
    heartbeat. The connections have a thread of their own that never waits for the store (nor
    for a connection: they are made without blocking), so that a slow store, or a store writer
    who makes its reads slow, delays no answer.
    A worker is *confirmed* alive once its connection answered or its counter changed while
    watched. Any failure of either thread (the store's above all) is kept and raised by `check` on
    the training thread: every worker names the store within about ``interval`` of its death
    (plus the store client's timeout when the store's machine is unreachable rather than its
    process dead).
    """

    RETRY = 5.0            # seconds between connection attempts to a worker not reached yet
    GREETING = 5.0         # seconds a connection may take to be established and greeted
    WATCHERS = 512         # connections of watchers kept at most (beyond: `Links._accept`)

    MEMORY = 4096          # incarnations whose highest heartbeat and death are remembered
    CHURN = 5              # heartbeats in a row the era key may have to be put back

    def __init__(self, keys: Keys, me: str, interval: float, memory: tuple[dict, ...] | None = None) -> None:
        self._keys, self._me, self._interval = keys, me, interval
        self._lock = threading.Lock()
        # What outlives a watch (`keep` ends it; a worker's next incarnation takes it over:
        # `memory`): each incarnation's highest heartbeat seen, and those whose verified connection
        # closed. A store writer who replays old sealed values to a fresh watch must not make a
        # dead worker look alive (from its highest value on, only a higher one is a beat).
        highest, gone, *rest = memory or ({}, {})
        self._highest: dict[str, int] = dict(highest)
        self._gone: dict[str, int] = dict(gone)            # (a dict: the oldest is forgotten first)
        # Shared by the threads (the training thread's, the store thread's, the link thread's):
        # under the lock.
        self._watch: dict[str, tuple[int, float]] = {}     # who -> (last value, when it changed)
        self._dead: set[str] = set()                       # their verified connection closed
        self._confirmed: set[str] = set()                  # answered, or their counter moved
        self._linked: set[str] = set()                     # their liveness connection answered and is open
        self._held: dict[str, int] = {}                    # job key -> the number it is kept at, at least
        self._reports: dict[int, int] = {}                 # era -> the newest epoch a pong said decided
        self._holding: dict[str, tuple[int, int, bytes]] = {}   # who -> era, epoch, decision digest its newest pong said
        self._digests: dict[int, tuple[int, bytes]] = {}  # era -> epoch held decided here and its decision's digest
        # who -> 1 once this worker read its liveness address authentically (learnt, or from the
        # store, sealed; also "none"): a worker it never could is no evidence of death (`reached`)
        self._reached: dict[str, int] = {}
        # who -> 1 once its silence can count (`evidence`): its link was verified once, or it has
        # no address (also from an earlier incarnation: `memory`)
        self._evidence: dict[str, int] = dict(rest[1]) if len(rest) > 1 else {}
        # who -> its liveness address as its generation's group gave it (`learn`): no store
        # writer can forge or hide these; the store's `addr/<who>` only where none is known
        self._known: dict[str, bytes] = dict(rest[0]) if rest else {}
        self._stored: dict[str, bytes] = {}                # who -> its address as the store had it (sealed)
        self._asked_at: dict[str, list[float]] = {}        # who -> when its link was asked (recent)
        self._answered: dict[str, float] = {}              # who -> when its link last answered a ping
        self._fresh: dict[str, float] = {}                 # who -> when the newest ping it answered was sent
        self._member_of = 0                                # the era this worker is a member of (echoes)
        self._later_era = 0                                # a later era the job's `era` key named (sealed)
        self._era_set_back = 0                             # beats in a row the era key had to be put back, or could not
        self._read_at = time.monotonic()                   # when the watched counters were last read
        self._drained_at = time.monotonic()                # when the link thread last read its connections
        self._beat_done = time.monotonic()                 # when the store thread last ended a beat
        self._error: Exception | None = None               # the first failure of either thread
        # The store thread's own (`_run_store`; it has `_keys`' connection):
        self._address_read: dict[str, float] = {}          # who -> when it last read its address
        self._echoed: dict[int, bytes] = {}                # probe slot -> the nonce last echoed there
        # The link thread's own (`_run`, `hetcomm.train.pulse_links`; never the store):
        self._links: dict[str, tuple[socket.socket, str, float, bytes]] = {}  # who -> sock, state, since, greeting
        self._dialled: dict[str, bytes] = {}               # who -> the address its link was dialled at
        self._tried: dict[str, float] = {}                 # when we last tried to connect
        self._challenges: dict[str, bytes] = {}            # who -> what we asked it to seal (a secret)
        self._asked: dict[socket.socket, bytes] = {}       # watchers' connections not answered yet
        self._watchers: dict[socket.socket, float] = {}    # watchers' connections -> since when
        self._pings: dict[str, list[tuple[bytes, float]]] = {}   # who -> the last pings its link may answer, when sent
        self._heard: dict[socket.socket, bytes] = {}       # a watcher's connection -> its partial line
        # `alarm`: (names, seconds, callback) armed, fired at most once
        self._alarm: tuple[frozenset, float, object] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()                     # (the store thread: new workers watched, or stop)
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
        # Two threads: the links (pings and answers) never wait for the store, so that a store
        # that is slow, or a store writer who makes its reads slow (huge values), stalls no answer.
        self._thread = threading.Thread(target=self._run, name="hetcomm-elastic-pulse", daemon=True)
        self._store_thread = threading.Thread(target=self._run_store, name="hetcomm-elastic-beat", daemon=True)
        self._thread.start()
        self._store_thread.start()

    def _run_store(self) -> None:
        """The store thread: the heartbeat, the watched counters, the held keys, the addresses."""
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_beat:
                    self._beat()
                    with self._lock:
                        self._beat_done = time.monotonic()
                    next_beat = time.monotonic() + self._interval
                if self._stop.is_set():
                    break                          # (stopped while a store call took its time)
                # (the addresses of workers watched from now on at once, not at the next beat:
                # their links, and so their admission, wait for them)
                self._read_addresses()
                self._wake.wait(max(0.0, next_beat - time.monotonic()))
                self._wake.clear()
        except Exception as e:  # noqa: BLE001 - kept for the training thread, which raises it
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        """Keeps the first failure of either thread (`check` raises it)."""
        with self._lock:
            if self._error is None:
                self._error = e

    def _read_addresses(self) -> None:
        """Reads the store's address of each watched worker the link thread has none for (every
        RETRY seconds at most)."""
        now = time.monotonic()
        with self._lock:
            todo = [n for n in self._watch if n not in self._dead and n not in self._linked and n not in self._known
                    and now - self._address_read.get(n, -math.inf) >= self.RETRY]
        for name in todo:
            self._address_read[name] = now
            # (a get of a key not there waits for the store's timeout: the heartbeat would stop)
            raw = self._keys.peek_bytes(f"addr/{name}")
            if raw is not None:
                with self._lock:
                    self._stored[name] = raw
                    self._remember(self._reached, name, 1)
                    if raw == b'""':                  # (it has none: its counter decides)
                        self._remember(self._evidence, name, 1)
        with self._lock:
            while len(self._stored) > self.MEMORY:
                self._stored.pop(next(iter(self._stored)))
        while len(self._address_read) > self.MEMORY:
            self._address_read.pop(next(iter(self._address_read)))

    def _beat(self) -> None:
        # Set, not added: a store writer's garbage under the key would make the store's `add`
        # fail and close this connection; a set overwrites it.
        self._beats += 1
        self._keys.set(f"hb/{self._me}", self._beats)
        with self._lock:
            names, held = list(self._watch), list(self._held.items())
        for key, n in held:
            done = self._keys.at_least(key, n, sealed=True)
            if key == "era":
                # (`check`: a member stops where a later era began, or where it must put the key
                # back, or cannot, beat after beat: the job's workers write it only when an era
                # begins, and someone who keeps setting it back, or churns it, would hide a later
                # era from this one's members)
                with self._lock:
                    self._era_set_back = 0 if done is not None and not done[1] else self._era_set_back + 1
                    if done is not None and done[0] > n:
                        self._later_era = max(done[0], self._later_era)
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
        if not slow and not self._stop.is_set():   # (a read that took that long: everyone would look silent)
            self._sound_alarm()

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

    def watch(self, names) -> None:
        """Watch these incarnations (their keys exist); from now, unless watched already."""
        now = time.monotonic()
        with self._lock:
            for name in names:
                if name != self._me and name not in self._watch:
                    self._watch[name] = (self._highest.get(name, -1), now)
                    if name in self._gone:
                        self._dead.add(name)
                    self._wake.set()

    def memory(self) -> tuple[dict, dict, dict, dict]:
        """What this worker's next incarnation's `Pulse` takes over (``memory=``): the highest
        heartbeats, the deaths, the liveness addresses learnt (`learn`), and whose silence can
        count (`evidence`)."""
        with self._lock:
            return dict(self._highest), dict(self._gone), dict(self._known), dict(self._evidence)

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

    def decided(self, era: int, epoch: int, digest: str) -> None:
        """This worker holds epoch ``epoch`` of ``era`` decided, by the decision whose digest is
        ``digest`` (`hold` of ``era<n>/latest`` too): its answers to pings say so from now on, so
        that a worker that holds another decision of the same epoch learns of it
        (`Epochs._check_no_rival`)."""
        key = f"era{era}/latest"
        with self._lock:                          # (one step: no answer says the epoch without its digest)
            if epoch >= 1:
                self._held[key] = max(epoch, self._held.get(key, epoch))
            if epoch >= self._digests.get(era, (0, b""))[0]:
                self._digests = {era: (epoch, digest.encode("ascii")[:16])}

    def holding(self, name: str) -> tuple[int, int, str] | None:
        """What ``name``'s newest sealed answer said it holds decided: its era, the epoch and the
        decision's digest (``"-"``: none said); None without one (or without a secret)."""
        with self._lock:
            held = self._holding.get(name) if self._keys.sealed else None
        return None if held is None or not held[0] else (held[0], held[1], held[2].decode("ascii"))

    def reached(self, name: str) -> bool:
        """Whether this worker read ``name``'s liveness address from a source a store writer
        cannot forge (its generation's group, a checkpoint, or the store's sealed record; also
        the record that it has none). Where it never could, its silence on the store is no
        evidence that it is gone: a store writer who keeps the address deleted and the counter
        held back would have it taken for dead."""
        with self._lock:
            return name in self._reached or name in self._known or name in self._evidence

    def evidence(self, name: str) -> bool:
        """Whether ``name``'s silence on the store can be taken for its absence: its liveness link
        was verified once (then its pings go unanswered: a store writer cannot stop them), it
        closed (dead), or it has no address (only the counter can tell). Not where no link could
        ever be made (nor where its port refused: a firewall that rejects does so too): a store
        writer who also holds its counter back could then have it taken for dead while it lives."""
        with self._lock:
            return name in self._evidence or name in self._dead or name in self._gone

    def unanswered_since(self, name: str, since: float, grace: float) -> bool:
        """Whether ``name``'s link was asked at or after ``since`` and the link thread has read its
        connections ``grace`` seconds after that first ask without an answer to a ping sent from
        ``since`` on (False while it may still answer; an answer that came while this process was
        frozen is read before the time it was read at counts)."""
        with self._lock:
            first = next((t for t in self._asked_at.get(name, ()) if t >= since), None)
            return first is not None and self._drained_at - first >= grace \
                and self._fresh.get(name, -math.inf) < since

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
        # (to when the link thread last read the connections: answers it has not read yet count)
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
                if name != self._me and (_address(raw) is not None or raw == b'""'):
                    self._known.pop(name, None)
                    self._known[name] = raw
                    if raw == b'""':              # (it has none: its counter decides)
                        self._remember(self._evidence, name, 1)
            while len(self._known) > self.MEMORY:
                self._known.pop(next(iter(self._known)))

    def answered_since(self, name: str, since: float) -> bool:
        """Whether ``name`` answered a ping the link thread sent at or after ``since`` (monotonic): its
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
        """Raises what stopped the thread (StoreUnreachable when the store failed), and a
        RuntimeError once the job's ``era`` key named a later era than the one this worker is a
        member of: a worker restarted from a checkpoint took the era for dead and started the
        next, and both going on would fork the run."""
        with self._lock:
            member_of, later, set_back = self._member_of, self._later_era, self._era_set_back
        if member_of and later > member_of:
            raise RuntimeError(f"{_PREFIX}: era {later} of the job began while this worker is a member of era "
                               f"{member_of}: a worker restarted from a checkpoint took this era for dead (its "
                               "members unreachable from it, or a store writer deleted the era's records). Stopping, "
                               "since both eras going on would fork the run: start this worker again (with its "
                               "checkpoint, if it has one): it joins the later era")
        if member_of and set_back >= self.CHURN:
            raise RuntimeError(f"{_PREFIX}: the job's era key had to be put back, or could not be, on {set_back} "
                               "heartbeats in a row: someone without the secret keeps writing it (it could hide a "
                               "later era from this one). Stopping: check the store's access")
        if self._error is not None:
            if isinstance(self._error, StoreUnreachable):
                raise self._error
            raise RuntimeError(f"{_PREFIX}: a heartbeat thread failed: {self._error!r}") from self._error
        if not (self._thread.is_alive() and self._store_thread.is_alive()) and not self._stop.is_set():
            raise RuntimeError(f"{_PREFIX}: a heartbeat thread stopped")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2 * self._interval + 5)
        self._store_thread.join(timeout=2 * self._interval + 5)
