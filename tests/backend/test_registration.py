"""Registration and life cycle: import, init paths, subgroups, debug mode, re-init, torchrun."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from marks import hetcomm_only
from harness import BACKEND, free_port, is_hetcomm, job_backend, run_ranks
from values import assert_same, expected_reduce, pattern

pytestmark = pytest.mark.usefixtures("backend_importable")

R = dist.ReduceOp


def _allreduce_is_right(rank: int, world_size: int, group=None, ranks=None) -> None:
    ranks = list(range(world_size)) if ranks is None else ranks
    inputs = [pattern(1031, torch.float32, r) for r in ranks]
    t = pattern(1031, torch.float32, rank)
    dist.all_reduce(t, group=group)
    assert_same(t, expected_reduce(inputs, R.SUM))


@hetcomm_only("checks that `import hetcomm` registers the backend")
def test_import_registers_the_backend() -> None:
    script = textwrap.dedent("""
        import torch.distributed as dist
        assert "hetcomm" not in dist.Backend.backend_list, "registered before the import"
        import hetcomm
        assert "hetcomm" in dist.Backend.backend_list, dist.Backend.backend_list
        assert dist.Backend("hetcomm") == "hetcomm"
        assert dist.is_backend_available("hetcomm")
        import importlib; importlib.reload(hetcomm)  # registering twice must be harmless
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@hetcomm_only("checks hetcomm's module names")
def test_training_modules_keep_their_old_names() -> None:
    """The training modules live in hetcomm.train; users' `import hetcomm.hooks`,
    `from hetcomm.diloco import DiLoCo` and pickles naming the old modules must keep working, in a
    fresh interpreter where they are the first import, and give the same module objects."""
    script = textwrap.dedent("""
        import pickle
        cls = pickle.loads(b"chetcomm.hooks\\nSampleWeightState\\n.")   # a pickle from before the move
        import hetcomm.hooks, hetcomm.diloco
        from hetcomm.partition import *
        from hetcomm.adaptive import AdaptiveDataParallel
        from hetcomm.data import HeteroBatchSampler
        from hetcomm.local_steps import make_policy
        import hetcomm
        for name in ("hooks", "partition", "data", "adaptive", "diloco", "local_steps"):
            old, new = getattr(hetcomm, name), getattr(hetcomm.train, name)
            assert old is new and new.__name__ == "hetcomm.train." + name, (name, old, new)
        assert hetcomm.hooks is hetcomm.train.hooks
        assert cls is hetcomm.train.hooks.SampleWeightState
        assert split_batch is hetcomm.train.partition.split_batch
        assert AdaptiveDataParallel is hetcomm.AdaptiveDataParallel is hetcomm.train.adaptive.AdaptiveDataParallel
        assert hetcomm.diloco.DiLoCo is hetcomm.DiLoCo
        assert pickle.loads(pickle.dumps(HeteroBatchSampler)) is HeteroBatchSampler
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@hetcomm_only("checks hetcomm's registration")
def test_backend_registers_cuda_only_when_built_with_cuda() -> None:
    """Registration takes the devices from what setup.py recorded when it built the extension
    (hetcomm._build_info, read without loading it); the loaded extension must agree."""
    import hetcomm
    from hetcomm import _engine

    expected = ["cpu", "cuda"] if _engine.extension().built_with_cuda() else ["cpu"]
    assert hetcomm.supported_devices() == expected
    assert dist.Backend.backend_capability["hetcomm"] == expected


@hetcomm_only("inspects hetcomm's extension module")
def test_extension_links_the_shared_cpp_runtime() -> None:
    """The extension must use torch's shared libstdc++, not carry a static copy of its own.

    A toolchain that links libstdc++ statically by default (seen on a GPU machine) produced an
    extension whose first std::ostringstream crashed the process; setup.py names the shared
    library torch runs with. Checked on the built module's dynamic section.
    """
    import shutil

    from hetcomm import _engine

    _C = _engine.extension()
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils) to read the extension's dynamic section")
    out = subprocess.run([objdump, "-p", _C.__file__], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    needed = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("NEEDED")]
    assert any(name.startswith("libstdc++.so") for name in needed), \
        f"{_C.__file__} does not link the shared libstdc++ (NEEDED: {needed})"


def env_init(rank: int, world_size: int) -> str:
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world_size)
    _allreduce_is_right(rank, world_size)
    return dist.get_backend()


def test_init_method_env() -> None:
    assert run_ranks(2, env_init, init="env") == [BACKEND, BACKEND]


def tcp_init(rank: int, world_size: int) -> str:
    _allreduce_is_right(rank, world_size)
    return dist.get_backend()


def test_init_method_tcp_and_file() -> None:
    assert run_ranks(2, tcp_init, init="tcp") == [BACKEND, BACKEND]
    assert run_ranks(2, tcp_init, init="file") == [BACKEND, BACKEND]


def subgroups(rank: int, world_size: int) -> dict:
    members = [0, 2]
    sub = dist.new_group(ranks=members, backend=job_backend())
    out = {"in_group": sub != dist.GroupMember.NON_GROUP_MEMBER}
    if rank in members:
        assert dist.get_backend(sub) == job_backend(), dist.get_backend(sub)
        assert dist.get_rank(sub) == members.index(rank) and dist.get_world_size(sub) == 2
        _allreduce_is_right(rank, world_size, group=sub, ranks=members)
        b = pattern(50, torch.int64, rank)
        dist.broadcast(b, src=2, group=sub)  # src is a global rank
        assert_same(b, pattern(50, torch.int64, 2), "broadcast on the subgroup")
    # The world group still works, before and after the subgroup's traffic.
    _allreduce_is_right(rank, world_size)
    # A second subgroup of other ranks, made after the first one has been used.
    sub2 = dist.new_group(ranks=[1, 2], backend=job_backend())
    if rank in (1, 2):
        _allreduce_is_right(rank, world_size, group=sub2, ranks=[1, 2])
    dist.barrier()
    return out


def test_new_group_over_a_subset_of_ranks() -> None:
    results = run_ranks(3, subgroups)
    assert [r["in_group"] for r in results] == [True, False, True]


def debug_detail(rank: int, world_size: int) -> None:
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL, dist.get_debug_level()
    _allreduce_is_right(rank, world_size)
    b = pattern(33, torch.float16, rank)
    dist.broadcast(b, src=1)
    assert_same(b, pattern(33, torch.float16, 1), "broadcast")
    outs = [torch.empty(5, dtype=torch.int32) for _ in range(world_size)]
    dist.all_gather(outs, pattern(5, torch.int32, rank))
    for r in range(world_size):
        assert_same(outs[r], pattern(5, torch.int32, r), f"all_gather[{r}]")
    dist.barrier()


def test_torch_distributed_debug_detail() -> None:
    # DETAIL wraps the backend in c10d's ProcessGroupWrapper, which checks every collective's
    # signature across ranks on a helper gloo group before running it on the backend.
    run_ranks(2, debug_detail, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def _counts() -> tuple[int, int]:
    threads = len(os.listdir("/proc/self/task"))
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return threads, sockets


def reinit(rank: int, world_size: int, ports: list[int]) -> dict:
    """Three init / use / destroy cycles in one process; (threads, sockets) during and after."""
    import datetime

    counts, during = [_counts()], []
    for port in ports:
        dist.init_process_group(job_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=30))
        _allreduce_is_right(rank, world_size)
        if is_hetcomm():
            import hetcomm

            assert hetcomm.listen_address()
        during.append(_counts())
        dist.destroy_process_group()
        assert not dist.is_initialized()
        time.sleep(0.2)  # let the OS finish closing what the backend closed
        counts.append(_counts())
    return {"after": counts, "during": during}


def test_destroy_then_reinit_in_the_same_process() -> None:
    results = run_ranks(2, reinit, [free_port() for _ in range(3)], init=None)
    for rank, res in enumerate(results):
        counts, during = res["after"], res["during"]
        base_threads, base_sockets = counts[0]
        # The probe must see the group's sockets while it exists, or the checks below are void.
        assert all(d[1] > base_sockets for d in during), f"rank {rank}: no sockets seen: {res}"
        # The first cycle may leave lazily created process-wide state (thread pools); every
        # later cycle must leave nothing more behind than the one before it.
        first, last = counts[1], counts[-1]
        assert last[0] <= first[0], f"rank {rank}: threads grow per cycle: {res}"
        assert last[1] <= first[1], f"rank {rank}: sockets grow per cycle: {res}"
        assert last[1] <= base_sockets, f"rank {rank}: sockets left open after destroy: {res}"


def test_torchrun_two_processes(tmp_path) -> None:
    script = tmp_path / "allreduce_job.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler
        import os
        # A hung worker prints every thread's stack and exits, before the test's own deadline.
        faulthandler.dump_traceback_later(WORKER_LIMIT_S, exit=True)
        import torch
        import torch.distributed as dist
        if {BACKEND!r} == "hetcomm":
            import hetcomm
        dist.init_process_group({BACKEND!r})
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world == 2 and int(os.environ["LOCAL_RANK"]) == rank
        t = torch.arange(1000, dtype=torch.float32) * 2 + rank
        dist.all_reduce(t)
        expected = torch.arange(1000, dtype=torch.float32) * 4 + 1
        assert torch.equal(t, expected), (t[:5], expected[:5])
        dist.destroy_process_group()
        print(f"OK rank {{rank}}", flush=True)
    """).replace("WORKER_LIMIT_S", "90"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A session of its own, so that a timeout can kill torchrun *and* its workers.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=tmp_path, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError("torchrun still running after 150 s, killed:\n"
                             + output[-8000:]) from None
    assert proc.returncode == 0, output[-8000:]
    assert "OK rank 0" in output and "OK rank 1" in output, output[-8000:]


def send_then_leave(rank: int, world_size: int):
    """Rank 1 sends, waits for its send and returns at once (the harness then destroys the
    group); rank 0 receives only after a pause, by when rank 1 has probably torn down."""
    x = pattern(1031, torch.float32, 1)
    if rank == 1:
        dist.isend(x, dst=0).wait()
        return None
    time.sleep(1.0)  # makes the race likely; a correct backend passes with or without it
    got = torch.empty_like(x)
    dist.recv(got, src=1)
    assert_same(got, x, "message received after the sender's destroy_process_group()")
    return None


def test_message_sent_before_destroy_is_delivered() -> None:
    """A completed send is delivered even if the sender destroys its group right after.

    A backend that closes a socket with unread incoming bytes makes the kernel reset the
    connection, and the peer loses what it has not read yet: shut down gracefully instead.
    """
    run_ranks(2, send_then_leave)


def backend_name(rank: int, world_size: int) -> str:
    return dist.get_backend()


def test_suite_runs_on_the_backend_it_says() -> None:
    """Guards the harness: a suite that silently fell back to another backend proves nothing."""
    names = run_ranks(2, backend_name)
    assert names == [BACKEND, BACKEND], names


def test_planner_modules_keep_their_old_names():
    """hetcomm.planner, hetcomm.site_planner, hetcomm.sites and hetcomm.topology's planning names
    still import, and are the hetcomm.plan objects."""
    code = textwrap.dedent("""
        import hetcomm.planner, hetcomm.site_planner, hetcomm.sites
        from hetcomm import plan, topology
        from hetcomm.planner import LinkModel, Plan, make_plan, best_plan
        from hetcomm.site_planner import best_site_plan, host_plan, SitePlan, cut_bound_seconds
        from hetcomm.sites import detect_sites, Topology, parse_sites
        assert hetcomm.site_planner.best_site_plan is plan.best_site_plan
        assert hetcomm.sites.detect_sites is plan.detect_sites
        assert topology.choose_plan is plan.choose_plan and topology.snap_measured is plan.snap_measured
        assert make_plan(LinkModel.from_nics([1e8, 1e8, 1e7])).order == (0, 1, 2)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_probe_modes(monkeypatch):
    from hetcomm import topology
    for value, mode in [("", "levels"), ("1", "levels"), ("levels", "levels"), ("TRUE", "levels"),
                        ("pairs", "pairs"), ("0", "0"), ("off", "0")]:
        monkeypatch.setenv("HETCOMM_PROBE", value)
        assert topology.probe_mode() == mode
    monkeypatch.setenv("HETCOMM_PROBE", "allpairs")
    with pytest.raises(ValueError, match="HETCOMM_PROBE='allpairs'"):
        topology.probe_mode()
