"""Pure helpers of the serving benchmark: settings, SSE parsing, per-request and per-level figures."""

from __future__ import annotations

import pytest
from ansible.module_utils.openai_bench import (
    DONE,
    BenchError,
    RequestTiming,
    chunk_text,
    chunk_usage_tokens,
    describe,
    level_summary,
    parse_sse_line,
    percentile,
    plan_requests,
    request_timing,
    run_summary,
    validate_prompts,
    validate_sweep,
)
from ansible.module_utils.openai_probe import SpecCounters


def test_sweep_is_sorted():
    assert validate_sweep([4, 1, 2]) == [1, 2, 4]


@pytest.mark.parametrize(
    ("levels", "message"),
    [
        ([], "concurrency is empty: give at least one level, e.g. [1, 2, 4]"),
        ([0, 2], "concurrency levels must be integers from 1 to 256, not [0]"),
        ([1, 257], "concurrency levels must be integers from 1 to 256, not [257]"),
        ([1, True], "concurrency levels must be integers from 1 to 256, not [True]"),
        ([1, 2, 2], "concurrency levels repeat: [1, 2, 2]; give each level once"),
    ],
)
def test_bad_sweeps_are_refused(levels, message):
    with pytest.raises(BenchError) as e:
        validate_sweep(levels)
    assert str(e.value) == message


def test_prompts_must_have_text():
    assert validate_prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(BenchError, match=r"^the prompt set is empty"):
        validate_prompts([])
    with pytest.raises(BenchError, match=r"^prompt\(s\) at index \[1\] are empty"):
        validate_prompts(["a", "  "])


def test_plan_cycles_prompts_and_fills_the_slots():
    assert plan_requests(["a", "b", "c"], 1, None) == ["a", "b", "c"]
    assert plan_requests(["a", "b", "c"], 4, None) == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert plan_requests(["a", "b"], 2, 5) == ["a", "b", "a", "b", "a"]
    with pytest.raises(BenchError) as e:
        plan_requests(["a"], 4, 3)
    assert str(e.value) == "3 request(s) per level cannot keep 4 in flight: give at least 4"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('data: {"choices": [{"text": " Rome"}]}\n', {"choices": [{"text": " Rome"}]}),
        ('data:{"choices": []}\r\n', {"choices": []}),
        ("data: [DONE]\n", DONE),
        ("\n", None),
        (": keep-alive\n", None),
        ("event: completion\n", None),
    ],
)
def test_sse_lines(line, expected):
    assert parse_sse_line(line) == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("data: {not json\n", "stream chunk is not JSON: '{not json'"),
        ("data: [1, 2]\n", "stream chunk is not a JSON object: '[1, 2]'"),
        (
            'data: {"error": {"message": "out of memory"}}\n',
            "the server reported an error mid-stream: {'message': 'out of memory'}",
        ),
    ],
)
def test_bad_sse_lines(line, message):
    with pytest.raises(BenchError) as e:
        parse_sse_line(line)
    assert str(e.value) == message


def test_chunk_text_and_usage():
    assert chunk_text({"choices": [{"index": 0, "text": " a b"}]}) == " a b"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 9}}) == ""
    assert chunk_usage_tokens({"choices": [], "usage": {"completion_tokens": 9}}) == 9
    assert chunk_usage_tokens({"choices": [{"text": "x"}]}) is None
    assert chunk_usage_tokens({"usage": None}) is None
    with pytest.raises(BenchError, match=r"^stream chunk has no choices list"):
        chunk_text({"object": "x"})
    with pytest.raises(BenchError) as e:
        chunk_usage_tokens({"usage": {"completion_tokens": -1}})
    assert str(e.value) == (
        "usage.completion_tokens is -1, not a count of tokens (a whole number from 0 to 1000000000000); "
        "the server's usage figures are broken"
    )


def test_timing_uses_the_first_text_chunk_and_the_usage():
    events = [
        (0.010, {"choices": [{"text": ""}]}),  # role/empty chunk: no token yet
        (0.025, {"choices": [{"text": " one two"}]}),
        (0.040, {"choices": [{"text": " three"}]}),
        (0.041, {"choices": [{"text": "", "finish_reason": "length"}]}),
        (0.042, {"choices": [], "usage": {"completion_tokens": 3}}),
    ]
    assert request_timing(events, 0.05) == RequestTiming(
        ttft_s=0.025, total_s=0.05, tokens=3, tokens_from_usage=True, chunks=2
    )


def test_timing_counts_chunks_without_usage():
    events = [(0.02, {"choices": [{"text": " one two"}]}), (0.03, {"choices": [{"text": " three"}]})]
    timing = request_timing(events, 0.04)
    assert (timing.tokens, timing.tokens_from_usage, timing.chunks) == (2, False, 2)
    assert timing.tokens_per_second == 50.0


def test_timing_without_text_is_an_error():
    with pytest.raises(BenchError) as e:
        request_timing([(0.01, {"choices": [], "usage": {"completion_tokens": 0}})], 0.02)
    assert str(e.value) == "the stream ended without any generated text"


def test_percentiles_interpolate_like_numpy():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 50) == 25.0
    assert percentile(values, 90) == 37.0
    assert percentile([5.0], 90) == 5.0
    assert describe([4.0, 1.0, 2.0, 3.0]) == {"mean": 2.5, "p50": 2.5, "p90": 3.7, "max": 4.0}
    with pytest.raises(BenchError):
        percentile([], 50)


def timings() -> list[RequestTiming]:
    return [RequestTiming(0.02, 0.5, 100, True, 20), RequestTiming(0.04, 1.0, 100, True, 20)]


def test_level_with_spec_counters():
    spec = SpecCounters(drafts=40.0, draft_tokens=600.0, accepted_tokens=160.0, present=True)
    assert level_summary(2, timings(), 1.25, spec) == {
        "concurrency": 2,
        "requests": 2,
        "output_tokens": 200,
        "tokens_from_usage": True,
        "wall_s": 1.25,
        "throughput_tok_s": 160.0,
        "request_tok_s": {"mean": 150.0, "p50": 150.0, "p90": 190.0, "max": 200.0},
        "ttft_ms": {"mean": 30.0, "p50": 30.0, "p90": 38.0, "max": 40.0},
        "latency_s": {"mean": 0.75, "p50": 0.75, "p90": 0.95, "max": 1.0},
        "mean_acceptance_length": 5.0,
        "draft_acceptance_rate": 0.2667,
    }


def test_level_without_counters_has_no_acceptance():
    level = level_summary(1, timings(), 1.5, None)
    assert (level["mean_acceptance_length"], level["draft_acceptance_rate"]) == (None, None)
    absent = level_summary(1, timings(), 1.5, SpecCounters())
    assert absent["mean_acceptance_length"] is None
    with pytest.raises(BenchError) as e:
        level_summary(4, [], 1.0, None)
    assert str(e.value) == "concurrency 4: no request finished"


def test_run_summary_headlines():
    levels = [level_summary(1, timings(), 1.5, None), level_summary(2, timings(), 1.0, None)]
    spec = SpecCounters(drafts=10.0, draft_tokens=150.0, accepted_tokens=45.0, present=True)
    summary = run_summary(levels, spec)
    assert summary["single_request_tok_s"] == 150.0
    assert summary["single_request_ttft_ms"] == 30.0
    assert summary["peak_throughput_tok_s"] == 200.0
    assert summary["mean_acceptance_length"] == 5.5
    assert summary["draft_acceptance_rate"] == 0.3
    assert summary["spec_decode"]["drafts"] == 10.0
    no_single = run_summary([levels[1]], None)
    assert (no_single["single_request_tok_s"], no_single["mean_acceptance_length"], no_single["spec_decode"]) == (
        None,
        None,
        None,
    )
