"""Waiting in tests for something another thread or process does, without a wall-clock bound on
how fast it happens: the limit only ends a hang."""
from __future__ import annotations

import time

import pytest


def until(condition, seconds: float = 60.0) -> None:
    """Waits for ``condition``; fails after ``seconds`` (a hang, not a slow machine)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > seconds:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.01)
