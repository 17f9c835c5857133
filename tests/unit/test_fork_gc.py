"""plugins/callback/fork_gc.py: the heap is frozen before each task's workers fork, and given back per play."""

import gc
import weakref

from fork_gc import COLLECT_AFTER_TASKS, CallbackModule


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_task_start_freezes_what_exists_and_a_play_start_after_enough_tasks_collects_frozen_garbage() -> None:
    cb = CallbackModule()
    try:
        gc.unfreeze()
        cycle = Node()
        gone = weakref.ref(cycle)
        cb.v2_playbook_on_task_start(task=None, is_conditional=False)
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert gone() is not None  # frozen: no collection frees it while the play runs
        cb.v2_playbook_on_play_start(play=None)
        assert gone() is not None  # one task since the last collection: not worth a full collection yet
        for _ in range(COLLECT_AFTER_TASKS - 1):
            cb.v2_playbook_on_task_start(task=None, is_conditional=False)
        cb.v2_playbook_on_play_start(play=None)
        assert gc.get_freeze_count() == 0
        assert gone() is None  # the next play (rollout batch) reclaims it
        assert cb.tasks_since_collect == 0
    finally:
        gc.unfreeze()


def test_handler_start_freezes_too() -> None:
    cb = CallbackModule()
    try:
        gc.unfreeze()
        cb.v2_playbook_on_handler_task_start(task=None)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
