"""playbooks/files/bench_report.py: a bench run compared with its baseline, and the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddtree.repo import repo_file

REPO = Path(__file__).resolve().parents[2]
bench_report = repo_file("playbooks/files/bench_report.py")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def level(c: int, tput: float, req: float, ttft: float, acc: float | None) -> dict:
    return {
        "concurrency": c,
        "throughput_tok_s": tput,
        "request_tok_s": {"mean": req, "p50": req, "p90": req, "max": req},
        "ttft_ms": {"mean": ttft, "p50": ttft, "p90": ttft + 10, "max": ttft + 20},
        "mean_acceptance_length": acc,
    }


def run(label: str, engine: str, levels: list[dict], acc: float | None, max_tokens: int = 128) -> dict:
    return {
        "host": "node-1",
        "label": label,
        "engine": engine,
        "model": "Qwen3.6-27B",
        "url": "http://127.0.0.1:8000",
        "time": "2026-11-30T10:00:00Z",
        "settings": {"max_tokens": max_tokens, "ignore_eos": True, "prompts": 8, "prompt_set_sha256": "ab"},
        "summary": {
            "single_request_tok_s": levels[0]["request_tok_s"]["mean"],
            "single_request_ttft_ms": levels[0]["ttft_ms"]["p50"],
            "peak_throughput_tok_s": max(lv["throughput_tok_s"] for lv in levels),
            "mean_acceptance_length": acc,
        },
        "levels": levels,
    }


BASELINE = run("baseline", "sglang", [level(1, 73.5, 73.5, 40.0, None), level(2, 140.0, 70.0, 50.0, None)], None)
CURRENT = run(
    "vllm",
    "vllm",
    [level(1, 147.0, 147.0, 40.0, 6.1), level(2, 280.0, 140.0, 40.0, 6.0), level(4, 500.0, 125.0, 60.0, 5.9)],
    6.05,
)


def test_ratios_side_by_side():
    cmp = bench_report.compare_runs(BASELINE, CURRENT)
    assert cmp["host"] == "node-1"
    assert cmp["baseline"]["engine"] == "sglang"
    assert cmp["current"]["label"] == "vllm"
    assert cmp["summary"]["single_request_tok_s"] == {
        "baseline": 73.5,
        "current": 147.0,
        "ratio": 2.0,
        "higher_is_better": True,
    }
    assert cmp["summary"]["single_request_ttft_ms"] == {
        "baseline": 40.0,
        "current": 40.0,
        "ratio": 1.0,
        "higher_is_better": False,
    }
    assert cmp["summary"]["mean_acceptance_length"]["ratio"] is None  # SGLang has no counters
    assert [lv["concurrency"] for lv in cmp["levels"]] == [1, 2]
    assert cmp["levels"][1]["throughput_tok_s"]["ratio"] == 2.0
    assert cmp["levels"][1]["ttft_ms_p50"]["ratio"] == 0.8
    assert cmp["levels"][1]["ttft_ms_p90"] == {
        "baseline": 60.0,
        "current": 50.0,
        "ratio": 0.833,
        "higher_is_better": False,
    }
    assert cmp["unmatched_concurrency"] == [4]
    assert cmp["settings_differ"] == []


def test_different_settings_are_named():
    other = run("vllm", "vllm", [level(1, 100.0, 100.0, 30.0, 6.0)], 6.0, max_tokens=256)
    assert bench_report.compare_runs(BASELINE, other)["settings_differ"] == ["max_tokens"]


def test_ratio_edges():
    assert bench_report.ratio(None, 1.0) is None
    assert bench_report.ratio(1.0, None) is None
    assert bench_report.ratio(0.0, 1.0) is None
    assert bench_report.ratio(3.0, 1.0) == 0.333


def test_bad_run_files(tmp_path):
    with pytest.raises(bench_report.ReportError) as e:
        bench_report.load_run(tmp_path / "missing.json")
    assert str(e.value) == f"{tmp_path / 'missing.json'} does not exist"
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(bench_report.ReportError, match="cannot be read as JSON"):
        bench_report.load_run(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text(json.dumps({"levels": []}))
    with pytest.raises(bench_report.ReportError) as e:
        bench_report.load_run(tmp_path / "empty.json")
    assert (
        str(e.value)
        == f"{tmp_path / 'empty.json'} is not a bench result (no levels): re-run playbooks/bench.yml to write it"
    )


def test_plot_alone_and_beside_the_baseline(tmp_path):
    bench_report.plot_runs(BASELINE, None, tmp_path / "alone.png")
    bench_report.plot_runs(CURRENT, BASELINE, tmp_path / "sub" / "both.png")
    for name in ("alone.png", "sub/both.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000


def test_main_writes_comparison_and_png(tmp_path, capsys):
    (tmp_path / "baseline.json").write_text(json.dumps(BASELINE))
    (tmp_path / "vllm.json").write_text(json.dumps(CURRENT))
    argv = ["--run", str(tmp_path / "vllm.json"), "--png", str(tmp_path / "vllm.png")]
    argv += ["--baseline", str(tmp_path / "baseline.json"), "--compare-out", str(tmp_path / "vllm-vs-baseline.json")]
    assert bench_report.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["summary"]["peak_throughput_tok_s"]["ratio"] == 3.571
    assert printed["settings_differ"] == []
    written = json.loads((tmp_path / "vllm-vs-baseline.json").read_text())
    assert written["summary"] == printed["summary"]
    assert (tmp_path / "vllm.png").read_bytes()[:8] == PNG_SIGNATURE


def test_main_without_baseline_prints_null(tmp_path, capsys):
    (tmp_path / "baseline.json").write_text(json.dumps(BASELINE))
    assert bench_report.main(["--run", str(tmp_path / "baseline.json"), "--png", str(tmp_path / "b.png")]) == 0
    assert capsys.readouterr().out.strip() == "null"


def test_main_refuses_a_missing_baseline(tmp_path, capsys):
    (tmp_path / "vllm.json").write_text(json.dumps(CURRENT))
    argv = ["--run", str(tmp_path / "vllm.json"), "--png", str(tmp_path / "v.png")]
    argv += ["--baseline", str(tmp_path / "nope.json"), "--compare-out", str(tmp_path / "c.json")]
    assert bench_report.main(argv) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.json'} does not exist\n"
    assert not (tmp_path / "c.json").exists()
    assert not (tmp_path / "v.png").exists()


def test_main_without_matplotlib_keeps_the_json(tmp_path, capsys, monkeypatch):
    (tmp_path / "baseline.json").write_text(json.dumps(BASELINE))
    (tmp_path / "vllm.json").write_text(json.dumps(CURRENT))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    argv = ["--run", str(tmp_path / "vllm.json"), "--png", str(tmp_path / "v.png")]
    argv += ["--baseline", str(tmp_path / "baseline.json"), "--compare-out", str(tmp_path / "c.json")]
    assert bench_report.main(argv) == 3
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert (tmp_path / "c.json").is_file()
    assert not (tmp_path / "v.png").exists()
