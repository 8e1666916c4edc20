"""Links measured by an earlier group, remembered by the ranks' hosts (`hetcomm.measure.known`): a
new world of processes on hosts measured before (an elastic run's next generation) takes rank
0's remembered model instead of probing; a host not measured before, or HETCOMM_PROBE_REUSE=0,
probes. The model travels from rank 0 as float64 values that every rank decodes and checks."""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from marks import hetcomm_only

from hetcomm import planner
from hetcomm.measure import known

MBIT = 1e6 / 8


@pytest.fixture(autouse=True)
def _empty_memory():
    known.forget()
    yield
    known.forget()


def nics(*mbit: float) -> planner.LinkModel:
    return planner.LinkModel.from_nics([m * MBIT for m in mbit])


def test_a_model_travels_exactly_as_float64_values() -> None:
    model = planner.LinkModel(bw=((0, 1e8, 2e8), (3e8, 0, 4e8), (5e8, 6e8, 0)), reduce_bps=(7e9, math.inf, 9e9),
                              alpha=1.5e-4, segment_bytes=1 << 16, small_allreduce_bytes=4096,
                              uplinks=(((0, 1), 2.5e8, math.inf), ((2,), 1e8, 1e8)))
    back = known.decode(known.encode(model), 3)
    assert back == model and back.uplinks == model.uplinks
    assert known.decode(known.encode(None), 3) is None


@pytest.mark.parametrize("values,why", [
    ([2.0, 1.0], "truncated"),
    ([2.5], "size"),
    ([4.0], "for 4 ranks"),
    (known.encode(nics(100, 200)) + [1.0], "trailing"),
    (known.encode(nics(100, 200))[:10] + [1.0, 1.0, 5.0, 1e8, 1e8], "uplink rank"),
    ([2.0, 0.0, -1.0, 1.0, 0.0] + [math.inf, math.inf, 1e-4, 0.0, 0.0, 0.0], "bandwidth|rate|link"),
])
def test_garbage_from_rank_0_is_a_value_error(values, why) -> None:
    with pytest.raises(ValueError, match=why):
        known.decode(values, 2)


def test_a_group_of_hosts_measured_together_takes_their_rows_and_columns() -> None:
    world = nics(100, 200, 300, 400)
    known.remember(["a", "b", "c", "d"], world)
    assert known.lookup(["c", "a"]) == world.restricted([2, 0])
    assert known.lookup(["a", "e"]) is None                 # e was never measured
    # a host's ranks: at most as many as it had, each taken once
    pairs = planner.LinkModel.from_nics([1 * MBIT, 2 * MBIT, 3 * MBIT])
    known.remember(["h", "h", "g"], pairs)
    assert known.lookup(["g", "h", "h"]) == pairs.restricted([2, 0, 1])
    assert known.lookup(["h", "h", "h"]) is None
    # the newest measurement of a host wins
    newer = nics(7, 8)
    known.remember(["b", "d"], newer)
    assert known.lookup(["d", "b"]) == newer.restricted([1, 0])
    assert known.lookup(["a", "b"]) == world.restricted([0, 1])
    # one host alone has no links to remember
    known.remember(["x", "x"], nics(1, 1))
    assert known.lookup(["x", "x"]) is None


def test_a_measurement_is_reused_only_for_its_age(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(known, "time", SimpleNamespace(monotonic=lambda: now[0]))
    world = nics(100, 200)
    known.remember(["a", "b"], world)
    now[0] += 700
    assert known.lookup(["a", "b"], 600) is None and known.lookup(["a", "b"], 800) == world
    for text, seconds in (("", known.DEFAULT_SECONDS), ("0", 0.0), ("30.5", 30.5)):
        monkeypatch.setenv("HETCOMM_PROBE_REUSE", text)
        assert known.max_age() == seconds
    for text in ("yes", "-1", "inf", "nan"):
        monkeypatch.setenv("HETCOMM_PROBE_REUSE", text)
        with pytest.raises(ValueError, match="HETCOMM_PROBE_REUSE"):
            known.max_age()


class _Backend:
    """A rank of a group whose broadcasts deliver ``sent`` (rank 0's values), in order."""

    def __init__(self, rank: int, size: int, sent: list[list[float]]) -> None:
        self._rank, self._size, self.sent = rank, size, list(sent)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def broadcast(self, tensors, opts):
        if self._rank != 0:
            tensors[0].copy_(torch.tensor(self.sent.pop(0), dtype=tensors[0].dtype))
        return self

    def wait(self) -> None:
        pass


def test_rank_0_announcing_too_many_values_is_a_value_error_before_any_allocation() -> None:
    from hetcomm import topology

    with pytest.raises(ValueError, match="announced 2000000000.0 values"):
        known.agreed(_Backend(1, 3, [[2e9]]), ["a", "b", "c"], topology._broadcast_floats)
    with pytest.raises(ValueError, match="announced 2.5 values"):
        topology._broadcast_floats(_Backend(1, 3, [[2.5]]), None)
    # a model's values within the bound arrive and decode
    model = nics(1, 2, 3)
    values = known.encode(model)
    assert known.agreed(_Backend(1, 3, [[float(len(values))], values]), ["a", "b", "c"],
                        topology._broadcast_floats) == model


def test_rank_0_that_cannot_look_up_tells_every_rank(monkeypatch) -> None:
    from hetcomm import topology

    monkeypatch.setenv("HETCOMM_PROBE_REUSE", "soon")
    with pytest.raises(ValueError, match="HETCOMM_PROBE_REUSE"):          # rank 0: its own error, once sent
        known.agreed(_Backend(0, 3, []), ["a", "b", "c"], topology._broadcast_floats)
    why = b"ValueError: HETCOMM_PROBE_REUSE='soon'"
    others = _Backend(1, 3, [[-float(len(why)) - 1], list(why)])
    with pytest.raises(RuntimeError, match="rank 0 said: ValueError: HETCOMM_PROBE_REUSE"):
        known.agreed(others, ["a", "b", "c"], topology._broadcast_floats)


def three_worlds(rank: int, world_size: int) -> dict:
    """Three successive worlds of the same processes (each on its own host): the first probes; the
    second, its ranks renumbered, reuses rank 0's memory; the third, with HETCOMM_PROBE_REUSE=0 on its
    rank 0, probes."""
    import hetcomm
    from hetcomm import topology

    probes = []
    real = topology.probe_backend
    topology.probe_backend = lambda backend, ranks=None: probes.append(1) or real(backend, ranks)
    store = dist.distributed_c10d._get_default_store()
    first = hetcomm.link_model(dist.group.WORLD)
    out = {"first": first.bw.tolist()}
    for name, reuse in (("second", "600"), ("third", "0")):
        dist.destroy_process_group()
        new_rank = (rank + 1) % world_size
        if new_rank == 0:
            os.environ["HETCOMM_PROBE_REUSE"] = reuse
        before = len(probes)
        dist.init_process_group("hetcomm", store=dist.PrefixStore(name, store), rank=new_rank, world_size=world_size)
        out[name] = {"bw": hetcomm.link_model(dist.group.WORLD).bw.tolist(), "probed": len(probes) > before}
        rank = new_rank
    return out


@hetcomm_only("the probe and its memory are hetcomm's")
def test_a_new_world_on_hosts_measured_before_does_not_probe() -> None:
    results = run_ranks(3, three_worlds, timeout=180, env={"HETCOMM_HOST_ID": ["h0", "h1", "h2"],
                                                          "HETCOMM_PROBE_REUSE": None})
    first = planner.LinkModel(bw=tuple(map(tuple, results[0]["first"])))
    for got in results:
        assert got["first"] == results[0]["first"]
        # the second world's rank k is the first world's rank k - 1: the same links, renumbered
        assert not got["second"]["probed"] and got["second"]["bw"] == first.restricted([2, 0, 1]).bw.tolist(), got
        assert got["third"]["probed"], got
