"""Ranks on one host: the shared-memory path (csrc/transport/shm, csrc/algorithms/local_collectives).

Every other multi-process test already runs its one-host groups through shared memory (the
default); this file checks what those do not:

* every collective with slots far smaller than the messages (many chunks per call) and with the
  fewest slot bytes a host allows, exact results as in test_collectives;
* which path a collective took (``hetcomm.stats``: ``collectives_by_path``), and that no
  collective byte crossed a socket on it;
* the fallback to TCP (``HETCOMM_SHM=0``, a segment too small), still exact;
* hosts from ``HETCOMM_HOST_ID`` (0,0,1,1 and 0,0,0,1), subgroups taking some ranks of each host,
  two groups in use at once, two jobs on one machine at once;
* ranks that disagree (shapes, dtypes, settings), a rank killed with SIGKILL mid-collective, no
  segment left in /dev/shm, an idle group that burns no CPU.

The differential against gloo is test_differential.py's: its groups run over shared memory
already (this file had a copy of it on 4 ranks, which checked nothing more).
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import resource
import threading
import time

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import RankFailure, run_ranks, run_ranks_outcomes, run_suite
from values import assert_same, expected_reduce, pattern
from harness import free_port as free_port_
import collective_suite

pytestmark = [pytest.mark.usefixtures("backend_importable"), hetcomm_only("shared-memory transport")]

R = dist.ReduceOp
SEGMENTS = "/dev/shm/hetcomm-*"


def _cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _paths(group=None) -> dict:
    import hetcomm
    return hetcomm.stats(group)["collectives_by_path"]


def _socket_bytes(group=None) -> int:
    import hetcomm
    s = hetcomm.stats(group)
    return sum(s["bytes_sent"]) + sum(s["bytes_received"])


# ----------------------------------------------------------------- every collective, many chunks

# (world size, env): the smallest slot a host takes, and slots of a few KB on three ranks.
SMALL_SLOTS = {
    "3ranks_16k_slots": (3, {"HETCOMM_SHM_SLOT_BYTES": str(16 << 10)}),
    "4ranks_4k_slots": (4, {"HETCOMM_SHM_SLOT_BYTES": "4096", "HETCOMM_SHM_SMALL_ALLREDUCE_BYTES": "0"}),
    # Device buffers (an emulated device: copies queued and run late, test_staged.py) through
    # the slots, as CUDA tensors on one host take them.
    "3ranks_emulated_device": (3, {"HETCOMM_DEBUG_EMULATE_DEVICE": "1", "HETCOMM_SHM_SLOT_BYTES": str(32 << 10)}),
}
_SUITES: dict = {}


def _slot_suite(name: str):
    if name not in _SUITES:
        ws, env = SMALL_SLOTS[name]
        families = [f for f in collective_suite.FAMILIES if f not in collective_suite.NEEDS_PEER]
        _SUITES[name] = run_suite(ws, collective_suite.collective_suite, families=families, timeout=400,
                                  pg_timeout=60, env=env)
    return _SUITES[name]


@pytest.mark.parametrize("config,family", [
    pytest.param(c, f, id=f"{c}-{f}") for c in SMALL_SLOTS for f in collective_suite.FAMILIES
    if f not in collective_suite.NEEDS_PEER])
def test_collectives_through_small_slots(config: str, family: str) -> None:
    _slot_suite(config).assert_family(family)


# ------------------------------------------------------------------------- paths and fallback

def _path_report(rank: int, ws: int) -> dict:
    before_bytes, before = _socket_bytes(), dict(_paths())
    n = 100_003
    t = pattern(n, torch.float32, rank)
    dist.all_reduce(t)
    assert_same(t, expected_reduce([pattern(n, torch.float32, r) for r in range(ws)], R.SUM))
    out = [torch.empty(n) for _ in range(ws)]
    dist.all_gather(out, pattern(n, torch.float32, rank))
    for r in range(ws):
        assert_same(out[r], pattern(n, torch.float32, r))
    dist.barrier()
    after = _paths()
    import hetcomm
    return {"paths": {k: after[k] - before.get(k, 0) for k in after},
            "socket_bytes": _socket_bytes() - before_bytes,
            "local_ranks": hetcomm.backend_of().local_ranks(),
            "segments": glob.glob(SEGMENTS)}


@pytest.mark.serial  # looks at every hetcomm segment in /dev/shm: no other job may run
def test_one_host_takes_shared_memory_and_no_socket_bytes() -> None:
    for res in run_ranks(3, _path_report):
        assert res["paths"]["shm"] == 3 and res["paths"]["tcp"] == 0, res
        assert res["socket_bytes"] == 0, res
        assert res["local_ranks"] == [0, 1, 2], res
        # Unlinked as soon as every rank had mapped it: nothing to leak.
        assert res["segments"] == [], res


@pytest.mark.parametrize("env,why", [
    ({"HETCOMM_SHM": "0"}, "turned off"),
    ({"HETCOMM_LOCAL": "tcp"}, "forced to tcp"),
    ({"HETCOMM_SHM_BYTES": "20000"}, "segment too small: falls back"),
])
def test_fallback_to_tcp_is_exact(env, why) -> None:
    for res in run_ranks(3, _path_report, env=env):
        assert res["paths"]["tcp"] == 3 and res["paths"]["shm"] == 0, (why, res)
        assert res["socket_bytes"] > 0, (why, res)
        assert res["local_ranks"] == [], (why, res)


# ------------------------------------------------------------------------ hosts and subgroups

def _hosts_job(rank: int, ws: int) -> dict:
    import hetcomm
    out = {"world_local": hetcomm.backend_of().local_ranks()}
    # Sub-groups: one rank of each host; and the first host alone (one host: shared memory).
    for ranks in ([0, ws - 1], [0, 1], list(range(ws))):
        g = dist.new_group(ranks, backend="hetcomm")
        if rank in ranks:
            created = dict(_paths(g))  # group creation's own collectives (host identities) excluded
            gr = dist.get_rank(g)
            k = len(ranks)
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                for n in (0, 1, 7, 70_001):
                    t = pattern(n, dtype, gr)
                    dist.all_reduce(t, group=g)
                    assert_same(t, expected_reduce([pattern(n, dtype, r) for r in range(k)], R.SUM),
                                f"group {ranks} {dtype} n={n}")
                    outs = [torch.empty(n, dtype=dtype) for _ in range(k)]
                    dist.all_gather(outs, pattern(n, dtype, gr), group=g)
                    for r in range(k):
                        assert_same(outs[r], pattern(n, dtype, r), f"all_gather group {ranks}")
            paths = {k: v - created[k] for k, v in _paths(g).items()}
            out[f"group{ranks}"] = {"local": hetcomm.backend_of(g).local_ranks(), "paths": paths}
    return out


@pytest.mark.parametrize("hosts", ["0,0,1,1", "0,0,0,1"])
def test_declared_hosts_and_subgroups(hosts: str) -> None:
    labels = [int(h) for h in hosts.split(",")]
    results = run_ranks(4, _hosts_job, env={"HETCOMM_HOST_ID": hosts, "HETCOMM_PROBE": "0"})
    for rank, res in enumerate(results):
        mine = [r for r in range(4) if labels[r] == labels[rank]]
        assert res["world_local"] == (mine if len(mine) > 1 else []), (rank, res)
        if rank in (0, 1):
            # [0, 1] shares host 0 in both layouts: every collective through shared memory.
            sub = res["group[0, 1]"]
            assert sub["local"] == [0, 1] and sub["paths"]["shm"] > 0 and sub["paths"]["tcp"] == 0, (rank, res)
        if rank in (0, 3):
            sub = res["group[0, 3]"]  # one rank of each host: nothing to share
            assert sub["local"] == [] and sub["paths"]["shm"] == 0, (rank, res)


def _init_with(rank: int, ws: int, port: int, env: dict) -> str:
    """Initialises the job's default group with this rank's own settings; the error, if any."""
    import datetime
    os.environ.update(env)
    try:
        dist.init_process_group("hetcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=30))
    except ValueError as e:
        return str(e)
    return "no error"


def _host_disagreement(rank: int, ws: int, port: int) -> str:
    # The last rank is started as if on a host of its own (a per-process HETCOMM_HOST_ID); the
    # others declare that it shares theirs.
    return _init_with(rank, ws, port, {"HETCOMM_HOST_ID": "lonely" if rank == ws - 1 else "0,0,0"})


def _setting_disagreement(rank: int, ws: int, port: int) -> str:
    return _init_with(rank, ws, port, {"HETCOMM_SHM_SLOT_BYTES": "8192" if rank == 1 else "65536"})


def _bad_host_id_on_one_rank(rank: int, ws: int, port: int) -> str:
    # One label short on the last rank only: it cannot use its setting, and says so everywhere.
    return _init_with(rank, ws, port, {"HETCOMM_HOST_ID": "0,0" if rank == ws - 1 else "0,0,1"})


def test_ranks_that_disagree_about_hosts_or_settings_fail_at_creation() -> None:
    for msg in run_ranks(3, _bad_host_id_on_one_rank, free_port_(), init=None):
        assert "HETCOMM_HOST_ID" in msg and "rank 2" in msg, msg
    for msg in run_ranks(3, _host_disagreement, free_port_(), init=None):
        assert "disagree" in msg and "hosts" in msg, msg
    for msg in run_ranks(3, _setting_disagreement, free_port_(), init=None):
        assert "HETCOMM_SHM_SLOT_BYTES" in msg and "rank 1" in msg, msg


def _two_groups(rank: int, ws: int) -> None:
    g = dist.new_group(backend="hetcomm")
    n = 300_001
    for i in range(6):
        a, b = pattern(n, torch.float32, rank, salt=i), pattern(n, torch.int32, rank, salt=i)
        wa = dist.all_reduce(a, async_op=True)
        wb = dist.all_reduce(b, group=g, async_op=True)
        wa.wait()
        wb.wait()
        assert_same(a, expected_reduce([pattern(n, torch.float32, r, salt=i) for r in range(ws)], R.SUM))
        assert_same(b, expected_reduce([pattern(n, torch.int32, r, salt=i) for r in range(ws)], R.SUM))
    assert _paths(g)["shm"] == 6 and _paths()["shm"] >= 6


def test_two_groups_at_once() -> None:
    run_ranks(3, _two_groups)


def _job(rank: int, ws: int, salt: int) -> float:
    t = pattern(1 << 20, torch.float32, rank, salt=salt)
    for _ in range(5):
        t = pattern(1 << 20, torch.float32, rank, salt=salt)
        dist.all_reduce(t)
    assert_same(t, expected_reduce([pattern(1 << 20, torch.float32, r, salt=salt) for r in range(ws)], R.SUM))
    return float(t[1])


def test_two_jobs_on_one_machine_at_once() -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_ranks, 2, _job, salt) for salt in (1, 2)]
        first, second = (f.result() for f in futures)
    assert first != second  # each job reduced its own data


# ------------------------------------------------------------------------------------ faults

def _mismatch(rank: int, ws: int, what: str) -> str:
    n = 1000 + (rank if what == "shape" else 0)
    dtype = torch.float64 if (what == "dtype" and rank == 1) else torch.float32
    t = torch.ones(n, dtype=dtype)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_mismatched_calls_raise_on_every_rank(what: str) -> None:
    for msg in run_ranks(3, _mismatch, what):
        assert "disagree" in msg, msg


def _killed_mid_collective(rank: int, ws: int, victim: int = 1) -> dict:
    x = torch.ones(4 << 20)
    dist.all_reduce(x)  # everyone is connected and in step
    if rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), 9)).start()
    start = time.monotonic()
    try:
        for _ in range(100_000):
            dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        return {"message": str(e), "elapsed": time.monotonic() - start - 0.3}
    return {"message": "no error", "elapsed": time.monotonic() - start}


@pytest.mark.serial  # looks at every hetcomm segment in /dev/shm: no other job may run
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_rank_killed_mid_collective_is_named_and_leaks_nothing(victim: int) -> None:
    before = set(glob.glob(SEGMENTS))
    results = run_ranks(3, _killed_mid_collective, victim, expect_dead=[victim], pg_timeout=20)
    for rank in {0, 1, 2} - {victim}:
        res = results[rank]
        assert f"rank {victim}" in res["message"], res
        assert "timed out" not in res["message"], res   # the liveness check, not the 20 s timeout
    assert set(glob.glob(SEGMENTS)) <= before


def _killed_with_a_forked_child(rank: int, ws: int, victim: int) -> dict:
    """The victim forks a child (as a data loader does) that outlives the others' 20 s timeout,
    then dies."""
    if rank == victim:
        pid = os.fork()
        if pid == 0:                     # the child: holds whatever it inherited, then leaves quietly
            time.sleep(30)
            os._exit(0)
    return _killed_mid_collective(rank, ws, victim)


@pytest.mark.parametrize("env", [{}, {"HETCOMM_LOCAL": "tcp"}], ids=["shm", "tcp"])
def test_a_dead_ranks_forked_child_does_not_hide_its_death(env: dict) -> None:
    """The child inherited the rank's sockets; they are let go of in the child at fork
    (transport/socket.h), so the rank's death closes its connections and the others name it at
    once; before, they learnt nothing until the child exited (here: after their 20 s timeout)."""
    results = run_ranks(3, _killed_with_a_forked_child, 1, expect_dead=[1], pg_timeout=20, env=env)
    for rank in (0, 2):
        assert "rank 1" in results[rank]["message"], results[rank]
        assert "timed out" not in results[rank]["message"], results[rank]


def _idle(rank: int, ws: int) -> dict:
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    # (1) every rank idle; (2) rank 0 inside a collective that the others join late.
    start = _cpu_seconds()
    time.sleep(IDLE_S)
    idle = _cpu_seconds() - start
    start = _cpu_seconds()
    if rank != 0:
        time.sleep(WAIT_S)
    dist.all_reduce(t)
    waiting = _cpu_seconds() - start
    return {"idle_cpu": idle, "waiting_cpu": waiting}


IDLE_S, WAIT_S = 3.0, 1.0     # a spinning thread would burn all of it: CPU seconds tell, not wall ones


def test_idle_group_burns_no_cpu() -> None:
    """(Shortened from 10 s idle and 3 s waiting: a spinning thread shows as a whole core's CPU
    time in any interval, so the longer waits proved nothing more.)"""
    results = run_ranks(2, _idle)
    for res in results:
        assert res["idle_cpu"] < 0.02 * IDLE_S, results
    # Waiting inside a collective: spins for microseconds, then sleeps.
    assert results[0]["waiting_cpu"] < 0.1 * WAIT_S, results


def _segment_error(rank: int, ws: int) -> None:
    raise RuntimeError("boom")


@pytest.mark.serial  # looks at every hetcomm segment in /dev/shm: no other job may run
def test_no_segment_left_after_exit_or_exception() -> None:
    before = set(glob.glob(SEGMENTS))
    run_ranks(2, _job, 3)
    with pytest.raises(RankFailure, match="boom"):
        run_ranks(2, _segment_error)
    assert set(glob.glob(SEGMENTS)) <= before


def _formed(rank: int, ws: int) -> str:
    return "formed"


@pytest.mark.serial  # looks at every hetcomm segment in /dev/shm: no other job may run
def test_a_creator_killed_before_it_unlinked_leaves_no_segment() -> None:
    """The host's first rank is killed right after it created the segment, before the others
    opened it (HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE): the creator published the name first, so the
    other rank, whose group creation fails at the 3 s timeout, removes it. Before, the segment
    stayed in /dev/shm until reboot."""
    before = set(glob.glob(SEGMENTS))
    outcomes = run_ranks_outcomes(2, _formed, pg_timeout=3, env={"HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE": "1"})
    assert outcomes[0].status == "died", outcomes[0].describe()
    assert outcomes[1].status == "raised" and "shared memory" in outcomes[1].message, outcomes[1].describe()
    assert set(glob.glob(SEGMENTS)) <= before


@pytest.mark.serial  # looks at every hetcomm segment in /dev/shm: no other job may run
def test_a_creator_killed_after_it_made_the_segment_with_a_rank_dead_before_opening_leaves_no_segment() -> None:
    """Three ranks on a host. The first creates the segment, says so, and is killed
    (HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE=made); rank 2 is killed before it opens the segment
    (HETCOMM_DEBUG_DIE_BEFORE_SHM_OPEN=2). Rank 1 opens it but is not the last to, and the creator
    that would remove the name once all had opened it is gone: before, the segment stayed in
    /dev/shm until reboot. Now rank 1 removes the name with its group (or at its exit)."""
    before = set(glob.glob(SEGMENTS))
    env = {"HETCOMM_DEBUG_DIE_AFTER_SHM_CREATE": "made", "HETCOMM_DEBUG_DIE_BEFORE_SHM_OPEN": "2"}
    outcomes = run_ranks_outcomes(3, _formed, pg_timeout=3, env=env)
    assert [o.status for o in outcomes][0::2] == ["died", "died"], [o.describe() for o in outcomes]
    assert outcomes[1].status != "died", outcomes[1].describe()
    assert set(glob.glob(SEGMENTS)) <= before
