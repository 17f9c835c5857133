"""Busy CPU cores over an interval, read from /proc/stat (Linux).

The lab's containers share the host's kernel, so this counts the controller, SSH and every lab node
together: a figure near the number of cores means the measured work was bound by CPU, and any
extra CPU work then lengthens it.
"""

from __future__ import annotations

import os


def snapshot() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return idle, sum(fields[:8])  # user nice system idle iowait irq softirq steal


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Average number of busy cores between two snapshots."""
    idle = after[0] - before[0]
    total = after[1] - before[1]
    return (os.cpu_count() or 1) * (1 - idle / total) if total else 0.0
