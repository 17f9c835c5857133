"""The shared safe-write and bounded-read helpers (issue 23, items 1, 3 and 5)."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import time

import pytest
import realfs
from ansible.module_utils.safe_io import (
    UnsafeFileError,
    atomic_write,
    json_depth,
    loads_json,
    locked_attribute,
    parse_mode,
    read_json,
    read_regular,
    resolve_owner,
    set_attributes,
    write_problem,
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


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_leaves_no_temp(tmpfs_dir):
    """A real full tmpfs: the data write fails with ENOSPC after the temporary file was created."""
    (tmpfs_dir / "f").write_text("old")
    realfs.fill(tmpfs_dir)
    with pytest.raises(OSError) as caught:
        atomic_write(str(tmpfs_dir / "f"), "new" * 10000, prefix=".x-")
    assert caught.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmpfs_dir)) == ["f", realfs.FILLER]
    assert (tmpfs_dir / "f").read_text() == "old"
    assert write_problem(caught.value, str(tmpfs_dir / "f")) == (
        "No space left on device",
        f"free space on the filesystem of {tmpfs_dir} and run again",
    )


def test_atomic_write_over_an_immutable_file_keeps_it_and_leaves_no_temp(ext4_dir):
    """A real ext4 file with chattr +i: the rename over it fails EPERM, the temporary file is removed."""
    target = ext4_dir / "f"
    target.write_text("old")
    with realfs.immutable(target):
        with pytest.raises(PermissionError) as caught:
            atomic_write(str(target), "new", prefix=".x-")
        assert sorted(os.listdir(ext4_dir)) == ["f", "lost+found"]
        assert target.read_text() == "old"
        assert write_problem(caught.value, str(target)) == (
            f"Operation not permitted: {target} is immutable (chattr +i)",
            f"if it is meant to change, run chattr -i {target} and run again",
        )


def test_locked_attribute_reads_what_chattr_set(ext4_dir, tmpfs_dir):
    f, d = ext4_dir / "f", ext4_dir / "d"
    f.write_text("x")
    d.mkdir()
    assert locked_attribute(str(f)) is None
    with realfs.immutable(f):
        assert locked_attribute(str(f)) == "immutable"
    subprocess.run(["chattr", "+a", str(f)], check=True)
    try:
        assert locked_attribute(str(f)) == "append-only"
    finally:
        subprocess.run(["chattr", "-a", str(f)], check=True)
    with realfs.immutable(d):
        assert locked_attribute(str(d)) == "immutable"
        with pytest.raises(PermissionError) as caught:
            atomic_write(str(d / "new"), "x")
        assert write_problem(caught.value, str(d / "new"))[0] == (
            f"Operation not permitted: its directory {d} is immutable (chattr +i)"
        )
    (ext4_dir / "link").symlink_to(f)
    assert locked_attribute(str(ext4_dir / "link")) is None  # never followed
    assert locked_attribute(str(ext4_dir / "missing")) is None
    (tmpfs_dir / "t").write_text("x")
    assert locked_attribute(str(tmpfs_dir / "t")) is None  # tmpfs has no attributes


def test_write_problem_names_a_read_only_filesystem_and_other_errors():
    assert write_problem(OSError(errno.EROFS, "Read-only file system"), "/srv/m/config.json") == (
        "Read-only file system",
        "remount the filesystem of /srv/m read-write and run again",
    )
    assert write_problem(OSError(errno.EACCES, "Permission denied"), "/nonexistent/x") == (
        "Permission denied",
        "check the permissions of /nonexistent and run again",
    )
    assert write_problem(OSError(errno.EIO, "Input/output error"), "x") == (
        "Input/output error",
        "fix that and run again",
    )


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


def test_set_attributes_goes_through_a_descriptor_and_never_through_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("root only\n")
    os.chmod(outside, 0o600)
    (tmp_path / "link").symlink_to(outside)
    with pytest.raises(UnsafeFileError, match=r"link is a symlink"):
        set_attributes(str(tmp_path / "link"), (65534, 65534), 0o644)
    assert (outside.stat().st_uid, outside.stat().st_mode & 0o7777) == (0, 0o600)
    assert set_attributes(str(outside), (65534, -1), 0o640) is True
    assert (outside.stat().st_uid, outside.stat().st_gid, outside.stat().st_mode & 0o7777) == (65534, 0, 0o640)
    assert set_attributes(str(outside), (-1, -1), None) is False
    os.link(outside, tmp_path / "hard")
    with pytest.raises(UnsafeFileError, match=r"has 1 other hard link\(s\)"):
        set_attributes(str(outside), (0, 0), 0o600)


def test_owner_names_and_modes_are_resolved_or_refused():
    assert resolve_owner("root", "0") == (0, 0)
    assert resolve_owner(None, "") == (-1, -1)
    with pytest.raises(UnsafeFileError, match=r"group 'no-such-group-x' does not exist on this host"):
        resolve_owner("root", "no-such-group-x")
    with pytest.raises(UnsafeFileError, match=r"user 'a\\x00b' does not exist"):
        resolve_owner("a\x00b", None)

    def symbolic(now, text):
        raise ValueError("bad symbolic mode")

    assert parse_mode("0640", 0o644, symbolic) == 0o640
    assert parse_mode(0o600, 0o644, symbolic) == 0o600
    with pytest.raises(UnsafeFileError, match=r"is neither octal"):
        parse_mode("u=x", 0o644, symbolic)
    with pytest.raises(UnsafeFileError, match=r"is not a file mode"):
        parse_mode("0170000", 0o644, symbolic)


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


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ('["\\\\", ["]"]]', 2),  # an escaped backslash ends right before the closing quote
        ('["\\\\\\"[", [[]]]', 3),  # backslash, quote, bracket: all inside the string
        ('{"k\\"{": {"v": "}\\\\"}}', 2),
        ('{"a": "\\u005b\\"", "b": [{}]}', 3),
        ("[[]][[[]]]", 3),
        ("]]][[", 0),
        ('[["abc\\" [[[[', 2),  # an unterminated string ends the count
        ('"\\', 0),
    ],
)
def test_json_depth_counts_brackets_outside_strings_only(text, depth):
    assert json_depth(text) == depth


def _depth_by_the_old_regex(text):
    """What json_depth answered before the linear scan (quadratic on unterminated strings: valid JSON only)."""
    import re

    deepest = depth = 0
    for ch in re.findall(r"[\[\]{}]", re.sub(r'"[^"\\]*(?:\\.[^"\\]*)*"', "", text, flags=re.DOTALL)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def test_json_depth_agrees_with_the_parser_and_the_old_regex_on_valid_json():
    """Seeded random JSON whose strings and keys are made of quotes, backslashes and brackets."""
    rng = random.Random(23)
    letters = ['"', "\\", "[", "]", "{", "}", "a", "\u00e9", "\U0001f600", "\n"]

    def value(level):
        roll = rng.random()
        if level > 6 or roll < 0.3:
            return "".join(rng.choice(letters) for _ in range(rng.randint(0, 6)))
        if roll < 0.6:
            return [value(level + 1) for _ in range(rng.randint(0, 3))]
        return {value(7): value(level + 1) for _ in range(rng.randint(0, 3))}

    def nesting(v):
        if isinstance(v, (list, dict)):
            return 1 + max(map(nesting, v.values() if isinstance(v, dict) else v), default=0)
        return 0

    for _ in range(2000):
        v = value(0)
        for text in (json.dumps(v), json.dumps(v, ensure_ascii=False, indent=1)):
            assert json_depth(text) == _depth_by_the_old_regex(text) == nesting(v), text


@pytest.mark.parametrize("size", [256 * 1024, 1024 * 1024, 16 * 1024 * 1024])
def test_an_unterminated_string_of_escaped_quotes_is_read_in_linear_time(size, deadline):
    """'"' followed by '\\"' repeated made the old regex backtrack quadratically: 32 KiB took 3 s, 128 KiB 60 s,
    so 256 KiB about 4 minutes and 16 MiB (the size read_json allows) days; every bounded JSON reader
    checks the depth first (issue 23). Linear now: 16 MiB in a fraction of a second."""
    text = '"' + '\\"' * (size // 2)
    started = time.monotonic()
    with deadline(30):
        assert json_depth(text) == 0
        with pytest.raises(UnsafeFileError, match=r"^x.json is not valid JSON \(Unterminated string starting at"):
            loads_json(text, "x.json")
    # About 0.2 s on one core; the bound leaves room for a loaded machine (it took 2.7 s beside a lab
    # run on two cores) while quadratic time would take days.
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("text", "escape"),
    [
        ('"\\ud800"', "\\ud800"),
        ('{"model_type": "qwen3\\udfff"}', "\\udfff"),
        ('{"\\udc00": 1}', "\\udc00"),
        ('{"a": [1, {"b": ["x", "\\uDBFF!"]}]}', "\\udbff"),
        ('["\\ude00\\ud83d"]', "\\ude00"),  # a low surrogate before a high one is no pair
        ('"\\ud800"'.replace("\\ud800", "\ud800"), "\\ud800"),  # one already in the text
    ],
)
def test_loads_json_refuses_a_lone_surrogate_in_any_string(text, escape):
    """A \\ud800 escape is valid JSON, but the str it parses into cannot be encoded as UTF-8: written into a file or
    returned in a result (the controller refuses such a result) it failed far from the file (issue 23)."""
    message = f"x.json holds a lone surrogate ({escape} escape), which no UTF-8 text can hold; it is not such a file"
    with pytest.raises(UnsafeFileError) as caught:
        loads_json(text, "x.json")
    assert str(caught.value) == message


def test_loads_json_and_read_json_keep_valid_text_and_paired_surrogates(tmp_path):
    assert loads_json('{"\\u00e9t\\u00e9": ["\\ud83d\\ude00", "\u00e9", "\\\\ud800"]}', "x.json") == {
        "\u00e9t\u00e9": ["\U0001f600", "\u00e9", "\\ud800"]
    }
    (tmp_path / "c.json").write_text('{"a": "\\ud800"}')
    with pytest.raises(UnsafeFileError, match=r"^c.json holds a lone surrogate \(\\ud800 escape\)"):
        read_json(str(tmp_path / "c.json"), what="c.json")
