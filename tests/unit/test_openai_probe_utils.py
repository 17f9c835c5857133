"""Pure helpers of module_utils/openai_probe: Prometheus text, spec-decode counters, acceptance."""

from __future__ import annotations

import pytest
from ansible.module_utils.openai_probe import (
    MetricsParseError,
    Sample,
    SpecCounters,
    counters_delta,
    draft_acceptance_rate,
    mean_acceptance_length,
    parse_labels,
    parse_prometheus_text,
    parse_systemctl_show,
    spec_decode_counters,
    tokens_per_second,
    unit_is_crashing,
)

# Shaped like vLLM 0.20.1's /metrics (prometheus_client text format): HELP/TYPE comments,
# _total and _created samples, labels model_name and engine, position for the per-position counter.
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen3.6-27B"} 11.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="Qwen3.6-27B"} 1.7960259671838e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen3.6-27B"} 165.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen3.6-27B"} 53.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen3.6-27B",position="0"} 11.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen3.6-27B",position="1"} 9.0
vllm:generation_tokens_total{engine="0",model_name="Qwen3.6-27B"} 64.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen3.6-27B"} 1.0
"""


def test_parses_samples_with_labels_and_skips_comments():
    samples = parse_prometheus_text(VLLM_METRICS)
    assert len(samples) == 8
    assert samples[0] == Sample("vllm:spec_decode_num_drafts_total", {"engine": "0", "model_name": "Qwen3.6-27B"}, 11.0)
    assert samples[1].value == 1796025967.1838
    assert samples[-1].labels == {"engine": "0", "le": "+Inf", "model_name": "Qwen3.6-27B"}


def test_parses_timestamps_unlabelled_samples_and_escapes():
    samples = parse_prometheus_text('up 1 1700000000000\nx{path="a\\"b\\\\c"} NaN\n\n')
    assert samples[0] == Sample("up", {}, 1.0)
    assert samples[1].labels == {"path": 'a"b\\c'}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html>not metrics</html>", "line 1 is not a metric sample"),
        ('good 1\nbad_value{a="b"} twelve', "line 2: value 'twelve' is not a number"),
        ('m{a="b",,} 1', "bad label set"),
    ],
)
def test_refuses_what_is_not_prometheus_text(text, message):
    with pytest.raises(MetricsParseError, match=message):
        parse_prometheus_text(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm:spec_decode_num_drafts_total 1e400", r"vllm:spec_decode_num_drafts_total is inf, not a count"),
        (
            "vllm:spec_decode_num_accepted_tokens_total NaN",
            r"vllm:spec_decode_num_accepted_tokens_total is nan, not a count",
        ),
        ("vllm:spec_decode_num_draft_tokens_total -4", r"vllm:spec_decode_num_draft_tokens_total is -4.0, not a count"),
        ("vllm:spec_decode_num_drafts_total 1e308\nvllm:spec_decode_num_drafts_total 1e308", "add up past any count"),
    ],
)
def test_spec_counters_that_are_no_count_are_refused(text, message):
    """A hostile /metrics with Inf or NaN counters gave a NaN mean acceptance length (issue 23, item 6)."""
    with pytest.raises(MetricsParseError, match=message):
        spec_decode_counters(parse_prometheus_text(text))
    # Other metrics may be anything Prometheus allows.
    assert spec_decode_counters(parse_prometheus_text("vllm:some_gauge NaN\nvllm:other +Inf")).present is False


def test_parse_labels_of_empty_set():
    assert parse_labels("") == {}


def test_spec_counters_use_totals_only_and_sum_engines():
    text = VLLM_METRICS + (
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="Qwen3.6-27B"} 4.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="Qwen3.6-27B"} 7.0\n'
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 1000.0\n'
    )
    c = spec_decode_counters(parse_prometheus_text(text), "Qwen3.6-27B")
    assert c.as_dict() == {
        "drafts": 15.0,
        "draft_tokens": 165.0,
        "accepted_tokens": 60.0,
        "accepted_per_position": {"0": 11.0, "1": 9.0},
        "generation_tokens": 64.0,
        "present": True,
    }
    every_model = spec_decode_counters(parse_prometheus_text(text))
    assert every_model.drafts == 1015.0


def test_no_spec_decode_counters_means_not_present():
    c = spec_decode_counters(parse_prometheus_text('vllm:generation_tokens_total{model_name="m"} 5\n'), "m")
    assert c.present is False
    assert mean_acceptance_length(c) is None
    assert draft_acceptance_rate(c) is None


def test_per_position_counter_needs_an_integer_position():
    bad = parse_prometheus_text('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="x"} 1\n')
    with pytest.raises(MetricsParseError, match="without an integer position"):
        spec_decode_counters(bad)


def test_mean_acceptance_length_is_one_plus_accepted_over_drafts():
    assert mean_acceptance_length(SpecCounters(drafts=11, accepted_tokens=53)) == 5.8182
    assert mean_acceptance_length(SpecCounters(drafts=61, accepted_tokens=3)) == 1.0492
    assert mean_acceptance_length(SpecCounters(drafts=4, accepted_tokens=0)) == 1.0
    assert draft_acceptance_rate(SpecCounters(draft_tokens=165, accepted_tokens=53)) == 0.3212


def test_delta_between_two_reads():
    before = SpecCounters(
        drafts=10, draft_tokens=150, accepted_tokens=40, accepted_per_position={0: 10}, generation_tokens=50
    )
    after = SpecCounters(
        drafts=21,
        draft_tokens=315,
        accepted_tokens=93,
        accepted_per_position={0: 21, 1: 9},
        generation_tokens=114,
        present=True,
    )
    d = counters_delta(before, after)
    assert d.as_dict() == {
        "drafts": 11,
        "draft_tokens": 165,
        "accepted_tokens": 53,
        "accepted_per_position": {"0": 11, "1": 9},
        "generation_tokens": 64,
        "present": True,
    }
    assert mean_acceptance_length(d) == 5.8182


def test_delta_refuses_counters_that_went_down():
    with pytest.raises(MetricsParseError, match="the server restarted meanwhile"):
        counters_delta(SpecCounters(drafts=10), SpecCounters(drafts=2))


def test_tokens_per_second():
    assert tokens_per_second(192, 1.5) == 128.0
    assert tokens_per_second(10, 0) is None
    assert tokens_per_second(10, float("inf")) is None


def test_systemctl_show_and_crash_detection():
    props = parse_systemctl_show("ActiveState=activating\nSubState=auto-restart\nNRestarts=3\nResult=exit-code\n")
    assert props == {"ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "3", "Result": "exit-code"}
    assert (
        unit_is_crashing(props, 2) == "the unit is crash-looping: systemd restarted it 3 times (SubState=auto-restart)"
    )
    assert unit_is_crashing(props, 3) is None
    assert (
        unit_is_crashing({"ActiveState": "failed", "Result": "start-limit-hit", "NRestarts": "5"}, 10)
        == "the unit failed (Result=start-limit-hit, 5 restart(s))"
    )
    assert (
        unit_is_crashing({"ActiveState": "inactive", "Result": "exit-code"}, 2) == "the unit stopped (Result=exit-code)"
    )
    assert unit_is_crashing({"ActiveState": "active", "SubState": "running", "NRestarts": "0"}, 2) is None
    assert unit_is_crashing({"ActiveState": "inactive", "Result": "success"}, 2) is None


@pytest.mark.parametrize("restarts", ["\\u0", "x", "9" * 5000, "-1", "٣"])
def test_a_garbled_restart_count_is_no_count_not_a_traceback(restarts):
    """The fuzz suite found int() raising on a garbled NRestarts= line (issue 23: never a traceback)."""
    assert unit_is_crashing({"ActiveState": "active", "NRestarts": restarts}, 2) is None
    assert unit_is_crashing({"ActiveState": "active", "NRestarts": "3"}, 2) is not None
