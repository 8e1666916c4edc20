"""Running one command per rank: output prefixing, waiting, failure grace, termination.

`supervise` never lets a run hang on a peer of a dead rank: a rank that fails gives the others
``grace_s`` seconds, then they are terminated; its status is the worst status of the ranks that
failed on their own. The rules: docs/simulator.md#when-a-rank-fails.
"""
from __future__ import annotations

import dataclasses
import io
import os
import signal
import subprocess
import threading
import time
from typing import BinaryIO, Callable, Optional, Sequence

EXIT_TIMEOUT = 124


class SimInterrupted(KeyboardInterrupt):
    """Raised in the main thread when the simulator receives SIGTERM or SIGHUP (or SIGINT)."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def exit_status(returncode: int) -> int:
    """Popen returncode -> shell-style status (killed by signal n -> 128+n)."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclasses.dataclass
class RankProcess:
    rank: int
    popen: subprocess.Popen
    terminated_by_sim: bool = False
    returncode: Optional[int] = None
    exited_at: Optional[float] = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            rc = self.popen.poll()
            if rc is not None:
                self.returncode = rc
                self.exited_at = time.monotonic()
        return self.returncode

    def signal_group(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)  # ranks start in their own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass


@dataclasses.dataclass
class RunResult:
    status: int
    statuses: list[Optional[int]]          # per rank, shell-style; None if never reaped
    terminated_by_sim: list[bool]
    timed_out: bool = False
    first_failure: Optional[int] = None    # rank that failed first on its own


def binary_writer(stream) -> Callable[[bytes], None]:
    """A thread-safe ``write(bytes)`` (then flush) for a binary or text stream."""
    lock = threading.Lock()
    target = getattr(stream, "buffer", None)
    binary = target is not None or isinstance(stream, (io.BufferedIOBase, io.RawIOBase, io.BytesIO))
    if target is None:
        target = stream

    def write(data: bytes) -> None:
        with lock:
            try:
                if binary:
                    target.write(data)
                else:
                    target.write(data.decode("utf-8", "replace"))
                target.flush()
            except (ValueError, OSError):
                pass  # our own stdout closed: keep draining the rank's pipe

    return write


def start_pump(pipe: BinaryIO, prefix: bytes, write: Callable[[bytes], None]) -> threading.Thread:
    def pump() -> None:
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                write(prefix + line)
        except (OSError, ValueError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    t = threading.Thread(target=pump, name=f"hcsim-pump-{prefix.decode().strip()}", daemon=True)
    t.start()
    return t


def stop_ranks(ranks: Sequence[RankProcess], first_sig: int, kill_wait_s: float,
               log: Callable[[str], None]) -> None:
    """Sends ``first_sig`` to every live rank's process group, SIGKILL after ``kill_wait_s``."""
    alive = [r for r in ranks if r.poll() is None]
    for r in alive:
        r.terminated_by_sim = True
        r.signal_group(first_sig)
    deadline = time.monotonic() + kill_wait_s
    while any(r.poll() is None for r in alive) and time.monotonic() < deadline:
        time.sleep(0.02)
    stubborn = [r for r in alive if r.poll() is None]
    if stubborn:
        log(f"SIGKILL to rank{'s' if len(stubborn) > 1 else ''} "
            f"{', '.join(str(r.rank) for r in stubborn)} ({kill_wait_s:g} s after "
            f"{signal.Signals(first_sig).name})")
        for r in stubborn:
            r.signal_group(signal.SIGKILL)
        for r in stubborn:
            try:
                r.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            r.poll()
    # also reap the group leaders' exits of ranks that had already exited
    for r in ranks:
        r.poll()


def supervise(ranks: Sequence[RankProcess], *, grace_s: float = 30.0, timeout_s: Optional[float] = None,
              kill_wait_s: float = 5.0, log: Callable[[str], None] = lambda s: None,
              pumps: Sequence[threading.Thread] = ()) -> RunResult:
    start = time.monotonic()
    failing_since: Optional[float] = None
    first_failure: Optional[int] = None
    timed_out = False
    reported: set[int] = set()
    try:
        while True:
            now = time.monotonic()
            for r in ranks:
                rc = r.poll()
                if rc is not None and r.rank not in reported:
                    reported.add(r.rank)
                    if rc != 0 and not r.terminated_by_sim:
                        how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0
                               else f"exited with status {rc}")
                        if failing_since is None:
                            failing_since = now
                            first_failure = r.rank
                            others = [x.rank for x in ranks if x.poll() is None]
                            log(f"rank {r.rank} {how}" + (
                                f"; the other ranks get {grace_s:g} s to finish" if others else ""))
                        else:
                            log(f"rank {r.rank} {how}")
            if all(r.poll() is not None for r in ranks):
                break
            if failing_since is not None and now - failing_since >= grace_s:
                left = [r.rank for r in ranks if r.poll() is None]
                log(f"terminating rank{'s' if len(left) > 1 else ''} {', '.join(map(str, left))}: "
                    f"still running {grace_s:g} s after rank {first_failure} failed")
                stop_ranks(ranks, signal.SIGTERM, kill_wait_s, log)
                break
            if timeout_s is not None and now - start >= timeout_s:
                timed_out = True
                log(f"timeout: {timeout_s:g} s elapsed; terminating every rank")
                stop_ranks(ranks, signal.SIGTERM, kill_wait_s, log)
                break
            time.sleep(0.02)
    except BaseException as e:
        sig = e.signum if isinstance(e, SimInterrupted) else signal.SIGINT
        if any(r.poll() is None for r in ranks):
            log(f"{signal.Signals(sig).name}: forwarding it to the ranks")
            stop_ranks(ranks, sig, kill_wait_s, log)
        _join(pumps, 0.5)
        raise
    _join(pumps)
    statuses = [None if r.returncode is None else exit_status(r.returncode) for r in ranks]
    own = [s for r, s in zip(ranks, statuses) if s and not r.terminated_by_sim]
    if own:
        status = max(own)
    elif timed_out:
        status = EXIT_TIMEOUT
    else:
        status = 0
    return RunResult(status=status, statuses=statuses,
                     terminated_by_sim=[r.terminated_by_sim for r in ranks],
                     timed_out=timed_out, first_failure=first_failure)


def _join(pumps: Sequence[threading.Thread], timeout_s: float = 2.0) -> None:
    # a rank's orphaned child may keep its pipe open; teardown kills it, so do not wait forever
    deadline = time.monotonic() + timeout_s
    for t in pumps:
        t.join(max(0.0, deadline - time.monotonic()))
