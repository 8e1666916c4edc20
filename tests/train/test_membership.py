"""The heartbeat thread of ElasticDiLoCo (`hetcomm.train.membership.Pulse`) on its own, in one
process: whom it confirms alive, whom it takes for dead, and what it does not conclude from."""
from __future__ import annotations

import math
import socket
import time

import pytest
import torch.distributed as dist

from hetcomm.train.membership import Keys, Pulse, StoreUnreachable, connect

INTERVAL = 0.2


def until(condition, seconds: float = 5.0) -> float:
    """Seconds it took ``condition`` to hold; fails after ``seconds``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > seconds:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
def cluster():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client, address = connect(f"127.0.0.1:{server.port}", 10)
    pulses: list[Pulse] = []

    def keys() -> Keys:
        return Keys(dist.TCPStore("127.0.0.1", server.port, is_master=False), address, "t/")

    def pulse(me: str) -> Pulse:
        pulses.append(Pulse(keys(), me, INTERVAL))
        return pulses[-1]

    yield pulse, keys()
    for p in pulses:
        p.stop()


def test_a_watched_worker_is_confirmed_through_its_connection_and_dead_once_it_closes(cluster):
    pulse, _ = cluster
    a, b = pulse("a#1"), pulse("b#1")
    a.watch(["b#1"])
    until(lambda: a.confirmed("b#1"), 2 * INTERVAL + 2)
    assert a.silent("b#1") < 2 * INTERVAL
    b.stop()                                   # its listener and connections close, as at death
    assert until(lambda: math.isinf(a.silent("b#1")), 2.0) < 1.0
    assert not a.confirmed("b#1")
    a.check()


def test_a_stranger_on_the_address_is_not_taken_for_the_worker(cluster):
    pulse, keys = cluster
    stranger = socket.create_server(("127.0.0.1", 0))
    keys.set("addr/c#1", "127.0.0.1:%d" % stranger.getsockname()[1])
    keys.add("hb/c#1", 1)
    a = pulse("a#1")
    a.watch(["c#1"])
    conn, _ = stranger.accept()
    conn.sendall(b"x#9\n")                      # someone else's greeting
    time.sleep(3 * INTERVAL)
    assert not a.confirmed("c#1") and a.silent("c#1") < math.inf
    conn.close()                               # and its going away proves nothing either
    time.sleep(3 * INTERVAL)
    assert a.silent("c#1") < math.inf
    stranger.close()


def test_a_refused_port_is_left_to_the_heartbeat(cluster):
    pulse, keys = cluster
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()                             # refuses from now on (a dead process, or a firewall's REJECT)
    keys.set("addr/d#1", f"127.0.0.1:{port}")
    keys.add("hb/d#1", 1)
    a = pulse("a#1")
    a.watch(["d#1"])
    time.sleep(5 * INTERVAL)
    assert not a.confirmed("d#1") and 4 * INTERVAL < a.silent("d#1") < math.inf
    keys.add("hb/d#1", 1)                       # its heartbeat moves: alive after all
    until(lambda: a.confirmed("d#1"), 3 * INTERVAL + 2)
    assert a.silent("d#1") < 2 * INTERVAL


def test_a_worker_that_publishes_no_address_is_judged_by_its_heartbeat(cluster):
    pulse, keys = cluster
    keys.set("addr/e#1", "")
    keys.add("hb/e#1", 1)
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
    until(lambda: list(a._links) == ["c#1"], 2.0)
    assert a.silent("b#1") == 0.0 and not a.confirmed("b#1")    # unwatched
    a.watch(["b#1"])                                            # watched again: judged afresh
    until(lambda: a.confirmed("b#1"))


def test_the_store_dying_is_raised_on_the_training_thread():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client, address = connect(f"127.0.0.1:{server.port}", 2)
    client.set_timeout(__import__("datetime").timedelta(seconds=2))
    a = Pulse(Keys(client, address, "t/"), "a#1", INTERVAL)
    a.check()
    del server                                 # the store's process is this one: its server stops
    with pytest.raises(StoreUnreachable, match=r"the store at 127\.0\.0\.1:\d+ failed"):
        until(lambda: a.check() or False, 10.0)
    a.stop()
