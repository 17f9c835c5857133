"""Figures from outside refused where they are read (issue 43, classes 1 to 3 and 6's helpers).

The engine's answers (a usage.completion_tokens of 8e306 or of 400 digits, a stream that carried
text but counts 0 tokens), the node's records (a tune.fact holding Infinity or a 0.0 tok/s chain)
and files (1e400 in any JSON the roles read): each is refused with a sentence, never stored or
reported as a number, and nothing that reads it crashes.
"""

from __future__ import annotations

import json
import math

import pytest
from ansible.module_utils.figures import (
    MAX_TOKENS,
    FigureError,
    figure_problem,
    finite_field,
    positive_figure,
    require_positive,
    token_count,
    whole_field,
)
from ansible.module_utils.json_file import UnsafeFileError, read_json_file
from ansible.module_utils.openai_bench import BenchError, RequestTiming, level_summary, request_timing
from ansible.module_utils.openai_probe import (
    MetricsParseError,
    SpecCounters,
    draft_acceptance_rate,
    mean_acceptance_length,
    tokens_per_second,
)
from playbook_run import ansible_playbook, local_play, localhost_inventory
from rollout_report import tune_rows, tune_table
from tune_choice import tune_choose, tune_read_record

from ddtree.repo import repo_file

HUGE = 10**400


@pytest.mark.parametrize(
    "value", [0, 0.0, -1, -0.5, math.inf, -math.inf, math.nan, HUGE, None, "12", True, [], {"a": 1}]
)
def test_what_is_not_a_finite_figure_above_zero_is_refused(value) -> None:
    assert positive_figure(value) is None
    problem = figure_problem(value, "the throughput")
    assert problem is not None and problem.startswith("the throughput is ")
    with pytest.raises(FigureError, match=r"^the throughput is "):
        require_positive(value, "the throughput")


@pytest.mark.parametrize("value", [1, 0.01, 812.4, 10**15])
def test_a_finite_figure_above_zero_passes(value) -> None:
    assert positive_figure(value) == float(value)
    assert figure_problem(value, "x") is None


def test_a_huge_integer_is_named_without_being_written_out() -> None:
    """str() of an int of 5000 digits raises ValueError: the message must not need it."""
    problem = figure_problem(10**5000, "usage")
    assert problem == "usage is an integer of about 5001 digits, not a finite figure above zero"


@pytest.mark.parametrize(("value", "count"), [(0, 0), (64, 64), (64.0, 64), (MAX_TOKENS, MAX_TOKENS)])
def test_token_counts_in_range_pass(value, count) -> None:
    assert token_count(value, "n") == count


@pytest.mark.parametrize("value", [-1, 2.5, 8e306, math.inf, math.nan, HUGE, MAX_TOKENS + 1, "12", True, None])
def test_token_counts_out_of_range_are_refused_without_converting_to_float(value) -> None:
    with pytest.raises(FigureError, match=r"^usage\.completion_tokens is .*, not a count of tokens"):
        token_count(value, "usage.completion_tokens")


def test_fields_of_a_node_file_are_checked_for_type_and_range() -> None:
    assert whole_field(16, "f: a", 1, 64) == 16
    assert whole_field(16.0, "f: a", 1, 64) == 16
    for bad, why in (
        ("sixteen", "not a whole number"),
        (None, "not a whole number"),
        (math.inf, "not a whole"),
        (-1, "outside 1 to 64"),
        (65, "outside 1 to 64"),
        (HUGE, "outside 1 to 64"),
        (True, "not a"),
    ):
        with pytest.raises(FigureError, match=rf"^f: a is .*{why}"):
            whole_field(bad, "f: a", 1, 64)
    assert finite_field(0.9, "u", 0.0, 1.0) == 0.9
    for bad in (math.nan, math.inf, 1.5, HUGE, "0.9"):
        with pytest.raises(FigureError, match=r"^u is "):
            finite_field(bad, "u", 0.0, 1.0)


# --- openai_bench: the figures of a level ------------------------------------------------------------------


def text_chunk(text: str = "x") -> dict:
    return {"choices": [{"text": text}]}


def usage_chunk(tokens) -> dict:
    return {"choices": [], "usage": {"completion_tokens": tokens}}


@pytest.mark.parametrize("tokens", [8e306, 10**400, -3, 1.5])
def test_a_stream_s_usage_past_any_count_is_refused_not_turned_into_infinity(tokens) -> None:
    """8e306 tokens gave tok/s Infinity and NaN; tuning picked that candidate and stored it."""
    with pytest.raises(BenchError, match=r"usage\.completion_tokens is .*the server's usage figures are broken"):
        request_timing([(0.1, text_chunk()), (0.2, usage_chunk(tokens))], 0.3)


def test_a_stream_that_carried_text_but_counts_no_token_is_refused() -> None:
    with pytest.raises(BenchError, match=r"^usage\.completion_tokens is 0 for a stream that carried text"):
        request_timing([(0.1, text_chunk()), (0.2, usage_chunk(0))], 0.3)


def test_a_level_reports_only_finite_figures_above_zero() -> None:
    timing = RequestTiming(0.01, 0.5, 64, True, 8)
    good = level_summary(1, [timing], 0.5, None)
    assert good["throughput_tok_s"] == 128.0
    with pytest.raises(BenchError, match=r"^concurrency 2: the level's wall time is 0.0, not a finite figure"):
        level_summary(2, [timing], 0.0, None)
    with pytest.raises(BenchError, match=r"^concurrency 4: the level's wall time is nan"):
        level_summary(4, [timing], math.nan, None)
    with pytest.raises(BenchError, match=r"^concurrency 1: a request's time is 0.0"):
        level_summary(1, [RequestTiming(0.0, 0.0, 3, True, 1)], 0.5, None)


# --- openai_probe: acceptance and tokens/s never Infinity ---------------------------------------------------


def test_counters_that_divide_into_infinity_are_an_error_not_a_passing_acceptance() -> None:
    """1e308 accepted over 1e-300 drafts is Infinity, which passes any floor."""
    counters = SpecCounters(drafts=1e-300, draft_tokens=1e-300, accepted_tokens=1e308, present=True)
    with pytest.raises(MetricsParseError, match=r"mean acceptance length of inf; the server's /metrics is broken"):
        mean_acceptance_length(counters)
    with pytest.raises(MetricsParseError, match=r"draft acceptance rate of inf"):
        draft_acceptance_rate(counters)


@pytest.mark.parametrize(
    ("tokens", "seconds", "rate"),
    [
        (128, 1.0, 128.0),
        (HUGE, 1.0, None),
        (1e308, 1e-10, None),
        (5, 0.0, None),
        (5, math.nan, None),
        (5, math.inf, None),
    ],
)
def test_tokens_per_second_is_a_finite_figure_or_none(tokens, seconds, rate) -> None:
    assert tokens_per_second(tokens, seconds) == rate


# --- tune_choose and the stored record -----------------------------------------------------------------------


ONE = [{"concurrency": 1, "weight": 1}]


def measured(method: str, budget: int | None, tok_s) -> dict:
    return {
        "method": method,
        "budget": budget,
        "status": "ok",
        "reason": "",
        "levels": [{"concurrency": 1, "throughput_tok_s": tok_s, "mean_acceptance_length": 5.0}],
    }


@pytest.mark.parametrize("chain", [0.0, -1.0, math.inf, math.nan, None, "fast", HUGE])
def test_a_chain_whose_figure_is_not_a_speed_is_refused_and_nothing_crashes(chain) -> None:
    """A chain at 0.0 tok/s crashed with "unsupported format string passed to NoneType.__format__"."""
    choice = tune_choose([measured("dflash", None, chain), measured("ddtree", 32, 250.0)], 0.05, ONE)
    chain_row = choice["rows"][0]
    assert chain_row["status"] == "failed"
    assert chain_row["levels"][0]["tok_s"] is None
    assert chain_row["note"].startswith("measured, but its throughput at concurrency 1 is ")
    assert chain_row["note"].endswith("not a speed to compare; measure again (tune_force=true)")
    assert choice["winner"] == "ddtree-32"
    assert choice["reason"].startswith("the DFlash chain has no speed to compare (measured, but its throughput")
    assert "not compared with a chain" in choice["reason"]
    json.dumps(choice, allow_nan=False)  # no inf or nan anywhere in what is stored and reported
    rows = tune_rows({"n1": {"report": {"tune": choice}}}, [1])
    assert [r[3:6] for r in rows] == [("-", "-", "-"), ("250.0", "-", "5.00")]  # tok/s, vs chain, acceptance
    tune_table(rows, [1])


@pytest.mark.parametrize("tree", [0.0, math.inf, math.nan])
def test_a_tree_whose_figure_is_not_a_speed_never_wins(tree) -> None:
    """Infinity won the choice ("inf tok/s ... xinf") and was written into tune.fact."""
    choice = tune_choose([measured("dflash", None, 100.0), measured("ddtree", 32, tree)], 0.05, ONE)
    assert choice["winner"] == "dflash"
    assert choice["rows"][1]["status"] == "failed"
    json.dumps(choice, allow_nan=False)


def test_both_refused_means_no_winner_with_each_reason() -> None:
    choice = tune_choose([measured("dflash", None, 0.0), measured("ddtree", 32, math.inf)], 0.05, ONE)
    assert choice["winner"] is None
    assert choice["reason"].startswith("every candidate failed, so none serves (dflash: measured, but its throughput")


def test_a_stored_record_with_a_refused_figure_is_measured_again_once() -> None:
    """The record was written before figures were checked: the node measures again instead of failing every run."""
    record = {"inputs_digest": "d", "inputs": {}, "results": [measured("dflash", None, 0.0)]}
    assert tune_read_record(record) == {}
    good = {"inputs_digest": "d", "inputs": {}, "results": [measured("dflash", None, 99.5)]}
    assert tune_read_record(good) == good
    failed = {"inputs_digest": "d", "inputs": {}, "results": [{"method": "dflash", "status": "failed", "reason": "x"}]}
    assert tune_read_record(failed) == failed  # a failure is a result, not a broken figure


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1E999"])
def test_a_json_number_past_a_float_is_refused_where_read_like_infinity(tmp_path, number) -> None:
    """json.loads reads 1e400 as inf: a tune.fact holding it would come back as Infinity."""
    path = tmp_path / "tune.fact"
    path.write_text('{"results": [{"levels": [{"throughput_tok_s": NUMBER}]}]}'.replace("NUMBER", number))
    with pytest.raises(UnsafeFileError, match=rf"is not valid JSON \(the number {number} is past what a float holds\)"):
        read_json_file(str(path))
    path.write_text('{"t": 1.5e300, "n": 12}')
    assert read_json_file(str(path)).data == {"t": 1.5e300, "n": 12}


# --- the controller's report scripts: a stored Infinity is no figure ------------------------------------------


def _report_scripts():
    return repo_file("playbooks/files/bench_report.py"), repo_file("playbooks/files/tune_plot.py")


def test_a_stored_bench_run_with_infinity_compares_as_missing_not_as_xinf(tmp_path) -> None:
    """A baseline written while openai_bench reported Infinity: its ratio was inf or nan in the play's summary."""
    bench_report, _ = _report_scripts()
    level = '{"concurrency": 1, "throughput_tok_s": VALUE, "request_tok_s": {"mean": 5.0}, "ttft_ms": {"p50": 9.0}}'
    runs = {}
    for name, value in (("base", "Infinity"), ("over", "1e400"), ("cur", "120.5")):
        path = tmp_path / f"{name}.json"
        path.write_text(
            '{"levels": [LEVEL], "summary": {"peak_throughput_tok_s": VALUE, "mean_acceptance_length": NaN}}'.replace(
                "LEVEL", level
            ).replace("VALUE", value)
        )
        runs[name] = bench_report.load_run(path)
    for base in ("base", "over"):
        cmp = bench_report.compare_runs(runs[base], runs["cur"])
        peak = cmp["summary"]["peak_throughput_tok_s"]
        assert (peak["baseline"], peak["current"], peak["ratio"]) == (None, 120.5, None)
        assert cmp["levels"][0]["throughput_tok_s"]["ratio"] is None
        json.dumps(cmp, allow_nan=False)
    assert bench_report.ratio(0.0, 5.0) is None and bench_report.ratio(1e-300, 1e300) is None


def test_the_tune_plot_draws_no_bar_from_a_figure_that_is_not_a_speed() -> None:
    _, tune_plot = _report_scripts()
    data = {"results": [measured("dflash", None, value) for value in (math.inf, "fast", -3.0, 10**400)]}
    data["results"].append(measured("ddtree", 32, 99.0))
    _levels, bars, _failed = tune_plot.series(data)
    assert [ys for _name, ys, _chosen in bars] == [[0.0], [0.0], [0.0], [0.0], [99.0]]


def test_a_stored_bad_record_through_ansible_playbook_neither_crashes_nor_sticks(tmp_path) -> None:
    """roles/tune's read path (json_file_info, tune_read_record, tune_choose) on the records issue 43 found:
    a chain at 0.0 tok/s and an Infinity written as 1e400. Each run measures again instead of failing."""
    zero = {
        "inputs_digest": "d",
        "inputs": {},
        "results": [measured("dflash", None, 0.0), measured("ddtree", 32, 250.0)],
    }
    (tmp_path / "zero.fact").write_text(json.dumps(zero))
    (tmp_path / "inf.fact").write_text(json.dumps(zero).replace("250.0", "1e400"))
    play = local_play(
        tmp_path / "record.yml",
        "    - json_file_info: {path: '" + str(tmp_path) + "/{{ item }}.fact', missing_ok: true}\n"
        "      loop: [zero, inf]\n      register: facts\n      failed_when: false\n"
        "    - ansible.builtin.debug:\n"
        '        msg: "RECORD {{ item.item }} {{ item.data | default(none) | tune_read_record | to_json }}"\n'
        "      loop: '{{ facts.results }}'\n"
        "    - ansible.builtin.debug:\n"
        '        msg: "CHOICE {{ (facts.results[0].data.results | tune_choose(0.05, [dict(concurrency=1, weight=1)])).reason }}"\n',
    )
    res = ansible_playbook(localhost_inventory(tmp_path), play, DFLASH_REPORT_DIR=str(tmp_path / "r"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert '"msg": "RECORD zero {}"' in out, out  # measured again, once
    assert '"msg": "RECORD inf {}"' in out, out  # refused where read (json_file_info), measured again
    assert (
        "CHOICE the DFlash chain has no speed to compare (measured, but its throughput at concurrency 1 is 0.0" in out
    )
    assert "NoneType.__format__" not in out


# --- openai_probe: an answer it cannot measure is a failed gate with a sentence (class 3) --------------------


@pytest.mark.parametrize(
    ("tokens", "requests", "shown"),
    [
        ("9" * 400, 1, "an integer of 400 digits"),
        ("1e308", 2, "1e+308"),  # each is whole but past the range
        ("999999999999", 2, "1999999999998"),  # each in range, their sum is not
    ],
)
def test_a_completion_count_past_any_count_is_a_sentence_not_a_crash(tokens, requests, shown, capsys) -> None:
    """400 digits (or 1e308 twice) crashed openai_probe with "int too large to convert to float"."""
    import openai_probe
    from ansible.module_utils.testing import patch_module_args
    from test_openai_hostile import Hostile, fixed, healthy

    server = Hostile()
    try:
        healthy(server)
        body = '{"choices": [{"text": "x"}], "usage": {"completion_tokens": TOKENS}}'.replace("TOKENS", tokens)
        server.behaviour["/v1/completions"] = fixed(body.encode())
        with patch_module_args({"url": server.url, "requests": requests, "timeout": 5}), pytest.raises(SystemExit):
            openai_probe.main()
        result = json.loads(capsys.readouterr().out)
    finally:
        server.close()
    assert result["error"].startswith("the server's answer cannot be measured: "), result
    assert f"is {shown}, not a count of tokens" in result["error"], result
    assert result["error"].endswith("; its usage figures are broken")
    assert "tokens_per_second" not in result and "int too large" not in result["error"]
