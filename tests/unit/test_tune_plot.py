"""playbooks/files/tune_plot.py: the tuning plot, and its note when matplotlib is missing."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from ddtree.repo import repo_file

tune_plot = repo_file("playbooks/files/tune_plot.py")

DATA = {
    "host": "n1",
    "choice": {
        "winner": "ddtree-16",
        "reason": "ddtree-16 is weighted x1.100 the chain",
        "rows": [{"name": "ddtree-32", "note": "refused: at concurrency 4 it is x0.933 the chain"}],
    },
    "results": [
        {
            "method": "dflash",
            "budget": None,
            "status": "ok",
            "levels": [{"concurrency": 1, "throughput_tok_s": 500.0}, {"concurrency": 4, "throughput_tok_s": 1500.0}],
        },
        {
            "method": "ddtree",
            "budget": 32,
            "status": "ok",
            "levels": [{"concurrency": 1, "throughput_tok_s": 600.0}, {"concurrency": 4, "throughput_tok_s": 1400.0}],
        },
        {"method": "ddtree", "budget": 64, "status": "failed", "reason": "vLLM did not become healthy"},
        {"method": "ddtree", "budget": 128, "status": "skipped", "reason": "not measured: DDTree is not available"},
    ],
}


def test_series_has_the_measured_candidates_and_names_the_failed() -> None:
    assert tune_plot.series(DATA) == (
        [1, 4],
        [("dflash", [500.0, 1500.0], False), ("ddtree-32", [600.0, 1400.0], False)],
        [
            "ddtree-32: refused: at concurrency 4 it is x0.933 the chain",
            "failed: ddtree-64: vLLM did not become healthy",
            "ddtree-128: not measured: DDTree is not available",
        ],
    )


def test_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "n1.json"
    src.write_text(json.dumps(DATA))
    assert tune_plot.main([str(src), str(tmp_path / "n1.png")]) == 0
    assert (tmp_path / "n1.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert capsys.readouterr().out == f"plot {tmp_path / 'n1.png'}\n"


def test_without_matplotlib_the_plot_is_skipped_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    src = tmp_path / "n1.json"
    src.write_text(json.dumps(DATA))
    assert tune_plot.main([str(src), str(tmp_path / "n1.png")]) == 0
    assert not (tmp_path / "n1.png").exists()
    assert capsys.readouterr().out.startswith("plot skipped: matplotlib is not installed for ")
