"""ddtree/bench/step_cost.py's CPU side: the real-shape configs it writes, the call plan and the table."""

from __future__ import annotations

import json

import pytest

from ddtree.bench import step_cost


@pytest.fixture(scope="module")
def bench():
    return step_cost


def test_the_27b_pair_is_the_hybrid_with_its_sliding_drafter(bench, tmp_path):
    target, drafter = bench.write_models("27b", tmp_path)
    t = json.loads((target / "config.json").read_text())
    d = json.loads((drafter / "config.json").read_text())
    assert t["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert t["text_config"]["layer_types"].count("linear_attention") == 48
    assert d["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert d["sliding_window"] == 2048
    assert d["dflash_config"] == {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    assert (d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]) == (5120, 17408, 5)


def test_the_8b_pair(bench, tmp_path):
    _target, drafter = bench.write_models("8b", tmp_path)
    d = json.loads((drafter / "config.json").read_text())
    assert d["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert "layer_types" not in d or d["layer_types"] == ["full_attention"] * 5


def test_the_plan_puts_every_method_in_a_call_with_its_baseline(bench):
    calls = bench.plan(["8b", "27b"], list(bench.METHODS))
    assert calls[:4] == [
        [("8b", "target"), ("8b", "target_tree")],
        [("8b", "chain"), ("8b", "chain_sync"), ("8b", "ddtree16")],  # 175 s each, 560 s a call
        [("8b", "chain"), ("8b", "ddtree32"), ("8b", "ddtree64")],
        [("8b", "chain"), ("8b", "ddtree16_sync")],
    ]
    assert calls[4:] == [[("27b", "target"), ("27b", "target_tree")]] + [
        [("27b", "chain"), ("27b", m)] for m in ("chain_sync", "ddtree16", "ddtree32", "ddtree64", "ddtree16_sync")
    ]
    assert [bench.call_seconds(c) for c in calls[:4]] == [350, 525, 525, 350]
    assert bench.call_seconds(calls[4]) == 650  # over a call cold: the plan says so
    assert bench.call_seconds(calls[4], pairs=2) == 2 * (270 + 28)


def test_a_method_whose_baseline_is_not_asked_for_is_planned_alone(bench):
    assert bench.plan(["8b"], ["ddtree16", "ddtree64"]) == [[("8b", "ddtree16"), ("8b", "ddtree64")]]
    assert bench.plan(["27b"], ["ddtree64", "ddtree32"]) == [[("27b", "ddtree64")], [("27b", "ddtree32")]]
    assert bench.plan(["8b"], ["chain", "target"]) == [[("8b", "chain"), ("8b", "target")]]


def test_a_case_may_take_its_cold_start_and_its_run_before_it_is_killed(bench):
    # A 27B DDTree case started in 265 s on an H200 with cold caches: a 200 s limit killed it.
    assert bench.case_timeout_s("27b") >= 265 + bench.RUN_S
    assert bench.case_timeout_s("8b") >= 141 + bench.RUN_S
    assert bench.case_timeout_s("27b") <= bench.CALL_S


def test_the_table_gives_each_row_its_ratio_to_the_chain(bench):
    rows = [
        {"shape": "8b", "method": "chain", "batch": 1, "context": 512, "ms_per_step": 7.5},
        {"shape": "8b", "method": "ddtree16", "batch": 1, "context": 512, "ms_per_step": 9.0},
        {"shape": "8b", "method": "target", "batch": 1, "context": 512, "ms_per_step": 5.0},
        {"shape": "8b", "method": "ddtree16", "batch": 8, "context": 512, "ms_per_step": 20.0},
    ]
    assert bench.table(rows).splitlines()[2:] == [
        "| 8b | 512 | 1 | target | 5.00 | 0.667 |",
        "| 8b | 512 | 1 | chain | 7.50 | 1.000 |",
        "| 8b | 512 | 1 | ddtree16 | 9.00 | 1.200 |",
        "| 8b | 512 | 8 | ddtree16 | 20.00 | - |",
    ]


def test_rows_of_two_runs_are_never_divided(bench):
    a = {"shape": "27b", "batch": 1, "context": 512, "run": "gpu-a 2026-12-04T03:20:00Z"}
    b = dict(a, run="gpu-b 2026-12-05T03:20:00Z")
    rows = [dict(a, method="chain", ms_per_step=24.0), dict(b, method="ddtree64", ms_per_step=34.4)]
    assert [r["vs_chain"] for r in bench.ratios(rows)] == [1.0, None]
    assert bench.table(rows).splitlines()[-1] == (
        "2 runs (gpu-a 2026-12-04T03:20:00Z, gpu-b 2026-12-05T03:20:00Z): ratios only within one run."
    )
    rows.append(dict(b, method="chain", ms_per_step=23.0))
    assert [r["vs_chain"] for r in bench.ratios(rows)] == [1.0, 1.496, 1.0]


def test_a_row_with_a_problem_is_marked_and_gets_no_ratio(bench):
    problem = "drafted on 2 of 128 steps per request: not this method's step cost"
    rows = [
        {"shape": "8b", "method": "chain", "batch": 1, "context": 8192, "ms_per_step": 7.9},
        {"shape": "8b", "method": "ddtree64", "batch": 1, "context": 8192, "ms_per_step": 15.5, "problem": problem},
    ]
    assert bench.table(rows).splitlines()[2:] == [
        "| 8b | 8192 | 1 | chain | 7.90 | 1.000 |",
        "| 8b | 8192 | 1 | ddtree64 | 15.50 (1) | - |",
        "",
        f"1. 8b ddtree64 batch 1 at 8192: {problem}",
    ]


@pytest.mark.parametrize(
    ("tokens", "batch", "drafts", "accepted", "speculative", "expected"),
    [
        (128, 8, 0, 0, False, (128.0, "")),  # the target alone: one token a step
        (128, 8, 8 * 128, 0, True, (128.0, "")),  # random weights: every step drafted, none accepted
        (128, 1, 100, 28, True, (100.0, "")),  # 28 tokens accepted: 100 steps, each drafted
        (128, 1, 2, 0, True, (128.0, "drafted on 2 of 128 steps per request: not this method's step cost")),
        (128, 8, 0, 0, True, (128.0, "drafted on 0 of 128 steps per request: not this method's step cost")),
    ],
)
def test_a_pass_counts_its_decode_steps_and_says_when_it_did_not_draft(
    bench, tokens, batch, drafts, accepted, speculative, expected
):
    assert bench.decode_steps(tokens, batch, drafts, accepted, speculative) == expected


def test_a_step_is_timed_from_the_last_first_token_to_the_last_token(bench):
    # Two requests: the second got its first token later; decode is timed from then.
    assert bench.decode_ms_per_step([10.0, 10.5], [12.0, 13.0], steps=100) == 25.0


@pytest.mark.parametrize(
    ("first", "last", "steps"),
    [([], [], 10), ([1.0], [2.0, 3.0], 10), ([1.0], [2.0], 0), ([2.0], [2.0], 10)],
)
def test_a_step_time_without_a_decode_span_is_refused(bench, first, last, steps):
    with pytest.raises(ValueError):
        bench.decode_ms_per_step(first, last, steps)


def test_only_case_files_are_read_back(bench, tmp_path):
    row = {"shape": "8b", "method": "chain", "batch": 1, "context": 512, "ms_per_step": 7.5}
    (tmp_path / "8b_chain.json").write_text(json.dumps([row]))
    (tmp_path / "summary_attention.json").write_text(json.dumps({"lossless": {}}))
    assert bench.load_results(tmp_path) == [row]


@pytest.mark.parametrize("tokens", [8192, 65536])
def test_ddtree_runs_with_the_graph_cap_service_swap_renders_and_the_rest_with_vllms_default(bench, tokens):
    assert bench.compilation_config(None, tokens) == {}  # the target alone
    assert bench.compilation_config(0, tokens) == {}  # the chain
    assert bench.compilation_config(16, tokens) == {"cudagraph_capture_sizes": [17, 34, 51, 68, 85, 102, 119, 136]}
    # 8 x 65 = 520 tokens, past vLLM's default cap of 512.
    assert bench.compilation_config(64, tokens) == {"cudagraph_capture_sizes": [65, 130, 195, 260, 325, 390, 455, 520]}


@pytest.mark.parametrize(
    ("pairs", "tokens"),
    [
        ([(1, 512)], 8192),  # never below the longest context
        ([(1, 512), (1, 8192)], 8192),
        ([(8, 512)], 8192),
        ([(1, 512), (8, 8192)], 65536),  # eight 8192-token prompts in one prefill step
    ],
)
def test_a_case_batches_the_tokens_of_its_largest_prefill(bench, pairs, tokens):
    assert bench.batched_tokens(pairs) == tokens


def test_the_context_leaves_room_for_the_largest_ddtree_step_after_the_last_token(bench):
    # 8192-token prompts, 128 tokens, DDTree 64: drafting needs the optimistic length (the last
    # step's 65 tokens counted twice under async scheduling) plus the budget to fit.
    assert bench.model_len(128) == 8192 + 128 + 4 * 65
    assert bench.model_len(128) - 8192 - 128 >= 3 * 65


def test_pairs_default_to_every_batch_and_context_in_the_measured_order(bench):
    assert bench.parse_pairs(None) == [(1, 512), (8, 512), (1, 8192), (8, 8192)]
    assert bench.parse_pairs("8x512, 1x8192") == [(8, 512), (1, 8192)]


@pytest.mark.parametrize("text", ["8", "8x", "x512", "eightx512", "4x512", "8x1024"])
def test_a_pair_that_is_not_a_measured_batch_and_context_is_named(bench, text):
    with pytest.raises(ValueError, match=text):
        bench.parse_pairs(text)


def test_cases_keep_tritons_autotuning_on_disk_unless_the_caller_says_otherwise(bench):
    assert bench.case_env({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin", "TRITON_CACHE_AUTOTUNING": "1"}
    assert bench.case_env({"TRITON_CACHE_AUTOTUNING": "0"}) == {"TRITON_CACHE_AUTOTUNING": "0"}


def test_only_the_hybrid_target_loads_its_language_model_alone_with_the_triton_gdn_prefill(bench):
    assert bench.shape_engine_args("8b") == {}
    assert bench.shape_engine_args("27b") == {
        "language_model_only": True,
        "additional_config": {"gdn_prefill_backend": "triton"},
    }
