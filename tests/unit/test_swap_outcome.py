"""service_swap's declared outcome in words (plugins/filter/swap_outcome.py): what roles/tune records
for a failed candidate, read from service_swap_result, never from the host's failure message."""

from __future__ import annotations

import pytest
from swap_outcome import service_swap_failure_text, tune_candidate_reason

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
