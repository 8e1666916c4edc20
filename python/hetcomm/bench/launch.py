"""How ranks come to exist: N local worker processes, or this process as one rank of torchrun.

Local mode (`launch_local`): the launcher hosts the ``TCPStore`` (so it outlives any worker) and
spawns ``--nprocs`` workers with the environment torchrun would give them, so both modes share
one code path (`hetcomm.bench.worker.run_rank`). Workers report ``alive``/``done``/``error`` over
a pipe each, and the launcher never hangs: a failed or silent worker ends the run. Env mode
(``RANK`` and ``WORLD_SIZE`` set): this process is that one rank, and failures are torchrun's.

The protocol and the failure rules: docs/bench-cli.md#how-ranks-come-to-exist.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from hetcomm.bench.config import BenchConfig
from hetcomm.bench.report import PREFIX

EXIT_FAILED = 2
_LOOPBACK = "127.0.0.1"
_STARTUP_S = 60.0               # process start and `import torch` on a loaded 2-core machine
_HANG_SLACK_S = 30.0            # on top of what a worker announced for its next phase
_FAILURE_GRACE_S = 2.0          # time for peers' consequent errors to arrive before reporting
_TERMINATE_WAIT_S = 5.0


def _hang_deadline(seconds: float) -> float:
    """When a worker that announced a phase of at most ``seconds`` counts as hung (monotonic)."""
    return time.monotonic() + seconds + _HANG_SLACK_S


def in_env_mode() -> bool:
    """True when RANK and WORLD_SIZE are set, i.e. we run as one rank of an external launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_env_rank(config: BenchConfig) -> int:
    """Runs this process as the rank named by the environment (torchrun)."""
    from hetcomm.bench.worker import run_rank     # imports torch; kept off the CLI's import path
    rank = os.environ["RANK"]
    try:
        return run_rank(config, launch="env", heartbeat=lambda seconds: None)
    except Exception as error:
        print(f"{PREFIX}: rank {rank} failed: {type(error).__name__}: {error}",
              file=sys.stderr, flush=True)
        raise


def _worker_main(rank: int, world_size: int, port: int, config: BenchConfig,
                 channel: multiprocessing.connection.Connection) -> None:
    """Body of a spawned worker: torchrun's environment, then :func:`run_rank`."""
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": _LOOPBACK, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    })
    # As torchrun does: N ranks sharing few cores must not each start a full OpenMP pool, and
    # both launch modes should measure the same thing. Set before this process imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def send(*message: Any) -> None:
        try:
            channel.send(message)
        except (BrokenPipeError, EOFError, OSError):
            pass                    # the launcher is gone; the group timeouts will end us

    try:
        from hetcomm.bench.worker import run_rank
        status = run_rank(config, launch="local", heartbeat=lambda seconds: send("alive", seconds))
        send("done", status)
    except BaseException as error:   # KeyboardInterrupt too: the launcher must hear about it
        send("error", f"{type(error).__name__}: {error}", traceback.format_exc(), time.time())
        sys.exit(1)


@dataclass
class _Rank:
    """The launcher's view of one worker."""

    rank: int
    process: multiprocessing.process.BaseProcess
    channel: multiprocessing.connection.Connection
    deadline: float                                 # monotonic; see _hang_deadline
    allowed_s: float                                # what the worker announced last
    status: Optional[int] = None                    # from "done"
    failure: Optional[str] = None
    failure_detail: str = ""
    failed_at: float = 0.0                          # wall clock, comparable across ranks


@dataclass
class _LocalRun:
    config: BenchConfig
    ranks: list[_Rank] = field(default_factory=list)

    def _receive(self, worker: _Rank) -> None:
        try:
            while worker.channel.poll():
                kind, *payload = worker.channel.recv()
                if kind == "alive":
                    worker.allowed_s = payload[0]
                    worker.deadline = _hang_deadline(worker.allowed_s)
                elif kind == "done":
                    worker.status = payload[0]
                elif kind == "error" and worker.failure is None:
                    worker.failure, worker.failure_detail, worker.failed_at = payload
        except (EOFError, OSError):
            pass

    def _check_exits(self) -> None:
        for worker in self.ranks:
            self._receive(worker)
            code = worker.process.exitcode
            if code is None or worker.failure is not None:
                continue
            if code != 0 or worker.status is None:
                worker.failure = _describe_exit(code)
                worker.failed_at = time.time()

    def _check_hangs(self) -> None:
        now = time.monotonic()
        for worker in self.ranks:
            if worker.process.exitcode is None and worker.failure is None and now > worker.deadline:
                worker.failure = (f"hung: silent for {worker.allowed_s + _HANG_SLACK_S:.0f} s, "
                                  f"its phase was to take at most {worker.allowed_s:.0f} s "
                                  f"(--timeout {self.config.timeout_s:g} s)")
                worker.failed_at = time.time()

    def failed(self) -> list[_Rank]:
        """Failed ranks, the likeliest cause first.

        A rank that died without reporting (a signal, ``os._exit``) comes first: its peers' errors
        ("connection closed by peer") are consequences, even if the launcher heard them before it
        noticed the death. Then in order of the time each rank failed.
        """
        failed = (w for w in self.ranks if w.failure is not None)
        return sorted(failed, key=lambda w: (bool(w.failure_detail), w.failed_at))

    def wait(self) -> None:
        """Returns when every worker has exited or one has failed (plus a short grace)."""
        handles = [w.process.sentinel for w in self.ranks] + [w.channel for w in self.ranks]
        grace_until: Optional[float] = None
        while any(w.process.exitcode is None for w in self.ranks):
            multiprocessing.connection.wait(handles, timeout=0.5)
            self._check_exits()
            self._check_hangs()
            if self.failed() and grace_until is None:
                grace_until = time.monotonic() + _FAILURE_GRACE_S
            if grace_until is not None and time.monotonic() > grace_until:
                return
        self._check_exits()

    def terminate(self) -> list[int]:
        """Terminates the workers still running; returns their ranks."""
        alive = [w for w in self.ranks if w.process.exitcode is None]
        for worker in alive:
            worker.process.terminate()
        deadline = time.monotonic() + _TERMINATE_WAIT_S
        for worker in alive:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                worker.process.kill()
                worker.process.join()
        return [w.rank for w in alive]


def _describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 0:
        return "exited without reporting a result"
    return f"exited with status {code}"


def _report_failures(run: _LocalRun, terminated: list[int]) -> None:
    failed = run.failed()
    first = failed[0]
    print(f"{PREFIX}: rank {first.rank} failed{' first' if len(failed) > 1 else ''}: "
          f"{first.failure}", file=sys.stderr)
    if first.failure_detail:
        print(first.failure_detail.rstrip(), file=sys.stderr)
    for other in failed[1:]:
        print(f"{PREFIX}: rank {other.rank} also failed: {other.failure}", file=sys.stderr)
    terminated = [r for r in terminated if r not in {w.rank for w in failed}]
    if terminated:
        print(f"{PREFIX}: terminated rank(s) {', '.join(map(str, terminated))}, still running; "
              f"if the failures above are timeouts, look there first", file=sys.stderr)
    sys.stderr.flush()


def launch_local(config: BenchConfig) -> int:
    """Runs ``config.nprocs`` local ranks; returns the exit status for the command."""
    from torch.distributed import TCPStore     # imports torch; kept off the CLI's import path

    timeout = timedelta(seconds=config.timeout_s)
    store = TCPStore(_LOOPBACK, 0, world_size=config.nprocs, is_master=True, timeout=timeout,
                     wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    run = _LocalRun(config)
    try:
        for rank in range(config.nprocs):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main, name=f"hetcomm.bench-rank{rank}", daemon=True,
                args=(rank, config.nprocs, store.port, config, sender))
            process.start()
            sender.close()          # the child holds the only write end: EOF when it dies
            startup_s = _STARTUP_S + config.timeout_s
            run.ranks.append(_Rank(rank, process, receiver,
                                   deadline=_hang_deadline(startup_s), allowed_s=startup_s))
        run.wait()
    except KeyboardInterrupt:
        run.terminate()
        print(f"{PREFIX}: interrupted", file=sys.stderr)
        return 130
    terminated = run.terminate()
    if run.failed():
        _report_failures(run, terminated)
        return EXIT_FAILED
    return run.ranks[0].status if run.ranks[0].status is not None else EXIT_FAILED
