"""roles/tune's choice between the DFlash chain and DDTree budgets (plugins/filter/tune_choice.py)."""

from __future__ import annotations

import pytest
from tune_choice import (
    tune_candidate_name,
    tune_candidate_problems,
    tune_choose,
    tune_ddtree_unavailable,
    tune_inputs_digest,
    tune_order_results,
    tune_plan,
    tune_plan_message,
    tune_read_prompts,
    tune_read_record,
    tune_swap_serving,
)

DEFAULTS = [
    {"method": "dflash"},
    {"method": "ddtree", "budget": 16},
    {"method": "ddtree", "budget": 32},
    {"method": "ddtree", "budget": 64},
]


def measured(method: str, budget: int | None, tok_s_c1: float, tok_s_c4: float, acc: float = 6.0) -> dict:
    return {
        "method": method,
        "budget": budget,
        "status": "ok",
        "reason": "",
        "levels": [
            {"concurrency": 1, "throughput_tok_s": tok_s_c1, "mean_acceptance_length": acc},
            {"concurrency": 4, "throughput_tok_s": tok_s_c4, "mean_acceptance_length": acc},
        ],
    }


def failed(method: str, budget: int | None, reason: str) -> dict:
    return {"method": method, "budget": budget, "status": "failed", "reason": reason, "levels": []}


def test_names() -> None:
    assert [tune_candidate_name(c) for c in DEFAULTS] == ["dflash", "ddtree-16", "ddtree-32", "ddtree-64"]


def test_the_default_candidates_are_fine() -> None:
    assert tune_candidate_problems(DEFAULTS, 15) == []


@pytest.mark.parametrize(
    ("candidates", "problem"),
    [
        (
            [],
            "tune_candidates must be a non-empty list such as [{method: dflash}, {method: ddtree, budget: 32}], not '[]'",
        ),
        (
            "dflash",
            "tune_candidates must be a non-empty list such as [{method: dflash}, {method: ddtree, budget: 32}], not 'dflash'",
        ),
        (
            [{"method": "ddtree", "budget": 32}],
            "tune_candidates has no {method: dflash}: the chain is the yardstick (DDTree serves only when it beats it), "
            "so it must be measured; add it",
        ),
        (
            [{"method": "dflash"}, {"method": "eagle"}],
            "tune_candidates[1] has method 'eagle'; it must be dflash or ddtree",
        ),
        (
            [{"method": "dflash"}, {"method": "ddtree", "budget": "32"}],
            "tune_candidates[1] is a DDTree candidate without an integer budget (got '32')",
        ),
        (
            [{"method": "dflash"}, {"method": "ddtree", "budget": 8}],
            "tune_candidates[1] has budget 8, below shared_settings_num_speculative_tokens (15): a DDTree budget is at "
            "least the tree's depth",
        ),
        (
            [{"method": "dflash", "budget": 16}],
            "tune_candidates[0] is the DFlash chain, which has no budget: remove its budget",
        ),
        (
            [{"method": "dflash"}, {"method": "ddtree", "budget": 32, "bugdet": 1}],
            "tune_candidates[1] has unknown key(s) bugdet; only method and budget are read",
        ),
        (
            [{"method": "dflash"}, {"method": "ddtree", "budget": 32}, {"method": "ddtree", "budget": 32}],
            "tune_candidates lists ddtree-32 more than once",
        ),
        (
            [{"method": "dflash"}, "ddtree"],
            "tune_candidates[1] is 'ddtree'; each candidate is a mapping with a method (and a budget)",
        ),
    ],
)
def test_bad_candidates_are_named(candidates: object, problem: str) -> None:
    assert problem in tune_candidate_problems(candidates, 15)


def test_ddtree_wins_when_it_beats_the_chain_by_the_margin() -> None:
    out = tune_choose(
        [
            measured("dflash", None, 100.0, 300.0),
            measured("ddtree", 16, 104.0, 290.0),
            measured("ddtree", 32, 122.0, 280.0),
        ],
        0.05,
        1,
    )
    assert (out["winner"], out["method"], out["budget"]) == ("ddtree-32", "ddtree", 32)
    assert out["reason"] == "ddtree-32 122.0 tok/s at concurrency 1 is x1.220 the chain's 100.0, at least the 5% margin"
    assert [(r["name"], r["tok_s"], r["vs_chain"], r["chosen"]) for r in out["rows"]] == [
        ("dflash", 100.0, 1.0, False),
        ("ddtree-16", 104.0, 1.04, False),
        ("ddtree-32", 122.0, 1.22, True),
    ]


def test_a_ddtree_faster_by_less_than_the_margin_leaves_the_chain() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 300.0), measured("ddtree", 16, 104.9, 310.0)], 0.05, 1)
    assert (out["winner"], out["method"], out["budget"]) == ("dflash", "dflash", None)
    assert out["reason"] == (
        "the chain 100.0 tok/s at concurrency 1: the fastest DDTree, ddtree-16 at 104.9 (x1.049), "
        "does not beat it by the 5% margin"
    )


def test_exactly_the_margin_is_enough() -> None:
    assert tune_choose([measured("dflash", None, 100.0, 1.0), measured("ddtree", 16, 105.0, 1.0)], 0.05, 1)[
        "winner"
    ] == ("ddtree-16")


def test_the_chosen_concurrency_decides() -> None:
    results = [measured("dflash", None, 100.0, 300.0), measured("ddtree", 32, 130.0, 250.0)]
    assert tune_choose(results, 0.05, 1)["winner"] == "ddtree-32"
    out = tune_choose(results, 0.05, 4)
    assert out["winner"] == "dflash"
    assert [r["vs_chain"] for r in out["rows"]] == [1.0, 0.833]


def test_never_slower_than_the_chain_even_with_no_margin() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 1.0), measured("ddtree", 16, 90.0, 1.0)], 0.0, 1)
    assert out["winner"] == "dflash"


def test_a_failed_candidate_is_never_chosen_and_keeps_its_reason() -> None:
    out = tune_choose(
        [
            measured("dflash", None, 100.0, 1.0),
            failed("ddtree", 64, "vLLM did not become healthy: the unit failed"),
            measured("ddtree", 32, 120.0, 1.0),
        ],
        0.05,
        1,
    )
    assert out["winner"] == "ddtree-32"
    row = out["rows"][1]
    assert (row["name"], row["status"], row["tok_s"], row["vs_chain"], row["chosen"], row["note"]) == (
        "ddtree-64",
        "failed",
        None,
        None,
        False,
        "vLLM did not become healthy: the unit failed",
    )


def test_a_candidate_without_figures_at_the_concurrency_counts_as_failed() -> None:
    ok = measured("ddtree", 16, 500.0, 1.0)
    ok["levels"] = ok["levels"][1:]
    out = tune_choose([measured("dflash", None, 100.0, 1.0), ok], 0.05, 1)
    assert out["winner"] == "dflash"
    assert out["reason"] == "the chain 100.0 tok/s at concurrency 1: no DDTree candidate passed its gates"
    assert out["rows"][1]["note"] == "no figures at concurrency 1"


def test_without_a_chain_the_fastest_that_passed_serves_and_says_so() -> None:
    out = tune_choose(
        [failed("dflash", None, "mean acceptance length 1.1 is under the floor"), measured("ddtree", 16, 80.0, 1.0)],
        0.05,
        1,
    )
    assert out["winner"] == "ddtree-16"
    assert out["reason"] == (
        "the DFlash chain failed its gates (mean acceptance length 1.1 is under the floor), so ddtree-16 serves as "
        "the fastest candidate that passed (80.0 tok/s at concurrency 1), not compared with a chain"
    )


def test_all_failed_has_no_winner() -> None:
    out = tune_choose([failed("dflash", None, "dies"), failed("ddtree", 16, "never healthy")], 0.05, 1)
    assert (out["winner"], out["method"], out["budget"]) == (None, None, None)
    assert out["reason"] == "every candidate failed, so none serves (dflash: dies; ddtree-16: never healthy)"


def test_equal_trees_prefer_the_smaller_budget() -> None:
    out = tune_choose(
        [measured("dflash", None, 100.0, 1.0), measured("ddtree", 64, 120.0, 1.0), measured("ddtree", 32, 120.0, 1.0)],
        0.05,
        1,
    )
    assert out["winner"] == "ddtree-32"


def test_the_digest_ignores_key_order_and_sees_every_change() -> None:
    a = {"vllm_version": "0.20.1", "candidates": ["dflash", "ddtree-16"], "gpus": [{"name": "H200"}]}
    b = {"gpus": [{"name": "H200"}], "candidates": ["dflash", "ddtree-16"], "vllm_version": "0.20.1"}
    assert tune_inputs_digest(a) == tune_inputs_digest(b)
    assert len(tune_inputs_digest(a)) == 64
    assert tune_inputs_digest(a) != tune_inputs_digest({**a, "vllm_version": "0.20.2"})
    assert tune_inputs_digest(a) != tune_inputs_digest({**a, "candidates": ["dflash"]})


# --- DDTree not available on the node, prompts, records and service_swap's fact ----------------

NO_TREE = "the target has Mamba layers (mamba2): trees need branch-local state"


def skipped(budget: int) -> dict:
    return {
        "method": "ddtree",
        "budget": budget,
        "status": "skipped",
        "reason": f"not measured: DDTree is not available on this node: {NO_TREE}",
    }


def test_without_ddtree_only_the_chain_is_started_and_the_rest_say_why() -> None:
    plan = tune_plan(DEFAULTS, NO_TREE)
    assert plan["measure"] == [{"method": "dflash"}]
    assert plan["skipped"] == [skipped(16), skipped(32), skipped(64)]


def test_with_ddtree_every_candidate_is_started() -> None:
    assert tune_plan(DEFAULTS, "") == {"measure": DEFAULTS, "skipped": []}


def test_the_chain_serves_when_no_ddtree_was_measured_and_says_why() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 1.0), skipped(16), skipped(32)], 0.05, 1)
    assert (out["winner"], out["budget"]) == ("dflash", None)
    assert out["reason"] == (
        "the chain 100.0 tok/s at concurrency 1: no DDTree candidate was measured (not measured: DDTree is not "
        "available on this node: the target has Mamba layers (mamba2): trees need branch-local state)"
    )
    assert [r["status"] for r in out["rows"]] == ["ok", "skipped", "skipped"]


def test_a_chain_only_list_says_it_lists_no_budget() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 1.0)], 0.05, 1)
    assert out["reason"] == "the chain 100.0 tok/s at concurrency 1: tune_candidates lists no DDTree budget"


def test_a_failed_chain_with_every_tree_skipped_has_no_winner() -> None:
    out = tune_choose([failed("dflash", None, "dies"), skipped(16)], 0.05, 1)
    assert out["winner"] is None
    assert out["reason"] == (
        "no candidate passed, so none serves (dflash: dies; ddtree-16: not measured: DDTree is not available on "
        "this node: the target has Mamba layers (mamba2): trees need branch-local state)"
    )


def test_results_come_back_in_the_candidates_order() -> None:
    results = [measured("dflash", None, 1.0, 1.0), skipped(16), skipped(64), failed("ddtree", 32, "x")]
    names = [tune_candidate_name(r) for r in tune_order_results(results, DEFAULTS)]
    assert names == ["dflash", "ddtree-16", "ddtree-32", "ddtree-64"]


def test_ddtree_patch_s_reason_comes_first() -> None:
    assert tune_ddtree_unavailable(" " + NO_TREE + " ", True, "/opt/vllm/0.20.1", "") == NO_TREE


def test_no_change_set_record_means_no_ddtree() -> None:
    assert tune_ddtree_unavailable(None, False, "/opt/vllm/0.20.1", "") == (
        "the DDTree change set is not applied to /opt/vllm/0.20.1 (no vllm-changeset.json): run site.yml "
        "(ddtree_patch with ddtree_patch_state present) to measure DDTree budgets"
    )


def test_the_target_s_own_reason_applies_without_ddtree_patch() -> None:
    assert tune_ddtree_unavailable(None, True, "/v", NO_TREE) == NO_TREE
    assert tune_ddtree_unavailable("", True, "/v", "") == ""


FIX = "point tune_prompts_file at a JSON list of prompt strings such as playbooks/files/bench_prompts.json"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", f"tune_prompts_file /p.json is missing or empty on the controller: {FIX}"),
        (None, f"tune_prompts_file /p.json is missing or empty on the controller: {FIX}"),
        (
            '["a", ',
            f"tune_prompts_file /p.json is not JSON (Expecting value: line 1 column 7 (char 6)): {FIX}",
        ),
        ('{"a": 1}', f"tune_prompts_file /p.json holds dict, not a list of prompts: {FIX}"),
        ("[]", f"tune_prompts_file /p.json holds an empty list, not a list of prompts: {FIX}"),
        (
            '["a", 3, " "]',
            f"tune_prompts_file /p.json has entries that are not non-empty strings (index 1, 2): {FIX}",
        ),
    ],
)
def test_a_bad_prompt_file_is_named_with_what_is_wrong(text: object, problem: str) -> None:
    assert tune_read_prompts(text, "/p.json") == {"prompts": [], "problem": problem}


def test_a_good_prompt_file_gives_its_prompts() -> None:
    assert tune_read_prompts('["one", "two"]', "/p.json") == {"prompts": ["one", "two"], "problem": ""}


@pytest.mark.parametrize(
    ("text", "serving"),
    [('{"phase": "swapped", "serving": "vllm"}', "vllm"), ('{"serving": "sglang"}', "sglang"), ("{", ""), ("", "")],
)
def test_what_the_swap_fact_says_serves(text: str, serving: str) -> None:
    assert tune_swap_serving(text) == serving


@pytest.mark.parametrize(
    ("data", "serving"),
    [({"phase": "swapped", "serving": "vllm"}, "vllm"), ({"serving": 5}, ""), ([], ""), (None, ""), (7, "")],
)
def test_the_swap_fact_may_come_parsed(data: object, serving: str) -> None:
    """json_file_info returns the fact parsed (data), None when the file is absent."""
    assert tune_swap_serving(data) == serving


def test_a_broken_record_counts_as_never_tuned() -> None:
    good = '{"inputs_digest": "ab", "inputs": {}, "results": [{"method": "dflash"}]}'
    assert tune_read_record(good) == {"inputs_digest": "ab", "inputs": {}, "results": [{"method": "dflash"}]}
    for bad in ("", "{", "[]", '{"inputs_digest": 1, "results": []}', '{"inputs_digest": "ab", "results": [1]}'):
        assert tune_read_record(bad) == {}


def test_the_record_may_come_parsed() -> None:
    good = {"inputs_digest": "ab", "inputs": {}, "results": [{"method": "dflash"}]}
    assert tune_read_record(good) == good
    for bad in (None, [], 3, {"inputs_digest": 1, "results": []}, {"inputs_digest": "ab", "results": [1]}):
        assert tune_read_record(bad) == {}


PLAN = {"measure": [{"method": "dflash"}, {"method": "ddtree", "budget": 32}], "skipped": []}


def test_the_plan_message_says_what_is_measured_and_why() -> None:
    what = {
        "measure": True,
        "check_mode": False,
        "force": False,
        "tuned_before": True,
        "plan": PLAN,
        "concurrency": [1, 2, 4],
        "pick_concurrency": 1,
        "ddtree_unavailable": "",
        "digest": "ab" * 32,
        "choice": None,
    }
    assert tune_plan_message(what) == (
        "Measuring dflash, ddtree-32 at concurrency 1, 2, 4 (inputs changed since the last tuning), each restarted"
        " behind the swap's gates, then serve the fastest at concurrency 1."
    )
    what.update(check_mode=True, force=True, plan={"measure": [{"method": "dflash"}]}, ddtree_unavailable=NO_TREE)
    assert tune_plan_message(what) == (
        "Would measure dflash at concurrency 1, 2, 4 (tune_force), each restarted behind the swap's gates, then serve"
        f" the fastest at concurrency 1. DDTree budgets not measured: {NO_TREE}."
    )
    what.update(force=False, tuned_before=False)
    assert "(never tuned)" in tune_plan_message(what)


def test_the_plan_message_of_a_node_already_tuned() -> None:
    what = {
        "measure": False,
        "digest": "0123456789abcdef",
        "choice": {"winner": "ddtree-32", "reason": "x1.2 the chain"},
    }
    assert tune_plan_message(what) == (
        "Already tuned with these inputs (digest 0123456789ab): serves ddtree-32, x1.2 the chain."
        " -e tune_force=true measures again."
    )
