"""The heartbeat of ElasticDiLoCo (`hetcomm.train.pulse.Pulse`, two threads) on its own, in one
process: whom it confirms alive, whom it takes for dead, and what it does not conclude from.

What is asserted is which path decided (a closed connection makes a worker infinitely silent at
once; the heartbeat only ever makes it finitely silent, for longer and longer), never how many
seconds it took: the tests wait for the watcher's own heartbeats (its counter in the store) to
know that its thread has had its turns, so a loaded machine only makes them take longer. The
waits' limits are there to end a hang, not to judge speed."""
from __future__ import annotations

import json
import math
import socket
import threading
import time

import pytest
import torch.distributed as dist

from hetcomm.train.membership import Keys, StoreUnreachable, connect
from hetcomm.train.pulse import Pulse
from waiting import until

INTERVAL = 0.2


def beats(keys: Keys, who: str, n: int = 3) -> None:
    """Waits until ``who``'s heartbeat thread has run ``n`` more times (its counter moved n)."""
    start = keys.counters([f"hb/{who}"])[0]
    until(lambda: keys.counters([f"hb/{who}"])[0] >= start + n)


@pytest.fixture(params=[None, b"s" * 32], ids=["plain", "sealed"])
def cluster(request):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client, address = connect(f"127.0.0.1:{server.port}", 10)
    pulses: list[Pulse] = []

    def keys() -> Keys:
        return Keys(dist.TCPStore("127.0.0.1", server.port, is_master=False), address, "t/", seal=request.param)

    def pulse(me: str, memory=None) -> Pulse:
        pulses.append(Pulse(keys(), me, INTERVAL, memory=memory))
        return pulses[-1]

    yield pulse, keys()
    for p in pulses:
        p.stop()


def test_a_watched_worker_is_confirmed_through_its_connection_and_dead_once_it_closes(cluster):
    pulse, keys = cluster
    a, b = pulse("a#1"), pulse("b#1")
    a.watch(["b#1"])
    until(lambda: a.confirmed("b#1"))
    beats(keys, "a#1")
    assert a.silent("b#1") < math.inf and a.confirmed("b#1")
    b.stop()                                   # its listener and connections close, as at death
    # Infinite silence comes only from the closed connection (the heartbeat path gives finite
    # values): the death was known from the connection, not waited out.
    until(lambda: math.isinf(a.silent("b#1")))
    assert not a.confirmed("b#1")
    a.check()


def test_a_stranger_on_the_address_is_not_taken_for_the_worker(cluster):
    """Strangers listen where watched workers' addresses lead. Without a secret one greets with
    another name. With a secret, where the worker must seal the watcher's challenge, one greets
    with the worker's bare name and one replays a greeting sealed for another challenge (before,
    the bare name counted). Without a secret the name is all a greeting has (docs/security.md)."""
    pulse, keys = cluster
    greetings = {"c#1": b"c#1\n", "g#1": b"g#1 " + keys.mac("pulse/g#1", b"0" * 64).hex().encode() + b"\n"} \
        if keys.sealed else {"c#1": b"x#9\n"}
    strangers = {}
    for name in greetings:
        strangers[name] = socket.create_server(("127.0.0.1", 0))
        keys.set(f"addr/{name}", "127.0.0.1:%d" % strangers[name].getsockname()[1])
        keys.set(f"hb/{name}", 1)
    a = pulse("a#1")
    a.watch(list(greetings))
    conns = []
    for name, greeting in greetings.items():
        conn, _ = strangers[name].accept()
        conn.settimeout(30)                    # (a guard against a hang)
        if keys.sealed:
            challenge = b""
            while not challenge.endswith(b"\n") and len(challenge) < 200:
                challenge += conn.recv(100) or b"!"     # (closed: fails below)
            assert len(challenge) == 130, challenge            # the challenge and its seal
        conn.sendall(greeting)
        conns.append(conn)
    beats(keys, "a#1")
    for name in greetings:
        assert not a.confirmed(name) and a.silent(name) < math.inf, name
    for conn in conns:
        conn.close()                           # and their going away proves nothing either
    beats(keys, "a#1")
    for name in greetings:
        assert a.silent(name) < math.inf
        strangers[name].close()


def test_a_refused_port_is_left_to_the_heartbeat(cluster):
    pulse, keys = cluster
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()                             # refuses from now on (a dead process, or a firewall's REJECT)
    keys.set("addr/d#1", f"127.0.0.1:{port}")
    keys.set("hb/d#1", 1)
    a = pulse("a#1")
    a.watch(["d#1"])
    beats(keys, "a#1")
    before = a.silent("d#1")
    beats(keys, "a#1")
    silent = a.silent("d#1")                   # the heartbeat's verdict: silent, longer and longer
    assert not a.confirmed("d#1") and before < silent < math.inf
    keys.set("hb/d#1", 2)                       # its heartbeat moves: alive after all
    until(lambda: a.confirmed("d#1"))
    assert a.silent("d#1") < silent             # and its silence starts over


def test_a_worker_that_publishes_no_address_is_judged_by_its_heartbeat(cluster):
    pulse, keys = cluster
    keys.set("addr/e#1", "")
    keys.set("hb/e#1", 1)
    a = pulse("a#1")
    a.watch(["e#1"])
    until(lambda: a.silent("e#1") > 4 * INTERVAL)
    assert not a.confirmed("e#1")


def test_keep_forgets_the_others_and_closes_their_connections(cluster):
    pulse, _ = cluster
    a = pulse("a#1")
    pulse("b#1"), pulse("c#1")
    a.watch(["b#1", "c#1"])
    until(lambda: a.confirmed("b#1") and a.confirmed("c#1"))
    a.keep(["c#1"])
    until(lambda: list(a._links) == ["c#1"])
    assert a.silent("b#1") == 0.0 and not a.confirmed("b#1")    # unwatched
    a.watch(["b#1"])                                            # watched again: judged afresh
    until(lambda: a.confirmed("b#1"))


@pytest.mark.parametrize("garbage", [b"\xff\x00junk", b"-1", b"9" * 40, b'"127.0.0.1:0"', b'["x"]',
                                     b"[" * 100000])
def test_garbage_a_store_writer_puts_under_the_heartbeat_keys_stops_nothing(cluster, garbage):
    """Under the watcher's own heartbeat (the store's `add` would fail on it and close the
    connection), a watched worker's heartbeat and its address: the thread goes on beating, and
    the worker without a usable address is judged by its heartbeat."""
    pulse, keys = cluster
    keys.set_bytes("hb/f#1", b"1")
    keys.set_bytes("addr/f#1", garbage)
    a = pulse("a#1")
    a.watch(["f#1"])
    keys.set_bytes("hb/a#1", garbage)
    keys.set_bytes("hb/f#1", garbage)
    beats(keys, "a#1")                          # (its counter is a number again: it overwrote it)
    a.check()
    assert not a._links                         # no connection to a garbage address
    keys.set_bytes("hb/f#1", b"7")              # a number again (garbage is never a baseline) ...
    beats(keys, "a#1", 2)
    keys.set_bytes("hb/f#1", b"8")              # ... and it moves: alive
    until(lambda: a.confirmed("f#1"))
    a.check()


def test_a_heartbeat_put_back_to_an_older_value_is_not_a_beat(cluster):
    """Seals are deterministic, so a store writer can put back an older authentic heartbeat: a
    counter moves only upwards. A dead worker's counter, replayed, does not confirm it."""
    pulse, keys = cluster
    keys.set_bytes("hb/f#1", b"5")
    keys.set_bytes("addr/f#1", b'""')            # no address: the heartbeat alone decides
    a = pulse("a#1")
    a.watch(["f#1"])
    beats(keys, "a#1")                            # it has read 5
    for old in (b"3", b"5", b"4"):
        keys.set_bytes("hb/f#1", old)
        beats(keys, "a#1", 2)
    assert not a.confirmed("f#1")
    keys.set_bytes("hb/f#1", b"6")
    until(lambda: a.confirmed("f#1"))


def test_a_dead_workers_old_heartbeats_replayed_to_a_new_watch_do_not_confirm_it(cluster):
    """A watch ends at each epoch for the workers that are not members (`keep`) and starts afresh
    when they are read again; a worker's next incarnation starts a new `Pulse`. A store writer who
    then puts back two of a dead joiner's old authentic values in order made the second read as a
    beat: confirmed, so an epoch admitted it (before). The highest value seen, and a verified
    connection that closed, outlive the watch and pass to the next incarnation."""
    pulse, keys = cluster
    a = pulse("a#1")
    keys.set_bytes("addr/f#1", b'""')            # no address: the heartbeat alone decides
    keys.set_bytes("hb/f#1", b"5")
    a.watch(["f#1"])
    beats(keys, "a#1")
    keys.set_bytes("hb/f#1", b"6")
    until(lambda: a.confirmed("f#1"))            # alive once: its counter moved to 6
    a.keep([])                                   # (an epoch it is not a member of)
    keys.set_bytes("hb/f#1", b"5")               # dead since; a store writer replays 5, then 6
    later = pulse("a#2", memory=a.memory())      # (and a's next incarnation)
    for p in (a, later):
        p.watch(["f#1"])
    beats(keys, "a#2")
    keys.set_bytes("hb/f#1", b"6")
    beats(keys, "a#1", 2)
    beats(keys, "a#2", 2)
    assert not a.confirmed("f#1") and not later.confirmed("f#1")
    keys.set_bytes("hb/f#1", b"7")               # a beat it never wrote before: a beat
    until(lambda: a.confirmed("f#1") and later.confirmed("f#1"))
    b = pulse("b#1")                             # a verified connection that closes: dead for good
    a.watch(["b#1"])
    until(lambda: a.linked("b#1"))
    b.stop()
    until(lambda: math.isinf(a.silent("b#1")))
    a.keep([])
    a.watch(["b#1"])
    assert math.isinf(a.silent("b#1")) and not a.confirmed("b#1")
    third = pulse("a#3", memory=a.memory())
    third.watch(["b#1"])
    assert math.isinf(third.silent("b#1"))


def freeze(p: Pulse, links: bool = True) -> threading.Event:
    """Stops ``p``'s heartbeat threads where they stand (the store's inside its beat, the links'
    at the top of its loop), its connections open, as a frozen process's; with ``links`` False
    only the store's (a store that takes that long to answer). Set the returned event to let them
    go on."""
    thaw = threading.Event()
    frozen = [threading.Event(), threading.Event()] if links else [threading.Event()]

    def stuck(i: int):
        def wait(*_) -> None:
            frozen[i].set()
            thaw.wait()
        return wait

    p._beat = stuck(0)
    if links:
        p._prune = stuck(1)
    until(lambda: all(f.is_set() for f in frozen))
    return thaw


def test_the_alarm_rings_once_for_a_frozen_worker_and_never_for_a_live_or_dead_one(cluster):
    """`Pulse.alarm` (a generation's watchdog): c beats, d dies (its connection closes: the
    collectives with it fail by themselves), b freezes (its heartbeat thread stops, its
    connections stay open). The callback runs once, for b; disarmed, it never runs."""
    pulse, keys = cluster
    a, b, d = pulse("a#1"), pulse("b#1"), pulse("d#1")
    pulse("c#1")
    a.watch(["b#1", "c#1", "d#1"])
    until(lambda: all(a.linked(w) for w in ("b#1", "c#1", "d#1")))
    rung, done = [], threading.Event()

    def ring(name, silent):
        rung.append((name, silent))
        done.set()

    a.alarm(["a#1", "b#1", "c#1", "d#1"], 30.0, ring)   # (negative checks: far from any slow beat)
    d.stop()
    until(lambda: math.isinf(a.silent("d#1")))
    beats(keys, "a#1", 5)
    assert rung == [], rung                              # the dead one does not ring it
    thaw = freeze(b)
    try:
        a.alarm(["b#1", "d#1"], 2 * INTERVAL, ring)
        until(done.is_set)
        assert [n for n, _ in rung] == ["b#1"] and 2 * INTERVAL < rung[0][1] < math.inf, rung
        beats(keys, "a#1", 5)
        assert len(rung) == 1, rung                      # once
        a.alarm(["b#1"], 2 * INTERVAL, ring)
        a.alarm(None, 0.0, None)                         # disarmed before a read: never
        beats(keys, "a#1", 5)
        assert len(rung) == 1, rung
    finally:
        thaw.set()


def test_a_store_writer_holding_a_counter_back_does_not_ring_the_alarm_while_the_link_answers(cluster):
    """A store writer puts b's heartbeat back to an old value as fast as it can: to a, b's counter
    never moves (its silence grows past the threshold). But b's heartbeat thread answers a's pings
    on their verified connection (sealed with a secret), so b is not silent: no alarm. Once b
    freezes, its link stops answering too, and the alarm rings."""
    pulse, keys = cluster
    a, b = pulse("a#1"), pulse("b#1")
    a.watch(["b#1"])
    until(lambda: a.linked("b#1"))
    rung = []
    writer = keys.clone()
    old = writer.peek_bytes("hb/b#1")
    stop = threading.Event()

    def hold():
        while not stop.is_set():
            writer.set_bytes("hb/b#1", old)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        until(lambda: a.silent("b#1") > 25 * INTERVAL)   # the store says b is silent...
        a.alarm(["b#1"], 20 * INTERVAL, lambda name, silent: rung.append(name))
        beats(keys, "a#1", 10)
        assert rung == [], rung                          # ...but its link answers
        thaw = freeze(b)
        try:
            until(lambda: rung == ["b#1"])
        finally:
            thaw.set()
    finally:
        stop.set()
        holder.join()


def test_silence_is_counted_to_the_last_read_not_to_now(cluster):
    """A watcher that stalls itself (its heartbeat thread not running: frozen, starved) must not
    take the others for silent: silence ends at its last read, and the next read after the stall
    sees that the counters moved."""
    pulse, keys = cluster
    a = pulse("a#1")
    pulse("b#1")
    a.watch(["b#1"])
    until(lambda: a.confirmed("b#1"))
    beats(keys, "a#1", 2)
    read = a._beat
    thaw = freeze(a)                                     # a's reads stop; b goes on beating
    before = a.silent("b#1")
    beats(keys, "b#1", 15)                               # 3 s at least, in which a reads nothing
    assert a.silent("b#1") == before                     # no read, no silence grown
    a._beat = read
    thaw.set()
    beats(keys, "a#1", 2)
    assert a.silent("b#1") < 15 * INTERVAL, a.silent("b#1")    # (not the stall: b beat in it)


def test_the_store_dying_is_raised_on_the_training_thread():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client, address = connect(f"127.0.0.1:{server.port}", 2)
    client.set_timeout(__import__("datetime").timedelta(seconds=2))
    a = Pulse(Keys(client, address, "t/"), "a#1", INTERVAL)
    a.check()
    del server                                 # the store's process is this one: its server stops
    with pytest.raises(StoreUnreachable, match=r"the store at 127\.0\.0\.1:\d+ failed"):
        until(lambda: a.check() or False)
    a.stop()


def _closed_by_peer(conn: socket.socket) -> bool:
    try:
        return conn.recv(100) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_flood_of_connections_to_the_liveness_port_is_bounded(cluster, monkeypatch):
    """Anyone who can reach a worker's liveness port may open connections to it. Beyond
    `WATCHERS` they are closed at once; with a secret, one that sends no sealed challenge within
    `GREETING` is closed too (and one whose challenge is not sealed at once) (before, every connection was kept for ever: enough of them ran
    the process out of file descriptors, and its store connections and groups with it)."""
    monkeypatch.setattr(Pulse, "WATCHERS", 3)
    monkeypatch.setattr(Pulse, "GREETING", 0.3)
    pulse, keys = cluster
    a = pulse("a#1")
    host, port = keys.peek("addr/a#1").rsplit(":", 1)
    flood = [socket.create_connection((host, int(port))) for _ in range(5)]
    for conn in flood:
        conn.settimeout(2 if keys.sealed else 0.5)   # (a guard against a hang)
    beats(keys, "a#1")
    if keys.sealed:
        flood[0].sendall(b"a" * 64 + b"\n")        # a challenge without the watcher's seal
    closed = [_closed_by_peer(conn) for conn in flood]
    # Without a secret the first three are watchers' connections, kept (the worker greets them);
    # with one, no challenge came: all are closed.
    assert closed == ([True] * 5 if keys.sealed else [False, False, False, True, True]), closed
    a.check()
    for conn in flood:
        conn.close()
    # The port still serves a watcher once the flood is gone.
    b = pulse("b#1")
    b.watch(["a#1"])
    until(lambda: b.confirmed("a#1") and b.linked("a#1"))


def test_a_pong_says_which_epoch_the_worker_holds_decided_and_a_forged_one_is_ignored(cluster):
    """b, a member of era 1 holding its epoch 5 decided, answers a's pings with era and epoch
    (`Pulse.reported`: the evidence an epoch was decided that a store writer who deletes its
    records cannot hide). With a secret the answer is sealed with the ping's nonce: a pong whose
    report is not the one sealed is not taken, and neither is a report for a nonce not asked.
    Without one, reports are not kept (anyone could give one)."""
    pulse, keys = cluster
    a, b = pulse("a#1"), pulse("b#1")
    b.member_of(1)
    b.hold("era1/latest", 5)
    a.watch(["b#1"])
    since = time.monotonic()
    until(lambda: a.answered_since("b#1", since))
    assert a.reported(1) == (5 if keys.sealed else 0) and a.reported(2) == 0
    assert a.holding("b#1") == ((1, 5, "-") if keys.sealed else None)    # (no decision's digest given)
    b.decided(1, 6, "0123456789abcdef")              # and which decision: `Epochs._check_no_rival`
    since = time.monotonic()
    until(lambda: a.answered_since("b#1", since))
    assert a.holding("b#1") == ((1, 6, "0123456789abcdef") if keys.sealed else None)
    assert a.reported(1) == (6 if keys.sealed else 0)
    b.member_of(0)                                   # left out of the era: it claims nothing more
    b.hold("era1/latest", 9)
    since = time.monotonic()
    until(lambda: a.answered_since("b#1", since))    # b answered a ping sent after that
    assert a.reported(1) == (6 if keys.sealed else 0) and a.holding("b#1") is None
    if not keys.sealed:
        return
    a.stop()                                         # (its thread no longer pings: _pings is ours)
    nonce = b"f" * 32
    sealed_five = keys.mac("pulse-pong/b#1", nonce + b" 1:5:-:0").hex().encode()
    a._pings["b#1"] = [(nonce, time.monotonic())]
    a._pong("b#1", b"!" + nonce + b" 1:7:-:0 " + sealed_five)     # the report changed: not taken
    a._pong("b#1", b"!" + b"e" * 32 + b" 1:8:-:0 "
            + keys.mac("pulse-pong/b#1", b"e" * 32 + b" 1:8:-:0").hex().encode())   # not asked
    assert a.reported(1) == 6
    a._pong("b#1", b"!" + nonce + b" 1:7:-:0 " + keys.mac("pulse-pong/b#1", nonce + b" 1:7:-:0").hex().encode())
    assert a.reported(1) == 7


def test_an_address_learnt_from_the_generation_is_used_where_the_store_misleads(cluster):
    """The store holds a wrong liveness address for b (a store writer's, kept there: here b itself
    publishes and puts back a refused port): a, watching b, makes no connection (the counter alone
    would decide, and a writer who also held it back could have b taken for dead). Once a learns
    b's address from another source (their generation's group: `Generation._share_liveness`), it
    connects and b's answers come."""
    pulse, keys = cluster
    a, b = pulse("a#1"), pulse("b#1")
    real, wrong = b.address, json.dumps("127.0.0.1:1").encode()
    own = b._keys.set_bytes                               # (b puts the wrong one back: what the store keeps saying)
    b._keys.set_bytes = lambda key, value: own(key, wrong if key == "addr/b#1" else value)
    keys.set_bytes("addr/b#1", wrong)
    a.watch(["b#1"])
    beats(keys, "a#1", 5)
    assert not a.linked("b#1")                           # (the control: misled, no connection)
    a.learn({"b#1": real, "c#1": b"not an address"})
    until(lambda: a.linked("b#1"))
    since = time.monotonic()
    until(lambda: a.answered_since("b#1", since))
    # What a learnt goes on to its next incarnation (and into a checkpoint: `memory`).
    assert a.memory()[2] == {"b#1": real}
    c = pulse("a#2", memory=a.memory())
    c.watch(["b#1"])
    until(lambda: c.linked("b#1"))


def test_a_relay_at_another_address_is_not_taken_for_the_worker(cluster):
    """a is given (as if its generation's group or the store said so) an address where a relay
    listens that forwards every byte to b and back. Without a secret the relay is taken for b (the
    control: the greeting is b's name). With one, b seals its own address into the greeting, and a
    dialled another: no link, and not taken for dead either."""
    pulse, keys = cluster
    a, b = pulse("a#1"), pulse("b#1")
    relay = socket.create_server(("127.0.0.1", 0))
    target = ("127.0.0.1", b._listener.getsockname()[1])
    stop = threading.Event()

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while not stop.is_set():
            try:
                data = src.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break

    def serve() -> None:
        relay.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = relay.accept()
                upstream = socket.create_connection(target)
            except socket.timeout:
                continue
            except OSError:
                break                                 # (closed: the test is over)
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pipe, args=(src, dst), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        a.learn({"b#1": json.dumps("127.0.0.1:%d" % relay.getsockname()[1]).encode()})
        a.watch(["b#1"])
        if not keys.sealed:
            until(lambda: a.linked("b#1"))           # the control: the relay passes for b
            return
        until(lambda: "b#1" in a._tried)             # (dialled: the greeting comes at once, and is refused)
        until(lambda: "b#1" not in a._links)
        assert not a.linked("b#1") and a.silent("b#1") < math.inf
    finally:
        stop.set()
        relay.close()


def test_a_worker_whose_address_was_never_read_is_not_reached(cluster):
    """`Pulse.reached`: whether an address of the worker was read from a source a store writer
    cannot forge (`Eras._era_alive` takes a member for dead only then): a deleted address is not
    read; a published one, or the record that it has none, or one learnt from a generation, is.
    Of these only the record that it has none lets its silence count (`Pulse.evidence`, for
    `Epochs._decide`): the others need a link made once (a refused connection is not enough: a
    firewall that rejects does the same)."""
    pulse, keys = cluster
    a = pulse("a#1")
    keys.set("hb/d#1", 1)                             # d: no address in the store
    keys.set("addr/e#1", "")                          # e: says it has none
    keys.set("hb/e#1", 1)
    keys.set("hb/f#1", 1)                             # f: learnt from a generation
    a.learn({"f#1": json.dumps("127.0.0.1:1").encode()})
    a.watch(["d#1", "e#1", "f#1"])
    beats(keys, "a#1", 3)
    assert not a.reached("d#1") and a.reached("e#1") and a.reached("f#1")
    keys.set("addr/d#1", "127.0.0.1:1")
    until(lambda: a.reached("d#1"), 30)               # (read at its next connection attempt)


def test_a_stalled_store_stops_no_answer(cluster):
    """b's store thread is stuck in a read (a slow store, or a store writer who put a huge value
    where b's heartbeat reads): its counter stops, but its link thread, which never waits for the
    store, still answers a's pings with the decision b holds (before, one thread did both: no
    answer came, and a worker waiting for b's fresh answer went on without it). Its answers say
    that its store is stalled, so they are no sign of life: b is quiet, as a worker cut off from
    the store is."""
    pulse, keys = cluster
    a, b = pulse("a#1"), pulse("b#1")
    b.member_of(1)
    a.watch(["b#1"])
    until(lambda: a.linked("b#1"))
    thaw = freeze(b, links=False)
    try:
        b.decided(1, 6, "0123456789abcdef")
        since = time.monotonic()
        until(lambda: a.answered_since("b#1", since))
        assert a.holding("b#1") == ((1, 6, "0123456789abcdef") if keys.sealed else None)
        until(lambda: a.quiet("b#1", 4 * INTERVAL))
        since = time.monotonic()
        until(lambda: a.answered_since("b#1", since))   # (it still answers)
        assert a.quiet("b#1", 4 * INTERVAL) and a.linked("b#1")
    finally:
        thaw.set()


def test_connections_that_never_greet_do_not_keep_a_watcher_out(cluster, monkeypatch):
    """Someone who reaches a's liveness port holds all its watcher slots with connections that send
    nothing. With a secret, b's connection takes the place of the oldest of them (it proves at
    once that it holds the secret; they never do), and b links. Without one (the control: every
    connection is a watcher the moment it opens) b is refused while the flood lasts."""
    monkeypatch.setattr(Pulse, "WATCHERS", 3)
    monkeypatch.setattr(Pulse, "GREETING", 600.0)  # (the flood is not closed for its silence meanwhile)
    pulse, keys = cluster
    a = pulse("a#1")
    host, port = keys.peek("addr/a#1").rsplit(":", 1)
    flood = [socket.create_connection((host, int(port))) for _ in range(3)]
    try:
        until(lambda: len(a._watchers) == 3)       # (a accepted them)
        b = pulse("b#1")
        b.watch(["a#1"])
        if keys.sealed:
            until(lambda: b.linked("a#1"))
        else:
            beats(keys, "b#1", 5)
            assert not b.linked("a#1")
    finally:
        for conn in flood:
            conn.close()
