"""Simulated time for tests of time-driven training policies, so that what they assert does not
depend on how busy the machine is.

``DeclaredClock`` advances only by the compute a test declares: a training step calls
``clock.compute(0.1)`` instead of sleeping 0.1 s. Nothing else moves it: a collective, waiting for
a background synchronisation or a loaded machine takes no time on it. So the steps per round, the
rounds' lengths and the budgets a time policy computes are the same on every run, and the test
takes a fraction of the wall time its sleeps took. ``DiLoCo(..., clock=clock)`` reads it.

``SlowLink`` is a link on that clock: each background synchronisation lands ``seconds`` of the
clock after its round ended. While the rank trains, it is let through at the first step that
reaches that time (the loop reports its steps with ``stepped``), and lands at that very step on
every rank; a rank that waits for it instead (idles) moves the clock to that time, and the wait
is counted in ``idle``, in declared seconds. ``seconds=0`` is a fast link, landing at the next
step. Without it, a background synchronisation would land after however many steps a rank races
through (in no declared time) while the collective runs in real time: a count that depends on
the machine. Until it is let through, the background thread reads the clock as it was when the
synchronisation was submitted (its agreement on the round's table takes no declared time); once
through, the training thread waits for it, so the clock does not move under it.
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

_real_wait = concurrent.futures.wait
_real_result = concurrent.futures.Future.result
_real_exception = concurrent.futures.Future.exception


class DeclaredClock:
    def __init__(self) -> None:
        self._now = 1000.0
        self._held: float | None = None      # what other threads read while a SlowLink holds them
        self._lock = threading.Lock()

    def __call__(self) -> float:
        held = self._held
        if held is not None and threading.current_thread() is not threading.main_thread():
            return held
        return self._now

    def hold(self) -> None:
        """Other threads read the clock as it is now until `release`."""
        self._held = self._now

    def release(self) -> None:
        self._held = None

    def compute(self, seconds: float) -> None:
        """A step's compute: the clock moves by ``seconds``."""
        with self._lock:
            self._now += seconds

    def advance_to(self, t: float) -> None:
        with self._lock:
            self._now = max(self._now, t)


class SlowLink:
    def __init__(self, clock: DeclaredClock, seconds: float, calls_per_sync: int = 1,
                 limit_s: float = 60.0) -> None:
        """``calls_per_sync``: how many calls of the held function one synchronisation makes
        (``DiLoCo._exchange_and_reduce``: 1; the compressed collective: one per fragment)."""
        self.clock, self.seconds, self.limit_s = clock, seconds, limit_s
        self.calls_per_sync = calls_per_sync
        self.idle = 0.0          # declared seconds a rank spent waiting for a landing
        self._opened: list[threading.Event] = []
        self._due: list[float] = []   # when each synchronisation lands, on the clock
        self._calls = 0
        self._calls_at_submit = 0
        self._all_open = False
        self._diloco = None
        self._lock = threading.Lock()

    def _event(self, index: int) -> threading.Event:
        with self._lock:
            while len(self._opened) <= index:
                self._opened.append(threading.Event())
            return self._opened[index]

    def wrap(self, owner, name: str, diloco) -> None:
        """Holds the calls of ``owner.name`` made off the training (main) thread, one per
        background synchronisation of ``diloco`` (e.g. ``DiLoCo._exchange_and_reduce``, or the
        compressed collective of a single-rank worker with one fragment), until they are due. A
        wait of the training thread for one (``concurrent.futures.wait``) is idle time: the clock
        moves to when it is due, and the wait is added to ``idle``. (The waits are seen through
        ``concurrent.futures``, patched in this process: only a rank of a test uses this.)"""
        original = getattr(owner, name)
        # stepped() waits for the landing through it: a rename must fail here, not silently
        # make landings depend on the machine again
        assert hasattr(diloco, "_pending"), "DiLoCo no longer has _pending: update tests/support/clock.py"
        assert hasattr(diloco, "_pending_agreed"), "DiLoCo no longer has _pending_agreed: update tests/support/clock.py"
        self._diloco = diloco

        @functools.wraps(original)
        def held(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread() and not self._all_open:
                with self._lock:
                    index = self._calls // self.calls_per_sync
                    self._calls += 1
                if not self._event(index).wait(self.limit_s):
                    raise TimeoutError(f"clock.SlowLink: synchronisation {index} never came due")
            return original(*args, **kwargs)

        setattr(owner, name, held)

        # A synchronisation submitted: until it is let through, the background thread's clock
        # stands at the submission (reading it in real time would count the steps the training
        # thread raced through meanwhile, e.g. in the round-length measurement DiLoCo takes from
        # its agreement on the table to its landing).
        executor = diloco._executor
        assert executor is not None, "SlowLink needs DiLoCo(overlap=True)"
        submit = executor.submit

        def submitting(*args, **kwargs):
            if not self._all_open:
                self.clock.hold()
            with self._lock:
                self._calls_at_submit = self._calls
            return submit(*args, **kwargs)

        executor.submit = submitting

        # The training thread waiting for a synchronisation in flight: that wait is idle time.
        def idling(fs) -> None:
            if threading.current_thread() is threading.main_thread() and not all(f.done() for f in fs):
                self._land_due(idle=True)

        def wait(fs, *args, **kwargs):
            idling(fs)
            return _real_wait(fs, *args, **kwargs)

        def result(future, timeout=None):
            idling([future])
            return _real_result(future, timeout)

        def exception(future, timeout=None):
            idling([future])
            return _real_exception(future, timeout)

        concurrent.futures.wait = wait
        concurrent.futures.Future.result = result
        concurrent.futures.Future.exception = exception

    def _land_due(self, idle: bool) -> None:
        """Lets through the synchronisations due by now (with ``idle``: every one started, the
        clock moving on to the last one's due time)."""
        for index, due in enumerate(self._due):
            event = self._event(index)
            if event.is_set():
                continue
            if idle and self.clock() < due:
                self.idle += due - self.clock()
                self.clock.advance_to(due)
            if self.clock() >= due - 1e-9:       # sums of declared steps carry rounding
                self.clock.release()
                event.set()

    def stepped(self, synced: bool) -> None:
        """After each step: ``synced`` is what ``DiLoCo.step()`` returned (True: a round ended and
        its synchronisation went to the background, due ``seconds`` from now). Lets through what
        is due, and waits (in real time, not on the clock) until it has landed, so that it lands
        at this very step on every rank, however the machine schedules them."""
        if synced:
            self._due.append(self.clock() + self.seconds)
            self._await_agreement()
            return
        before = sum(e.is_set() for e in self._opened)
        self._land_due(idle=False)
        pending = getattr(self._diloco, "_pending", None)
        if pending is not None and sum(e.is_set() for e in self._opened) > before:
            _real_exception(pending, self.limit_s)      # waits until it has landed

    def _await_agreement(self) -> None:
        """The synchronisation just submitted first agrees on its round's table, in the
        background and in no declared time, and DiLoCo acts on that agreement at the first step
        that sees it (it shortens a last round from it). Waits in real time until the agreement
        is there -- or the synchronisation is held here, failed, or done -- so that every rank
        sees it at this very step: a background thread scheduled late let one rank see it only
        after the landing and train one step more ([46, 47] instead of [46, 46], once in about ten
        fresh-clone runs)."""
        diloco = self._diloco
        pending = getattr(diloco, "_pending", None)
        deadline = time.monotonic() + self.limit_s
        while not (pending is None or pending.done() or diloco._pending_agreed is not None
                   or self._calls > self._calls_at_submit):
            if time.monotonic() > deadline:
                raise TimeoutError("clock.SlowLink: the synchronisation submitted never agreed on its table")
            time.sleep(0.0005)

    def open_all(self) -> None:
        """Lets every synchronisation through from now on, held or still to come."""
        self._all_open = True
        self.clock.release()
        self._due = [0.0] * len(self._due)
        with self._lock:
            events = list(self._opened)
        for event in events:
            event.set()
