"""safetensors header spans: the in-order shortcut gives exactly what the sorted check gives.

parse_header_bytes checks the tensors' byte spans in the order the header lists them and sorts
them (``_check_spans``, the definition) only when that order is not contiguous. These tests run
real headers, hand-written edge cases and seeded random mutations through both and require the
same tensors, metadata or exact error; and they prove the shortcut is taken for the headers
writers produce, so a change that silently always sorts (or never does) fails here.
"""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
from ansible.module_utils import safetensors_header as sh
from ansible.module_utils.safetensors_header import SafetensorsError, inspect_path
from safetensors.numpy import save_file
from safetensors_files import QWEN36_27B_DFLASH, header_bytes, write_raw, write_real, write_sparse


def outcome(header: bytes, data_len: int, shortcut: bool) -> tuple:
    """("ok", tensors in order, metadata in order) or ("error", message)."""
    try:
        tensors, metadata = sh._parse_header(header, data_len, "f.safetensors", in_order_shortcut=shortcut)
    except SafetensorsError as exc:
        return ("error", str(exc))
    return ("ok", list(tensors.items()), list(metadata.items()))


def same(header: bytes, data_len: int) -> tuple:
    fast = outcome(header, data_len, True)
    assert fast == outcome(header, data_len, False), header
    assert fast == outcome_public(header, data_len)
    return fast


def outcome_public(header: bytes, data_len: int) -> tuple:
    try:
        tensors, metadata = sh.parse_header_bytes(header, data_len, "f.safetensors")
    except SafetensorsError as exc:
        return ("error", str(exc))
    return ("ok", list(tensors.items()), list(metadata.items()))


def split(raw: bytes) -> tuple[bytes, int]:
    """(header, data length) of a whole safetensors file's bytes."""
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n], len(raw) - 8 - n


def real_headers(tmp_path) -> list[tuple[bytes, int]]:
    """Headers written by the safetensors library (mixed dtypes, metadata, scalars, empty) and the test helper."""
    out = []
    path = tmp_path / "mixed.safetensors"
    save_file(
        {
            "a": np.zeros((3,), dtype=np.float16),
            "b": np.zeros((2, 2), dtype=np.float32),
            "c": np.zeros((1,), dtype=np.int8),
            "d": np.zeros((2,), dtype=np.float64),
            "e": np.zeros((), dtype=np.int64),
            "f": np.zeros((0, 4), dtype=np.uint8),
        },
        str(path),
        metadata={"format": "pt", "note": "x"},
    )
    out.append(split(path.read_bytes()))
    out.append(
        split(write_real(tmp_path / "r.safetensors", {"a.weight": (3, 5), "b": (7,), "c": (2, 2, 2)}).read_bytes())
    )
    out.append(header_bytes(QWEN36_27B_DFLASH))
    out.append(header_bytes({"x": (4,), "y": (0,), "z": (2, 3)}, "F32"))
    return out


def test_writers_lay_out_data_in_header_order_so_the_shortcut_is_taken(tmp_path, monkeypatch):
    """With the sorted check made to fail, the writers' headers still parse: it was not needed."""
    headers = real_headers(tmp_path)
    expected = [outcome(h, n, False) for h, n in headers]
    assert all(e[0] == "ok" for e in expected)

    def must_not_sort(tensors, where):
        raise AssertionError("spans were sorted")

    monkeypatch.setattr(sh, "_check_spans", must_not_sort)
    assert [outcome_public(h, n) for h, n in headers] == expected
    sparse = write_sparse(tmp_path / "drafter.safetensors", QWEN36_27B_DFLASH)
    assert len(inspect_path(str(sparse)).tensors) == 58
    # The control: a header in another order does reach the sorted check.
    obj = json.loads(headers[0][0])
    reordered = json.dumps(dict(reversed(list(obj.items())))).encode()
    with pytest.raises(AssertionError, match="spans were sorted"):
        sh.parse_header_bytes(reordered, headers[0][1], "f")


def _e(begin: int, end: int, dtype: str = "U8") -> dict:
    return {"dtype": dtype, "shape": [end - begin], "data_offsets": [begin, end]}


def _h(*items: tuple[str, dict]) -> bytes:
    return json.dumps(dict(items)).encode()


EDGES = [
    ("in order", _h(("a", _e(0, 8)), ("b", _e(8, 12))), 12, "ok"),
    ("reversed, contiguous", _h(("b", _e(8, 12)), ("a", _e(0, 8))), 12, "ok"),
    ("empty header", b"{}", 0, "ok"),
    ("empty header, data left", b"{}", 4, "4 bytes after the last tensor"),
    ("metadata only", b'{"__metadata__": {"k": "v"}}', 0, "ok"),
    ("metadata between", _h(("a", _e(0, 2)), ("__metadata__", {"k": "v"}), ("b", _e(2, 4))), 4, "ok"),
    ("zero-length first", _h(("z", _e(0, 0)), ("a", _e(0, 8))), 8, "ok"),
    ("zero-length last", _h(("a", _e(0, 8)), ("z", _e(8, 8))), 8, "ok"),
    ("two zero-length alike", _h(("y", _e(4, 4)), ("a", _e(0, 4)), ("z", _e(4, 4))), 4, "ok"),
    ("zero-length inside another", _h(("a", _e(0, 8)), ("z", _e(4, 4))), 8, "overlap tensor 'a'"),
    ("zero-length past the end", _h(("a", _e(0, 8)), ("z", _e(9, 9))), 8, "gap in the data buffer"),
    ("starts late", _h(("a", _e(4, 8))), 8, "gap in the data buffer between byte 0"),
    ("gap in order", _h(("a", _e(0, 4)), ("b", _e(6, 8))), 8, "gap in the data buffer between byte 4"),
    ("overlap in order", _h(("a", _e(0, 4)), ("b", _e(2, 8))), 8, "overlap tensor 'a' which ends at 4"),
    ("overlap reversed", _h(("b", _e(2, 8)), ("a", _e(0, 4))), 8, "overlap tensor 'a' which ends at 4"),
    ("same span twice", _h(("a", _e(0, 4)), ("b", _e(0, 4))), 4, "overlap tensor 'a'"),
    ("in order, truncated", _h(("a", _e(0, 4)), ("b", _e(4, 8))), 6, "the file is truncated"),
    ("out of order, truncated", _h(("b", _e(4, 8)), ("a", _e(0, 4))), 6, "the file is truncated"),
    ("in order, trailing", _h(("a", _e(0, 4))), 6, "2 bytes after the last tensor"),
    ("bad entry after good ones", _h(("a", _e(0, 4)), ("b", {"dtype": "U8"})), 4, "lacks data_offsets"),
    (
        "bad entry wins over a gap",
        _h(("a", _e(2, 4)), ("b", {"dtype": "U8", "shape": [2], "data_offsets": [0, 3]})),
        4,
        "'b' is U8 [2] = 2 bytes but data_offsets span 3",
    ),
    (
        "duplicate name",
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", '
        b'"shape": [1], "data_offsets": [1, 2]}}',
        2,
        "duplicate key 'a'",
    ),
]


@pytest.mark.parametrize(("header", "data_len", "expect"), [e[1:] for e in EDGES], ids=[e[0] for e in EDGES])
def test_edge_cases_agree(header, data_len, expect):
    result = same(header, data_len)
    if expect == "ok":
        assert result[0] == "ok"
    else:
        assert result[0] == "error"
        assert expect in result[1]


def _mutate(rng: random.Random, header: bytes, data_len: int) -> tuple[bytes, int]:
    """One to three random edits of a header: structural ones on its entries, or raw byte edits."""
    try:
        items = list(json.loads(header).items())
    except ValueError:
        items = None
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(9)
        if items is None or op == 8:
            raw = bytearray(json.dumps(dict(items)).encode() if items is not None else header)
            pos = rng.randrange(len(raw) + 1)
            raw[pos:pos] = rng.choice([b"0", b"1", b"8", b"-", b",", b"]", b"}", b" ", b'"a"'])
            return bytes(raw), data_len
        tensors = [i for i, (name, _) in enumerate(items) if name != "__metadata__"]
        if op == 0:
            rng.shuffle(items)
        elif op == 1 and len(tensors) >= 2:
            i, j = rng.sample(tensors, 2)
            a, b = dict(items[i][1]), dict(items[j][1])
            a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
            items[i], items[j] = (items[i][0], a), (items[j][0], b)
        elif op in (2, 3) and tensors:
            i = rng.choice(tensors)
            entry = dict(items[i][1])
            offs = list(entry["data_offsets"])
            offs[op - 2] += rng.choice([-8, -2, -1, 1, 2, 8])
            entry["data_offsets"] = offs
            items[i] = (items[i][0], entry)
        elif op == 4:
            bounds = [0, data_len] + [o for _, e in items if "data_offsets" in e for o in e["data_offsets"]]
            at = rng.choice(bounds) + rng.choice([0, 0, 0, 1])
            items.insert(rng.randrange(len(items) + 1), (f"z{rng.randrange(100)}", _e(at, at)))
        elif op == 5:
            data_len += rng.choice([-2, -1, 1, 2])
        elif op == 6 and tensors:
            # Move one tensor's span to the end of the data, keeping its size: a gap where it was.
            i = rng.choice(tensors)
            entry = dict(items[i][1])
            b, e = entry["data_offsets"]
            entry["data_offsets"] = [data_len, data_len + e - b]
            items[i] = (items[i][0], entry)
            data_len += (e - b) * rng.choice([0, 1])
        elif op == 7 and tensors:
            items.append(items[rng.choice(tensors)])
    if items is None:
        return header, data_len
    separators = rng.choice([(",", ":"), (", ", ": ")])
    pairs = ",".join(json.dumps(k) + separators[1] + json.dumps(v, separators=separators) for k, v in items)
    return ("{" + pairs + "}").encode(), data_len


def test_random_mutations_agree(tmp_path):
    """Seeded: the shortcut and the sorted check agree on every mutated header, valid or not."""
    rng = random.Random(20261130)
    counts = {"ok in order": 0, "ok sorted": 0, "overlap": 0, "gap": 0, "truncated": 0, "trailing": 0, "other": 0}
    library_mixed, library_f16, _drafter, helper_f32 = real_headers(tmp_path)
    sources = [library_mixed, library_f16, helper_f32]
    for _ in range(4000):
        header, data_len = _mutate(rng, *rng.choice(sources))
        result = same(header, data_len)
        if result[0] == "ok":
            spans = [(t.begin, t.end) for _, t in result[1]]
            counts["ok in order" if spans == sorted(spans) else "ok sorted"] += 1
        else:
            key = next((k for k in ("overlap", "gap", "truncated") if k in result[1]), None)
            key = key or ("trailing" if "after the last tensor" in result[1] else "other")
            counts[key] += 1
    # Every branch is exercised, so agreement is not vacuous.
    assert min(counts.values()) >= 50, counts


def test_public_functions_agree_on_files(tmp_path, monkeypatch):
    """Through inspect_path as well: the same summary or error with the sorted check forced."""
    rng = random.Random(7)
    header, data_len = real_headers(tmp_path)[0]
    results = []
    for i in range(200):
        mutated, n = _mutate(rng, header, data_len)
        path = write_raw(tmp_path / f"m{i}.safetensors", mutated, max(n, 0))
        results.append((path, n))
    fast = [_inspect(p) for p, _ in results]
    reference = sh._parse_header
    monkeypatch.setattr(sh, "parse_header_bytes", lambda h, d, p: reference(h, d, p, in_order_shortcut=False))
    assert [_inspect(p) for p, _ in results] == fast
    assert {r[0] for r in fast} == {"ok", "error"}


def _inspect(path) -> tuple:
    try:
        return ("ok", inspect_path(str(path)).summary())
    except SafetensorsError as exc:
        return ("error", str(exc))
