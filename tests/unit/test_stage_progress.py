"""safetensors_stage shows rsync's progress on a multi-GB transfer instead of minutes of silence."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "action" / "safetensors_stage.py"


@pytest.fixture(scope="module")
def action():
    spec = importlib.util.spec_from_file_location("safetensors_stage_progress", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("    130,285,568  43%   58.62MB/s    0:00:02  ", (130285568, 43, "58.62MB/s", "0:00:02")),
        ("         32,768   0%    0.00kB/s    0:00:00", (32768, 0, "0.00kB/s", "0:00:00")),
        ("  3,543,210,112 100%  112.40MB/s    0:00:30 (xfr#1, to-chk=0/1)", (3543210112, 100, "112.40MB/s", "0:00:30")),
        ("sending incremental file list", None),
        ("", None),
    ],
)
def test_rsync_progress_lines_are_read(action, line, parsed):
    assert action.rsync_progress(line) == parsed


def test_the_progress_message_says_bytes_rate_and_time_left(action):
    assert action.progress_message(
        "qwen-ct101", "model.safetensors", 1610612736, 3543210112, 48, "112.40MB/s", "0:00:16"
    ) == ("qwen-ct101: staging model.safetensors: 1.5 of 3.3 GiB (48%), 112.40MB/s, 0:00:16 left")


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_a_slow_transfer_reports_progress_at_the_interval_and_a_failure_its_stderr(action, tmp_path):
    src = tmp_path / "d.safetensors"
    src.write_bytes(b"\0" * (24 * 1024 * 1024))
    seen = []
    # 24 MiB at 8 MiB/s: about 3 s, reported at most every second.
    rc, err = action.run_rsync(
        ["rsync", "--bwlimit=8192", str(src), str(tmp_path / "out")], lambda *p: seen.append(p), every_s=1
    )
    assert (rc, err) == (0, "")
    assert 1 <= len(seen) <= 4
    assert all(isinstance(done, int) and 0 <= pct <= 100 and rate.endswith("/s") for done, pct, rate, _ in seen)
    assert (tmp_path / "out").read_bytes() == src.read_bytes()

    rc, err = action.run_rsync(["rsync", str(tmp_path / "missing"), str(tmp_path / "x")], seen.append)
    assert rc == 23
    assert 'link_stat "' + str(tmp_path / "missing") + '" failed: No such file or directory' in err
