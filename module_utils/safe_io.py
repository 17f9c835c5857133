"""Write and read back files safely in directories another account may own.

The modules run as root in directories the service account owns (a model directory, a venv).
That account can plant a symlink, a FIFO or a hard link at any name there, so:

- a file is written only through a new temporary name created with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` relative to a descriptor of its directory; owner and mode are set on the
  descriptor, the data is fsynced and the temporary name renamed over the final one (a rename
  replaces a symlink, never writes through it);
- a file is read only as a regular file opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO does not
  hang the open, a symlink is refused), at most a bounded number of bytes;
- JSON read back is bounded in size and depth and named in every error.

Standard library only (runs on managed nodes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import itertools
import json
import math
import os
import pwd
import re
import secrets
import stat
import sys
from collections.abc import Callable
from typing import Any

MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64


class UnsafeFileError(ValueError):
    """A file cannot be read or written safely; the message names it and says what to do."""


def atomic_write(
    path: str,
    data: bytes | str,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    prefix: str = ".tmp-",
    suffix: str = ".tmp",
) -> None:
    """Replace ``path`` with ``data`` in one rename, never following a link planted in its directory.

    ``owner`` (uid, gid) and ``mode`` are set on the new file's descriptor before it gets its name.
    On any failure the temporary file is removed and ``path`` is left as it was.
    """
    directory, name = os.path.split(path)
    if not name:
        raise UnsafeFileError(f"{path!r} is not a file path; give the path of the file to write")
    if isinstance(data, str):
        data = data.encode("utf-8")
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, tmp = _create_temp(dfd, name, prefix, suffix)
        try:
            with os.fdopen(fd, "wb") as fh:
                if owner is not None:
                    os.fchown(fh.fileno(), owner[0], owner[1])
                os.fchmod(fh.fileno(), mode)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


# linux/fs.h: FS_IOC_GETFLAGS reads a file's attributes (what lsattr shows); the kernel stores an int.
FS_IOC_GETFLAGS = 0x80086601
FS_IMMUTABLE_FL = 0x10
FS_APPEND_FL = 0x20


def locked_attribute(path: str) -> str | None:
    """``"immutable"`` or ``"append-only"`` when ``path`` carries that attribute (chattr +i / +a), else None.

    Such a file cannot be replaced, renamed over or removed, even by root. Never follows a symlink;
    a filesystem without attributes (tmpfs) or a path that cannot be opened answers None.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
    except OSError:
        return None
    finally:
        os.close(fd)
    flags = int.from_bytes(buf[:4], sys.byteorder)
    if flags & FS_IMMUTABLE_FL:
        return "immutable"
    if flags & FS_APPEND_FL:
        return "append-only"
    return None


def write_problem(exc: OSError, path: str) -> tuple[str, str]:
    """Why writing ``path`` failed with ``exc`` and what the operator does about it, as two phrases.

    The first names the cause (the error text, and the attribute when an immutable or append-only
    file or directory is the reason for EPERM); the second is the remedy, ending "and run again".
    """
    directory = os.path.dirname(path) or "."
    text = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "free space" if exc.errno == errno.ENOSPC else "free space or raise the quota"
        return text, f"{what} on the filesystem of {directory} and run again"
    if exc.errno == errno.EROFS:
        return text, f"remount the filesystem of {directory} read-write and run again"
    if exc.errno in (errno.EPERM, errno.EACCES):
        for where, whose in ((path, path), (directory, f"its directory {directory}")):
            attribute = locked_attribute(where)
            if attribute is not None:
                flag = "i" if attribute == "immutable" else "a"
                return (
                    f"{text}: {whose} is {attribute} (chattr +{flag})",
                    f"if it is meant to change, run chattr -{flag} {where} and run again",
                )
        return text, f"check the permissions of {directory} and run again"
    return text, "fix that and run again"


def resolve_owner(owner: str | int | None, group: str | int | None) -> tuple[int, int]:
    """(uid, gid) for an owner and a group given by name or number; -1 (leave as is) for None.

    Raises UnsafeFileError naming the one that does not exist on this host.
    """
    ids = []
    for value, lookup, what in ((owner, _uid_of, "user"), (group, _gid_of, "group")):
        if value is None or value == "":
            ids.append(-1)
            continue
        text = str(value)
        if text.isdigit():
            ids.append(int(text))
            continue
        try:
            ids.append(lookup(text))
        except (KeyError, ValueError):
            raise UnsafeFileError(
                f"{what} {text[:60]!r} does not exist on this host; create it or give another"
            ) from None
    return ids[0], ids[1]


def _uid_of(name: str) -> int:
    return pwd.getpwnam(name).pw_uid


def _gid_of(name: str) -> int:
    return grp.getgrnam(name).gr_gid


def parse_mode(value: str | int, current: int, symbolic: Callable[[int, str], int]) -> int:
    """A file mode from Ansible's ``mode`` option: an octal string ('0640'), an int, or symbolic ('u=rw,g=r').

    ``current`` is the file's mode now (0o644 for a new file); ``symbolic`` turns (current, text)
    into a mode (AnsibleModule._symbolic_mode_to_octal). Raises UnsafeFileError for anything else.
    """
    if isinstance(value, int):
        number = value
    else:
        try:
            number = int(str(value), 8)
        except ValueError:
            try:
                number = symbolic(current, str(value))
            except Exception as exc:  # Ansible's converter raises ValueError or its own errors
                raise UnsafeFileError(
                    f"mode {str(value)[:60]!r} is neither octal ('0644') nor symbolic ('u=rw,go=r') ({exc})"
                ) from None
    if number < 0 or number != stat.S_IMODE(number):
        raise UnsafeFileError(f"mode {str(value)[:60]!r} is not a file mode (permission bits only, such as '0644')")
    return number


def attributes_differ(st: os.stat_result, owner: tuple[int, int], mode: int | None) -> bool:
    """Whether a file with ``st`` needs another owner, group (-1: any) or mode (None: any)."""
    uid, gid = owner
    return (
        (uid != -1 and st.st_uid != uid)
        or (gid != -1 and st.st_gid != gid)
        or (mode is not None and stat.S_IMODE(st.st_mode) != mode)
    )


def set_attributes(path: str, owner: tuple[int, int], mode: int | None, what: str = "") -> bool:
    """Give the regular file ``path`` that owner, group (-1: leave) and mode (None: leave), through a descriptor.

    Never follows a symlink and never changes a file with other hard links (a link planted in a
    directory another account owns would otherwise hand that account the file it points at).
    Returns whether anything changed.
    """
    label = what or path
    fd = open_regular(path, label)
    try:
        st = os.fstat(fd)
        if not attributes_differ(st, owner, mode):
            return False
        if st.st_nlink != 1:
            raise UnsafeFileError(
                f"{label} has {st.st_nlink - 1} other hard link(s); its owner and mode are not changed: remove the"
                " extra links (or the file) and run again"
            )
        if owner != (-1, -1):
            os.fchown(fd, owner[0], owner[1])
        if mode is not None:
            os.fchmod(fd, mode)
        return True
    finally:
        os.close(fd)


def _create_temp(dfd: int, name: str, prefix: str, suffix: str) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = f"{prefix}{name}.{secrets.token_hex(8)}{suffix}"
        try:
            return os.open(tmp, flags, 0o600, dir_fd=dfd), tmp
        except FileExistsError:
            continue
    raise UnsafeFileError(f"no free temporary name for {name} after 100 tries; remove {prefix}* files beside it")


def open_regular(path: str, what: str = "", follow: bool = False) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (not a symlink, FIFO, device or directory).

    ``follow``: a symlink to a regular file is accepted (for files only read, never written
    through). FileNotFoundError passes through; everything else unsafe is an UnsafeFileError.
    """
    label = what or path
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except ValueError:  # an embedded NUL: no file has such a name
        raise UnsafeFileError(f"{label!r} holds a NUL character, which no path can hold; check the path") from None
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise UnsafeFileError(
                f"{label} is a symlink; it is read only as a regular file: remove the link and run again"
            ) from None
        raise UnsafeFileError(f"{label}: cannot be opened ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(
            f"{label} is not a regular file ({_kind(st.st_mode)}); remove it or put the real file there and run again"
        )
    os.set_blocking(fd, True)
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def read_regular(path: str, limit: int, what: str = "", follow: bool = False) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``; a bigger file is refused, naming it."""
    label = what or path
    fd = open_regular(path, label, follow)
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise UnsafeFileError(f"{label}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise UnsafeFileError(f"{label} is larger than {limit} bytes, more than such a file ever holds; check it")
    return data


def read_text(path: str, limit: int, what: str = "", follow: bool = False) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; anything else names the file."""
    label = what or path
    data = read_regular(path, limit, label, follow)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeFileError(f"{label} is not UTF-8 text ({exc.reason} at byte {exc.start}); check it") from None


def loads_json(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH, **kwargs: Any) -> Any:
    """``json.loads`` that names ``what`` in its errors and refuses nesting deeper than ``max_depth``.

    Raises UnsafeFileError for invalid JSON, non-UTF-8 bytes, too deep nesting, NaN/Infinity (written as such,
    or as a number past what a float holds, such as 1e400) and a
    string (key or value, at any depth) holding a lone surrogate: ``"\\ud800"`` is valid JSON, but the
    str it parses into cannot be encoded as UTF-8, so a file written from it, or a module result that
    carries it (the controller refuses such a result), would fail far from the file that held it.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnsafeFileError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise UnsafeFileError(f"{what} is nested {depth} levels deep (at most {max_depth}); it is not such a file")
    kwargs.setdefault("parse_float", _finite_float)
    try:
        value = json.loads(text, parse_constant=_no_constant, **kwargs)
    except RecursionError:
        raise UnsafeFileError(f"{what} is nested too deeply to read; it is not such a file") from None
    except ValueError as exc:
        raise UnsafeFileError(f"{what} is not valid JSON ({exc})") from None
    escape = lone_surrogate(value, text)
    if escape is not None:
        raise UnsafeFileError(
            f"{what} holds a lone surrogate ({escape} escape), which no UTF-8 text can hold; it is not such a file"
        )
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; 1e400 is valid JSON but no float: it would be read as
    Infinity, which NaN/Infinity's own refusal exists to keep out (issue 43)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is past what a float holds")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")
# How a surrogate gets into parsed JSON: a \uD800-\uDFFF escape (a pair of them parses into one
# character, not into surrogates) or a surrogate already in the text (a str decoded with surrogateescape).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate(value: Any, text: str | None = None) -> str | None:
    """A lone surrogate in a string of the parsed JSON ``value`` (keys and values, at any depth), as its
    escape (``"\\ud800"``), or None when every string of it can be encoded as UTF-8.

    ``text``: the JSON text ``value`` was parsed from; when it holds neither a surrogate nor a
    ``\\ud800``-``\\udfff`` escape, no string can hold one and nothing is walked. The walk visits each
    container and string once, with a stack (no recursion, no re-serialisation).
    """
    if text is not None and _SURROGATE.search(text) is None and _SURROGATE_ESCAPE.search(text) is None:
        return None
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                return f"\\u{ord(found.group()):04x}"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings not counted).

    Linear in the length of ``text`` whatever it holds (the regular expression this replaces
    backtracked quadratically on an unterminated string of escaped quotes: 128 KiB took a minute).
    It counts what a left-to-right scanner tracking string and escape state counts, with str methods
    that run in C: inside a string a backslash escapes the next character, so pairs of backslashes
    are dropped first, then each escaped quote; every quote left opens or closes a string, so the
    pieces between quotes alternate outside, inside, outside. An unterminated string runs to the end
    of the text and so ends the count. A backslash outside any string is invalid JSON, which the
    parser refuses right there: the count may differ only past that point, where the parser never goes.
    """
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    steps = map(_STEP.__getitem__, _NOT_BRACKET.sub("", outside))
    return max(0, max(itertools.accumulate(steps), default=0))


def read_json(path: str, limit: int = MAX_JSON_BYTES, what: str = "", **kwargs: Any) -> Any:
    """The JSON value in the regular file ``path``, read bounded and checked (see loads_json)."""
    label = what or path
    return loads_json(read_regular(path, limit, label), label, **kwargs)
