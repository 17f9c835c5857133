"""Task runs that never leave the controller run in its own process, not in a forked worker.

ansible-playbook's strategies fork one worker per task and host. On an idempotent site.yml run
most task runs are not module round trips: a set_fact, an assert, a debug message, a role's
argument check, or a task whose ``when`` is false. Each such worker costs the controller about
27 ms of CPU (half of it the page faults of a fork of a heap of tens of MB) for work of about a
millisecond (issue 25). This callback wraps the strategies' ``_queue_task`` so that this work is
done in the controller's process, with the same TaskExecutor a worker runs, and its result goes
into the same results queue, so what runs, its results, registered variables, facts, callbacks
and output stay the same. Everything else is forked as before.

Done in the controller's process:

- a task whose action runs only on the controller (set_fact, assert, debug, fail,
  validate_argument_spec), on a copy of the task and its blocks (the executor templates them in
  place, which a worker does on its own copy);
- for any other task, its ``when``: where it is false, the skipped result is made here, the one
  the worker would make; where it is true or cannot be worked out, the task is forked.

Left to a worker: whatever has a loop, delegate_to, async, until (retries sleep), a timeout or a
debugger, and handlers.
``DFLASH_INLINE_TASKS=0`` in the environment turns it off (every task forked, as ansible-core
does). No options otherwise, loaded without being listed in ``callbacks_enabled``.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: inline_tasks
type: aggregate
short_description: run controller-only task runs without forking a worker
description:
  - Task runs that never leave the controller (set_fact, assert, debug, fail,
    validate_argument_spec, and a task whose when is false) run in the controller's process instead
    of a forked worker; the rest are forked as ansible-core does.
  - DFLASH_INLINE_TASKS=0 in the environment turns it off.
requirements:
  - in the callback plugin path (ansible.cfg callback_plugins); it needs no enabling
"""

import functools
import os
import typing as t

from ansible.errors import AnsibleError
from ansible.executor.task_executor import TaskExecutor
from ansible.playbook.handler import Handler
from ansible.plugins import loader as plugin_loader
from ansible.plugins.callback import CallbackBase
from ansible.plugins.strategy import StrategyBase
from ansible.utils.display import Display
from ansible.utils.fqcn import add_internal_fqcns

try:  # ansible-core's internals as of the pinned 2.19 (requirements.txt); without them, every task is forked
    from ansible._internal import _display_utils, _task
    from ansible._internal._errors import _error_utils
    from ansible._internal._templating._engine import TemplateEngine
    from ansible.executor.task_result import _RawTaskResult
except ImportError:  # pragma: no cover - another ansible-core
    _RawTaskResult = None

display = Display()

CONTROLLER_ONLY = frozenset(add_internal_fqcns(("set_fact", "assert", "debug", "fail", "validate_argument_spec")))
SKIPPED = {"changed": False, "skipped": True, "skip_reason": "Conditional result was False"}


def inlinable(task: t.Any) -> bool:
    """Whether the task's run (or its skip) can be worked out without a worker."""
    return not (
        isinstance(task, Handler)
        or task.loop is not None
        or task.loop_with
        or task.delegate_to
        or task.async_val
        or task.timeout
        or task.until
        or task.debugger
    )


def queue_task(original: t.Callable[..., None], self: StrategyBase, host, task, task_vars, play_context) -> None:
    """StrategyBase._queue_task: here where the task run never leaves the controller, else original."""
    if inlinable(task):
        try:
            if task.action in CONTROLLER_ONLY:
                run_here(self, host, task, task_vars, play_context)
                return
            result = skip_here(self, host, task, task_vars, play_context)
        except Exception as ex:  # the worker works out (and reports) the same
            display.debug(f"inline_tasks: forking {task.get_name()} for {host.name}: {ex}")
            result = None
        if result is not None:
            self._tqm.send_callback("v2_runner_on_start", host, task)
            hand_over(self, host, task, task, result, task_vars, play_context)
            return
    original(self, host, task, task_vars, play_context)


def run_here(self, host, task, task_vars, play_context) -> None:
    """The worker's TaskExecutor run, here, on a copy of the task and its blocks."""
    copy = task.copy(exclude_tasks=True)
    self._tqm.send_callback("v2_runner_on_start", host, task)
    with _task.TaskContext(copy):
        result = TaskExecutor(
            host,
            copy,
            task_vars,
            play_context,
            self._loader,
            plugin_loader.get_plugin_loader_namespace(),
            self._final_q,
            self._variable_manager,
        ).run()
    hand_over(self, host, task, copy, result, task_vars, play_context)


def skip_here(self, host, task, task_vars, play_context) -> dict[str, t.Any] | None:
    """The skipped result the worker would make where the task's when is false, else None."""
    if not task.when:
        return None
    templar = TemplateEngine(loader=self._loader, variables=task_vars)
    tempvars = task_vars.copy()
    with _display_utils.DeferredWarningContext(variables=tempvars) as warning_ctx:
        # As TaskExecutor does before the conditional: the connection variables of the host.
        context = play_context.set_task_and_variable_override(task=task, variables=task_vars, templar=templar)
        context.post_validate(templar=templar)
        if not context.remote_addr:
            context.remote_addr = host.address
        context.update_vars(tempvars)
        rc: dict[str, t.Any] = {}
        if task._resolve_conditional(task.when, tempvars, result_context=rc):
            return None
        result = dict(SKIPPED) | rc
        task.update_result_no_log(templar, result)
    if warnings := warning_ctx.get_warnings():
        result.update(warnings=warnings)
    if deprecations := warning_ctx.get_deprecation_warnings():
        result.update(deprecations=deprecations)
    return result


def hand_over(self, host, task, ran, result, task_vars, play_context) -> None:
    """Into the results queue, as a worker puts it, counted and cached as _queue_task does."""
    self._queued_task_cache[(host.name, task._uuid)] = {
        "host": host,
        "task": task,
        "task_vars": task_vars,
        "play_context": play_context,
    }
    try:
        self._final_q.send_task_result(
            _RawTaskResult(host=host, task=ran, return_data=result, task_fields=ran.dump_attrs())
        )
    except Exception as ex:
        try:
            raise AnsibleError("Task result omitted due to queue send failure.") from ex
        except Exception as wrapper:
            self._final_q.send_task_result(
                _RawTaskResult(
                    host=host,
                    task=ran,
                    return_data=_error_utils.result_dict_from_exception(wrapper),
                    task_fields={},
                )
            )
    self._pending_results += 1


def install() -> bool:
    """Wrap StrategyBase._queue_task (once per process); whether it is wrapped."""
    original = StrategyBase._queue_task
    if getattr(original, "inline_tasks", False):
        return True
    if os.environ.get("DFLASH_INLINE_TASKS", "1") == "0" or _RawTaskResult is None:
        return False

    @functools.wraps(original)
    def wrapped(self, host, task, task_vars, play_context):
        queue_task(original, self, host, task, task_vars, play_context)

    wrapped.inline_tasks = True  # type: ignore[attr-defined]
    StrategyBase._queue_task = wrapped
    return True


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "inline_tasks"
    CALLBACK_NEEDS_ENABLED = False

    def v2_playbook_on_start(self, playbook: t.Any) -> None:
        install()
