"""Multi-process test harness for hetcomm (and any other torch.distributed backend).

``run_ranks(world_size, fn, *args)`` starts ``world_size`` processes, initialises a process group
in each and returns ``[fn(rank, world_size, *args) for each rank]``. ``fn`` must be a module-level
function (it is pickled by reference) and its result must be picklable. The processes are forked
from a fork server that imported torch and hetcomm once (a new interpreter costs about 2 s of a
core per rank, which was most of the suite's time); ``fresh=True`` spawns new interpreters instead,
for tests of how a process exits, and a job whose environment changes what torch reads when it
is imported gets them too.

Why the harness looks the way it does:

* A rank that raises is reported with its rank, exception and traceback; a rank that dies
  (segfault, SIGKILL, ``os._exit``) with its exit status and the faulthandler traceback it left;
  a rank that is still running at the harness deadline gets SIGUSR1 (faulthandler dumps every
  Python thread's stack to a file), then SIGKILL, and the dump goes into the failure message.
  Pytest never waits on a child without a deadline.
* Starting a set of processes still costs something (a group to form, a store to reach), so
  suites run many checks in one job. ``Cases`` lets a rank run hundreds of named checks, keep going after a
  failed one, and log each one to a per-rank file *as it happens*. If the job then crashes or
  hangs, ``run_suite`` still knows which checks passed, which failed and which one was running
  when the job died, and reports them per family of checks.
* The rendezvous store is a TCPStore hosted by the pytest process on an ephemeral port, so there
  is no race for a "free port" between choosing it and binding it, and a rank that dies cannot
  take the store down with it. ``init="tcp"``/``"env"``/``"file"`` exercise the other
  ``init_process_group`` paths.
* Fault tests kill a rank on purpose from inside it (``die()``), at a point in the program
  rather than at a point in time, and declare it with ``expect_dead`` so the harness checks that
  it really died while the other ranks must still finish.

The backend under test comes from ``HETCOMM_TEST_BACKEND`` (default "hetcomm"); "gloo" runs the
whole suite against PyTorch's reference CPU backend, which is how the suite itself is validated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait as wait_for_objects
from typing import Any, Callable, Iterable, Sequence

# How ranks start (fork server or fresh interpreters) and with what environment: start.py.
from start import (BACKEND, START_METHOD, _context, _read_at_import, enter_process,  # noqa: F401
                   environment_for, exit_like_a_program)


DEFAULT_TIMEOUT_S = 120.0     # the whole job: start, fn, teardown
DEFAULT_PG_TIMEOUT_S = 30.0   # passed to init_process_group; must stay below the job timeout


def job_backend() -> str:
    """The backend of the job this process belongs to (in a rank), else the one under test."""
    return _JOB_BACKEND or BACKEND


def is_hetcomm(backend: str | None = None) -> bool:
    return (backend or job_backend()) == "hetcomm"


def free_port() -> int:
    """A port that was free a moment ago (only for init paths that must bind it themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Outcomes
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RankOutcome:
    rank: int
    status: str = "died"          # ok | raised | died | hung
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    teardown: str | None = None   # None: never reported; "": clean; else the teardown error
    stack_dump: str = ""          # faulthandler output (crash or hang)
    output: str = ""              # what the rank wrote to its stdout and stderr (C++ logging too)
    cases: list[dict] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.status == "ok" and self.exitcode == 0 and self.teardown == ""

    def running_case(self) -> dict | None:
        """The case this rank had started but not finished, if any."""
        open_case = None
        for event in self.cases:
            if event["event"] == "start":
                open_case = event
            else:
                open_case = None
        return open_case

    def describe(self) -> str:
        exit_text = _describe_exitcode(self.exitcode)
        if self.status == "raised":
            text = f"rank {self.rank} raised {self.exc_type}: {self.message}\n{self.traceback}"
        elif self.status == "died":
            text = f"rank {self.rank} died without a result ({exit_text})"
        elif self.status == "hung":
            text = f"rank {self.rank} was still running at the harness deadline and was killed"
        else:
            text = f"rank {self.rank} returned a result"
            if self.exitcode != 0:
                text += f" but then exited with {exit_text}"
            if self.teardown is None:
                text += " but never finished destroy_process_group() (hung or crashed in teardown)"
            elif self.teardown:
                text += f" but destroy_process_group() failed: {self.teardown}"
        if self.status == "raised" and self.teardown is None:
            text += ("\n  and then never finished destroy_process_group() "
                     "(hung or crashed in teardown)")
        case = self.running_case()
        if case is not None and self.status != "ok":
            text += f"\n  it was running case [{case['family']}] {case['label']}"
        if self.stack_dump.strip() and not self.clean:
            text += "\n  faulthandler dump:\n" + _indent(_tail(self.stack_dump, 60), "    ")
        if self.output.strip() and not self.clean:
            text += "\n  its output (last lines):\n" + _indent(_tail(self.output, 30), "    ")
        return text


class RankFailure(AssertionError):
    """One or more ranks of a job did not finish cleanly."""


def _describe_exitcode(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def first_lines(text: str, n: int = 4) -> str:
    return "\n".join(str(text).strip().splitlines()[:n])


# --------------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _RankSpec:
    fn: Callable
    args: tuple
    backend: str
    init: str | None
    init_arg: Any
    pg_timeout_s: float
    workdir: str
    destroy: bool
    environ: dict  # the whole environment the rank runs with (the parent's, plus the job's env)
    forked: bool = False  # forked from the fork server (not a new interpreter)


_CASE_LOG = None     # the open case log of this rank (child processes only)
_JOB_BACKEND = None  # the backend this rank's job runs on (child processes only)


def _rank_entry(rank: int, world_size: int, environ: dict, workdir: str, spec_bytes: bytes, conn) -> None:
    """The target of a rank's process: the job's environment and output first, then its spec,
    whose unpickling imports the test module (which then sees that environment, and whose
    import errors go to the rank's output)."""
    enter_process(environ, os.path.join(workdir, f"rank{rank}.out"))
    spec = pickle.loads(spec_bytes)
    _rank_main(rank, world_size, spec, conn)


def _rank_main(rank: int, world_size: int, spec: _RankSpec, conn) -> None:
    global _CASE_LOG, _JOB_BACKEND
    _JOB_BACKEND = spec.backend
    trace_file = open(os.path.join(spec.workdir, f"rank{rank}.trace"), "w")
    faulthandler.enable(file=trace_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=trace_file, all_threads=True, chain=False)
    _CASE_LOG = open(os.path.join(spec.workdir, f"rank{rank}.cases"), "a", buffering=1)

    import torch
    import torch.distributed as dist

    # Up to four ranks share two cores: one compute thread each avoids oversubscription.
    torch.set_num_threads(1)

    def send(kind: str, payload: Any) -> None:
        # Plain pickle, not the Connection's ForkingPickler: with torch imported, that one
        # passes tensors as shared-memory handles, which die with this process.
        try:
            data = pickle.dumps((kind, payload))
        except Exception as e:  # an unpicklable result is the test's bug; say so
            data = pickle.dumps(("error", {"type": type(e).__name__,
                                           "message": f"could not pickle the {kind}: {e}",
                                           "traceback": traceback.format_exc()}))
        conn.send_bytes(data)

    try:
        if spec.backend == "hetcomm":
            import hetcomm  # noqa: F401  (registers the backend)
        _init_process_group(rank, world_size, spec)
        value = spec.fn(rank, world_size, *spec.args)
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        send("error", {"type": type(e).__name__, "message": str(e),
                       "traceback": traceback.format_exc()})
    else:
        send("result", value)

    teardown = ""
    if spec.destroy and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001
            teardown = f"{type(e).__name__}: {first_lines(str(e))}"
    send("teardown", teardown)
    conn.close()
    if spec.forked:
        exit_like_a_program()


def _init_process_group(rank: int, world_size: int, spec: _RankSpec) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    if spec.init is None:
        return
    if spec.init == "store":
        host, port = spec.init_arg
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    elif spec.init == "tcp":
        dist.init_process_group(spec.backend, init_method=f"tcp://127.0.0.1:{spec.init_arg}",
                                rank=rank, world_size=world_size, timeout=timeout)
    elif spec.init == "env":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.init_arg),
                          RANK=str(rank), WORLD_SIZE=str(world_size))
        dist.init_process_group(spec.backend, init_method="env://", timeout=timeout)
    elif spec.init == "file":
        dist.init_process_group(spec.backend, init_method=f"file://{spec.init_arg}", rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        raise ValueError(f"unknown init {spec.init!r}")


def die(sig: int = signal.SIGKILL) -> None:
    """Kill the calling rank at once (no cleanup, no result): for fault tests."""
    os.kill(os.getpid(), sig)
    time.sleep(60)  # not reached for SIGKILL; keeps other signals from returning


def wait_until_gone(pid: int, limit_s: float = 60.0) -> None:
    """Until the process has exited (gone, or a zombie: either way its sockets are closed)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not exit within {limit_s} s")


def wait_for_key(key: str, limit_s: float = 60.0) -> None:
    """Until ``key`` is in the default group's store, polled (a wait that an abort of the group
    cannot turn into an error); raises after ``limit_s``."""
    store, deadline = default_store(), time.monotonic() + limit_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the key {key!r} did not appear in the store within {limit_s} s")
        time.sleep(0.05)


def default_store():
    """The store of the default group, for out-of-band coordination inside a rank."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _log_case(event: dict) -> None:
    event["t"] = round(time.monotonic(), 4)
    if _CASE_LOG is not None:
        _CASE_LOG.write(json.dumps(event) + "\n")


class SuiteAborted(RuntimeError):
    """Raised by Cases when continuing would only pile timeouts onto a broken group."""


_TIMEOUT_RE = re.compile(r"time[ds]?\s*out|timeout|deadline", re.IGNORECASE)


class Cases:
    """Runs many named checks in one rank, records failures and keeps going.

    ``with cases.case("all_reduce", "SUM float16 n=11"): ...`` -- an exception inside the block
    (an AssertionError from a check or an error from the backend) is recorded against the family
    and the label, and the next case runs. Every start and end is appended to the rank's case log
    at once, so a crash or a hang still tells the parent where it happened. A timeout aborts the
    whole suite: after one, the ranks no longer agree on which collective comes next.
    """

    def __init__(self, rank: int):
        self.rank = rank

    @contextlib.contextmanager
    def case(self, family: str, label: str):
        _log_case({"event": "start", "family": family, "label": label})
        try:
            yield
        except SuiteAborted:
            raise
        except Exception as e:  # noqa: BLE001
            message = f"{type(e).__name__}: {first_lines(str(e), 6)}"
            _log_case({"event": "fail", "family": family, "label": label, "message": message})
            if not isinstance(e, AssertionError) and _TIMEOUT_RE.search(str(e)):
                raise SuiteAborted(f"[{family}] {label}: {message}") from e
        else:
            _log_case({"event": "pass", "family": family, "label": label})


# --------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------

def run_ranks_outcomes(world_size: int, fn: Callable, *args: Any, backend: str | None = None,
                       timeout: float = DEFAULT_TIMEOUT_S,
                       pg_timeout: float = DEFAULT_PG_TIMEOUT_S,
                       env: dict[str, Any] | None = None, init: str | None = "store",
                       destroy: bool = True, fresh: bool = False) -> list[RankOutcome]:
    """Runs the job and returns what happened on every rank; never raises for a rank's fate.

    ``env``: variables for every rank (None unsets one; a list gives each rank its own value).
    ``fresh``: every rank a new interpreter (spawned), for a test of how a process exits: a
    forked rank runs the program's exit handlers but then ends with ``os._exit``, without the
    interpreter's finalization (threads that outlive it, destructors at exit)."""
    backend = backend or BACKEND
    workdir = tempfile.mkdtemp(prefix="hetcomm-test-")
    store = None
    if init == "store":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        init_arg: Any = ("127.0.0.1", store.port)
    elif init in ("tcp", "env"):
        init_arg = free_port()
    elif init == "file":
        init_arg = os.path.join(workdir, "filestore")
    else:
        init_arg = None
    environ = dict(os.environ)
    per_rank = {k: v for k, v in (env or {}).items() if isinstance(v, (list, tuple))}  # one value per rank
    assert all(len(v) == world_size and None not in v for v in per_rank.values()), per_rank
    for k, v in (env or {}).items():  # None unsets a variable
        if v is None:
            environ.pop(k, None)
        elif k not in per_rank:
            environ[k] = str(v)
    spec = _RankSpec(fn=fn, args=args, backend=backend, init=init, init_arg=init_arg,
                     pg_timeout_s=pg_timeout, workdir=workdir, destroy=destroy, environ=environ)

    # A per-rank value read at import (NCCL_*) must not be taken from the fork server's.
    fresh = fresh or bool(_read_at_import({k: "" for k in per_rank}))
    ctx = multiprocessing.get_context("spawn") if fresh else _context(environ)
    spec.forked = ctx.get_start_method() != "spawn"
    spec_bytes = pickle.dumps(spec)
    procs, conns = [], []
    outcomes = [RankOutcome(rank=r) for r in range(world_size)]
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            rank_environ = {**environ, **{k: str(v[rank]) for k, v in per_rank.items()}}
            p = ctx.Process(target=_rank_entry, args=(rank, world_size, rank_environ, workdir, spec_bytes, child_end),
                            name=f"rank{rank}", daemon=True)
            with environment_for(ctx, rank_environ):
                p.start()
            child_end.close()  # else the parent never sees EOF from a dead child
            procs.append(p)
            conns.append(parent_end)
        _collect(procs, conns, outcomes, deadline=time.monotonic() + timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        for c in conns:
            c.close()
        for o in outcomes:
            o.exitcode = procs[o.rank].exitcode if o.rank < len(procs) else None
            o.stack_dump = _read(os.path.join(workdir, f"rank{o.rank}.trace"))
            o.output = _read(os.path.join(workdir, f"rank{o.rank}.out"))
            if o.output.strip():  # to pytest's captured output of the test that ran the job
                print(f"--- rank {o.rank} of {getattr(fn, '__name__', fn)}:\n{_tail(o.output, 200)}",
                      file=sys.stderr)
            o.cases = _read_cases(os.path.join(workdir, f"rank{o.rank}.cases"))
        del store
        shutil.rmtree(workdir, ignore_errors=True)
    return outcomes


def _collect(procs, conns, outcomes: list[RankOutcome], deadline: float) -> None:
    """Drains every child's pipe until each child has exited or the deadline passes.

    A rank is hung only if its sentinel has not fired by the deadline and it has not been
    reaped. A fired sentinel means the process has closed every descriptor, which the kernel
    does while the process exits (do_exit: exit_files) but *before* it makes it reapable
    (exit_notify), so ``is_alive()`` (waitpid WNOHANG) may still say "running" for a moment
    afterwards. Asking ``is_alive()`` at that moment once reported a rank that had died by
    SIGSEGV as "still running at the harness deadline" (with its segfault dump), in a test that
    had not waited for any deadline.
    """
    open_conns = {c: r for r, c in enumerate(conns)}
    live = {p.sentinel: r for r, p in enumerate(procs)}
    while open_conns or live:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for ready in wait_for_objects(list(open_conns) + list(live), timeout=remaining):
            if ready in live:
                del live[ready]
                continue
            rank = open_conns[ready]
            try:
                kind, payload = pickle.loads(ready.recv_bytes())
            except (EOFError, OSError):
                del open_conns[ready]
                continue
            except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be unpickled here
                kind, payload = "error", {"type": type(e).__name__,
                                          "message": f"the parent could not read rank {rank}'s "
                                                     f"message: {e}",
                                          "traceback": traceback.format_exc()}
            _record(outcomes[rank], kind, payload)
        # A dead child whose pipe is drained is finished.
        for c, r in list(open_conns.items()):
            if not procs[r].is_alive() and not c.poll():
                del open_conns[c]
    # is_alive() is trusted only when it says "exited" (the process was reaped), and only asked
    # of ranks whose sentinel never fired: those were running at the deadline.
    hung = [r for r in live.values() if procs[r].is_alive()]
    for r in hung:
        if outcomes[r].status not in ("ok", "raised"):
            outcomes[r].status = "hung"
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler: dump every thread's stack
        except ProcessLookupError:
            pass
    if hung:
        time.sleep(1.0)
    for r in hung:
        procs[r].kill()
    # The others have ended: reap them, so that their exit status is the one they died with.
    # join() returns as soon as the kernel has finished the exit. A rank that closed its own
    # sentinel and kept running is killed when the deadline has passed; SIGKILL cannot change
    # the status of a process that is already exiting (its exit code is fixed by then).
    for r, p in enumerate(procs):
        if r not in hung:
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()


def _record(outcome: RankOutcome, kind: str, payload: Any) -> None:
    if kind == "result":
        outcome.status, outcome.value = "ok", payload
    elif kind == "error":
        outcome.status = "raised"
        outcome.exc_type = payload["type"]
        outcome.message = payload["message"]
        outcome.traceback = payload["traceback"]
    elif kind == "teardown":
        outcome.teardown = payload


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _read_cases(path: str) -> list[dict]:
    events = []
    for line in _read(path).splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a crash
    return events


def run_ranks(world_size: int, fn: Callable, *args: Any, expect_dead: Iterable[int] = (),
              **kwargs: Any) -> list[Any]:
    """Runs the job; returns every rank's result or raises RankFailure naming what went wrong.

    Ranks in ``expect_dead`` must die (they killed themselves on purpose); their entry in the
    returned list is None. Every other rank must return, tear down, and exit with status 0.
    """
    expect_dead = set(expect_dead)
    outcomes = run_ranks_outcomes(world_size, fn, *args, **kwargs)
    problems = []
    for o in outcomes:
        if o.rank in expect_dead:
            if o.status != "died" or o.exitcode in (0, None):
                problems.append(f"rank {o.rank} was expected to die but: {o.describe()} "
                                f"({_describe_exitcode(o.exitcode)})")
        elif not o.clean:
            problems.append(o.describe())
    if problems:
        name = getattr(fn, "__name__", str(fn))
        raise RankFailure(f"{name} on {world_size} ranks "
                          f"({kwargs.get('backend') or BACKEND}):\n" + "\n".join(problems))
    return [None if o.rank in expect_dead else o.value for o in outcomes]


@dataclasses.dataclass
class SuiteReport:
    """Per-family results of a job whose ranks ran ``Cases``."""
    failures: dict[str, list[str]]
    passed: dict[str, int]
    job_problems: list[str]
    values: list[Any]  # what each rank's fn returned (None for a rank that did not return)

    def assert_family(self, family: str) -> None:
        failures = self.failures.get(family, [])
        if failures:
            shown = "\n".join(failures[:12])
            more = f"\n... and {len(failures) - 12} more" if len(failures) > 12 else ""
            raise AssertionError(f"{len(failures)} failed check(s) in [{family}]:\n{shown}{more}")
        if self.passed.get(family, 0) == 0:
            raise AssertionError(f"no check of [{family}] ran:\n" + "\n".join(self.job_problems))


def run_suite(world_size: int, fn: Callable, *args: Any, families: Sequence[str],
              **kwargs: Any) -> SuiteReport:
    """Runs a job whose ranks record checks with ``Cases`` and sorts the results by family.

    A failed check is reported as "rank R: LABEL: error". If a rank crashed, hung or raised
    outside a case, the family it was in gets that story, and families that never ran get a
    "not reached" failure, so one broken collective cannot hide the state of the others.
    """
    outcomes = run_ranks_outcomes(world_size, fn, *args, **kwargs)
    failures: dict[str, list[str]] = {}
    passed: dict[str, int] = {}
    problems = []
    for o in outcomes:
        started = set()
        for e in o.cases:
            started.add(e["family"])
            if e["event"] == "fail":
                failures.setdefault(e["family"], []).append(
                    f"rank {o.rank}: {e['label']}: {e['message']}")
            elif e["event"] == "pass" and o.rank == 0:
                passed[e["family"]] = passed.get(e["family"], 0) + 1
        if o.clean:
            continue
        story = o.describe()
        problems.append(story)
        running = o.running_case()
        if running is not None:
            failures.setdefault(running["family"], []).append(
                f"rank {o.rank}: {running['label']}: the job ended during this case:\n{story}")
        for family in families:
            if family not in started:
                failures.setdefault(family, []).append(
                    f"rank {o.rank}: not reached, the job ended earlier:\n{first_lines(story, 8)}")
    return SuiteReport(failures=failures, passed=passed, job_problems=problems,
                       values=[o.value if o.status == "ok" else None for o in outcomes])
