"""How a run of service_swap ended, in words, for the role itself and for the roles that call it.

service_swap declares its outcome as the result fact ``service_swap_result`` (docs/service_swap.md,
"The result"): ``status`` is ``ok`` (vLLM serves behind its gates), ``rolled_back`` (a gate failed
and SGLang was put back; ``failed_task`` and ``reason`` say what failed), ``restored`` (SGLang put
back on request) or ``refused`` (it stopped before any engine was stopped or started; ``failed_task``
and ``reason``). A caller reads those fields; it never takes the host's failure message apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The failure statuses whose reason is service_swap's own (the others leave no reason to quote).
FAILED = ("rolled_back", "refused")
# A candidate's reason in the tuning record and table is cut at a word to about this many characters.
REASON_WIDTH = 300


def service_swap_failure_text(result: Any) -> str:
    """The operator's sentence of a failed task's result (``ansible_failed_result``).

    A loop's failed items' messages, one per line; else ``msg``; else, for a command that ran out of
    retries without a message, its last output. Never empty.
    """
    if not isinstance(result, Mapping):
        return "failed"
    items = result.get("results")
    if isinstance(items, list):
        msgs = [str(r.get("msg")) for r in items if isinstance(r, Mapping) and r.get("failed") and r.get("msg")]
        if msgs:
            return "\n".join(msgs)
    msg = str(result.get("msg") or "").strip()
    if msg:
        return msg
    out = " ".join(str(result.get(k) or "").replace("\n", " ").strip() for k in ("stdout", "stderr")).strip()
    return f"it gave up waiting; last output: {out}" if out else "failed"


def _cut(text: str, width: int = REASON_WIDTH) -> str:
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    head = text[: width - 3]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + "..."


def tune_candidate_reason(swap_result: Any, failed_result: Any) -> str:
    """Why a tuning candidate failed, for its record: service_swap's declared outcome where the swap
    failed (``task: reason`` after a rollback, the refusal alone when it stopped before any engine
    moved), else the failed step's own message (the benchmark's). Without the host, without what
    was restored; one line, cut at a word."""
    swap = swap_result if isinstance(swap_result, Mapping) else {}
    if swap.get("status") in FAILED and swap.get("reason"):
        reason = str(swap["reason"])
        task = str(swap.get("failed_task") or "")
        text = f"{task}: {reason}" if swap["status"] == "rolled_back" and task else reason
    else:
        text = service_swap_failure_text(failed_result)
    return _cut(text)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "service_swap_failure_text": service_swap_failure_text,
            "tune_candidate_reason": tune_candidate_reason,
        }
