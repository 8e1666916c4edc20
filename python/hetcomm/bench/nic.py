"""Bytes this network namespace sends, sampled over time, and the peak rate over a window.

On the simulated cluster (`hetcomm.sim`) every host is a network namespace whose only
interface besides loopback is its NIC, so its bytes sent are what leaves the host: its uplink.
A sync that staggers its fragments lowers the peak of that rate, not the total
(benchmarks/diloco_sim.py reports both).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

__all__ = ["bytes_sent", "NicSampler", "peak_rate"]


def bytes_sent(path: str = "/proc/self/net/dev") -> int:
    """Bytes sent so far by every interface of this process's network namespace but loopback."""
    total = 0
    with open(path) as f:
        for line in f.readlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() != "lo":
                total += int(fields.split()[8])
    return total


class NicSampler:
    """(seconds, bytes sent) every ``interval`` seconds on a daemon thread, from `start` to `stop`
    (time.monotonic() seconds, bytes since `start`)."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = float(interval)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "NicSampler":
        base = bytes_sent()
        self.samples = [(time.monotonic(), 0)]

        def run() -> None:
            while not self._stop.wait(self.interval):
                self.samples.append((time.monotonic(), bytes_sent() - base))

        self._thread = threading.Thread(target=run, name="hetcomm-nic-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return list(self.samples)


def peak_rate(samples: Sequence[Sequence[float]], window: float = 1.0, *, start: float = -math.inf,
              end: float = math.inf) -> float | None:
    """The largest mean rate (bytes per second) over any ``window`` seconds of ``samples``
    ((seconds, cumulative bytes), in time order) between ``start`` and ``end``: for every sample,
    the bytes up to the first sample at least ``window`` later, over the time between them. None
    if they span less than ``window``."""
    samples = [x for x in samples if start <= x[0] <= end]
    best = None
    j = 0
    for i, (t, b) in enumerate(samples):
        j = max(j, i + 1)
        while j < len(samples) and samples[j][0] - t < window:
            j += 1
        if j == len(samples):
            break
        rate = (samples[j][1] - b) / (samples[j][0] - t)
        best = rate if best is None else max(best, rate)
    return best
