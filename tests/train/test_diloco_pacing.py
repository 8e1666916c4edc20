"""Pacing of staggered fragments (`hetcomm.train.diloco.pacing`).

* The caps reach the kernel: `ProcessGroupHetcomm.set_pacing` sets ``SO_MAX_PACING_RATE`` on the
  TCP links open now and those of a new group, read back with ``getsockopt``
  (`ProcessGroupHetcomm.pacing`), and lifts it; a list of the wrong length is refused. (Links
  that open after the cap was set: tests/cpp/test_tcp_mesh.cc.)
* The pacer's arithmetic, by hand, on a stand-in backend: the caps (a fragment's bytes over share
  × slot, on each link it used), the time pacing added (left out of the synchronisation's
  duration that ``time`` plans by), and a job the cap did not hold back; fragments of unequal
  sizes at one rate, a job queued behind a larger one, a late one catching up, and the bound on a
  job's planned end; a fragment not measured yet paced by the bytes per element of those
  measured; a job whose boundary waits for it uncapped (`Pacer.lift`).
* Pacing changes when bytes leave, not which: the staggered float64 schedule of
  test_diloco_stream, paced over TCP links, ends exactly at its reference; workers of two ranks
  with ``time`` and int8, paced, stay identical across ranks.
* That it lowers the peak rate a host sends at: benchmarks/diloco_sim.py (``-f4-paced-full``,
  docs/diloco-results.md#paced-12-05).
"""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_diloco_stream import stagger_reference, train_staggered, train_workers_staggered

pytestmark = pytest.mark.usefixtures("backend_importable")

TCP = {"HETCOMM_LOCAL": "tcp"}       # every byte over the ranks' TCP links (no shared memory)


def pacing_on_links(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from hetcomm._backend import backend_of

    out = {}
    backend = backend_of()
    dist.all_reduce(torch.ones(8))                       # the links exist now
    out["before"] = backend.pacing()
    caps = [0] * world
    caps[(rank + 1) % world] = 123_456 + rank
    out["refused"] = backend.set_pacing(caps)
    out["set"] = backend.pacing()
    backend.set_pacing([0] * world)
    out["lifted"] = backend.pacing()
    try:
        backend.set_pacing([1])
    except ValueError as e:
        out["wrong_length"] = str(e)
    # a group whose links open after the caps were set
    group = dist.new_group(list(range(world)))
    later = backend_of(group)
    later.set_pacing([777_000] * world)
    out["later_before"] = later.pacing()
    dist.all_reduce(torch.ones(1 << 16), group=group)
    out["later"] = later.pacing()
    return out


def test_set_pacing_reaches_the_kernel_on_the_links_of_a_group():
    world = 3
    res = run_ranks(world, pacing_on_links, env=TCP)
    for rank, r in enumerate(res):
        nxt = (rank + 1) % world
        assert r["refused"] == 0
        assert r["before"][rank] == -1 and all(v == 0 for p, v in enumerate(r["before"]) if p != rank), r
        assert r["set"][nxt] == 123_456 + rank, r
        assert all(v == 0 for p, v in enumerate(r["set"]) if p not in (rank, nxt)), r
        assert all(v == 0 for p, v in enumerate(r["lifted"]) if p != rank), r
        assert "one rate per rank of the group (3), got 1" in r["wrong_length"]
        # (the group's creation may open its links; those it did not take the cap when they open:
        # tests/cpp/test_tcp_mesh.cc shows that case on its own)
        assert all(v in (-1, 777_000) for v in r["later_before"]), r
        linked = [v for p, v in enumerate(r["later"]) if p != rank and v != -1]
        assert linked and all(v == 777_000 for v in linked), r


class Backend:
    """Stands in for ProcessGroupHetcomm: bytes sent per peer, and the caps it was given."""

    def __init__(self, world: int) -> None:
        self.sent = [0] * world
        self.calls: list[list[int]] = []

    def size(self) -> int:
        return len(self.sent)

    def traffic(self) -> dict:
        return {"bytes_sent": list(self.sent)}

    def set_pacing(self, caps: list[int]) -> int:
        self.calls.append(list(caps))
        return 0


def test_pacer_caps_and_the_time_it_added_by_hand():
    from hetcomm.compress.collective import _phase_boundary
    from hetcomm.train.diloco.pacing import Pacer, check_pace

    now = [0.0]
    backend = Backend(4)
    pacer = Pacer(0.5, backend, lambda: now[0])
    # rank 0 of 4: the all-to-all sends 100 bytes to each peer, the all-gather 300 to the next
    reduction = [[0, 100, 100, 100], [0, 300, 0, 0]]

    def job(f: int, phases: list[list[int]], seconds: float, late: float = 0.0, fail: bool = False) -> None:
        pacer.fired(f)
        now[0] += late                           # waited for the others' triggers, or queued
        backend.calls.clear()
        with pacer.job(f):
            for k, sent in enumerate(phases):
                if k:
                    _phase_boundary()             # as weighted_allreduce marks it
                backend.sent = [a + b for a, b in zip(backend.sent, sent)]
            now[0] += seconds
            if fail:
                raise RuntimeError("the reduction failed")

    pacer.plan(8, 0.25, 4)                      # 8 steps of 0.25 s over 4 fragments: 0.5 s a slot
    assert pacer.slot == 0.5                    # share 0.5: a job's transfer planned for 0.25 s
    job(1, reduction, 0.1)                      # nothing measured yet: unpaced
    assert backend.calls == [] and pacer.paced_jobs == 0
    # 600 bytes in the 0.2 s left after 0.05 s late: 3000 B/s, each phase's share of it on each
    # link it used, the whole rate on the others (this rank's own entry included: no link)
    job(1, reduction, 0.28, late=0.05)
    assert backend.calls == [[3000, 1000, 1000, 1000], [3000, 3000, 3000, 3000], [0, 0, 0, 0]]
    assert pacer.take_delay() == pytest.approx(0.18) and pacer.take_delay() == 0.0   # 0.28 s against 0.1
    # 0.3 s late, past its planned end: a third of the 0.25 s (7200 B/s), not one burst; it took
    # 0.5 s, four times its planned transfer: the link set the pace, not the cap
    job(1, reduction, 0.5, late=0.3)
    assert backend.calls[:2] == [[7200, 2400, 2400, 2400], [7200] * 4]
    assert pacer.take_delay() == 0.0
    job(1, reduction, 0.3)                      # within its plan: beyond the unpaced 0.1 s, pacing's
    assert backend.calls[0] == [2400, 800, 800, 800] and pacer.take_delay() == pytest.approx(0.2)
    job(1, reduction + [[0, 0, 50, 0]], 0.3)    # a phase not seen last time: the whole rate
    assert backend.calls[2] == [2400] * 4, backend.calls
    with pytest.raises(RuntimeError, match="the reduction failed"):
        job(1, [[0, 999, 999, 999]], 0.1, fail=True)
    assert backend.calls[-1] == [0, 0, 0, 0]    # the caps lifted; the next job is paced by the
    job(1, reduction, 0.2)                      # last whole job's 650 bytes, not by its 2997
    assert backend.calls[0] == [2600, 866, 866, 866]
    job(2, [[0, 0, 0, 0]], 0.1)                 # sent nothing: nothing to pace by
    job(2, [[0, 0, 0, 0]], 0.1)
    assert pacer.paced_jobs == 6
    pacer.hurry()                               # someone waits for the jobs: unpaced until resume()
    assert backend.calls[-1] == [0, 0, 0, 0]
    job(1, reduction, 0.2)
    pacer.plan(8, 0.25, 4)
    job(1, reduction, 0.2)
    assert backend.calls == [] and pacer.paced_jobs == 6
    pacer.resume()
    pacer.plan(None, 0.25, 4)                   # no planned steps: unpaced
    job(1, reduction, 0.2)
    pacer.plan(8, 0.25, 4)
    job(1, reduction, 0.2)
    assert pacer.paced_jobs == 7
    assert check_pace(None, False, 1, True) is None and check_pace(1, True, 2, True) == 1.0
    for bad in (0.0, 0.01, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"in \[0.05, 1\]"):
            check_pace(bad, True, 4, True)
    for overlap, fragments, stagger in ((False, 4, True), (True, 1, True), (True, 4, False)):
        with pytest.raises(ValueError, match="needs overlap=True, fragments > 1 and stagger=True"):
            check_pace(0.5, overlap, fragments, stagger)


def test_fragments_of_unequal_sizes_share_one_rate_by_hand():
    from hetcomm.train.diloco.pacing import Pacer

    now = [0.0]
    backend = Backend(2)
    pacer = Pacer(1.0, backend, lambda: now[0])

    def send(b: int) -> None:
        backend.sent = [backend.sent[0], backend.sent[1] + b]

    def job(f: int, b: int, seconds: float, fire: bool = True) -> float:
        if fire:
            pacer.fired(f)
        backend.calls.clear()
        with pacer.job(f):
            send(b)
            now[0] += seconds
        return backend.calls[0][1] if backend.calls else None

    pacer.plan(6, 0.25, 3)                      # 3 fragments, a slot of 0.5 s, 1.5 s of compute
    for f, b in enumerate((300, 500, 700)):     # the first round: unpaced
        assert job(f, b, 0.1) is None
        now[0] += 0.4
    # then one rate: 1500 bytes over 1.5 s, 1000 B/s for each fragment (each over its own slot:
    # 600, 1000 and 1400 B/s)
    t = now[0]
    assert job(0, 300, 0.3) == pytest.approx(1000, abs=1)     # planned to end at t + 0.3
    now[0] = t + 0.5
    assert job(1, 500, 0.5) == pytest.approx(1000, abs=1)     # t + 0.5 to t + 1.0
    now[0] = t + 1.0
    pacer.fired(2)
    backend.calls.clear()
    with pacer.job(2):                          # 0.7 s: past the next trigger of fragment 0
        assert backend.calls[0][1] == pytest.approx(1000, abs=1)
        send(700)
        now[0] = t + 1.5
        pacer.fired(0)
        now[0] = t + 1.7
    # fragment 0 queued behind it: planned from t + 1.7, not from its trigger: no catching up;
    # the link held it back: it ended at t + 2.2
    assert job(0, 300, 0.5, fire=False) == pytest.approx(1000, abs=1)
    now[0] = t + 2.0
    pacer.fired(1)
    now[0] = t + 2.2
    # fragment 1 planned from its trigger (the job before was planned to end at t + 2.0): 500 bytes
    # in the 0.3 s left
    assert job(1, 500, 0.3, fire=False) == pytest.approx(1666, abs=1)
    # a job that ends before its planned end frees the link then: fragment 2, planned to t + 3.2,
    # ends at t + 2.8; fragment 0, triggered at t + 2.9, is planned from its trigger (1000 B/s),
    # not behind t + 3.2 (500 B/s)
    job(2, 700, 0.3)
    now[0] = t + 2.9
    assert job(0, 300, 0.3) == pytest.approx(1000, abs=1)
    # a job that starts past its planned end catches up at three times the rate, not in one burst
    now[0] = t + 3.5
    pacer.fired(1)
    now[0] = t + 4.4                            # planned to end at t + 4.0
    assert job(1, 500, 0.5, fire=False) == pytest.approx(3000, abs=1)
    # step times no round could have (a corrupt agreed table) plan no slot: unpaced, no overflow
    for seconds in (1e-300, float("inf"), float("nan"), 1e300):
        pacer.plan(6, seconds, 3)
        assert pacer.slot is None
        assert job(0, 300, 0.1) is None
    # a fragment at more than two of its slots at the rate is planned to end two slots after its
    # trigger: 100 + 100 + 1300 bytes, 1000 B/s, the third's 1.3 s cut to 1.0 s
    pacer = Pacer(1.0, backend, lambda: now[0])
    pacer.plan(6, 0.25, 3)
    for f, b in enumerate((100, 100, 1300)):
        job(f, b, 0.1)
        now[0] += 0.4
    job(0, 100, 0.1)
    now[0] += 0.4
    job(1, 100, 0.1)
    now[0] += 0.4
    assert job(2, 1300, 1.0) == pytest.approx(1300, abs=1)


def test_fragments_not_measured_yet_and_a_lifted_job_by_hand():
    """With ``sizes``, a fragment's first job is paced by the bytes per element of those measured;
    the time pacing added to it counts against their unpaced seconds per byte. A job someone
    waits for (`Pacer.lift`) runs uncapped from then to its end, or from its start if it had not
    started; the jobs of other fragments keep their caps."""
    from hetcomm.compress.collective import _phase_boundary
    from hetcomm.train.diloco.pacing import Pacer

    now = [0.0]
    backend = Backend(2)
    pacer = Pacer(1.0, backend, lambda: now[0], sizes=[100, 200, 300])

    def job(f: int, b: int, seconds: float, lift_during: bool = False) -> list[list[int]]:
        pacer.fired(f)
        backend.calls.clear()
        with pacer.job(f):
            if lift_during:
                pacer.lift(f)
            _phase_boundary()                    # (a second phase: capped again unless lifted)
            backend.sent = [0, backend.sent[1] + b]
            now[0] += seconds
        return list(backend.calls)

    pacer.plan(6, 0.25, 3)                      # a slot of 0.5 s, 1.5 s of compute
    assert job(0, 300, 0.1) == []               # nothing measured: unpaced (3 bytes an element)
    # fragment 1 (200 elements): 600 bytes expected; all three 1800 bytes over 1.5 s: 1200 B/s
    assert job(1, 600, 0.5)[0][1] == pytest.approx(1200, abs=1)
    # unpaced, its 600 bytes would have taken 0.2 s (fragment 0's 0.1 s for 300 bytes)
    assert pacer.take_delay() == pytest.approx(0.3)
    assert job(2, 900, 0.75)[0][1] == pytest.approx(1200, abs=1)
    assert pacer.take_delay() == pytest.approx(0.45)
    # lifted while it runs: its caps go to 0 and its next phase is not capped again
    calls = job(0, 300, 0.25, lift_during=True)
    assert calls[0][1] > 0 and calls[1:] == [[0, 0], [0, 0]], calls
    pacer.lift(None)
    assert job(1, 600, 0.5)[0][1] > 0           # another fragment's job: capped
    pacer.lift(0)                               # lifted before it starts: never capped
    assert job(0, 300, 0.1) == [[0, 0]]         # (only the end's lifting)
    assert job(1, 600, 0.5)[0][1] > 0
    pacer.lift(None)
    assert job(0, 300, 0.25)[0][1] > 0
    # no sizes: a fragment not measured yet is unpaced, as before
    other = Pacer(1.0, Backend(2), lambda: now[0])
    other.plan(6, 0.25, 3)
    other.fired(0)
    with other.job(0):
        other._backend.sent = [0, 300]
    other.fired(1)
    assert other.rate(1, now[0]) is None


def test_paced_fragments_equal_the_float64_reference():
    world, F, tau, beta = 3, 3, 2, 0.25
    want = stagger_reference(world, F, tau, beta)
    per_rank = run_ranks(world, train_staggered, F, tau, beta, "nesterov", 0.5, env=TCP)
    for r, res in enumerate(per_rank):
        assert res["paced"][0] > 0 and res["paced"][1] == 0, res["paced"]    # jobs paced, no cap refused
        for g, w in zip(res["global"], want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m: f"rank {r}: {m}")
        for g0, g in zip(per_rank[0]["global"], res["global"]):
            assert torch.equal(g0, g), f"rank {r}'s global parameters differ from rank 0's"


def test_paced_fragments_compose_with_sharded_workers_time_and_int8():
    """Workers of two ranks (state sharded over them), ``time`` on a declared clock, int8, three
    staggered fragments moved as they land (test_diloco_stream), paced over half their slots."""
    per_rank = run_ranks(4, train_workers_staggered, 0.5, timeout=240, env=TCP)
    for res in per_rank:
        assert res["sharded"] and res["paced"] > 0 and res["moves"] > 0, res
        assert res["history"] == per_rank[0]["history"]
        for a, b, p in zip(per_rank[0]["global"], res["global"], res["model"]):
            assert torch.equal(a, b) and torch.equal(a, p)
    assert len(per_rank[0]["history"]) == 8


def construct_on_gloo(rank: int, world: int) -> str:
    import hetcomm

    net = torch.nn.Linear(4, 4)
    try:
        hetcomm.DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), overlap=True, fragments=2, pace=0.5)
    except ValueError as e:
        return str(e)
    return "constructed"


def test_pace_on_a_gloo_group_is_refused_on_every_rank():
    for message in run_ranks(2, construct_on_gloo, backend="gloo"):
        assert "DiLoCo's group must use the hetcomm backend" in message, message
