"""Read and validate safetensors headers without reading tensor data.

A safetensors file is an 8-byte little-endian header length N, N bytes of a
UTF-8 JSON object describing every tensor (dtype, shape, byte offsets into the
data buffer that follows) and an optional ``__metadata__`` string map, then the
data buffer. Everything this module needs is in the first 8 + N bytes, so the
cost of inspecting a file does not depend on its size. A sharded checkpoint is
a directory of such files plus ``model.safetensors.index.json`` mapping every
tensor name to the shard that holds it.

Standard library only: managed nodes have no safetensors package.
Every problem raises :class:`SafetensorsError` with a message an operator can act on.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

# Refuse headers larger than this; the reference implementation uses 100 MB too.
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_CHUNK = 8 * 1024 * 1024

# Bits per element for every dtype the safetensors format defines (0.8.0).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


class SafetensorsError(ValueError):
    """A safetensors file or shard set is malformed, incomplete or unreadable."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class FileHeader:
    path: str
    size: int
    header_len: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    sha256: str | None = None


@dataclass
class Checkpoint:
    """A validated single file or shard set."""

    files: list[FileHeader]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    index_path: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def total_parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def dtypes(self) -> dict[str, int]:
        """Parameters per dtype."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.numel
        return dict(sorted(out.items()))

    def summary(self) -> dict[str, Any]:
        """Plain JSON-able description (what the safetensors_info module returns)."""
        return {
            "tensors": {
                name: {"dtype": t.dtype, "shape": list(t.shape), "file": os.path.basename(t.file)}
                for name, t in sorted(self.tensors.items())
            },
            "total_parameters": self.total_parameters,
            "total_bytes": self.total_bytes,
            "dtypes": self.dtypes(),
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "header_bytes": f.header_len,
                    "tensors": len(f.tensors),
                    **({"sha256": f.sha256} if f.sha256 is not None else {}),
                }
                for f in self.files
            ],
            "metadata": dict(sorted(self.metadata.items())),
            "index": self.index_path,
        }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SafetensorsError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _load_json(raw: bytes, what: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except SafetensorsError as exc:
        raise SafetensorsError(f"{what} has a {exc}") from None
    except RecursionError:
        raise SafetensorsError(f"{what} is nested too deeply to be a safetensors header") from None
    except ValueError as exc:
        raise SafetensorsError(f"{what} is not valid JSON ({exc})") from None


def parse_header_bytes(header: bytes, data_len: int, path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate a header's JSON bytes against the size of the data buffer that follows it.

    Rules (those of the reference implementation): a JSON object; each entry has a
    known dtype, a shape of non-negative integers and ``data_offsets`` [begin, end]
    with end - begin = elements x dtype size; sorted by offset the spans start at 0,
    touch without gap or overlap, and the last one ends exactly at the end of the file.
    """
    where = f"{path}: header"
    obj = _load_json(header, where)
    if not isinstance(obj, dict):
        raise SafetensorsError(f"{where} is JSON but not an object (got {type(obj).__name__})")
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise SafetensorsError(f"{where}: __metadata__ must be a map of strings to strings")
            metadata = dict(entry)
            continue
        tensors[name] = _tensor_entry(name, entry, where, path)
    spans = sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end))
    offset = 0
    prev = None
    for name, t in spans:
        if t.begin != offset:
            if t.begin < offset:
                raise SafetensorsError(
                    f"{where}: tensor {name!r} bytes [{t.begin}, {t.end}) overlap tensor {prev!r}"
                    f" which ends at {offset}"
                )
            raise SafetensorsError(
                f"{where}: gap in the data buffer between byte {offset} and tensor {name!r} at {t.begin}"
            )
        offset = t.end
        prev = name
    if offset != data_len:
        if offset > data_len:
            raise SafetensorsError(
                f"{path}: the header describes {offset} bytes of tensor data but the file holds only"
                f" {data_len} after the header: the file is truncated (an incomplete download?);"
                " fetch it again"
            )
        raise SafetensorsError(
            f"{path}: the file has {data_len - offset} bytes after the last tensor that no tensor"
            " covers; it is not a valid safetensors file"
        )
    return tensors, metadata


def _tensor_entry(name: str, entry: Any, where: str, path: str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where}: entry {name!r} must be an object with dtype, shape, data_offsets")
    missing = {"dtype", "shape", "data_offsets"} - set(entry)
    if missing:
        raise SafetensorsError(f"{where}: entry {name!r} lacks {', '.join(sorted(missing))}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SafetensorsError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: tensor {name!r} shape must be a list of non-negative integers")
    offs = entry["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
        raise SafetensorsError(f"{where}: tensor {name!r} data_offsets must be [begin, end], non-negative integers")
    begin, end = offs
    if end < begin:
        raise SafetensorsError(f"{where}: tensor {name!r} data_offsets end {end} is before begin {begin}")
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8:
        raise SafetensorsError(f"{where}: tensor {name!r} of {numel} x {dtype} does not fill whole bytes")
    if bits // 8 != end - begin:
        raise SafetensorsError(
            f"{where}: tensor {name!r} is {dtype} {shape} = {bits // 8} bytes but data_offsets span {end - begin} bytes"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=begin, end=end, file=path)


def read_file_header(path: str, checksum: str = "none") -> FileHeader:
    """Read and validate one .safetensors file; reads only its header unless ``checksum='sha256'``."""
    if checksum not in ("none", "sha256"):
        raise SafetensorsError(f"checksum must be 'none' or 'sha256', not {checksum!r}")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(
                    f"{path}: only {size} bytes, too short for a safetensors file (8-byte length prefix"
                    " missing): the file is truncated or not safetensors"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(
                    f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit: not a"
                    " safetensors file, or a corrupt one"
                )
            if 8 + n > size:
                raise SafetensorsError(
                    f"{path}: header claims {n} bytes but the file has only {size - 8} after the length"
                    " prefix: the file is truncated (an incomplete download?) or not safetensors"
                )
            if n < 2:
                raise SafetensorsError(f"{path}: header length {n} is too small to hold a JSON object")
            header = fh.read(n)
            digest = _sha256(fh) if checksum == "sha256" else None
    except SafetensorsError:
        raise
    except IsADirectoryError:
        raise SafetensorsError(f"{path}: is a directory, expected a .safetensors file") from None
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(header) != n:
        raise SafetensorsError(f"{path}: file shrank while reading the header")
    tensors, metadata = parse_header_bytes(header, size - 8 - n, path)
    return FileHeader(path=path, size=size, header_len=n, tensors=tensors, metadata=metadata, sha256=digest)


def _sha256(fh: Any) -> str:
    fh.seek(0)
    h = hashlib.sha256()
    while True:
        chunk = fh.read(_CHUNK)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)


def _read_index(index_path: str) -> tuple[dict[str, str], dict[str, Any]]:
    try:
        with open(index_path, "rb") as fh:
            raw = fh.read(MAX_HEADER_BYTES + 1)
    except OSError as exc:
        raise SafetensorsError(f"{index_path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{index_path}: larger than {MAX_HEADER_BYTES} bytes; not a shard index")
    obj = _load_json(raw, index_path)
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise SafetensorsError(f"{index_path}: must be a JSON object with a 'weight_map' object")
    wmap = obj["weight_map"]
    if not wmap:
        raise SafetensorsError(f"{index_path}: weight_map is empty")
    for name, shard in wmap.items():
        if not isinstance(shard, str) or not shard or shard != os.path.basename(shard) or shard in (".", ".."):
            raise SafetensorsError(
                f"{index_path}: weight_map entry {name!r} -> {shard!r} is not a plain file name in the same directory"
            )
    meta = obj.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{index_path}: 'metadata' must be an object")
    return wmap, meta


def inspect_path(path: str, checksum: str = "none") -> Checkpoint:
    """Validate a .safetensors file, or a directory with one such file or shards plus an index."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            return inspect_shards(index, checksum)
        try:
            found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        except OSError as exc:
            raise SafetensorsError(f"{path}: cannot list directory: {exc.strerror or exc}") from None
        if not found:
            raise SafetensorsError(f"{path}: no .safetensors file and no {INDEX_NAME} in this directory")
        if len(found) > 1:
            raise SafetensorsError(
                f"{path}: {len(found)} .safetensors files ({', '.join(found[:5])}) but no {INDEX_NAME}:"
                " cannot tell which tensors belong together; add the index or keep one file"
            )
        path = os.path.join(path, found[0])
    elif not os.path.exists(path):
        raise SafetensorsError(f"{path}: does not exist")
    fh = read_file_header(path, checksum)
    return Checkpoint(files=[fh], tensors=dict(fh.tensors), metadata=dict(fh.metadata))


def inspect_shards(index_path: str, checksum: str = "none") -> Checkpoint:
    """Validate every shard an index names and that the index and the shards agree."""
    wmap, index_meta = _read_index(index_path)
    base = os.path.dirname(index_path)
    shard_names = sorted(set(wmap.values()))
    files: list[FileHeader] = []
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for shard in shard_names:
        shard_path = os.path.join(base, shard)
        if not os.path.isfile(shard_path):
            raise SafetensorsError(f"{index_path}: names shard {shard!r} which is missing from {base}; copy it there")
        fh = read_file_header(shard_path, checksum)
        files.append(fh)
        for name, t in fh.tensors.items():
            if name in tensors:
                raise SafetensorsError(f"tensor {name!r} is in both {os.path.basename(tensors[name].file)} and {shard}")
            tensors[name] = t
        metadata.update(fh.metadata)
    for name, shard in sorted(wmap.items()):
        t = tensors.get(name)
        if t is None:
            raise SafetensorsError(f"{index_path}: tensor {name!r} is mapped to {shard} but no shard holds it")
        if os.path.basename(t.file) != shard:
            raise SafetensorsError(
                f"{index_path}: tensor {name!r} is mapped to {shard} but it is in {os.path.basename(t.file)}"
            )
    unindexed = sorted(set(tensors) - set(wmap))
    if unindexed:
        raise SafetensorsError(
            f"{index_path}: {len(unindexed)} tensor(s) in the shards are missing from the index"
            f" (first: {unindexed[0]!r}); the index does not match these shards"
        )
    cp = Checkpoint(files=files, tensors=tensors, metadata=metadata, index_path=index_path)
    declared = index_meta.get("total_size")
    if declared is not None and declared != cp.total_bytes:
        cp.warnings.append(
            f"{index_path}: metadata.total_size is {declared} but the shards hold {cp.total_bytes} bytes of tensors"
        )
    return cp
