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
    tune_traffic_levels,
    tune_traffic_problems,
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


ONE = [{"concurrency": 1, "weight": 1}]
BOTH = [{"concurrency": 1, "weight": 1}, {"concurrency": 4, "weight": 1}]


def test_ddtree_wins_when_it_beats_the_chain_by_the_margin() -> None:
    out = tune_choose(
        [
            measured("dflash", None, 100.0, 300.0),
            measured("ddtree", 16, 104.0, 306.0),
            measured("ddtree", 32, 122.0, 330.0),
        ],
        0.05,
        BOTH,
    )
    assert (out["winner"], out["method"], out["budget"]) == ("ddtree-32", "ddtree", 32)
    assert out["reason"] == (
        "ddtree-32 is weighted x1.160 the chain's tok/s (c=1 x1.220, c=4 x1.100), at least the 5% margin and within"
        " it at every concurrency"
    )
    assert [(r["name"], r["vs_chain"], r["chosen"], r["note"]) for r in out["rows"]] == [
        ("dflash", 1.0, False, ""),
        ("ddtree-16", 1.03, False, ""),
        ("ddtree-32", 1.16, True, ""),
    ]
    assert out["rows"][2]["levels"] == [
        {"concurrency": 1, "tok_s": 122.0, "acceptance": 6.0, "vs_chain": 1.22},
        {"concurrency": 4, "tok_s": 330.0, "acceptance": 6.0, "vs_chain": 1.1},
    ]
    assert out["traffic"] == [{"concurrency": 1, "weight": 1.0}, {"concurrency": 4, "weight": 1.0}]


def test_a_ddtree_faster_by_less_than_the_margin_leaves_the_chain() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 300.0), measured("ddtree", 16, 104.9, 310.0)], 0.05, ONE)
    assert (out["winner"], out["method"], out["budget"]) == ("dflash", "dflash", None)
    assert out["reason"] == (
        "the chain (c=1 100.0 tok/s): the best DDTree within the margin everywhere, ddtree-16, is weighted x1.049"
        " (c=1 x1.049), short of the 5% margin"
    )


def test_exactly_the_margin_is_enough() -> None:
    assert tune_choose([measured("dflash", None, 100.0, 1.0), measured("ddtree", 16, 105.0, 1.0)], 0.05, ONE)[
        "winner"
    ] == ("ddtree-16")


def test_the_winner_differs_between_concurrencies_and_the_traffic_decides() -> None:
    """ddtree-32 is the fastest alone, the chain under load (a step verifies concurrency x (budget + 1) tokens)."""
    results = [
        measured("dflash", None, 100.0, 300.0),
        measured("ddtree", 16, 115.0, 300.0),
        measured("ddtree", 32, 140.0, 270.0),
    ]
    alone = tune_choose(results, 0.05, ONE)
    assert alone["winner"] == "ddtree-32"
    loaded = tune_choose(results, 0.05, [{"concurrency": 4, "weight": 1}])
    assert loaded["winner"] == "dflash"
    assert loaded["reason"] == (
        "the chain (c=4 300.0 tok/s): the best DDTree within the margin everywhere, ddtree-16, is weighted x1.000"
        " (c=4 x1.000), short of the 5% margin"
    )
    assert (
        loaded["rows"][2]["note"] == "refused: at concurrency 4 it is x0.900 the chain, more than the 5% margin slower"
    )
    # Both concurrencies: ddtree-32's weighted x1.150 beats ddtree-16's x1.075, but at concurrency 4 it is
    # 10% slower than the chain, so ddtree-16 serves.
    both = tune_choose(results, 0.05, BOTH)
    assert both["winner"] == "ddtree-16"
    assert both["reason"] == (
        "ddtree-16 is weighted x1.075 the chain's tok/s (c=1 x1.150, c=4 x1.000), at least the 5% margin and within"
        " it at every concurrency; ddtree-32, weighted x1.150, is refused: at concurrency 4 it is x0.900 the chain,"
        " more than the 5% margin slower"
    )
    row = both["rows"][2]
    assert (row["vs_chain"], row["refused_at"], row["chosen"]) == (1.15, [4], False)
    assert row["note"] == "refused: at concurrency 4 it is x0.900 the chain, more than the 5% margin slower"


def test_weights_are_a_weighted_mean_of_the_ratios_to_the_chain() -> None:
    """The chain's tok/s at 4 is 3x its tok/s at 1: a weight means the same at either concurrency."""
    results = [measured("dflash", None, 100.0, 300.0), measured("ddtree", 32, 130.0, 291.0)]
    light = [{"concurrency": 1, "weight": 1}, {"concurrency": 4, "weight": 9}]
    out = tune_choose(results, 0.05, light)
    # (1 x 1.30 + 9 x 0.97) / 10 = 1.003: short of the margin, although within it at concurrency 4.
    assert (out["winner"], out["rows"][1]["vs_chain"], out["rows"][1]["refused_at"]) == ("dflash", 1.003, [])
    heavy = [{"concurrency": 1, "weight": 9}, {"concurrency": 4, "weight": 1}]
    out = tune_choose(results, 0.05, heavy)
    # (9 x 1.30 + 1 x 0.97) / 10 = 1.267.
    assert (out["winner"], out["rows"][1]["vs_chain"]) == ("ddtree-32", 1.267)


def test_slower_within_the_margin_at_one_concurrency_is_allowed() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 300.0), measured("ddtree", 32, 140.0, 285.0)], 0.05, BOTH)
    assert (out["winner"], out["rows"][1]["refused_at"]) == ("ddtree-32", [])


def test_the_chain_fastest_at_every_concurrency_says_so() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 300.0), measured("ddtree", 16, 99.0, 240.0)], 0.05, BOTH)
    assert out["winner"] == "dflash"
    assert out["reason"] == (
        "the chain (c=1 100.0, c=4 300.0 tok/s) is the fastest at every concurrency; the best DDTree, ddtree-16, is"
        " weighted x0.895"
    )


def test_every_tree_refused_somewhere_leaves_the_chain() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 300.0), measured("ddtree", 64, 200.0, 150.0)], 0.05, BOTH)
    assert out["winner"] == "dflash"
    assert out["reason"] == (
        "the chain (c=1 100.0, c=4 300.0 tok/s): every DDTree is more than the 5% margin slower than it at some"
        " concurrency; ddtree-64, weighted x1.250, is refused: at concurrency 4 it is x0.500 the chain, more than"
        " the 5% margin slower"
    )


def test_never_slower_than_the_chain_even_with_no_margin() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 1.0), measured("ddtree", 16, 90.0, 1.0)], 0.0, ONE)
    assert out["winner"] == "dflash"


def test_a_failed_candidate_is_never_chosen_and_keeps_its_reason() -> None:
    out = tune_choose(
        [
            measured("dflash", None, 100.0, 1.0),
            failed("ddtree", 64, "vLLM did not become healthy: the unit failed"),
            measured("ddtree", 32, 120.0, 1.0),
        ],
        0.05,
        ONE,
    )
    assert out["winner"] == "ddtree-32"
    row = out["rows"][1]
    assert (row["name"], row["status"], row["levels"], row["vs_chain"], row["chosen"], row["note"]) == (
        "ddtree-64",
        "failed",
        [{"concurrency": 1, "tok_s": None, "acceptance": None, "vs_chain": None}],
        None,
        False,
        "vLLM did not become healthy: the unit failed",
    )


def test_a_candidate_without_figures_at_a_declared_concurrency_counts_as_failed() -> None:
    ok = measured("ddtree", 16, 500.0, 1.0)
    ok["levels"] = ok["levels"][:1]
    out = tune_choose([measured("dflash", None, 100.0, 100.0), ok], 0.05, BOTH)
    assert out["winner"] == "dflash"
    assert out["reason"] == "the chain (c=1 100.0, c=4 100.0 tok/s): no DDTree candidate passed its gates"
    assert (out["rows"][1]["status"], out["rows"][1]["note"]) == ("failed", "no figures at concurrency 4")


def test_without_a_chain_the_best_weighted_that_passed_serves_and_says_so() -> None:
    out = tune_choose(
        [
            failed("dflash", None, "mean acceptance length 1.1 is under the floor"),
            measured("ddtree", 16, 80.0, 300.0),
            measured("ddtree", 32, 100.0, 200.0),
        ],
        0.05,
        BOTH,
    )
    # Over the fastest at each concurrency: ddtree-16 (0.8 + 1.0) / 2 = 0.9, ddtree-32 (1.0 + 0.667) / 2 = 0.833.
    assert out["winner"] == "ddtree-16"
    assert out["reason"] == (
        "the DFlash chain failed its gates (mean acceptance length 1.1 is under the floor), so ddtree-16 serves as"
        " the candidate that passed with the best weighted tok/s (c=1 80.0, c=4 300.0 tok/s), not compared with a"
        " chain"
    )
    assert [r["vs_chain"] for r in out["rows"]] == [None, None, None]


def test_all_failed_has_no_winner() -> None:
    out = tune_choose([failed("dflash", None, "dies"), failed("ddtree", 16, "never healthy")], 0.05, ONE)
    assert (out["winner"], out["method"], out["budget"]) == (None, None, None)
    assert out["reason"] == "every candidate failed, so none serves (dflash: dies; ddtree-16: never healthy)"


def test_equal_trees_prefer_the_smaller_budget() -> None:
    out = tune_choose(
        [measured("dflash", None, 100.0, 1.0), measured("ddtree", 64, 120.0, 1.0), measured("ddtree", 32, 120.0, 1.0)],
        0.05,
        ONE,
    )
    assert out["winner"] == "ddtree-32"


def test_the_default_traffic_is_fine() -> None:
    traffic = [{"concurrency": 1, "weight": 1}, {"concurrency": 4, "weight": 1}, {"concurrency": 8, "weight": 1}]
    assert tune_traffic_problems(traffic) == []
    assert tune_traffic_problems([{"concurrency": 8, "weight": 0.5}, {"concurrency": 2, "weight": 3}]) == []
    assert tune_traffic_levels([{"concurrency": 8, "weight": 0.5}, {"concurrency": 2, "weight": 3}]) == [2, 8]


def test_a_concurrency_above_max_num_seqs_is_named() -> None:
    # vLLM would queue the requests above max_num_seqs: the figure would be a queue's, not that concurrency's.
    traffic = [{"concurrency": 1, "weight": 3}, {"concurrency": 8, "weight": 1}]
    assert tune_traffic_problems(traffic, 8) == tune_traffic_problems(traffic, None) == []
    assert tune_traffic_problems(traffic, "x") == []  # service_swap's preflight names a max_num_seqs that is no number
    assert (
        tune_traffic_problems(traffic, "4")
        == tune_traffic_problems(traffic, 4)
        == [
            "tune_traffic[1] has concurrency 8, more than service_swap_max_num_seqs=4 requests vLLM runs at once; lower "
            "the concurrency or raise service_swap_max_num_seqs (as far as service_swap's memory fit allows)"
        ]
    )


EXAMPLE = "[{concurrency: 1, weight: 1}, {concurrency: 8, weight: 2}]"


@pytest.mark.parametrize(
    ("traffic", "problem"),
    [
        ([], f"tune_traffic must be a non-empty list such as {EXAMPLE}, not '[]'"),
        ({"concurrency": 1}, f"tune_traffic must be a non-empty list such as {EXAMPLE}, not \"{{'concurrency': 1}}\""),
        ([8], "tune_traffic[0] is '8'; each entry is a mapping such as {concurrency: 8, weight: 2}"),
        (
            [{"concurrency": 0, "weight": 1}],
            "tune_traffic[0] has concurrency 0; it must be a positive integer (requests in flight at once)",
        ),
        (
            [{"concurrency": "4", "weight": 1}],
            "tune_traffic[0] has concurrency '4'; it must be a positive integer (requests in flight at once)",
        ),
        (
            [{"concurrency": True, "weight": 1}],
            "tune_traffic[0] has concurrency True; it must be a positive integer (requests in flight at once)",
        ),
        (
            [{"concurrency": 1, "weight": 0}],
            "tune_traffic[0] has weight 0; it must be a number above 0 (how much that concurrency counts)",
        ),
        (
            [{"concurrency": 1}],
            "tune_traffic[0] has weight None; it must be a number above 0 (how much that concurrency counts)",
        ),
        (
            [{"concurrency": 1, "weight": float("inf")}],
            "tune_traffic[0] has weight inf; it must be a number above 0 (how much that concurrency counts)",
        ),
        (
            [{"concurrency": 1, "weight": 1}, {"concurrency": 1, "weight": 2}],
            "tune_traffic lists concurrency 1 more than once; give each concurrency one weight",
        ),
        (
            [{"concurrency": 1, "weight": 1, "wieght": 2}],
            "tune_traffic[0] has unknown key(s) wieght; only concurrency and weight are read",
        ),
    ],
)
def test_bad_traffic_is_named(traffic: object, problem: str) -> None:
    assert tune_traffic_problems(traffic) == [problem]


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
    out = tune_choose([measured("dflash", None, 100.0, 1.0), skipped(16), skipped(32)], 0.05, ONE)
    assert (out["winner"], out["budget"]) == ("dflash", None)
    assert out["reason"] == (
        "the chain (c=1 100.0 tok/s): no DDTree candidate was measured (not measured: DDTree is not "
        "available on this node: the target has Mamba layers (mamba2): trees need branch-local state)"
    )
    assert [r["status"] for r in out["rows"]] == ["ok", "skipped", "skipped"]


def test_a_chain_only_list_says_it_lists_no_budget() -> None:
    out = tune_choose([measured("dflash", None, 100.0, 1.0)], 0.05, ONE)
    assert out["reason"] == "the chain (c=1 100.0 tok/s): tune_candidates lists no DDTree budget"


def test_a_failed_chain_with_every_tree_skipped_has_no_winner() -> None:
    out = tune_choose([failed("dflash", None, "dies"), skipped(16)], 0.05, ONE)
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
        "traffic": [
            {"concurrency": 1, "weight": 1},
            {"concurrency": 4, "weight": 1},
            {"concurrency": 8, "weight": 2.5},
        ],
        "ddtree_unavailable": "",
        "digest": "ab" * 32,
        "choice": None,
    }
    assert tune_plan_message(what) == (
        "Measuring dflash, ddtree-32 at concurrency 1, 4, 8 (inputs changed since the last tuning), each restarted"
        " behind the swap's gates, then serve the best weighted tok/s for the traffic (concurrency 1 (weight 1),"
        " 4 (weight 1), 8 (weight 2.5))."
    )
    what.update(check_mode=True, force=True, plan={"measure": [{"method": "dflash"}]}, ddtree_unavailable=NO_TREE)
    assert tune_plan_message(what) == (
        "Would measure dflash at concurrency 1, 4, 8 (tune_force), each restarted behind the swap's gates, then serve"
        " the best weighted tok/s for the traffic (concurrency 1 (weight 1), 4 (weight 1), 8 (weight 2.5))."
        f" DDTree budgets not measured: {NO_TREE}."
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
