"""json_file_info: the bounded JSON reader that replaces slurp | b64decode | from_json (issue 23, items 3 and 5)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import json_file_info
import pytest
from ansible.module_utils.json_file import JsonFile, UnsafeFileError, read_json_file
from ansible.module_utils.testing import patch_module_args


def run_module(args: dict, capsys: pytest.CaptureFixture[str]) -> tuple[bool, dict]:
    """Run the module's main() in-process; returns (failed, result)."""
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        json_file_info.main()
    result = json.loads(capsys.readouterr().out)
    return exc.value.code != 0, result


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"layer_types": []}}\n')
    return path


def test_reads_the_value_and_changes_nothing(config: Path, capsys) -> None:
    failed, result = run_module({"path": str(config)}, capsys)
    assert failed is False
    assert result["changed"] is False
    assert result["exists"] is True
    assert result["data"] == {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"layer_types": []}}
    assert set(result) == {"changed", "exists", "data", "invocation"}


def test_runs_the_same_in_check_mode(config: Path, capsys) -> None:
    failed, result = run_module({"path": str(config), "_ansible_check_mode": True}, capsys)
    assert (failed, result["changed"], result["exists"]) == (False, False, True)
    assert result["data"]["architectures"] == ["Qwen3_5ForConditionalGeneration"]


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', "3", "null", "true"])
def test_any_json_value_is_returned(tmp_path: Path, text: str) -> None:
    path = tmp_path / "v.json"
    path.write_text(text)
    assert read_json_file(str(path)) == JsonFile(exists=True, data=json.loads(text))


def test_a_symlink_into_a_blobs_directory_is_read_by_default(tmp_path: Path, config: Path, capsys) -> None:
    link = tmp_path / "snapshot-config.json"
    link.symlink_to(config)
    failed, result = run_module({"path": str(link)}, capsys)
    assert failed is False and result["data"]["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    failed, result = run_module({"path": str(link), "follow": False}, capsys)
    assert failed is True
    assert result["msg"] == f"{link} is a symlink; it is read only as a regular file: remove the link and run again"


def test_a_missing_file_fails_unless_missing_ok(tmp_path: Path, capsys) -> None:
    absent = tmp_path / "service_swap.fact"
    failed, result = run_module({"path": str(absent)}, capsys)
    assert failed is True
    assert result["msg"] == (
        f"{absent} does not exist; create it (or fix the path), or set missing_ok where it may be absent"
    )
    assert set(result) == {"failed", "msg", "invocation"}
    failed, result = run_module({"path": str(absent), "missing_ok": True}, capsys)
    assert failed is False
    assert (result["exists"], result["data"], result["changed"]) == (False, None, False)


def test_a_dangling_symlink_counts_as_missing(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert read_json_file(str(tmp_path / "link"), missing_ok=True) == JsonFile(exists=False)


def test_a_fifo_is_refused_without_waiting(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    done: list[tuple[bool, dict]] = []
    # A writer that never comes: the open must not wait for one.
    worker = threading.Thread(target=lambda: done.append(_refusal(str(fifo))), daemon=True)
    worker.start()
    worker.join(10)
    assert done == [
        (True, f"{fifo} is not a regular file (a FIFO); remove it or put the real file there and run again")
    ]


def _refusal(path: str, **kwargs) -> tuple[bool, str]:
    try:
        read_json_file(path, **kwargs)
    except UnsafeFileError as exc:
        return True, str(exc)
    return False, ""


def test_dev_zero_behind_a_link_is_refused_before_any_read(tmp_path: Path) -> None:
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    assert _refusal(str(link)) == (
        True,
        f"{link} is not a regular file (a device); remove it or put the real file there and run again",
    )
    assert _refusal(str(link), follow=False) == (
        True,
        f"{link} is a symlink; it is read only as a regular file: remove the link and run again",
    )


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert _refusal(str(tmp_path)) == (
        True,
        f"{tmp_path} is not a regular file (a directory); remove it or put the real file there and run again",
    )


def test_an_oversize_file_is_refused_naming_the_bound(tmp_path: Path, capsys) -> None:
    path = tmp_path / "index.json"
    path.write_text('{"a": "' + "x" * 100 + '"}')
    failed, result = run_module({"path": str(path), "max_bytes": 64}, capsys)
    assert failed is True
    assert result["msg"] == (
        f"{path} is larger than 64 bytes, more than such a file ever holds; check it"
        " (or raise max_bytes if it really is that large)"
    )
    assert read_json_file(str(path), max_bytes=200).exists is True


@pytest.mark.parametrize("max_bytes", [0, -1, 2**30 + 1, 10**30])
def test_max_bytes_out_of_range_is_refused(config: Path, max_bytes: int, capsys) -> None:
    failed, result = run_module({"path": str(config), "max_bytes": max_bytes}, capsys)
    assert failed is True
    assert result["msg"] == f"max_bytes {max_bytes} is out of range; give 1 to 1073741824 (the default is 16777216)"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"\xff{}", "is not UTF-8 text (invalid start byte at byte 0)"),
        (b"", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        (b'{"a": }', "is not valid JSON (Expecting value: line 1 column 7 (char 6))"),
        (b'{"a": NaN}', "is not valid JSON (NaN is not a JSON number)"),
        (b'{"a": -Infinity}', "is not valid JSON (-Infinity is not a JSON number)"),
        (b"[" * 65 + b"]" * 65, "is nested 65 levels deep (at most 64); it is not such a file"),
        (b"[" * 100000, "is nested 100000 levels deep (at most 64); it is not such a file"),
    ],
)
def test_bad_content_names_the_file_and_what_to_do(tmp_path: Path, content: bytes, problem: str, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    failed, result = run_module({"path": str(path)}, capsys)
    assert failed is True
    assert result["msg"] == f"{path} {problem}; fix or replace the file and run again"
    assert "Traceback" not in json.dumps(result)


def test_a_lone_surrogate_escape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"ok": ["\\ud800x"]}')
    assert _refusal(str(path)) == (
        True,
        f"{path} holds a lone surrogate (\\ud800 escape), which no UTF-8 text can hold; it is not such a file; fix or"
        " replace the file and run again",
    )


def test_64_levels_are_read(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 64 + "]" * 64)
    assert read_json_file(str(path)).exists is True


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", "path is empty; give the path of the JSON file to read"),
        ("/etc/a\x00b", "path '/etc/a\\x00b' holds a NUL character, which no path can hold; check the path"),
    ],
)
def test_a_path_no_file_can_have_is_refused(path: str, message: str, capsys) -> None:
    failed, result = run_module({"path": path}, capsys)
    assert failed is True
    assert result["msg"] == message
