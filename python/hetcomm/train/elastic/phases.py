"""Where the time between two generations goes (`hetcomm.train.elastic.run`): from the moment the
members agreed to end a generation (a join, a leave) or saw it fail, to the first step of the next
one, split by phase. Logged once per generation and kept in ``stats()["generations"]`` (key
``formed``), so that a user sees what a membership change costs the workers that stay."""
from __future__ import annotations

import time


class Phases:
    """Seconds per phase of one change of generation. `mark` is a no-op outside one (between
    `begin` and `end`); each `begin` starts afresh."""

    def __init__(self) -> None:
        self._why: str | None = None
        self._begin = self._last = 0.0
        self._parts: dict[str, float] = {}

    def begin(self, why: str, at: float | None = None) -> None:
        """A change starts (``at``: when it was decided, on `time.perf_counter`'s clock)."""
        now = time.perf_counter()
        self._why, self._parts = why, {}
        self._begin = self._last = now if at is None or at > now else at

    def mark(self, phase: str) -> None:
        """The time since the last mark goes to ``phase`` (a phase met twice, as in an epoch that
        is redone, adds up)."""
        if self._why is None:
            return
        now = time.perf_counter()
        self._parts[phase] = self._parts.get(phase, 0.0) + now - self._last
        self._last = now

    def end(self) -> dict | None:
        """The change's record (``why``, ``seconds`` in all, then each phase in order), or None
        when none was under way."""
        if self._why is None:
            return None
        record = {"why": self._why, "seconds": round(time.perf_counter() - self._begin, 4),
                  **{k: round(v, 4) for k, v in self._parts.items()}}
        self._why = None
        return record

    @staticmethod
    def describe(record: dict) -> str:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in record.items() if k not in ("why", "seconds"))
        return f"{record['seconds']:.2f} s after the {record['why']} ({parts})"
