"""The link side of an elastic run's heartbeat (a mixin of `hetcomm.train.pulse.Pulse`, on a
thread of its own that never touches the store): the liveness connections to the watched workers
(made without blocking, greeted, pinged every heartbeat) and the answers to the watchers'
connections. Split from `pulse.py`, whose state it shares."""
from __future__ import annotations

import errno
import hmac
import math
import os
import selectors
import socket
import time

from hetcomm.train.liveness_wire import _address, _report

_LISTENER = object()       # selector data of the listening socket (a watched link's is its name)


class Links:
    """(uses `Pulse`'s state: see `Pulse.__init__`)"""

    def _run(self) -> None:
        """The link thread: connections, pings and answers; never the store."""
        next_ping = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_ping:
                    self._ping()
                    next_ping = time.monotonic() + self._interval
                self._prune()
                self._connect()
                wait = max(0.0, min(0.2, next_ping - time.monotonic()))
                for key, events in self._selector.select(wait):
                    self._event(key.fileobj, key.data, events)
                with self._lock:
                    self._drained_at = time.monotonic()   # (answers that came before this are read)
        except Exception as e:  # noqa: BLE001 - kept for the training thread, which raises it
            self._failed(e)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()
            self._selector.close()
            with self._lock:
                self._linked.clear()              # (nothing answers any more: no one waits on a link)

    def _ping(self) -> None:
        """Asks every verified link to answer (`_pong`): its answer in time shows that the
        worker's link thread runs, which the store's counter cannot prove when a store
        writer holds it back (with a secret the answer is sealed: nobody else can give it)."""
        for name, (sock, state, _, _) in list(self._links.items()):
            if state != "verified":
                continue
            nonce = os.urandom(16).hex().encode()
            now = time.monotonic()
            with self._lock:                               # (asked, even if it cannot take the line)
                asked = [t for t in self._asked_at.get(name, ()) if now - t <= 4 * self._interval + 10.0]
                self._asked_at[name] = asked + [now]
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
            era, epoch, digest, stalled = _report(report)
            with self._lock:
                if not stalled:                           # (else alive, but cut off from the store)
                    self._answered[name] = time.monotonic()
                if sent >= self._fresh.get(name, sent):
                    self._holding[name] = (era, epoch, digest)
                self._fresh[name] = max(sent, self._fresh.get(name, sent))
                if era and self._keys.sealed:           # (unsealed, anyone could say anything: not kept)
                    self._reports[era] = max(epoch, self._reports.get(era, 0))

    def _drop_link(self, name: str) -> None:
        sock = self._links.pop(name)[0]
        self._challenges.pop(name, None)
        self._dialled.pop(name, None)
        self._pings.pop(name, None)
        with self._lock:
            self._linked.discard(name)
            self._answered.pop(name, None)
            self._fresh.pop(name, None)
            self._holding.pop(name, None)
            self._asked_at.pop(name, None)
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
            with self._lock:
                raw = self._known.get(name) or self._stored.get(name)
            if raw is None:
                continue                          # (none read yet: the store thread reads it)
            self._tried[name] = now
            address = _address(raw)
            if address is None:
                continue                          # no address: the heartbeat decides
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
            self._dialled[name] = raw
            self._selector.register(sock, selectors.EVENT_WRITE, name)

    def _accept(self, sock: socket.socket) -> bool:
        """Takes one watcher's connection from the listener; False when none waits."""
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return False
        except OSError:
            time.sleep(0.05)                      # out of descriptors (a flood): no busy loop
            return False
        if len(self._watchers) >= self.WATCHERS:
            # A flood. With a secret, the oldest connection that has not proved it holds it
            # makes room (a watcher's challenge comes at once; a flood's never does), so that
            # connections that never greet cannot keep the workers from linking; the watchers
            # already here stay.
            oldest = min(self._asked, key=self._watchers.__getitem__, default=None)
            if oldest is None:
                conn.close()
                return True
            self._close_watcher(oldest)
        try:
            conn.setblocking(False)               # kept open (closed by the kernel when we die)
            if self._keys.sealed:
                self._asked[conn] = b""           # greeted once it sent its challenge
            else:
                conn.send(f"{self._me}\n".encode())
        except OSError:
            conn.close()
            return True
        self._selector.register(conn, selectors.EVENT_READ, None)
        self._watchers[conn] = time.monotonic()
        return True

    def _event(self, sock: socket.socket, name, events: int) -> None:
        if name is _LISTENER:
            # (a burst at a time: a flood must not keep the kernel's queue full between turns)
            for _ in range(64):
                if not self._accept(sock):
                    break
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
                                       self._greeting(name, self._challenges.get(name, b""),
                                                      self._dialled.get(name, b""))):
                    self._links[name] = (sock, "verified", since, b"")
                    with self._lock:
                        self._confirmed.add(name)
                        self._linked.add(name)
                        self._remember(self._evidence, name, 1)
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

    def _greeting(self, name: str, challenge: bytes, address: bytes) -> bytes:
        """What worker ``name`` greets a watcher with: its name, and with a secret the seal of the
        watcher's challenge and of its own liveness address under a key that names it (a watcher
        that dialled another address, one that relays to the worker, takes no link from it)."""
        mac = self._keys.mac(f"pulse/{name}", challenge + b" " + address)
        return name.encode() + (b" " + mac.hex().encode() if mac else b"")

    def _answer(self, sock: socket.socket, data: bytes) -> bool:
        """Data from a watcher: with a secret, its challenge first (answered once); then its pings
        (`_ping`): the newest of each read answered with its nonce, this worker's era, the newest
        epoch it holds decided there, that decision's digest, and whether its store thread is
        stalled (``!nonce era:epoch:digest:stalled mac``, sealed with a secret). False when the
        connection is to be closed (a challenge that is not one, a line too long)."""
        if sock not in self._asked:
            *lines, rest = (self._heard.pop(sock, b"") + data).split(b"\n")
            # (only the newest ping is answered: a watcher that floods gets one answer a read)
            nonce = next((line[1:] for line in reversed(lines) if line.startswith(b"?") and len(line) == 33), None)
            if nonce is not None:
                with self._lock:
                    era = self._member_of
                    epoch = self._held.get(f"era{era}/latest", 0) if era else 0
                    held, digest = self._digests.get(era, (0, b""))
                    # (no beat for two heartbeats and a second: cut off from the store, the worker
                    # answers what it holds, but not as a sign of life: `_pong`)
                    stalled = time.monotonic() - self._beat_done > 2 * self._interval + 1.0
                report = b"%d:%d:%s:%d" % (era, epoch, digest if held == epoch and digest else b"-", stalled)
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
            sock.send(self._greeting(self._me, challenge, self._address) + b"\n")
        except OSError:
            return False
        return True
