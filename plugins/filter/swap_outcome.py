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


def _yes(value: Any) -> bool:
    """A flag as templating hands it over: True, or the text true."""
    return value is True or str(value).strip().lower() == "true"


def service_swap_rollback_report(facts: Mapping[str, Any]) -> str:
    """The one paragraph a host fails with after the swap's rescue put SGLang back (tasks/rollback.yml):
    what failed, what was restored, whether SGLang answers, where to look, and the tail of vLLM's journal.

    ``facts``: host, failed_task, reason, vllm_unit, unit_restored (the previous unit file was put back),
    had_backup (a previous unit file existed), sglang_unit, sglang_healthy, sglang_port, sglang_problem,
    unit_path, drafter_dir, fact_file, journal (lines, already cleaned for a terminal).
    """
    f = facts if isinstance(facts, Mapping) else {}
    if _yes(f.get("unit_restored")):
        unit = "previous unit file put back"
    elif _yes(f.get("had_backup")):
        unit = "unit file unchanged"
    else:
        unit = "the new unit file is left in place, disabled"
    sglang = f.get("sglang_unit", "")
    if _yes(f.get("sglang_healthy")):
        serving = f"{sglang} started, enabled at boot and answering /health on port {f.get('sglang_port', '')}, so the node serves as before."
    else:
        serving = (
            f"WARNING: {sglang} did NOT come back healthy ({f.get('sglang_problem', '')}): this node serves nothing; "
            f"see journalctl -u {sglang}."
        )
    journal = f.get("journal") or []
    lines = " | ".join(str(line) for line in journal) if isinstance(journal, list) else str(journal)
    vllm = f.get("vllm_unit", "")
    return " ".join(
        [
            f'service_swap failed on {f.get("host", "")} at "{f.get("failed_task", "")}": {str(f.get("reason", "")).strip()}',
            f"Restored: {vllm} stopped and disabled ({unit});",
            serving,
            f"Look at: journalctl -u {vllm} (last lines below), the unit {f.get('unit_path', '')}, the drafter at "
            f"{f.get('drafter_dir', '')} and the local fact {f.get('fact_file', '')}; fix the cause and re-run, the swap "
            "starts over.",
            f"vLLM journal tail: {lines}",
        ]
    )


def service_swap_stopped_text(result: Any, host: str) -> str:
    """The host's failure after main.yml's rescue recorded service_swap_result: one line pointing at the
    reason already printed by the task that failed (printing it again doubled every refusal, issue 44)."""
    r = result if isinstance(result, Mapping) else {}
    status = r.get("status") or "refused"
    return (
        f"service_swap {'rolled back' if status == 'rolled_back' else 'refused'} on {host} at "
        f'"{r.get("failed_task") or "unknown task"}": the reason is above, and in service_swap_result.reason.'
    )


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "service_swap_failure_text": service_swap_failure_text,
            "service_swap_rollback_report": service_swap_rollback_report,
            "service_swap_stopped_text": service_swap_stopped_text,
            "tune_candidate_reason": tune_candidate_reason,
        }
