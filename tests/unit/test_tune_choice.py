"""roles/tune's choice between the DFlash chain and DDTree budgets (plugins/filter/tune_choice.py)."""

from __future__ import annotations

import pytest
from tune_choice import tune_candidate_name, tune_candidate_problems, tune_choose, tune_inputs_digest

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
            "tune_candidates[1] has budget 8, below service_swap_num_speculative_tokens (15): a DDTree budget is at "
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
