"""Keeps Python's cyclic garbage collector off the controller's heap in the workers it forks.

ansible-playbook forks one worker per task and host. Each worker starts with a copy-on-write view
of the controller's heap (the parsed playbooks, roles, inventory and variables: tens of MB), and
the first full collection the worker runs writes to every object it scans, copying the whole heap
page by page: CPU the controller pays on every task of every host (issue 25). ``gc.freeze()`` at
each task start moves every object alive then into the collector's permanent generation, which no
collection scans, so a worker only ever scans what it made itself. A play (a rollout batch) that
starts after at least ``COLLECT_AFTER_TASKS`` task starts since the last collection unfreezes and
collects once, so cyclic garbage frozen during the batches before is reclaimed; a full collection
of the controller's heap costs tens of ms, which a one-node run of a few plays need not pay for the
little garbage it makes. Nothing about what runs, or its output, changes; no options, loaded
without being listed in ``callbacks_enabled``.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: fork_gc
type: aggregate
short_description: freeze the controller's heap before workers are forked
description:
  - Calls C(gc.freeze()) at every task start, so forked workers do not copy the controller's heap
    by collecting it; unfreezes and collects once at a play start after enough task starts.
requirements:
  - in the callback plugin path (ansible.cfg callback_plugins); it needs no enabling
"""

import gc
from typing import Any

from ansible.plugins.callback import CallbackBase

# Task starts (per play, not per host) after which the next play start collects: more than one
# node's idempotent site.yml (about 130 task starts), so a one-node run never collects and a
# rollout in batches of one node collects about every second batch. What stays frozen until then
# is the cyclic garbage of those task starts: bounded, however long the rollout.
COLLECT_AFTER_TASKS = 150


def freeze_heap() -> None:
    """Move every object the collector tracks into its permanent generation.

    Not followed by ``gc.get_freeze_count()``: that walks the whole permanent generation (millions
    of objects in ansible-playbook), about a fifth of the controller's CPU on an idempotent run
    when done at every task start (issue 25), where ``gc.freeze()`` itself only relinks lists."""
    gc.freeze()


def collect_frozen() -> int:
    """Give the frozen objects back to the collector and collect once; how many it found unreachable."""
    gc.unfreeze()
    return gc.collect()


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "fork_gc"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks_since_collect = 0

    def v2_playbook_on_play_start(self, play: Any) -> None:
        if self.tasks_since_collect >= COLLECT_AFTER_TASKS:
            collect_frozen()
            self.tasks_since_collect = 0

    def v2_playbook_on_task_start(self, task: Any, is_conditional: bool) -> None:
        self.tasks_since_collect += 1
        freeze_heap()

    def v2_playbook_on_handler_task_start(self, task: Any) -> None:
        self.tasks_since_collect += 1
        freeze_heap()
