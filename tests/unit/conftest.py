"""Fixtures shared by the unit tests that run the lab's stand-in engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TARGET_MODEL = Path(__file__).resolve().parents[2] / "tests" / "fakes" / "target_model.py"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The lab's stand-in Qwen3.6-27B directory (config.json, tokenizer files, small shards)."""
    path = tmp_path_factory.mktemp("models") / "Qwen3.6-27B"
    subprocess.run([sys.executable, str(TARGET_MODEL), str(path)], check=True, capture_output=True)
    return path
