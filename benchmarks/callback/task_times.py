"""Wall time per play batch and per task, written as JSON for benchmarks/rollout_scale.py.

A profile_tasks-like callback for the benchmarks (ansible.posix's profile_tasks prints no JSON and is not part of
ansible-core): a task's time runs from its start to the start of the next task or the end of its
play batch, summed over batches. Enabled only by the benchmark (ANSIBLE_CALLBACKS_ENABLED).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: task_times
type: aggregate
short_description: per-batch and per-task wall time as JSON
description:
  - Writes the wall time of every play batch and every task (summed over batches) to a JSON file.
requirements:
  - enabled with ANSIBLE_CALLBACKS_ENABLED
options:
  out:
    description: File the timings are written to when the playbook ends.
    required: true
    env:
      - name: TASK_TIMES_FILE
"""

import json  # noqa: E402 (Ansible plugins put DOCUMENTATION first)
import time  # noqa: E402
from typing import Any  # noqa: E402

from ansible.plugins.callback import CallbackBase  # noqa: E402


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.t0 = time.monotonic()
        self.batches: list[dict[str, Any]] = []
        self.tasks: dict[str, dict[str, Any]] = {}
        self.current: tuple[str, float] | None = None

    def _close_task(self, now: float) -> None:
        if self.current is not None:
            key, started = self.current
            entry = self.tasks.setdefault(key, {"seconds": 0.0, "runs": 0})
            entry["seconds"] += now - started
            entry["runs"] += 1
            self.current = None

    def _close_batch(self, now: float) -> None:
        self._close_task(now)
        if self.batches and "seconds" not in self.batches[-1]:
            self.batches[-1]["seconds"] = now - self.batches[-1]["start"]

    def v2_playbook_on_play_start(self, play: Any) -> None:
        now = time.monotonic()
        self._close_batch(now)
        self.batches.append({"play": play.get_name(), "start": now})

    def _task_start(self, task: Any) -> None:
        now = time.monotonic()
        self._close_task(now)
        play = self.batches[-1]["play"] if self.batches else ""
        self.current = (f"{play} | {task.get_name()}", now)

    def v2_playbook_on_task_start(self, task: Any, is_conditional: bool) -> None:
        self._task_start(task)

    def v2_playbook_on_handler_task_start(self, task: Any) -> None:
        self._task_start(task)

    def v2_playbook_on_stats(self, stats: Any) -> None:
        now = time.monotonic()
        self._close_batch(now)
        body = {
            "total_seconds": now - self.t0,
            "batches": [{"play": b["play"], "seconds": b.get("seconds", 0.0)} for b in self.batches],
            "tasks": self.tasks,
        }
        with open(self.get_option("out"), "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1, sort_keys=True)
