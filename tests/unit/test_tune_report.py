"""plugins/filter/tune_report.py: when the tune role skips rewriting and replotting a host's report."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tune_report import tune_failure_text, tune_figures_text, tune_report_current

CONTENT = '{\n    "host": "n1"\n}\n'


def report(tmp_path: Path, content: str = CONTENT) -> tuple[Path, Path]:
    root = tmp_path / "tune"
    root.mkdir()
    root.chmod(0o755)
    js, png = root / "n1.json", root / "n1.png"
    js.write_text(content)
    js.chmod(0o644)
    png.write_bytes(b"\x89PNG")
    os.utime(js, ns=(1_000_000_000, 1_000_000_000))
    os.utime(png, ns=(2_000_000_000, 2_000_000_000))
    return js, png


def test_an_unchanged_report_with_its_plot_is_current(tmp_path: Path) -> None:
    js, png = report(tmp_path)
    assert tune_report_current(str(js), CONTENT, str(png)) is True


def test_a_plot_as_new_as_its_json_is_current(tmp_path: Path) -> None:
    js, png = report(tmp_path)
    os.utime(png, ns=(1_000_000_000, 1_000_000_000))
    assert tune_report_current(str(js), CONTENT, str(png)) is True


@pytest.mark.parametrize(
    "content",
    [
        '{\n    "host": "n2"\n}\n',  # another figure
        '{\n    "host": "n1"\n}',  # the same without its newline
        '{\n    "host": "n1"\n}\n\n',  # one byte more
    ],
)
def test_other_content_is_not_current(tmp_path: Path, content: str) -> None:
    js, png = report(tmp_path)
    assert tune_report_current(str(js), content, str(png)) is False


def test_a_missing_json_or_plot_is_not_current(tmp_path: Path) -> None:
    js, png = report(tmp_path)
    png.unlink()
    assert tune_report_current(str(js), CONTENT, str(png)) is False
    assert tune_report_current(str(tmp_path / "tune" / "n2.json"), CONTENT, str(tmp_path / "tune" / "n1.json")) is False
    assert tune_report_current(str(tmp_path / "nowhere" / "n1.json"), CONTENT, str(png)) is False


def test_a_plot_older_than_its_json_is_not_current(tmp_path: Path) -> None:
    js, png = report(tmp_path)
    os.utime(png, ns=(500_000_000, 500_000_000))
    assert tune_report_current(str(js), CONTENT, str(png)) is False


def test_another_mode_of_the_json_or_its_directory_is_not_current(tmp_path: Path) -> None:
    js, png = report(tmp_path)
    js.chmod(0o600)
    assert tune_report_current(str(js), CONTENT, str(png)) is False
    js.chmod(0o644)
    js.parent.chmod(0o700)
    assert tune_report_current(str(js), CONTENT, str(png)) is False


def test_a_directory_where_the_json_or_plot_should_be_is_not_current(tmp_path: Path) -> None:
    js, png = report(tmp_path)
    png.unlink()
    png.mkdir()
    assert tune_report_current(str(js), CONTENT, str(png)) is False
    js.unlink()
    js.mkdir()
    assert tune_report_current(str(js), CONTENT, str(tmp_path / "tune")) is False


def test_non_ascii_content_is_compared_as_utf8(tmp_path: Path) -> None:
    text = '{\n    "reason": "x1.2 \u2265 margin"\n}\n'
    js, png = report(tmp_path, text)
    assert tune_report_current(str(js), text, str(png)) is True


RESULT = {"winner": "ddtree budget 32", "reason": "fastest at 8 of 8 levels"}


def test_the_figures_line_says_what_serves_and_where_the_figures_are() -> None:
    js, png = "/r/tune/n1.json", "/r/tune/n1.png"
    # The report was current: its plot is already there.
    assert tune_figures_text(RESULT, "n1", js, png, {"skipped": True}) == (
        "n1 serves ddtree budget 32: fastest at 8 of 8 levels. Figures: /r/tune/n1.json; plot /r/tune/n1.png"
    )
    # Drawn now: what tune_plot.py said, or nothing where it said nothing.
    drawn = {"changed": False, "stdout": "no plot: matplotlib is not installed"}
    assert tune_figures_text(RESULT, "n1", js, png, drawn) == (
        "n1 serves ddtree budget 32: fastest at 8 of 8 levels. Figures: /r/tune/n1.json; no plot: matplotlib is not"
        " installed"
    )
    assert tune_figures_text({"winner": None, "reason": "every candidate failed"}, "n1", js, png, {"stdout": ""}) == (
        "n1 serves no candidate: every candidate failed. Figures: /r/tune/n1.json"
    )


def test_a_failed_tuning_says_whether_sglang_serves_again() -> None:
    args = ("n1",)
    units = ("sglang-qwen.service", "vllm-qwen.service")
    assert tune_failure_text("every candidate failed", *args, "sglang", *units) == (
        "tune failed on n1: every candidate failed. sglang-qwen.service serves again. Fix the cause (journalctl -u"
        " vllm-qwen.service, reports/tune/n1.json) and re-run playbooks/tune.yml."
    )
    assert tune_failure_text("every candidate failed", *args, "none", *units) == (
        "tune failed on n1: every candidate failed. sglang-qwen.service did NOT come back healthy: the node serves"
        " nothing; see journalctl -u sglang-qwen.service. Fix the cause (journalctl -u vllm-qwen.service,"
        " reports/tune/n1.json) and re-run playbooks/tune.yml."
    )
