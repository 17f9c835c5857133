"""Read and validate safetensors headers without reading tensor data.

A safetensors file is an 8-byte little-endian header length N, N bytes of a
UTF-8 JSON object describing every tensor (dtype, shape, byte offsets into the
data buffer that follows) and an optional ``__metadata__`` string map, then the
data buffer. Everything this module needs is in the first 8 + N bytes, so the
cost of inspecting a file does not depend on its size. A sharded checkpoint is
a directory of such files plus ``model.safetensors.index.json`` mapping every
tensor name to the shard that holds it.

Standard library only: managed nodes have no safetensors package. Speed matters little on a
node but is measured against ``safetensors.safe_open`` (benchmarks/safetensors_inspect.py,
docs/benchmarks.md), so the common case is kept lean: one open, fstat and 16 KiB read per file,
``json.loads`` (the definition of the header's content; a regular-expression parser of the
canonical layout was measured and was no faster), and spans checked in header order when the
writer laid them out that way (the sorted check, ``_check_spans``, is the definition).
Every problem raises :class:`SafetensorsError` with a message an operator can act on.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ansible.module_utils.safe_io import UnsafeFileError, read_regular

# Refuse headers larger than this; the reference implementation uses 100 MB too.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# No file holds more than 2**64 bytes: a shape whose product passes that is refused at once (the
# reference implementation's checked multiplication), before big-integer products cost seconds.
_MAX_BITS = 8 << 64
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_CHUNK = 8 * 1024 * 1024
# The first read brings the length prefix and, for up to ~150 tensors, the whole header; a longer
# header takes a second read. Reading 64 KiB instead cost a measurable share of a small header's time.
_FIRST_READ = 16 * 1024

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


class TensorInfo(NamedTuple):
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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise SafetensorsError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _load_json(raw: bytes, what: str, strict: bool = True) -> Any:
    """Parse JSON bytes; ``strict`` refuses duplicate keys at any depth."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates if strict else None)
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
    return _parse_header(header, data_len, path, in_order_shortcut=True)


def _parse_header(
    header: bytes, data_len: int, path: str, in_order_shortcut: bool
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """parse_header_bytes; ``in_order_shortcut=False`` always sorts the spans (_check_spans, the
    definition), which the tests compare the shortcut against."""
    where = f"{path}: header"
    obj = _load_json(header, where, strict=False)
    # Duplicate keys (a tensor name, a field inside an entry, a metadata key): a plain parse keeps
    # the last one silently. A compact header has exactly one ':' per member of each object: per
    # entry its name and its three fields, per metadata item one. Any other count means a
    # duplicate, a ':' inside a string or an extra field; then the strict parse decides, refusing
    # duplicate keys at any depth before anything else is judged (and costs time only then).
    if type(obj) is dict:
        meta = obj.get("__metadata__")
        entries = len(obj) - ("__metadata__" in obj)
        if header.count(b":") != len(obj) + 3 * entries + (len(meta) if type(meta) is dict else 0):
            _load_json(header, where)
    if type(obj) is not dict:
        raise SafetensorsError(f"{where} is JSON but not an object (got {type(obj).__name__})")
    if b"\\u" in header:
        # Only a \u escape can make a lone UTF-16 surrogate, which is no text: the node would pass
        # such a name and the controller refuse the module's result.
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise SafetensorsError(
                f"{where}: a tensor name or metadata string holds a lone UTF-16 surrogate (a \\ud800-\\udfff"
                " escape), which is not text; the file is not a valid safetensors file"
            ) from None
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    bits_of = DTYPE_BITS
    new = tuple.__new__
    # Writers (the safetensors library among them) list the tensors in the order of their data,
    # so the spans are first checked in the order the header lists them, while parsing: spans
    # that start at 0 and each start where the previous one ended need no sort. Otherwise they
    # are sorted and checked by _check_spans, which finds the precise error or accepts another
    # contiguous order. This saves a tuple per tensor and a sort: with the smaller first read
    # and no separate stat call, about 10% of inspecting a 58-tensor file (docs/benchmarks.md).
    offset = 0
    in_order = True
    for name, entry in obj.items():
        if name == "__metadata__":
            if type(entry) is not dict or not all(type(v) is str for v in entry.values()):
                raise SafetensorsError(f"{where}: __metadata__ must be a map of strings to strings")
            metadata = dict(entry)
            continue
        # Fast path for a well-formed entry (exact types keep bools and floats out); anything it
        # does not accept goes to _tensor_entry, which raises with the precise reason.
        info = None
        try:
            dtype = entry["dtype"]
            shape = entry["shape"]
            begin, end = entry["data_offsets"]
            bits = bits_of[dtype]
        except (KeyError, TypeError, ValueError):
            bits = 0
        # (The lookups above succeeding mean entry is a dict: json.loads makes no other mapping.)
        if bits and type(shape) is list and type(begin) is int and type(end) is int:
            for d in shape:
                if type(d) is not int or d < 0:
                    break
                bits *= d
                if bits > _MAX_BITS:
                    break
            else:
                if 0 <= begin <= end and bits == 8 * (end - begin):
                    info = new(TensorInfo, (dtype, tuple(shape), begin, end, path))
        if info is None:
            info = _tensor_entry(name, entry, where, path)
            begin = info[2]
            end = info[3]
        tensors[name] = info
        if begin != offset:
            in_order = False
        offset = end
    if not (in_order and in_order_shortcut):
        offset = _check_spans(tensors, where)
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


def _check_spans(tensors: dict[str, TensorInfo], where: str) -> int:
    """Sorted by offset the spans must start at 0 and touch without gap or overlap; return their end."""
    offset = 0
    prev = None
    for begin, end, name in sorted((t[2], t[3], name) for name, t in tensors.items()):
        if begin != offset:
            if begin < offset:
                raise SafetensorsError(
                    f"{where}: tensor {name!r} bytes [{begin}, {end}) overlap tensor {prev!r} which ends at {offset}"
                )
            raise SafetensorsError(
                f"{where}: gap in the data buffer between byte {offset} and tensor {name!r} at {begin}"
            )
        offset = end
        prev = name
    return offset


def _tensor_entry(name: str, entry: Any, where: str, path: str) -> TensorInfo:
    # Exact type checks (``type(x) is int``) keep bools and floats out and are the fast path:
    # a 27B checkpoint has hundreds of entries per shard.
    if type(entry) is not dict:
        raise SafetensorsError(f"{where}: entry {name!r} must be an object with dtype, shape, data_offsets")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offs = entry.get("data_offsets")
    if dtype is None or shape is None or offs is None:
        missing = sorted({"dtype", "shape", "data_offsets"} - set(entry))
        raise SafetensorsError(f"{where}: entry {name!r} lacks {', '.join(missing) or 'a non-null value'}")
    bits_per = DTYPE_BITS.get(dtype) if type(dtype) is str else None
    if bits_per is None:
        raise SafetensorsError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    if type(shape) is not list:
        raise SafetensorsError(f"{where}: tensor {name!r} shape must be a list of non-negative integers")
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise SafetensorsError(f"{where}: tensor {name!r} shape must be a list of non-negative integers")
        numel *= d
        if numel * bits_per > _MAX_BITS:
            raise SafetensorsError(
                f"{where}: tensor {name!r} shape {_short(shape)} has more elements than any file can hold;"
                " the header is corrupt"
            )
    if type(offs) is not list or len(offs) != 2:
        raise SafetensorsError(f"{where}: tensor {name!r} data_offsets must be [begin, end], non-negative integers")
    begin, end = offs
    if type(begin) is not int or type(end) is not int or begin < 0:
        raise SafetensorsError(f"{where}: tensor {name!r} data_offsets must be [begin, end], non-negative integers")
    if end < begin:
        raise SafetensorsError(f"{where}: tensor {name!r} data_offsets end {end} is before begin {begin}")
    bits = numel * bits_per
    if bits % 8:
        raise SafetensorsError(f"{where}: tensor {name!r} of {numel} x {dtype} does not fill whole bytes")
    if bits // 8 != end - begin:
        raise SafetensorsError(
            f"{where}: tensor {name!r} is {dtype} {shape} = {bits // 8} bytes but data_offsets span {end - begin} bytes"
        )
    return TensorInfo(dtype, tuple(shape), begin, end, path)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_file_header(path: str, checksum: str = "none") -> FileHeader:
    """Read and validate one .safetensors file; reads only its header unless ``checksum='sha256'``."""
    _check_checksum(checksum)
    fh = _read_file_header(path, checksum, directory_ok=False)
    if fh is None:
        raise SafetensorsError(f"{path}: is a directory, expected a .safetensors file")
    return fh


def _check_checksum(checksum: str) -> None:
    if checksum not in ("none", "sha256"):
        raise SafetensorsError(f"checksum must be 'none' or 'sha256', not {checksum!r}")


def _read_file_header(path: str, checksum: str, directory_ok: bool) -> FileHeader | None:
    """read_file_header, or None when ``path`` is a directory.

    inspect_path learns whether its path is a directory from this open and fstat rather than
    from a separate stat call first, a measurable share of the time for one small header.
    With ``directory_ok`` a directory that cannot be opened is None too (listing it will
    say why); without, it is refused as a file that cannot be read.
    """
    try:
        # O_NONBLOCK: a FIFO planted as a weights file must not hang the open (refused below).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except ValueError:  # an embedded NUL
        raise SafetensorsError(f"{path!r}: holds a NUL character, which no path can hold; check the path") from None
    except OSError as exc:
        if directory_ok and os.path.isdir(path):
            return None  # a directory this user may not open; listing it says why
        _check_checksum(checksum)
        if isinstance(exc, FileNotFoundError):
            raise SafetensorsError(f"{path}: does not exist") from None
        raise SafetensorsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return None
        _check_checksum(checksum)  # (inspect_path checks it here: a directory gets listed first)
        if not stat.S_ISREG(st.st_mode):
            raise SafetensorsError(f"{path}: not a regular file (a FIFO, socket or device); point at the weights file")
        size = st.st_size
        # One read usually brings the length prefix and the whole header.
        head = os.pread(fd, _FIRST_READ, 0)
        if len(head) < 8:
            raise SafetensorsError(
                f"{path}: only {size} bytes, too short for a safetensors file (8-byte length prefix"
                " missing): the file is truncated or not safetensors"
            )
        (n,) = struct.unpack_from("<Q", head)
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
        header = head[8 : 8 + n] if len(head) >= 8 + n else os.pread(fd, n, 8)
        digest = _sha256(fd) if checksum == "sha256" else None
    except IsADirectoryError:
        raise SafetensorsError(f"{path}: is a directory, expected a .safetensors file") from None
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(header) != n:
        raise SafetensorsError(f"{path}: file shrank while reading the header")
    tensors, metadata = parse_header_bytes(header, size - 8 - n, path)
    return FileHeader(path=path, size=size, header_len=n, tensors=tensors, metadata=metadata, sha256=digest)


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while True:
        chunk = os.pread(fd, _CHUNK, offset)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        offset += len(chunk)


def _read_index(index_path: str) -> tuple[dict[str, str], dict[str, Any]]:
    try:
        raw = read_regular(index_path, MAX_HEADER_BYTES, follow=True)
    except UnsafeFileError as exc:
        raise SafetensorsError(f"{exc}; not a shard index") from None
    except OSError as exc:
        raise SafetensorsError(f"{index_path}: cannot read: {exc.strerror or exc}") from None
    obj = _load_json(raw, index_path)
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise SafetensorsError(f"{index_path}: must be a JSON object with a 'weight_map' object")
    wmap = obj["weight_map"]
    if not wmap:
        raise SafetensorsError(f"{index_path}: weight_map is empty")

    def plain(shard: Any) -> bool:
        return type(shard) is str and shard not in ("", ".", "..") and shard == os.path.basename(shard)

    # Check each distinct shard name once (a 27B index maps hundreds of tensors to a dozen files).
    if not all(type(v) is str for v in wmap.values()) or not all(plain(v) for v in set(wmap.values())):
        name, shard = next((n, v) for n, v in wmap.items() if not plain(v))
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
    fh = _read_file_header(path, checksum, directory_ok=True)
    if fh is None:
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
        fh = read_file_header(os.path.join(path, found[0]), checksum)
    return Checkpoint(files=[fh], tensors=dict(fh.tensors), metadata=dict(fh.metadata))


def inspect_shards(index_path: str, checksum: str = "none") -> Checkpoint:
    """Validate every shard an index names and that the index and the shards agree."""
    wmap, index_meta = _read_index(index_path)
    base = os.path.dirname(index_path)
    shard_names = sorted(set(wmap.values()))
    files: list[FileHeader] = []
    tensors: dict[str, TensorInfo] = {}
    holder: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for shard in shard_names:
        shard_path = os.path.join(base, shard)
        if not os.path.isfile(shard_path):
            raise SafetensorsError(f"{index_path}: names shard {shard!r} which is missing from {base}; copy it there")
        fh = read_file_header(shard_path, checksum)
        files.append(fh)
        for name, t in fh.tensors.items():
            if name in tensors:
                raise SafetensorsError(f"tensor {name!r} is in both {holder[name]} and {shard}")
            tensors[name] = t
            holder[name] = shard
        metadata.update(fh.metadata)
    if holder != wmap:
        for name, shard in sorted(wmap.items()):
            if name not in holder:
                raise SafetensorsError(f"{index_path}: tensor {name!r} is mapped to {shard} but no shard holds it")
            if holder[name] != shard:
                raise SafetensorsError(
                    f"{index_path}: tensor {name!r} is mapped to {shard} but it is in {holder[name]}"
                )
        unindexed = sorted(set(holder) - set(wmap))
        raise SafetensorsError(
            f"{index_path}: {len(unindexed)} tensor(s) in the shards are missing from the index"
            f" (first: {unindexed[0]!r}); the index does not match these shards"
        )
    cp = Checkpoint(files=files, tensors=tensors, metadata=metadata, index_path=index_path)
    declared = index_meta.get("total_size")
    if declared is not None and declared != cp.total_bytes:
        cp.warnings.append(
            f"{index_path}: metadata.total_size is {declared!r} but the shards hold {cp.total_bytes} bytes of tensors"
        )
    return cp
