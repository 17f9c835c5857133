"""Busy CPU cores over an interval, read from /proc/stat (Linux).

The lab's containers share the host's kernel, so this counts the controller, SSH and every lab node
together: a figure near the number of cores means the measured work was bound by CPU, and any
extra CPU work then lengthens it.
"""

from __future__ import annotations

import os
import time


def _jiffies() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return idle, sum(fields[:8])  # user nice system idle iowait irq softirq steal


class Interval:
    """``with Interval() as span:`` times the block: ``span.seconds`` (wall) and ``span.cores``
    (average busy cores over it)."""

    seconds = 0.0
    cores = 0.0

    def __enter__(self) -> Interval:
        self._start = (time.monotonic(), _jiffies())
        return self

    def __exit__(self, *exc: object) -> None:
        t0, (idle0, total0) = self._start
        self.seconds = time.monotonic() - t0
        idle, total = _jiffies()
        busy = 1 - (idle - idle0) / (total - total0) if total > total0 else 0.0
        self.cores = (os.cpu_count() or 1) * busy
