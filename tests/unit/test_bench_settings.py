"""playbooks/bench.yml's decisions (plugins/filter/bench_settings.py)."""

import pytest
from bench_settings import (
    bench_concurrency,
    bench_engine,
    bench_figures_line,
    bench_report_argv,
    bench_setting_problems,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [([1, 2, 4], [1, 2, 4]), (["1", "8"], [1, 8]), ("1,2,4", [1, 2, 4]), ("[1, 16]", [1, 16]), ("none", [])],
)
def test_concurrency_from_a_list_or_an_extra_var_string(raw, expected) -> None:
    assert bench_concurrency(raw) == expected


def test_good_settings_have_no_problems() -> None:
    assert bench_setting_problems("auto", "auto", "baseline", None, [1, 2, 4], [1, 2, 4], False) == []
    assert bench_setting_problems("vllm", "true", "baseline", "after-v2", [1], [1], True) == []


def test_each_bad_setting_is_one_sentence() -> None:
    assert bench_setting_problems("tgi", "maybe", "base line", "a/b", [], "x", True) == [
        "bench_engine must be auto, vllm or sglang, not tgi",
        "bench_compare must be auto, true or false, not maybe",
        'bench_baseline_label names a file: letters, digits, ".", "_" or "-" only, not base line',
        'bench_label names a file: letters, digits, ".", "_" or "-" only, not a/b',
        "bench_concurrency must list integers such as [1, 2, 4], not x",
    ]


def test_a_url_needs_the_engine_that_answers_there() -> None:
    assert bench_setting_problems("auto", "auto", "baseline", None, [1], [1], True) == [
        "with bench_url, say which engine answers there: -e bench_engine=vllm or -e bench_engine=sglang"
    ]


@pytest.mark.parametrize(
    ("setting", "fact", "vllm_healthy", "expected"),
    [
        ("sglang", {"serving": "vllm"}, True, "sglang"),  # the setting wins
        ("auto", {"serving": "sglang"}, True, "sglang"),  # then service_swap's local fact
        ("auto", {"serving": "none"}, True, "vllm"),  # then what answers on vLLM's port
        ("auto", {}, False, "sglang"),
        ("auto", ["not", "a", "mapping"], False, "sglang"),
    ],
)
def test_which_engine_is_benchmarked(setting, fact, vllm_healthy, expected) -> None:
    assert bench_engine(setting, fact, vllm_healthy) == expected


def test_the_report_argv_compares_only_with_a_baseline() -> None:
    assert bench_report_argv("/py", "/r.py", "/out/h", "vllm", None, "baseline") == [
        "/py",
        "/r.py",
        "--run",
        "/out/h/vllm.json",
        "--png",
        "/out/h/vllm.png",
    ]
    assert bench_report_argv("/py", "/r.py", "/out/h", "vllm", "/out/h/baseline.json", "baseline")[6:] == [
        "--baseline",
        "/out/h/baseline.json",
        "--compare-out",
        "/out/h/vllm-vs-baseline.json",
    ]


SUMMARY = {
    "single_request_tok_s": 61.2,
    "single_request_ttft_ms": 48.0,
    "peak_throughput_tok_s": 180.4,
    "mean_acceptance_length": 3.1,
}


def test_the_figures_line_without_a_baseline() -> None:
    line = bench_figures_line(
        {**SUMMARY, "mean_acceptance_length": None},
        "n1",
        "sglang",
        "sglang",
        [4, 1, 2],
        None,
        "baseline",
        "/r/n1/sglang",
    )
    assert line == (
        "n1 sglang (sglang): single request 61.2 tok/s, TTFT p50 48.0 ms, peak 180.4 tok/s (sweep 1, 2, 4), "
        "mean acceptance length none (no spec-decode counters). Files: /r/n1/sglang.{json,png}"
    )


def test_the_figures_line_against_a_baseline_says_when_settings_differ() -> None:
    comparison = {
        "summary": {"single_request_tok_s": {"ratio": 1.8}, "peak_throughput_tok_s": {"ratio": 1.4}},
        "settings_differ": ["max_tokens", "prompt_set_sha256"],
    }
    line = bench_figures_line(SUMMARY, "n1", "vllm", "vllm", [1], comparison, "baseline", "/r/n1/vllm")
    assert line == (
        "n1 vllm (vllm): single request 61.2 tok/s, TTFT p50 48.0 ms, peak 180.4 tok/s (sweep 1), mean acceptance "
        "length 3.1. Against baseline: single request x1.8, TTFT x-, peak throughput x1.4 (NOT comparable: "
        "max_tokens, prompt_set_sha256 differ). Files: /r/n1/vllm.{json,png}"
    )
