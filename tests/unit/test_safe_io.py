"""The shared safe-write and bounded-read helpers (issue 23, items 1, 3 and 5)."""

from __future__ import annotations

import os

import pytest
from ansible.module_utils.safe_io import (
    UnsafeFileError,
    atomic_write,
    json_depth,
    loads_json,
    read_json,
    read_regular,
)


def test_atomic_write_replaces_a_symlink_at_the_final_name_without_writing_through(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret\n")
    os.chmod(outside, 0o600)
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").symlink_to(outside)
    atomic_write(str(d / "config.json"), "{}\n", 0o640, (65534, 65534), prefix=".x-")
    assert outside.read_bytes() == b"secret\n"
    assert (outside.stat().st_uid, outside.stat().st_mode & 0o7777) == (0, 0o600)
    st = (d / "config.json").lstat()
    assert (d / "config.json").read_text() == "{}\n"
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (65534, 65534, 0o640)
    assert os.listdir(d) == ["config.json"]


def test_atomic_write_leaves_nothing_when_it_fails(tmp_path):
    (tmp_path / "f").write_text("old")
    with pytest.raises(TypeError):
        atomic_write(str(tmp_path / "f"), 5)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == ["f"]
    assert (tmp_path / "f").read_text() == "old"
    with pytest.raises(UnsafeFileError, match="is not a file path"):
        atomic_write(str(tmp_path) + "/", "x")


def test_read_regular_refuses_symlink_fifo_directory_and_oversize(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 11)
    (tmp_path / "link").symlink_to(tmp_path / "big")
    os.mkfifo(tmp_path / "fifo")
    assert read_regular(str(tmp_path / "big"), 11) == b"x" * 11
    with pytest.raises(UnsafeFileError, match=r"big is larger than 10 bytes"):
        read_regular(str(tmp_path / "big"), 10)
    with pytest.raises(UnsafeFileError, match=r"link is a symlink"):
        read_regular(str(tmp_path / "link"), 100)
    with pytest.raises(UnsafeFileError, match=r"fifo is not a regular file \(a FIFO\)"):
        read_regular(str(tmp_path / "fifo"), 100)
    with pytest.raises(UnsafeFileError, match=r"is not a regular file \(a directory\)"):
        read_regular(str(tmp_path), 100)
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "absent"), 100)


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth('{"a": [1, {"b": "[[[\\"["}]}') == 3
    assert json_depth("[]") == 1
    assert json_depth("5") == 0


def test_loads_json_names_the_file_for_deep_nesting_nan_and_bad_bytes(tmp_path):
    with pytest.raises(UnsafeFileError, match=r"^x.json is nested 100000 levels deep \(at most 64\)"):
        loads_json("[" * 100000 + "]" * 100000, "x.json")
    with pytest.raises(UnsafeFileError, match=r"^x.json is not valid JSON \(NaN is not a JSON number"):
        loads_json('{"a": NaN}', "x.json")
    with pytest.raises(UnsafeFileError, match=r"^x.json is not UTF-8 text"):
        loads_json(b'"\xff"', "x.json")
    (tmp_path / "c.json").write_text('{"a": 1}')
    assert read_json(str(tmp_path / "c.json")) == {"a": 1}
