"""playbooks/bench.yml's decisions (plugins/filter/bench_settings.py)."""

import pytest
from bench_settings import bench_concurrency, bench_engine, bench_report_argv, bench_setting_problems


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
