"""hetcomm.stats: per-peer traffic counters, held to what the algorithms must move.

* A ring allreduce of N elements sends exactly one collective header plus (2N - o_i - o_{i+1})
  elements on the link from ring position i to i+1 (ring_schedule.h derives it), and nothing to
  any other peer: checked byte for byte on 2 and 3 ranks, under uniform shares and under a plan
  with another order and unequal shares, on the host pipeline and (HETCOMM_DEBUG_EMULATE_DEVICE)
  on the staged one.
* What rank a counts as sent to b, b counts as received from a (cumulative totals, creation
  included).
* The collective count grows by exactly the operations issued; their time grows with every
  operation and includes waiting for a late peer. Point-to-point messages count once each, with
  their header; collectives leave them alone and they leave the collective count alone.
* A subgroup has counters of its own, indexed by group rank, with its global ranks in ``peers``;
  a gloo group is refused with a message that says so.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hetcomm import planner
from marks import hetcomm_only
from harness import default_store, run_ranks
from values import exact_counts

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("hetcomm.stats")]

# csrc/transport/framing.h: CollectiveHeader::kBytes, P2PHeader::kBytes.
COLLECTIVE_HEADER_BYTES = 40
P2P_HEADER_BYTES = 24
# float32: 480 KB, above the 32 KB recursive-doubling limit (the ring runs); every share the
# plans below give divides it (values.exact_counts).
NUMEL = 120_000
NUMEL_ODD = 120_007  # prime: no share divides it
LATE_S = 0.3
KEYS = {"rank", "world_size", "peers", "bytes_sent", "bytes_received", "collectives", "collective_seconds",
        "p2p_sent_messages", "p2p_received_messages", "collectives_by_path", "shared_memory_bytes",
        "collectives_on_caller_thread", "p2p_links"}


def ring_link_bytes(numel: int, element_size: int, order: list[int], shares: list[float], counts=exact_counts) -> dict:
    """{(sender, receiver): bytes} of one ring allreduce over the plan (order, shares)."""
    p = len(order)
    counts = counts(numel, [shares[order[pos]] for pos in range(p)])
    return {(order[i], order[(i + 1) % p]):
            COLLECTIVE_HEADER_BYTES + element_size * (2 * numel - counts[i] - counts[(i + 1) % p])
            for i in range(p)}


def delta(after: dict, before: dict) -> dict:
    out = {}
    for key in ("bytes_sent", "bytes_received"):
        out[key] = [a - b for a, b in zip(after[key], before[key])]
    for key in ("collectives", "collective_seconds", "p2p_sent_messages", "p2p_received_messages"):
        out[key] = after[key] - before[key]
    return out


def _fence(name: str, rank: int, world_size: int) -> None:
    """Every rank reaches this point before any leaves it, through the store (no hetcomm traffic)."""
    store = default_store()
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(world_size)])


def _fenced_delta(name: str, rank: int, world_size: int, run) -> dict:
    """The counters' change over run() on this rank. The point-to-point engine reads incoming
    messages as soon as they arrive, so an interval is only this operation's when no rank starts
    it before every rank has its first snapshot, nor starts the next one before every rank has
    its second."""
    import hetcomm

    before = hetcomm.stats()
    _fence(f"{name}/start", rank, world_size)
    run()
    after = hetcomm.stats()
    _fence(f"{name}/end", rank, world_size)
    return delta(after, before)


def _traffic(rank: int, world_size: int, plans: list, extras: bool) -> dict:
    import hetcomm

    out = {"start": hetcomm.stats(), "allreduce": []}
    for plan in plans:  # None: the plan the group was created with; else (order, shares, numel)
        numel = NUMEL
        if plan is not None:
            hetcomm.backend_of().set_plan(plan[0], plan[1], 0, 0)
            numel = plan[2]
        p = hetcomm.get_plan()
        t = torch.full((numel,), float(rank + 1))
        before = hetcomm.stats()
        dist.all_reduce(t)
        after = hetcomm.stats()
        assert t[0].item() == world_size * (world_size + 1) / 2
        out["allreduce"].append({"order": list(p.order), "shares": list(p.shares), "min_bytes": p.min_bytes,
                                 "numel": numel, "delta": delta(after, before)})

    # Four collectives, one of each kind; a small allreduce runs recursive doubling.
    before = hetcomm.stats()
    x = torch.arange(8.0)
    dist.broadcast(x, src=0)
    dist.all_reduce(x)
    dist.all_gather([torch.empty(8) for _ in range(world_size)], x)
    dist.barrier()
    after = hetcomm.stats()
    out["four_ops"] = delta(after, before)
    out["monotone"] = before["collective_seconds"] <= after["collective_seconds"]

    # The last rank arrives late: the others' allreduce waits for it, and that wait is counted.
    before = hetcomm.stats()
    if rank == world_size - 1:
        time.sleep(LATE_S)
    dist.all_reduce(torch.ones(4))
    out["late"] = delta(hetcomm.stats(), before)

    # Point-to-point around the ring, sizes that differ per rank, and an empty message.
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size

    def ring_of_sends() -> None:
        ops = [dist.isend(torch.zeros(1000 * (rank + 1)), nxt, tag=5), dist.isend(torch.zeros(0), nxt, tag=6),
               dist.irecv(torch.empty(1000 * (prv + 1)), prv, tag=5), dist.irecv(torch.empty(0), prv, tag=6)]
        for op in ops:
            op.wait()

    out["p2p"] = _fenced_delta("p2p", rank, world_size, ring_of_sends)

    if extras:
        out["monitored_barrier"] = _fenced_delta("monitored_barrier", rank, world_size, hetcomm.monitored_barrier)

        gloo = dist.new_group(backend="gloo")
        try:
            hetcomm.stats(gloo)
            out["gloo_error"] = None
        except RuntimeError as e:
            out["gloo_error"] = str(e)

        sub = dist.new_group([1, 2])  # every rank creates it; ranks 1 and 2 use it
        if rank in (1, 2):
            world_before, sub_before = hetcomm.stats(), hetcomm.stats(sub)
            dist.all_reduce(torch.ones(NUMEL), group=sub)
            out["sub"] = {"before": sub_before, "delta": delta(hetcomm.stats(sub), sub_before),
                          "world_delta": delta(hetcomm.stats(), world_before)}

    # A final barrier would add traffic after the snapshot; the totals are taken once every
    # operation this rank took part in has completed here, which is all the pairing needs.
    out["final"] = hetcomm.stats()
    return out


def check_job(results: list[dict], world_size: int) -> None:
    for rank, r in enumerate(results):
        start = r["start"]
        assert set(start) == KEYS
        assert start["rank"] == rank and start["world_size"] == world_size
        assert start["peers"] == list(range(world_size))
        assert len(start["bytes_sent"]) == len(start["bytes_received"]) == world_size

        for ar in r["allreduce"]:
            d, numel = ar["delta"], ar["numel"]
            assert numel * 4 >= ar["min_bytes"]  # the plan applies at this size
            # A total every share divides: the counts by hand. Another (prime) one: the engine's
            # rounding (sharesToCounts) must be the planner's model of it, the Python twin
            # (checked by itself against exact apportionment in tests/plan/test_planner.py).
            counts = exact_counts if numel == NUMEL else planner.shares_to_counts
            expected = ring_link_bytes(numel, 4, ar["order"], ar["shares"], counts)
            for peer in range(world_size):
                assert d["bytes_sent"][peer] == expected.get((rank, peer), 0), (rank, peer, ar)
                assert d["bytes_received"][peer] == expected.get((peer, rank), 0), (rank, peer, ar)
            if numel == NUMEL and (world_size == 2 or ar["shares"] == [1 / world_size] * world_size):
                # Uniform shares: the classic 2(P-1)/P of the buffer, plus one header.
                payload = 2 * (world_size - 1) * NUMEL * 4 // world_size
                assert sum(d["bytes_sent"]) == payload + COLLECTIVE_HEADER_BYTES
            assert d["collectives"] == 1 and d["collective_seconds"] > 0
            assert d["p2p_sent_messages"] == d["p2p_received_messages"] == 0

        four = r["four_ops"]
        assert four["collectives"] == 4, four
        assert four["collective_seconds"] > 0 and r["monotone"]
        assert sum(four["bytes_sent"]) > 4 * COLLECTIVE_HEADER_BYTES
        assert four["p2p_sent_messages"] == four["p2p_received_messages"] == 0

        late = r["late"]
        assert late["collectives"] == 1
        if rank != world_size - 1:
            assert late["collective_seconds"] >= LATE_S / 2, late

        p2p = r["p2p"]
        nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
        assert p2p["p2p_sent_messages"] == 2 and p2p["p2p_received_messages"] == 2, p2p
        assert p2p["collectives"] == 0 and p2p["collective_seconds"] == 0
        sent = [0] * world_size
        received = [0] * world_size
        sent[nxt] += 4000 * (rank + 1) + 2 * P2P_HEADER_BYTES
        received[prv] += 4000 * (prv + 1) + 2 * P2P_HEADER_BYTES
        assert p2p["bytes_sent"] == sent and p2p["bytes_received"] == received, p2p

    # Pairing: a's bytes to b are b's bytes from a, over the whole life of the group.
    for a in range(world_size):
        for b in range(world_size):
            assert results[a]["final"]["bytes_sent"][b] == results[b]["final"]["bytes_received"][a], (a, b)
        assert results[a]["final"]["bytes_sent"][a] == results[a]["final"]["bytes_received"][a] == 0


@pytest.mark.parametrize("world_size,emulate_device", [(2, False), (2, True), (3, False)],
                         ids=["2ranks", "2ranks-staged", "3ranks"])
def test_counts_match_the_algorithms(world_size: int, emulate_device: bool) -> None:
    """Every link's bytes, byte for byte, against the ring's schedule: counts by hand where the
    total divides every share, and the planner's model of the engine's rounding where it does not
    (this test used to rebuild sharesToCounts operation for operation: the code against itself)."""
    plans = [None]
    if world_size == 3:
        plans.append(([2, 0, 1], [0.5, 0.3, 0.2], NUMEL))       # another order, unequal shares
        plans.append(([2, 0, 1], [0.5, 0.3, 0.2], NUMEL_ODD))   # and a total they do not divide
    # The algorithms over TCP: these ranks share one machine, whose collectives would otherwise go
    # through shared memory (test_shm.py checks that no socket byte moves then).
    env = {"HETCOMM_SHM": "0", **({"HETCOMM_DEBUG_EMULATE_DEVICE": "1"} if emulate_device else {})}
    extras = world_size == 3
    results = run_ranks(world_size, _traffic, plans, extras, env=env, timeout=90)
    check_job(results, world_size)
    if not extras:
        return

    # Rank 0 collects a check-in from, and sends a release to, every other rank.
    for rank, r in enumerate(results):
        mb = r["monitored_barrier"]
        expect = world_size - 1 if rank == 0 else 1
        assert mb["p2p_sent_messages"] == mb["p2p_received_messages"] == expect, (rank, mb)
        assert mb["collectives"] == 0
        assert r["gloo_error"] == "hetcomm.stats: the group's backend is gloo, not hetcomm"

    for rank in (1, 2):
        sub = results[rank]["sub"]
        before, d = sub["before"], sub["delta"]
        assert before["rank"] == rank - 1 and before["world_size"] == 2 and before["peers"] == [1, 2]
        other = 2 - rank  # the other member's group rank
        assert d["bytes_sent"][other] == d["bytes_received"][other] == NUMEL * 4 + COLLECTIVE_HEADER_BYTES
        assert d["bytes_sent"][rank - 1] == 0
        assert d["collectives"] == 1
        # The world group's counters did not see the subgroup's traffic.
        assert sum(sub["world_delta"]["bytes_sent"]) == 0 and sub["world_delta"]["collectives"] == 0


def _wan(rank: int, world_size: int) -> dict:
    before = hetcomm_stats()
    dist.all_reduce(torch.ones(NUMEL))
    return {"before": before, "after": hetcomm_stats()}


def hetcomm_stats() -> dict:
    import hetcomm

    return hetcomm.stats()


def test_bytes_across_sites_are_counted_apart() -> None:
    """Sites declared 0,0,1,1 (rates declared: no probe): the bytes to and from the other site's
    ranks are the WAN's, and nothing else is."""
    env = {"HETCOMM_SITES": "0,0,1,1", "HETCOMM_LOCAL": "tcp",
           "HETCOMM_LINK_MBIT": "0,1000,100,100;1000,0,100,100;100,100,0,1000;100,100,1000,0"}
    results = run_ranks(4, _wan, env=env)
    for rank, res in enumerate(results):
        after = res["after"]
        assert after["sites"] == [0, 0, 1, 1], after
        other = [p for p in range(4) if p // 2 != rank // 2]
        assert after["wan_bytes_sent"] == sum(after["bytes_sent"][p] for p in other)
        assert after["wan_bytes_received"] == sum(after["bytes_received"][p] for p in other)
        assert after["wan_bytes_sent"] > res["before"]["wan_bytes_sent"], "the allreduce crossed no site boundary"
