"""Decide and carry out the staging of safetensors weights into an HF-layout directory.

Pure logic shared by the ``safetensors_stage`` action plugin (controller side) and module
(node side). A staging moves files into ``dest`` as ``model.safetensors`` (one file) or as
shards plus ``model.safetensors.index.json``. Each file travels to a temporary name in
``dest`` itself (same filesystem, so the final ``os.replace`` is atomic), keyed by the
source's size and mtime so an interrupted transfer of the same source resumes and a changed
source never appends to a stale one. After a file is verified (size, SHA-256, header) it is
renamed into place and recorded in a sidecar, ``dest/.model_stage.json``, keyed by size and
mtime: a re-run that finds the same size and mtime on both sides transfers and hashes nothing.
The mtime is compared to the nanosecond too (the record's ``mtime_ns``, else the dest file's own,
which the copy sets to the source's): a same-size source rewritten within the same second is staged
again (issue 43), where seconds alone kept the old weights.

When more than one file in ``dest`` changes (a shard set replaced, a single file replaced by
shards), the new set is built complete in a staging directory beside ``dest`` (same filesystem:
every file that stays, and everything else ``dest`` holds such as ``config.json``, is hard-linked)
and swapped with ``dest`` in one ``renameat2(RENAME_EXCHANGE)``; the old set, now at the staging
path, is removed afterwards. At every moment ``dest`` holds either the old or the new complete set;
an interrupted run leaves at most the staging directory, which the next run removes.

Standard library and ``ansible.module_utils`` only (runs on managed nodes).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.safe_io import UnsafeFileError, atomic_write, loads_json

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SIDECAR_NAME = ".model_stage.json"
TEMP_PREFIX = ".model_stage-"
# The directory's owner. Root, not the service account: an account that owns the directory can
# plant a link under a temporary name between a plan and the write that follows it (rsync opens its
# temp by name, following links); in a root-owned directory it can create nothing. The service
# account reads through the group (issue 23).
DIR_UID = 0
TEMP_SUFFIX = ".part"
SWAP_PREFIX = ".model_stage-swap-"
SIDECAR_VERSION = 1
# The sidecar and a shard index hold a line per file or tensor: far below this.
MAX_RECORD_BYTES = 64 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class StageError(ValueError):
    """Staging cannot go on; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class SourceFile:
    """One file to stage: the name it gets in dest, where it comes from, its size and mtime."""

    name: str
    origin: str
    size: int
    mtime: int
    sha256: str | None = None  # expected digest from the inventory, if any
    mtime_ns: int | None = None  # the same time to the nanosecond, where the reader knows it

    @property
    def is_index(self) -> bool:
        return self.name == INDEX_NAME

    @property
    def temp(self) -> str:
        return temp_name(self.name, self.size, self.mtime)


@dataclass(frozen=True)
class DestFile:
    """What ``dest`` holds under one name (None fields: absent)."""

    size: int
    mtime: int
    uid: int
    gid: int
    mode: int
    mtime_ns: int | None = None


@dataclass
class FilePlan:
    source: SourceFile
    action: str  # "keep" or "transfer"
    reason: str
    partial: int = 0  # bytes already in the temporary file from an interrupted run


@dataclass
class Plan:
    files: list[FilePlan]
    stale_temps: list[str] = field(default_factory=list)
    stale_weights: list[str] = field(default_factory=list)
    write_index: bool = False  # the source has shards but no index: the node writes one
    index_stale: bool = False  # ... and the one in dest is missing or will change

    @property
    def transfers(self) -> list[FilePlan]:
        return [p for p in self.files if p.action == "transfer"]

    @property
    def replaces_set(self) -> bool:
        """More than one file in dest may change: the new set is swapped in as one directory."""
        return len(self.transfers) + len(self.stale_weights) + int(self.index_stale) > 1

    def bytes_to_write(self) -> int:
        return sum(p.source.size - p.partial for p in self.transfers)


def temp_name(name: str, size: int, mtime: int) -> str:
    return f"{TEMP_PREFIX}{name}.{size}-{mtime}{TEMP_SUFFIX}"


FILE_KINDS = ("transfer", "keep", "remove", "generate_index")
_NEEDS = {
    "plan": ("origin", "size", "mtime"),
    "follow": ("temp", "size"),
    "copy": ("origin", "temp", "size", "mtime"),
    "commit": ("origin", "temp", "size", "mtime", "digest", "digest_from"),
}


def file_entries_problem(files: list[Any] | None, dest: str, step: str) -> str | None:
    """What is wrong with the ``files`` list the action plugin sends for ``step``, or None.

    Every name is a plain file name, and every temporary file the one temp_name gives for that
    name, size and mtime in ``dest``: nothing a step reads, writes or removes lies outside dest.
    """
    for i, f in enumerate(files or []):
        where = f"files[{i}]"
        if not isinstance(f, dict):
            return f"{where} is not a mapping"
        name = f.get("name")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\x00" in name:
            return f"{where}: name {str(name)[:80]!r} is not a plain file name"
        kind = f.get("kind", "transfer")
        if step == "commit" and kind not in FILE_KINDS:
            return f"{where} ({name}): kind {str(kind)[:40]!r} is none of {', '.join(FILE_KINDS)}"
        if step in ("copy", "commit") and kind != "transfer":
            continue  # plan and follow take every entry as a file to transfer; copy and commit go by kind
        missing = [key for key in _NEEDS.get(step, ()) if key not in f]
        if missing:
            return f"{where} ({name}) lacks {', '.join(missing)}"
        numbers = {}
        for key in ("size", "mtime", "mtime_ns"):
            if key in f:
                value = f[key]
                if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
                    return f"{where} ({name}): {key} {str(value)[:40]!r} is not a whole number >= 0"
                numbers[key] = int(value)
        if "stall" in f and not (isinstance(f["stall"], (int, float)) and 0 <= f["stall"] <= 3600):
            return f"{where} ({name}): stall {str(f['stall'])[:40]!r} is not 0 to 3600 seconds"
        if step == "commit" and not (isinstance(f["digest"], str) and _HEX64.match(f["digest"])):
            return f"{where} ({name}): digest is not a SHA-256 in hex"
        if "temp" in f:
            temp = f["temp"]
            if "mtime" in numbers:
                good = temp == os.path.join(dest, temp_name(name, numbers["size"], numbers["mtime"]))
            else:
                base = os.path.basename(str(temp))
                good = (
                    os.path.dirname(str(temp)) == dest.rstrip("/")
                    and base.startswith(f"{TEMP_PREFIX}{name}.")
                    and base.endswith(TEMP_SUFFIX)
                )
            if not good:
                return f"{where} ({name}): temp {str(temp)[:200]!r} is not this file's temporary name in {dest}"
    return None


def human(n: int) -> str:
    """Bytes as an operator reads them, with the exact count."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v = float(n)
    for u in units:
        if abs(v) < 1024 or u == units[-1]:
            return f"{v:.1f} {u} ({n} bytes)" if u != "B" else f"{n} bytes"
        v /= 1024
    return f"{n} bytes"  # pragma: no cover


def normalise_digest(value: Any, what: str) -> str:
    """A SHA-256 digest as 64 lowercase hex digits; accepts an optional ``sha256:`` prefix."""
    if not isinstance(value, str):
        raise StageError(f"{what}: the expected SHA-256 must be a string of 64 hex digits, not {value!r}")
    text = value.strip().lower()
    if text.startswith("sha256:"):
        text = text[len("sha256:") :]
    if not _HEX64.match(text):
        raise StageError(
            f"{what}: {value!r} is not a SHA-256 digest (64 hex digits); give the output of"
            " 'sha256sum FILE' for the source file"
        )
    return text


def expected_digests(sha256: Any, names: list[str], single_origin: str | None) -> dict[str, str]:
    """Map source file names to expected digests from the task's ``sha256`` option.

    A string applies to a single-file source; a dict maps source file names (as in the source
    directory) to digests and must name only files that are staged.
    """
    if sha256 is None or sha256 == "" or sha256 == {}:
        return {}
    if isinstance(sha256, str):
        if single_origin is None:
            raise StageError(
                "sha256 is one digest but the source has several files; give a mapping of file name to digest instead"
            )
        return {single_origin: normalise_digest(sha256, single_origin)}
    if isinstance(sha256, dict):
        unknown = sorted(set(sha256) - set(names))
        if unknown:
            raise StageError(
                f"sha256 names {', '.join(unknown)}, which the source does not have (it has"
                f" {', '.join(sorted(names))}); fix the names in the inventory"
            )
        return {k: normalise_digest(v, k) for k, v in sha256.items()}
    raise StageError(f"sha256 must be a digest string or a mapping of file name to digest, not {type(sha256).__name__}")


def source_layout(src: str, is_dir: bool, listing: list[str]) -> list[tuple[str, str]]:
    """(source path, name in dest) for every file to stage, from the source and its listing.

    A file (any name) becomes ``model.safetensors``; a directory with one ``.safetensors`` and no
    index likewise; a directory with shards keeps their names, plus its index if it has one.
    """
    if not is_dir:
        if not src.endswith(".safetensors"):
            raise StageError(
                f"{src}: the source must be a .safetensors file or a directory of them (got a file named"
                f" {os.path.basename(src)!r}); point model_stage_src at the weights"
            )
        return [(src, SINGLE_NAME)]
    shards = sorted(n for n in listing if n.endswith(".safetensors") and not n.startswith("."))
    has_index = INDEX_NAME in listing
    if not shards:
        raise StageError(f"{src}: the directory holds no .safetensors file; point model_stage_src at the weights")
    if len(shards) == 1 and not has_index:
        return [(os.path.join(src, shards[0]), SINGLE_NAME)]
    out = [(os.path.join(src, n), n) for n in shards]
    if has_index:
        out.append((os.path.join(src, INDEX_NAME), INDEX_NAME))
    return out


def parse_sidecar(text: str | None) -> dict[str, dict[str, Any]]:
    """The sidecar's per-file records; anything unreadable counts as no record (files get re-verified)."""
    if not text:
        return {}
    try:
        obj = loads_json(text, SIDECAR_NAME)
    except UnsafeFileError:
        return {}
    if not isinstance(obj, dict) or obj.get("version") != SIDECAR_VERSION or not isinstance(obj.get("files"), dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, rec in obj["files"].items():
        if isinstance(rec, dict) and isinstance(rec.get("sha256"), str):
            out[name] = rec
    return out


def render_sidecar(records: dict[str, dict[str, Any]]) -> str:
    return (
        json.dumps({"version": SIDECAR_VERSION, "files": dict(sorted(records.items()))}, indent=2, sort_keys=True)
        + "\n"
    )


def record(src: SourceFile, digest: str) -> dict[str, Any]:
    """The sidecar entry for a staged file: the dest's own size and mtime equal the source's."""
    entry = {"size": src.size, "mtime": src.mtime, "sha256": digest, "source": src.origin}
    if src.mtime_ns is not None:
        entry["mtime_ns"] = src.mtime_ns
    return entry


def same_nanosecond(source: SourceFile, have: DestFile, rec: dict[str, Any]) -> bool:
    """Whether the source's mtime is, to the nanosecond, the one its verified copy was made from.

    The record's ``mtime_ns`` says so where the record has one; an older record (seconds only) is
    trusted where the dest file's own mtime is the source's to the nanosecond (the copy sets it so:
    rsync --times, os.utime). Unknown nanoseconds on the source side compare as before, in seconds.
    """
    if source.mtime_ns is None:
        return True
    recorded = rec.get("mtime_ns")
    if recorded is not None:
        return recorded == source.mtime_ns
    return have.mtime_ns == source.mtime_ns


def plan_stage(
    sources: list[SourceFile],
    dest: dict[str, DestFile],
    sidecar: dict[str, dict[str, Any]],
    temps: dict[str, int],
    generated_index: bool,
) -> Plan:
    """Which files need a transfer, which temporary files are stale, which old weights to remove.

    ``dest`` maps names in the destination to their state, ``temps`` maps temporary file names
    found there to their size. A file is kept only when dest has it with the source's size and
    mtime and the sidecar holds a digest for exactly that size and mtime (and, when the inventory
    gives a digest, that digest).
    """
    plans: list[FilePlan] = []
    for s in sources:
        have = dest.get(s.name)
        rec = sidecar.get(s.name)
        if have is None:
            action, reason = "transfer", "not in the destination"
        elif have.size != s.size:
            action, reason = "transfer", f"size differs ({have.size} in dest, {s.size} in source)"
        elif have.mtime != s.mtime:
            action, reason = "transfer", "modification time differs (the source changed)"
        elif rec is None or rec.get("size") != s.size or rec.get("mtime") != s.mtime:
            action, reason = "transfer", "no verified digest recorded for this file"
        elif not same_nanosecond(s, have, rec):
            action, reason = "transfer", "modification time differs within the second (the source was rewritten)"
        elif s.sha256 is not None and rec.get("sha256") != s.sha256:
            action, reason = "transfer", "the expected SHA-256 differs from the one recorded"
        else:
            action, reason = "keep", "unchanged (size, mtime and recorded digest match)"
        partial = 0
        if action == "transfer":
            partial = min(temps.get(s.temp, 0), s.size)
        plans.append(FilePlan(source=s, action=action, reason=reason, partial=partial))
    wanted_temps = {p.source.temp for p in plans if p.action == "transfer"}
    stale_temps = sorted(t for t in temps if t not in wanted_temps)
    names = {s.name for s in sources}
    if generated_index:
        names.add(INDEX_NAME)
    stale_weights = sorted(n for n in dest if n not in names and (n.endswith(".safetensors") or n == INDEX_NAME))
    index_stale = generated_index and (INDEX_NAME not in dest or any(p.action == "transfer" for p in plans))
    return Plan(
        files=plans,
        stale_temps=stale_temps,
        stale_weights=stale_weights,
        write_index=generated_index,
        index_stale=index_stale,
    )


def check_space(dest: str, needed: int, margin: int, free: int) -> None:
    if needed == 0:
        return
    if free < needed + margin:
        raise StageError(
            f"not enough space for {dest}: staging needs {human(needed)} plus a margin of {human(margin)},"
            f" but the filesystem has {human(free)} free; free up space or stage elsewhere (shared_settings_drafter_dir)"
        )


def build_index(shards: dict[str, dict[str, int]]) -> dict[str, Any]:
    """A ``model.safetensors.index.json`` for shards given as {shard name: {tensor: nbytes}}."""
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(shards):
        for tensor, nbytes in sorted(shards[shard].items()):
            if tensor in weight_map:
                raise StageError(
                    f"tensor {tensor!r} is in both {weight_map[tensor]} and {shard}; the shards do not belong together"
                )
            weight_map[tensor] = shard
            total += nbytes
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def render_index(index: dict[str, Any]) -> str:
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def check_index(index: dict[str, Any], shards: dict[str, set[str]], where: str) -> None:
    """The index maps every tensor of the shards, and only those, to the shard holding it."""
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise StageError(f"{where}: not a shard index (needs a non-empty 'weight_map' object)")
    named = set(wmap.values())
    missing = sorted(n for n in named if n not in shards)
    if missing:
        raise StageError(f"{where}: names shard(s) {', '.join(missing)} that the source does not have")
    for shard, tensors in sorted(shards.items()):
        for t in sorted(tensors):
            if wmap.get(t) != shard:
                raise StageError(f"{where}: tensor {t!r} is in {shard} but the index maps it to {wmap.get(t)!r}")
    extra = sorted(set(wmap) - set().union(*shards.values()))
    if extra:
        raise StageError(f"{where}: maps tensor {extra[0]!r} that no shard holds")


def describe(plan: Plan) -> list[str]:
    """One line per file for check mode, diff and the task's result."""
    lines = []
    for p in plan.files:
        if p.action == "transfer":
            extra = f", resuming after {p.partial} bytes" if p.partial else ""
            lines.append(f"copy {p.source.origin} -> {p.source.name} ({p.source.size} bytes; {p.reason}{extra})")
    if plan.index_stale:
        lines.append(f"write {INDEX_NAME} (the source has shards but no index)")
    lines += [f"remove {n} (not part of the source)" for n in plan.stale_weights]
    if plan.replaces_set:
        lines.append("swap the new set in as one directory (the old set stays complete until then)")
    lines += [f"remove {n} (left over from an earlier transfer of another source)" for n in plan.stale_temps]
    return lines


# ------------------------------------------------------------------ replacing a set of files in one step

RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# renameat2's syscall number where the C library has no wrapper (glibc < 2.28).
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "ppc64le": 357, "s390x": 347, "i686": 353}
# What renameat2 answers when the kernel or the filesystem cannot exchange two entries.
UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})

Exchange = Callable[[str, str], None]


def exchange_paths(a: str, b: str) -> None:
    """Swap two directory entries in one step: ``renameat2(a, b, RENAME_EXCHANGE)`` (Linux >= 3.15).

    Raises OSError with the kernel's errno; errno in UNSUPPORTED means the filesystem (or kernel)
    cannot do it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    args = (_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    func = getattr(libc, "renameat2", None)
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        func.restype = ctypes.c_int
        rc = func(*args)
    else:  # pragma: no cover (glibc >= 2.28 has the wrapper)
        nr = _SYS_RENAMEAT2.get(platform.machine())
        if nr is None:
            raise OSError(errno.ENOSYS, f"renameat2 is not known on {platform.machine()}", a)
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(
            ctypes.c_long(nr),
            ctypes.c_int(args[0]),
            ctypes.c_char_p(args[1]),
            ctypes.c_int(args[2]),
            ctypes.c_char_p(args[3]),
            ctypes.c_uint(args[4]),
        )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)


def swap_paths(real_dest: str) -> tuple[str, str]:
    """The staging directory beside ``real_dest`` (dest with symlinks resolved) and the plan's probe."""
    parent, base = os.path.split(real_dest.rstrip("/"))
    staging = os.path.join(parent, f"{SWAP_PREFIX}{base}")
    return staging, staging + ".probe"


def _unescape_mount(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def mount_of(path: str, mountinfo: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding the absolute ``path``, from /proc/self/mountinfo text."""
    best = ("/", "unknown")
    best_len = -1
    for line in mountinfo.splitlines():
        parts = line.split()
        if "-" not in parts[6:]:
            continue
        point = _unescape_mount(parts[4])
        fstype = parts[parts.index("-", 6) + 1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = (point, fstype), len(point)
    return best


def describe_filesystem(path: str) -> str:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            point, fstype = mount_of(os.path.realpath(path), fh.read())
    except OSError:
        return "its filesystem"
    return f"the {fstype} filesystem mounted at {point}"


def _no_exchange(dest: str, exc: OSError) -> StageError:
    return StageError(
        f"{dest}: {describe_filesystem(dest)} cannot swap two directories in one step (renameat2"
        f" RENAME_EXCHANGE: {exc.strerror}), so a set of several files cannot be replaced atomically there;"
        " nothing was replaced. Put shared_settings_drafter_dir on a filesystem that can (ext4, xfs, btrfs, tmpfs,"
        " zfs >= 2.2) or stage a single-file drafter"
    )


def check_exchange(dest: str, exchange: Exchange = exchange_paths) -> None:
    """Before anything is changed or transferred: can a directory beside ``dest`` be swapped with it?

    ``dest``'s parent must exist. ``dest``, if it exists, must be on its parent's filesystem (not a
    mount point), and that filesystem must support RENAME_EXCHANGE (tried on two empty directories
    beside ``dest``, removed again).
    """
    real = os.path.realpath(dest)
    parent = os.path.dirname(real)
    if os.path.isdir(real) and os.stat(parent).st_dev != os.stat(real).st_dev:
        raise StageError(
            f"{dest} is a mount point: a set of several files is replaced by swapping in a complete new"
            f" directory built beside it, which must be on the same filesystem, but {parent} is not;"
            " set shared_settings_drafter_dir to a directory inside the mount"
        )
    a, b = swap_paths(real)
    for path in (a, b):
        remove_tree(path)
    os.mkdir(a, 0o700)
    try:
        os.mkdir(b, 0o700)
        try:
            exchange(a, b)
        except OSError as exc:
            if exc.errno in UNSUPPORTED:
                raise _no_exchange(dest, exc) from None
            raise
        finally:
            os.rmdir(b)
    finally:
        os.rmdir(a)


def leftovers(dest: str) -> list[str]:
    """Staging or probe directories an interrupted run left beside ``dest``."""
    return [p for p in swap_paths(os.path.realpath(dest)) if os.path.lexists(p)]


def remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


@dataclass
class NewSet:
    """The files that change in dest; everything else dest holds is carried over unchanged."""

    place: dict[str, str]  # name in dest -> verified file (on dest's filesystem) to hard-link there
    write: dict[str, tuple[str, int]]  # name in dest -> (text, mode) written fresh
    remove: set[str] = field(default_factory=set)  # names in dest left out of the new set
    # name in dest -> (st_dev, st_ino) the placed file must have (the file verified, not one swapped in)
    identity: dict[str, tuple[int, int]] = field(default_factory=dict)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mirror(src: str, dst: str, skip: set[str]) -> None:
    """Hard-link every file under ``src`` into the new directory ``dst`` (subdirectories recreated)."""
    for entry in os.scandir(src):
        if entry.name in skip:
            continue
        path, target = entry.path, os.path.join(dst, entry.name)
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(path), target)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(target, stat.S_IMODE(st.st_mode))
            os.chown(target, st.st_uid, st.st_gid)
            _mirror(path, target, set())
            os.chmod(target, stat.S_IMODE(st.st_mode))
        elif stat.S_ISREG(st.st_mode):
            os.link(path, target, follow_symlinks=False)
        else:
            raise StageError(
                f"{path} is neither a file, a directory nor a symlink; it cannot be carried over into the new"
                " set: remove it from the destination"
            )


def prepare_set(dest: str, new: NewSet, uid: int, gid: int, dir_mode: int) -> str:
    """Step 1: build the complete new set in the staging directory beside ``dest``; returns its path.

    Files that stay, and everything else in dest (config.json, tokenizer files, subdirectories),
    are hard-linked; the changed files are hard-linked from their verified temporary files or
    written. dest itself is not touched. Temporary files (``.model_stage-*``) are not carried over.
    """
    real = os.path.realpath(dest)
    staging, _ = swap_paths(real)
    remove_tree(staging)
    os.mkdir(staging, 0o700)
    try:
        _fill_set(real, staging, new, uid, gid, dir_mode)
    except BaseException:
        # A full disk, a file that cannot be linked (chattr +i): no half-built set stays beside dest.
        with contextlib.suppress(OSError):
            remove_tree(staging)
        raise
    return staging


def _fill_set(real: str, staging: str, new: NewSet, uid: int, gid: int, dir_mode: int) -> None:
    skip = set(new.place) | set(new.write) | new.remove
    skip |= {e.name for e in os.scandir(real) if e.name.startswith(TEMP_PREFIX)}
    _mirror(real, staging, skip)
    for name, path in sorted(new.place.items()):
        target = os.path.join(staging, name)
        os.link(path, target, follow_symlinks=False)
        st = os.lstat(target)
        if name in new.identity and (st.st_dev, st.st_ino) != new.identity[name]:
            remove_tree(staging)
            raise StageError(
                f"{path} was replaced between its check and the commit; nothing was replaced: check who writes"
                " into the destination and run the play again"
            )
    for name, (text, mode) in sorted(new.write.items()):
        atomic_write(os.path.join(staging, name), text, mode, (uid, gid), prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
    os.chown(staging, DIR_UID, gid)
    os.chmod(staging, dir_mode)
    fsync_path(staging)


def swap_set(dest: str, staging: str, exchange: Exchange = exchange_paths) -> None:
    """Step 2: exchange the staging directory with ``dest`` in one step; dest now holds the new set.

    If the filesystem cannot exchange, the staging directory is removed and dest is left as it was.
    """
    real = os.path.realpath(dest)
    try:
        exchange(staging, real)
    except OSError as exc:
        remove_tree(staging)
        if exc.errno in UNSUPPORTED:
            raise _no_exchange(dest, exc) from None
        raise StageError(f"{dest}: swapping in the new set failed ({exc.strerror}); nothing was replaced") from None
    fsync_path(os.path.dirname(real))


def discard_old_set(staging: str) -> None:
    """Step 3: remove the old set (at the staging path since the swap)."""
    remove_tree(staging)


def replace_set(dest: str, new: NewSet, uid: int, gid: int, dir_mode: int, exchange: Exchange = exchange_paths) -> None:
    """Replace dest's set of files with ``new`` so that dest never holds a mix of old and new."""
    for path in leftovers(dest):
        remove_tree(path)
    staging = prepare_set(dest, new, uid, gid, dir_mode)
    swap_set(dest, staging, exchange)
    discard_old_set(staging)
