"""Read one JSON file on the node, bounded and checked (the logic of library/json_file_info.py).

What ``slurp`` followed by ``from_json`` did, without its hazards: the file is opened only if it
is a regular file (a FIFO does not block, a device such as /dev/zero behind a link is refused),
at most ``max_bytes`` are read, and the JSON must be UTF-8, valid, free of NaN/Infinity and at
most ``MAX_JSON_DEPTH`` levels deep. Every refusal is an UnsafeFileError whose message names the
file and says what to do.

Standard library and ansible.module_utils only (runs on managed nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ansible.module_utils.safe_io import MAX_JSON_BYTES, UnsafeFileError, loads_json, read_regular

__all__ = ["MAX_JSON_BYTES", "MAX_READ_BYTES", "JsonFile", "UnsafeFileError", "read_json_file"]

# The most max_bytes may be: a read of n bytes sets aside n bytes before it reads any.
MAX_READ_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class JsonFile:
    """Whether the file exists and, when it does, the JSON value it holds."""

    exists: bool
    data: Any = None


def read_json_file(
    path: str, max_bytes: int = MAX_JSON_BYTES, follow: bool = True, missing_ok: bool = False
) -> JsonFile:
    """The JSON value in the regular file ``path``; ``missing_ok``: an absent file is JsonFile(False).

    ``follow``: a symlink to a regular file is read (a link to anything else is still refused).
    """
    if not path:
        raise UnsafeFileError("path is empty; give the path of the JSON file to read")
    if "\x00" in path:
        raise UnsafeFileError(f"path {path!r} holds a NUL character, which no path can hold; check the path")
    if not 1 <= max_bytes <= MAX_READ_BYTES:
        raise UnsafeFileError(
            f"max_bytes {max_bytes} is out of range; give 1 to {MAX_READ_BYTES} (the default is {MAX_JSON_BYTES})"
        )
    try:
        raw = read_regular(path, max_bytes, path, follow)
    except FileNotFoundError:
        if missing_ok:
            return JsonFile(exists=False)
        raise UnsafeFileError(
            f"{path} does not exist; create it (or fix the path), or set missing_ok where it may be absent"
        ) from None
    except UnsafeFileError as exc:
        if str(exc).startswith(f"{path} is larger than "):
            raise UnsafeFileError(f"{exc} (or raise max_bytes if it really is that large)") from None
        raise
    try:
        data = loads_json(raw, path)
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"{exc}; fix or replace the file and run again") from None
    return JsonFile(exists=True, data=data)
