"""safetensors header parser: real files from the safetensors library, sparse big files, hostile headers."""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct

import numpy as np
import pytest
from ansible.module_utils.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsError,
    inspect_path,
    read_file_header,
)
from safetensors.numpy import save_file
from safetensors_files import (
    QWEN36_27B_DFLASH,
    disk_bytes,
    write_raw,
    write_real,
    write_sharded,
    write_sparse,
)


def test_real_file_written_by_safetensors(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(
        {
            "a": np.zeros((2, 3), dtype=np.float32),
            "b": np.zeros((4,), dtype=np.float16),
            "c": np.zeros((), dtype=np.int64),
            "d": np.zeros((0, 5), dtype=np.uint8),
        },
        str(path),
        metadata={"format": "pt", "note": "x"},
    )
    cp = inspect_path(str(path))
    s = cp.summary()
    assert s["tensors"] == {
        "a": {"dtype": "F32", "shape": [2, 3], "file": "t.safetensors"},
        "b": {"dtype": "F16", "shape": [4], "file": "t.safetensors"},
        "c": {"dtype": "I64", "shape": [], "file": "t.safetensors"},
        "d": {"dtype": "U8", "shape": [0, 5], "file": "t.safetensors"},
    }
    assert s["total_parameters"] == 6 + 4 + 1 + 0
    assert s["total_bytes"] == 24 + 8 + 8
    assert s["dtypes"] == {"F16": 4, "F32": 6, "I64": 1, "U8": 0}
    assert s["metadata"] == {"format": "pt", "note": "x"}
    assert s["index"] is None
    assert s["files"][0]["size"] == path.stat().st_size
    assert "sha256" not in s["files"][0]


def test_sha256_matches_hashlib(tmp_path):
    path = write_real(tmp_path / "t.safetensors", {"w": (8, 8)})
    fh = read_file_header(str(path), checksum="sha256")
    assert fh.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_directory_with_one_file(tmp_path):
    write_real(tmp_path / "model.safetensors", {"w": (2, 2)})
    assert list(inspect_path(str(tmp_path)).tensors) == ["w"]


def test_sparse_published_drafter_is_full_size_but_reads_only_the_header(tmp_path):
    path = write_sparse(tmp_path / "model.safetensors", QWEN36_27B_DFLASH)
    cp = inspect_path(str(path))
    assert cp.total_parameters == 1_730_213_120
    assert cp.total_bytes == 3_460_426_240
    assert path.stat().st_size > 3_460_426_240
    assert disk_bytes(path) < 1_000_000
    assert cp.tensors["fc.weight"].shape == (5120, 25600)


def test_sharded_checkpoint(tmp_path):
    shapes = {f"layers.{i}.w": (4, 4) for i in range(10)}
    write_sharded(tmp_path, shapes, shards=3, sparse=False)
    cp = inspect_path(str(tmp_path))
    assert len(cp.files) == 3
    assert cp.total_parameters == 160
    assert cp.index_path == str(tmp_path / "model.safetensors.index.json")
    assert cp.tensors["layers.9.w"].file.endswith("model-00003-of-00003.safetensors")
    assert cp.warnings == []


def _index(tmp_path, wmap, total=None):
    obj = {"metadata": {"total_size": total}, "weight_map": wmap}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(obj))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w.update({"ghost": "model-00001-of-00002.safetensors"}), "'ghost' is mapped to"),
        (lambda w: w.update({"a": "model-00002-of-00002.safetensors"}), "'a' is mapped to model-00002"),
        (lambda w: w.pop("b"), "missing from the index"),
        (lambda w: w.update({"a": "nope.safetensors"}), "names shard 'nope.safetensors' which is missing"),
        (lambda w: w.update({"a": "../x.safetensors"}), "not a plain file name"),
        (lambda w: w.clear(), "weight_map is empty"),
    ],
)
def test_index_inconsistencies_are_refused(tmp_path, mutate, message):
    write_sharded(tmp_path, {"a": (2,), "b": (2,), "c": (2,)}, shards=2, sparse=False)
    wmap = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    mutate(wmap)
    _index(tmp_path, wmap)
    with pytest.raises(SafetensorsError, match=message.replace("(", r"\(")):
        inspect_path(str(tmp_path))


def test_index_total_size_mismatch_is_a_warning(tmp_path):
    write_sharded(tmp_path, {"a": (2,), "b": (2,)}, shards=2, sparse=False)
    wmap = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    _index(tmp_path, wmap, total=999)
    cp = inspect_path(str(tmp_path))
    assert cp.warnings == [
        f"{tmp_path}/model.safetensors.index.json: metadata.total_size is 999 but the shards hold 8 bytes of tensors"
    ]


def test_tensor_in_two_shards_is_refused(tmp_path):
    write_real(tmp_path / "s1.safetensors", {"a": (2,)})
    write_real(tmp_path / "s2.safetensors", {"a": (2,)})
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(SafetensorsError, match=r"tensor 'a' is in both s1\.safetensors and s2\.safetensors"):
        inspect_path(str(tmp_path))


def test_directory_without_index_and_two_files(tmp_path):
    write_real(tmp_path / "a.safetensors", {"a": (2,)})
    write_real(tmp_path / "b.safetensors", {"b": (2,)})
    with pytest.raises(SafetensorsError, match=r"2 \.safetensors files"):
        inspect_path(str(tmp_path))


def test_empty_directory_and_missing_path(tmp_path):
    with pytest.raises(SafetensorsError, match=r"no \.safetensors file"):
        inspect_path(str(tmp_path))
    with pytest.raises(SafetensorsError, match="does not exist"):
        inspect_path(str(tmp_path / "nope"))


def test_truncated_download_is_caught(tmp_path):
    path = write_real(tmp_path / "t.safetensors", {"w": (16, 16)})
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(SafetensorsError, match="the file is truncated"):
        inspect_path(str(path))


def test_trailing_bytes_are_caught(tmp_path):
    path = write_real(tmp_path / "t.safetensors", {"w": (4,)})
    path.write_bytes(path.read_bytes() + b"\0\0")
    with pytest.raises(SafetensorsError, match="2 bytes after the last tensor"):
        inspect_path(str(path))


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE = [
    ("huge length", b"{}", 0, 2**63, "exceeds the 104857600-byte limit"),
    ("length past file end", b"{}", 0, 1000, "header claims 1000 bytes"),
    ("length just over limit", b"{}", 0, MAX_HEADER_BYTES + 1, "exceeds"),
    ("non-json", b"not json at all!", 0, None, "not valid JSON"),
    ("not utf-8", b'{"\xff": 1}', 0, None, "not UTF-8"),
    ("json array", b"[1, 2, 3]", 0, None, "not an object"),
    ("nested junk", b"[" * 100000 + b"]" * 100000, 0, None, "nested too deeply|not an object"),
    ("deep object", b'{"a":' * 50000 + b"1" + b"}" * 50000, 0, None, "nested too deeply|must be an object"),
    ("duplicate key", b'{"a": {}, "a": {}}', 0, None, "duplicate key 'a'"),
    # The last of a duplicated name is valid: a plain parse would keep it and accept the file.
    (
        "junk then valid duplicate",
        b'{"a": 5, "a": ' + json.dumps(_entry()).encode() + b"}",
        8,
        None,
        "duplicate key 'a'",
    ),
    (
        "invalid then valid duplicate",
        b'{"a": {"dtype": "F32"}, "a": ' + json.dumps(_entry()).encode() + b"}",
        8,
        None,
        "duplicate key 'a'",
    ),
    (
        "duplicate field in an entry",
        b'{"a": {"dtype": "F64", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
        8,
        None,
        "duplicate key 'dtype'",
    ),
    (
        "duplicate metadata key",
        b'{"__metadata__": {"k": "v", "k": "w"}, "a": ' + json.dumps(_entry()).encode() + b"}",
        8,
        None,
        "duplicate key 'k'",
    ),
    ("entry not object", json.dumps({"w": 5}).encode(), 0, None, "must be an object with dtype"),
    (
        "missing offsets",
        json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode(),
        8,
        None,
        "lacks data_offsets",
    ),
    ("unknown dtype", json.dumps({"w": _entry(dtype="F128")}).encode(), 8, None, "unknown dtype 'F128'"),
    ("negative dim", json.dumps({"w": _entry(shape=(-2,))}).encode(), 8, None, "non-negative integers"),
    ("bool dim", json.dumps({"w": _entry(shape=(True, 2))}).encode(), 8, None, "non-negative integers"),
    ("float dim", json.dumps({"w": _entry(shape=(2.0,))}).encode(), 8, None, "non-negative integers"),
    (
        "span mismatch",
        json.dumps({"w": _entry(offsets=(0, 7))}).encode(),
        7,
        None,
        "= 8 bytes but data_offsets span 7",
    ),
    (
        "end before begin",
        json.dumps({"w": _entry(offsets=(8, 0))}).encode(),
        8,
        None,
        "end 0 is before begin 8",
    ),
    (
        "overlap",
        json.dumps({"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))}).encode(),
        12,
        None,
        "overlap tensor 'a'",
    ),
    (
        "gap",
        json.dumps({"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(12, 20))}).encode(),
        20,
        None,
        "gap in the data buffer between byte 8",
    ),
    ("out of file", json.dumps({"w": _entry(offsets=(8, 16))}).encode(), 8, None, "gap in the data buffer"),
    ("past end", json.dumps({"w": _entry(shape=(4,), offsets=(0, 16))}).encode(), 8, None, "truncated"),
    ("metadata not map", json.dumps({"__metadata__": ["x"]}).encode(), 0, None, "__metadata__ must be a map"),
    (
        "metadata int value",
        json.dumps({"__metadata__": {"k": 1}}).encode(),
        0,
        None,
        "__metadata__ must be a map",
    ),
    (
        "sub-byte leftover",
        json.dumps({"w": _entry(dtype="F4", shape=(3,), offsets=(0, 1))}).encode(),
        1,
        None,
        "whole bytes",
    ),
    (
        "huge shape",
        json.dumps({"w": _entry(shape=(2**62, 2**62))}).encode(),
        8,
        None,
        "has more elements than any file can hold",
    ),
]


@pytest.mark.parametrize(
    ("header", "data_len", "length", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_headers_fail_cleanly(tmp_path, header, data_len, length, message):
    path = write_raw(tmp_path / "h.safetensors", header, data_len, length)
    with pytest.raises(SafetensorsError, match=message):
        inspect_path(str(path))


def test_too_short_file(tmp_path):
    (tmp_path / "s.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short for a safetensors file"):
        inspect_path(str(tmp_path / "s.safetensors"))


def test_tiny_header_length(tmp_path):
    (tmp_path / "s.safetensors").write_bytes(struct.pack("<Q", 1) + b"{")
    with pytest.raises(SafetensorsError, match="too small to hold a JSON object"):
        inspect_path(str(tmp_path / "s.safetensors"))


def test_padded_header_is_accepted(tmp_path):
    header = json.dumps({"w": _entry()}).encode() + b"        "
    path = write_raw(tmp_path / "p.safetensors", header, 8)
    assert inspect_path(str(path)).tensors["w"].shape == (2,)


def test_fuzz_random_header_mutations_never_traceback(tmp_path):
    """Seeded: flip, insert, delete, truncate header bytes; only clean errors or success."""
    base = write_real(tmp_path / "base.safetensors", {"a.weight": (3, 5), "b": (7,), "c": (2, 2, 2)})
    original = base.read_bytes()
    (n,) = struct.unpack("<Q", original[:8])
    rng = random.Random(20261130)
    outcomes = {"ok": 0, "error": 0}
    target = tmp_path / "fuzz.safetensors"
    for _ in range(3000):
        header = bytearray(original[8 : 8 + n])
        data = original[8 + n :]
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(6)
            pos = rng.randrange(len(header)) if header else 0
            if op == 0 and header:
                header[pos] = rng.randrange(256)
            elif op == 1:
                header[pos:pos] = bytes([rng.choice(b'{}[]",:0123456789-eE.truefalsnul ')])
            elif op == 2 and header:
                del header[pos]
            elif op == 3:
                digits = str(rng.choice([0, 1, 7, 8, 2**31, 2**64, -1, 10**30]))
                header[pos:pos] = digits.encode()
            elif op == 4:
                data = data[: rng.randrange(len(data) + 1)]
            else:
                header = header[: rng.randrange(len(header) + 1)]
        length = len(header) if rng.random() < 0.8 else rng.randrange(2**64)
        target.write_bytes(struct.pack("<Q", length) + bytes(header) + data)
        try:
            inspect_path(str(target))
            outcomes["ok"] += 1
        except SafetensorsError as exc:
            assert str(exc)
            outcomes["error"] += 1
    assert outcomes["error"] > 2500
    assert outcomes["ok"] > 0


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('{"weight_map": []}', "must be a JSON object with a 'weight_map' object"),
        ("[1]", "must be a JSON object with a 'weight_map' object"),
        ('{"weight_map": {"a": "s1.safetensors"}, "metadata": 5}', "'metadata' must be an object"),
        ('{"weight_map": {"a": 7}}', "is not a plain file name"),
        ('{"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}}', "duplicate key 'a'"),
    ],
)
def test_bad_index_files(tmp_path, index, message):
    write_real(tmp_path / "s1.safetensors", {"a": (2,)})
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(SafetensorsError, match=re.escape(message)):
        inspect_path(str(tmp_path))


def test_directory_given_as_a_file_and_bad_checksum_values(tmp_path):
    """inspect_path tells files from directories by one open and fstat; the messages are unchanged."""
    write_real(tmp_path / "model.safetensors", {"w": (2,)})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SafetensorsError, match=re.escape(f"{tmp_path}: is a directory, expected a .safetensors file")):
        read_file_header(str(tmp_path))
    bad = "checksum must be 'none' or 'sha256', not 'md5'"
    for call in (
        lambda: read_file_header(str(tmp_path), "md5"),
        lambda: read_file_header(str(tmp_path / "nope"), "md5"),
        lambda: inspect_path(str(tmp_path / "model.safetensors"), "md5"),
        lambda: inspect_path(str(tmp_path / "nope"), "md5"),
        lambda: inspect_path(str(tmp_path), "md5"),
    ):
        with pytest.raises(SafetensorsError, match=re.escape(bad)):
            call()
    # A directory is listed before the checksum value matters, as before.
    with pytest.raises(SafetensorsError, match=r"no \.safetensors file"):
        inspect_path(str(empty), "md5")


def test_directory_that_cannot_be_opened_is_still_listed(tmp_path, monkeypatch):
    """open() of a directory can fail (no read permission) where listing it may not: no file error then."""
    import ansible.module_utils.safetensors_header as sh

    write_real(tmp_path / "model.safetensors", {"w": (2,)})
    real_open = sh.os.open

    def refuse_dir(path, flags, *args):
        if str(path) == str(tmp_path):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(sh.os, "open", refuse_dir)
    assert list(inspect_path(str(tmp_path)).tensors) == ["w"]
    with pytest.raises(SafetensorsError, match=re.escape(f"{tmp_path}: cannot read: Permission denied")):
        read_file_header(str(tmp_path))


@pytest.mark.parametrize("extra", [-1, 0, 1, 100_000])
def test_header_around_the_first_read(tmp_path, extra):
    """Headers ending just inside, at, and past the first read, and far past it, parse alike."""
    import ansible.module_utils.safetensors_header as sh

    raw = json.dumps({"w": _entry()}).encode()
    header = raw + b" " * (sh._FIRST_READ - 8 - len(raw) + extra)
    path = write_raw(tmp_path / "p.safetensors", header, 8)
    fh = read_file_header(str(path))
    assert (fh.header_len, fh.tensors["w"].shape) == (len(header), (2,))


def test_a_fifo_as_a_weights_file_or_index_is_refused_without_hanging(tmp_path):
    """A FIFO planted in the drafter directory hung the inspection (issue 23, LOW)."""
    import os

    from ansible.module_utils.safetensors_header import SafetensorsError, read_file_header

    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(SafetensorsError, match=r"model\.safetensors: not a regular file \(a FIFO"):
        read_file_header(str(tmp_path / "model.safetensors"))


def test_a_shape_product_past_any_file_size_is_refused_quickly_and_its_message_is_short():
    """Thousands of digits crashed the message (int-to-str limit); a 900 KB header cost 17 s (issue 23, LOW)."""
    import json as _json
    import time as _time

    from ansible.module_utils.safetensors_header import SafetensorsError, parse_header_bytes

    shape = [10**4000] * 200
    header = _json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}).encode()
    assert len(header) > 800_000
    started = _time.monotonic()
    with pytest.raises(SafetensorsError, match=r"tensor 't' shape \[1000.*\.\.\. has more elements than any file"):
        parse_header_bytes(header, 4, "x.safetensors")
    assert _time.monotonic() - started < 2
    wide = _json.dumps({"t": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(SafetensorsError, match="has more elements than any file can hold"):
        parse_header_bytes(wide, 4, "x.safetensors")


def test_a_lone_surrogate_in_a_tensor_name_is_refused_on_the_node():
    """It passed the node and the controller refused the result (issue 23, LOW)."""
    from ansible.module_utils.safetensors_header import SafetensorsError, parse_header_bytes

    header = b'{"t\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    with pytest.raises(SafetensorsError, match="holds a lone UTF-16 surrogate"):
        parse_header_bytes(header, 4, "x.safetensors")
    fine = b'{"t\\u00e9": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    assert list(parse_header_bytes(fine, 4, "x.safetensors")[0]) == ["t\u00e9"]
