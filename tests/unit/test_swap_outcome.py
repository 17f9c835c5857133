"""service_swap's declared outcome in words (plugins/filter/swap_outcome.py): what roles/tune records
for a failed candidate, read from service_swap_result, never from the host's failure message."""

from __future__ import annotations

import pytest
from swap_outcome import (
    service_swap_failure_text,
    service_swap_rollback_report,
    service_swap_stopped_text,
    tune_candidate_reason,
)

GATE3 = "Gate 3, the drafter's mean acceptance length is above the floor"
LOW = "mean acceptance length 1.2 over 3 requests is under the floor service_swap_min_acceptance_length 2.0"


@pytest.mark.parametrize(
    ("result", "text"),
    [
        ({"failed": True, "msg": "  vLLM did not become healthy  "}, "vLLM did not become healthy"),
        (
            {
                "msg": "One or more items failed",
                "results": [{"failed": True, "msg": "a"}, {"failed": False}, {"failed": True, "msg": "b"}],
            },
            "a\nb",
        ),
        (
            {"msg": "", "stdout": "active\nactivating", "stderr": "x"},
            "it gave up waiting; last output: active activating x",
        ),
        ({}, "failed"),
        (None, "failed"),
    ],
)
def test_failure_text(result, text) -> None:
    assert service_swap_failure_text(result) == text


def test_a_rolled_back_candidate_gives_the_task_and_the_reason_not_the_paragraph() -> None:
    swap = {"status": "rolled_back", "serving": "sglang", "failed_task": GATE3, "reason": LOW}
    # The host's paragraph (host, what was restored, the journal) is not where the reason comes from.
    failed = {"msg": f'service_swap failed on n1 at "{GATE3}": {LOW} Restored: vllm-qwen.service stopped'}
    assert tune_candidate_reason(swap, failed) == f"{GATE3}: {LOW}"


def test_a_refused_candidate_gives_the_refusal_alone() -> None:
    swap = {
        "status": "refused",
        "failed_task": "Check the tree state fits",
        "reason": "a DDTree request keeps 65 slots",
    }
    assert tune_candidate_reason(swap, {"msg": "a DDTree request keeps 65 slots"}) == "a DDTree request keeps 65 slots"


@pytest.mark.parametrize("swap", [{"status": "ok", "serving": "vllm"}, {}, None, {"status": "rolled_back"}])
def test_a_swap_that_passed_leaves_the_failed_step_s_own_message(swap) -> None:
    assert (
        tune_candidate_reason(swap, {"msg": "openai_bench: connection refused"}) == "openai_bench: connection refused"
    )


def test_a_long_reason_is_one_line_cut_at_a_word() -> None:
    swap = {"status": "refused", "failed_task": "t", "reason": "word\n" * 100}
    out = tune_candidate_reason(swap, {})
    assert len(out) <= 300 and out.endswith("word...") and "\n" not in out


ROLLBACK = {
    "host": "n1",
    "failed_task": GATE3,
    "reason": f"  {LOW} ",
    "vllm_unit": "vllm-qwen.service",
    "unit_restored": True,
    "had_backup": True,
    "sglang_unit": "sglang-qwen.service",
    "sglang_healthy": True,
    "sglang_port": 30000,
    "sglang_problem": "",
    "unit_path": "/etc/systemd/system/vllm-qwen.service",
    "drafter_dir": "/opt/models/d",
    "fact_file": "/etc/ansible/facts.d/service_swap.fact",
    "journal": ["loading", "ready"],
}


def test_the_rollback_paragraph_says_what_failed_what_was_restored_and_where_to_look() -> None:
    assert service_swap_rollback_report(ROLLBACK) == (
        f'service_swap failed on n1 at "{GATE3}": {LOW} Restored: vllm-qwen.service stopped and disabled (previous '
        "unit file put back); sglang-qwen.service started, enabled at boot and answering /health on port 30000, so "
        "the node serves as before. Look at: journalctl -u vllm-qwen.service (last lines below), the unit "
        "/etc/systemd/system/vllm-qwen.service, the drafter at /opt/models/d and the local fact "
        "/etc/ansible/facts.d/service_swap.fact; fix the cause and re-run, the swap starts over. vLLM journal tail: "
        "loading | ready"
    )


@pytest.mark.parametrize(
    ("restored", "backup", "unit"),
    [
        ("False", "True", "unit file unchanged"),
        (False, False, "the new unit file is left in place, disabled"),
        ("true", False, "previous unit file put back"),
    ],
)
def test_the_rollback_paragraph_names_what_became_of_the_unit_file(restored, backup, unit) -> None:
    text = service_swap_rollback_report({**ROLLBACK, "unit_restored": restored, "had_backup": backup})
    assert f"Restored: vllm-qwen.service stopped and disabled ({unit});" in text


def test_the_rollback_paragraph_warns_when_sglang_did_not_come_back() -> None:
    text = service_swap_rollback_report({**ROLLBACK, "sglang_healthy": False, "sglang_problem": "exit 1"})
    assert (
        "WARNING: sglang-qwen.service did NOT come back healthy (exit 1): this node serves nothing; see journalctl -u "
        "sglang-qwen.service." in text
    )
    assert "so the node serves as before" not in text


def test_the_final_failure_points_at_the_reason_instead_of_repeating_it() -> None:
    refused = {"status": "refused", "failed_task": "Check the pair fits", "reason": "32 requests ... need"}
    assert service_swap_stopped_text(refused, "n1") == (
        'service_swap refused on n1 at "Check the pair fits": the reason is above, and in service_swap_result.reason.'
    )
    rolled = {"status": "rolled_back", "failed_task": GATE3, "reason": LOW}
    text = service_swap_stopped_text(rolled, "n1")
    assert text.startswith(f'service_swap rolled back on n1 at "{GATE3}"') and LOW not in text
    assert service_swap_stopped_text(None, "n1").startswith('service_swap refused on n1 at "unknown task"')
