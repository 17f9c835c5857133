"""Action plugin (controller side): wait for an inference server's /health, saying what it waits for.

A vLLM start takes minutes (weights, torch.compile, CUDA graphs). Polling it with ``until:`` and
``retries:`` printed one "FAILED - RETRYING" line per poll, hundreds per host for a normal start.
This plugin polls with the ``openai_probe`` module itself (``requests: 0``: /health and the unit's
state) and prints one line when the phase it reads from the unit's journal changes, or every
``progress_s`` seconds, such as::

    qwen-ct101: waiting for vllm-qwen.service's /health: capturing CUDA graphs (3m05s; /health: connection refused)

It returns the last probe's result (``healthy``, ``unit_problem``, ``health_status``, ``error``,
``unit_state``) plus ``waited_s`` and ``phases``, and never fails on what it finds: the caller's
gate asserts on the result, as with the module. It stops early, like the module's callers did,
when the unit failed or crash-loops.

Options: the module's (``url``, ``unit``, ``max_restarts``, ``timeout``, ...), plus ``wait_s`` (the
most to wait, seconds), ``poll_s`` (between probes, default 5), ``progress_s`` (a line at least
this often while the phase stays the same, default 30) and ``journal_lines`` (lines of the unit's
journal read per poll to find the phase, default 40; 0 reads none).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C
from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

_HERE = Path(__file__).resolve().parent
for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(_HERE.parent.parent / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.terminal_text import terminal_text, terminal_values

display = Display()

MODULE = "openai_probe"
OWN = ("wait_s", "poll_s", "progress_s", "journal_lines")

# What a starting engine logs, newest match wins: (pattern, the phase an operator reads).
# vLLM 0.20's start-up lines; SGLang's loading lines share the weight-loading wording.
PHASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), phase)
    for p, phase in (
        (
            r"Starting to load model|Loading (safetensors )?checkpoint shards|Loading weights(?! took)",
            "loading weights",
        ),
        (r"Loading weights took|Model loading took", "weights loaded"),
        (r"torch\.compile|Compiling a graph|Dynamo bytecode transform|compil(e|ing) (the )?model", "compiling"),
        (r"KV cache|profil(e|ing) run|Memory profiling", "sizing the KV cache"),
        (r"Capturing (CUDA|cuda) ?graphs?|Graph capturing|cudagraph capture", "capturing CUDA graphs"),
        (r"Starting vLLM API server|Uvicorn running|Application startup complete", "starting the API server"),
    )
)


def phase_of(lines: list[str]) -> str:
    """The start-up phase the newest recognised journal line names; 'starting' when none does."""
    for line in reversed(lines):
        for pattern, phase in PHASES:
            if pattern.search(line):
                return phase
    return "starting"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_line(host: str, unit: str, phase: str, waited: float, probe: dict[str, Any]) -> str:
    what = f"{terminal_text(unit, 200)}'s /health" if unit else "/health"
    status = probe.get("health_status")
    last = f"answered {status}" if status else (probe.get("error") or "no answer")
    # The probe's error is the server's or the network's words: no escape sequence reaches the terminal (issue 43).
    return f"{terminal_text(host, 200)}: waiting for {what}: {phase} ({duration(waited)}; /health: {terminal_text(last, 500)})"


class Progress:
    """Decides when a line is due: the phase changed, or progress_s passed since the last line."""

    def __init__(self, progress_s: float) -> None:
        self.progress_s = progress_s
        self.phase: str | None = None
        self.last = float("-inf")

    def due(self, phase: str, now: float) -> bool:
        if phase != self.phase or now - self.last >= self.progress_s:
            self.phase, self.last = phase, now
            return True
        return False


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = True

    def _int(self, name: str, default: int | None, minimum: int) -> int:
        raw = self._task.args.get(name, default)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise AnsibleActionFail(f"openai_wait: {name} must be a whole number of seconds, not {raw!r}.") from None
        if value < minimum:
            raise AnsibleActionFail(f"openai_wait: {name} is {value}; it must be at least {minimum}.")
        return value

    def _journal(self, unit: str, lines: int, since_s: int, task_vars: dict[str, Any]) -> list[str]:
        if not unit or lines <= 0:
            return []
        argv = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines), "-u", unit, f"--since=-{since_s}s"]
        res = self._execute_module(
            module_name="ansible.builtin.command", module_args={"argv": argv}, task_vars=task_vars
        )
        return str(res.get("stdout") or "").splitlines() if res.get("rc") == 0 else []

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        wait_s = self._int("wait_s", None, 0)
        poll_s = self._int("poll_s", 5, 1)
        progress = Progress(self._int("progress_s", 30, 1))
        journal_lines = self._int("journal_lines", 40, 0)
        args = {k: v for k, v in self._task.args.items() if k not in OWN}
        if int(args.get("requests") or 0):
            raise AnsibleActionFail("openai_wait waits for /health only: leave requests out (use openai_probe).")
        host = task_vars.get("inventory_hostname", "?")
        unit = str(args.get("unit") or "")

        start = time.monotonic()
        phases: list[dict[str, Any]] = []
        polls = 0
        while True:
            probe = self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars)
            polls += 1
            waited = time.monotonic() - start
            if probe.get("failed"):
                result.update(probe)  # bad parameters: the module's own message
                return result
            if probe.get("healthy") or probe.get("unit_problem") or waited >= wait_s:
                break
            phase = phase_of(self._journal(unit, journal_lines, int(waited) + poll_s + 5, task_vars))
            if not phases or phases[-1]["phase"] != phase:
                phases.append({"phase": phase, "after_s": round(waited)})
            if progress.due(phase, waited):
                display.display(progress_line(host, unit, phase, waited, probe))
            time.sleep(min(poll_s, max(0.0, wait_s - waited)))

        for key in ("invocation", "_ansible_no_log"):
            probe.pop(key, None)
        for key in ("error", "unit_problem", "unit_state"):  # the module cleans them too; a gate prints them
            if key in probe:
                probe[key] = terminal_values(probe[key], 2000)
        result.update(probe)
        result.update(changed=False, waited_s=round(time.monotonic() - start), polls=polls, phases=phases)
        return result
