"""Hash-verified, all-or-nothing change sets for an installed vLLM release.

A change set lives in a directory per vLLM release (``vllm-<version>/``) with a
``manifest.json``::

    {
      "format": 1,
      "patchset": "ddtree",
      "vllm_version": "0.20.1",
      "description": "...",
      "files": [
        {"path": "vllm/config/speculative.py", "kind": "patch",
         "diff": "vllm-0.20.1/patches/vllm__config__speculative.py.diff",
         "pristine_sha256": "...", "patched_sha256": "..."},
        {"path": "vllm/v1/spec_decode/ddtree.py", "kind": "add",
         "source": "vllm-0.20.1/added/ddtree.py", "patched_sha256": "..."}
      ]
    }

``path`` is relative to the site-packages directory that holds the ``vllm``
package; ``diff`` and ``source`` are relative to the change-set root (the
directory that holds ``vllm-<version>/``, so files shared by releases can live
beside them). A ``patch`` entry carries a unified diff that turns the pristine file
(digest ``pristine_sha256``) into the patched one (digest ``patched_sha256``);
an ``add`` entry carries a whole new file. Every file on disk must be exactly
pristine or exactly patched: anything else is refused and nothing is written.

Everything is computed in memory and verified against the manifest's digests
before the first byte is written; files are then replaced atomically one by one,
and any failure puts every file already touched back as it was.

Pure logic plus file I/O, standard library only (runs on managed nodes).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ansible.module_utils.safe_io import UnsafeFileError, atomic_write, loads_json, read_regular, write_problem

MANIFEST = "manifest.json"
# A manifest lists a few dozen files; a patched or added source file is well below this.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_SOURCE_BYTES = 64 * 1024 * 1024
FORMAT = 1
RECORD_NAME = "vllm-changeset.json"

PRESENT = "present"
ABSENT = "absent"

# Per-file states found on disk.
PRISTINE = "pristine"
PATCHED = "patched"
MISSING = "missing"


class ChangeSetError(ValueError):
    """The change set, the vLLM install or a file on disk does not allow a safe change."""


class SourcesNeeded(ChangeSetError):
    """A change is needed but some change-set files it needs were not provided (nothing was changed)."""

    def __init__(self, message: str, sources: list[str]) -> None:
        super().__init__(message)
        self.sources = sources


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------
# Finding vLLM in a venv without importing it
# ---------------------------------------------------------------------------

_VERSION_RE = re.compile(r"^Version:\s*(\S+)\s*$", re.MULTILINE)
_NAME_RE = re.compile(r"^Name:\s*(\S+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class VllmInstall:
    version: str
    site_packages: str
    dist_info: str


# A wheel's METADATA is a few KiB (vLLM 0.20.1: 11 KB); far more is not one.
MAX_METADATA_BYTES = 4 * 1024 * 1024


def find_vllm(venv: str) -> VllmInstall:
    """Locate the vLLM distribution in ``venv`` from its dist-info METADATA.

    Never imports vLLM (the node may have no torch, and importing vLLM is slow).
    """
    root = Path(venv)
    try:
        is_dir = root.is_dir()
    except (OSError, ValueError) as exc:  # a name too long, a NUL
        why = getattr(exc, "strerror", None) or exc
        raise ChangeSetError(f"The venv {venv[:200]!r} cannot be looked at ({why}); give the venv's path.") from None
    if not is_dir:
        raise ChangeSetError(
            f"The venv {venv} does not exist. Install vLLM first (role vllm_install) "
            "or point the venv parameter at the directory that holds bin/ and lib/."
        )
    candidates = sorted(root.glob("lib/python3*/site-packages/vllm-*.dist-info")) + sorted(
        root.glob("lib64/python3*/site-packages/vllm-*.dist-info")
    )
    found: list[VllmInstall] = []
    seen: set[str] = set()
    for dist_info in candidates:
        real = os.path.realpath(dist_info)
        if real in seen:
            continue
        seen.add(real)
        meta = dist_info / "METADATA"
        if not meta.is_file():
            continue
        try:
            text = read_regular(str(meta), MAX_METADATA_BYTES, follow=True).decode("utf-8", "replace")
        except (OSError, UnsafeFileError) as exc:  # huge, or swapped for a FIFO since: never a hang
            raise ChangeSetError(
                f"vLLM's METADATA cannot be read: {exc}. Reinstall vLLM into the venv (role vllm_install)."
            ) from None
        name = _NAME_RE.search(text)
        version = _VERSION_RE.search(text)
        if not name or name.group(1).lower() != "vllm" or not version:
            continue
        site = dist_info.parent
        if not (site / "vllm" / "__init__.py").is_file():
            raise ChangeSetError(
                f"{dist_info} says vLLM {version.group(1)} is installed but "
                f"{site / 'vllm' / '__init__.py'} is missing: the install is broken. "
                "Reinstall vLLM into the venv (role vllm_install)."
            )
        found.append(VllmInstall(version.group(1), str(site), str(dist_info)))
    if not found:
        raise ChangeSetError(
            f"No vLLM found in the venv {venv} (no lib/python3*/site-packages/vllm-*.dist-info "
            "with a METADATA file). Install vLLM first (role vllm_install)."
        )
    if len(found) > 1:
        versions = ", ".join(f.version for f in found)
        raise ChangeSetError(
            f"The venv {venv} holds more than one vLLM dist-info ({versions}); "
            "it is not clear which one is installed. Recreate the venv."
        )
    return found[0]


# ---------------------------------------------------------------------------
# Unified diffs (strict: exact context, no fuzz, no offsets guessed)
# ---------------------------------------------------------------------------

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    old_start: int
    new_start: int
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]


def parse_unified_diff(text: str) -> tuple[Hunk, ...]:
    """Parse one file's unified diff (``diff -u`` output) into hunks."""
    lines = text.splitlines(keepends=True)
    hunks: list[Hunk] = []
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        i += 1
    if i == len(lines):
        raise ChangeSetError("The diff has no hunks (no line starting with '@@').")
    while i < len(lines):
        m = _HUNK_RE.match(lines[i])
        if not m:
            raise ChangeSetError(f"Malformed diff: expected a hunk header, got {lines[i]!r}.")
        old_count = int(m.group(2)) if m.group(2) is not None else 1
        new_count = int(m.group(4)) if m.group(4) is not None else 1
        i += 1
        old: list[str] = []
        new: list[str] = []
        last_tag = ""
        while i < len(lines) and (len(old) < old_count or len(new) < new_count or lines[i].startswith("\\")):
            line = lines[i]
            i += 1
            if line.startswith("\\"):  # "\ No newline at end of file"
                targets = {" ": (old, new), "-": (old,), "+": (new,)}.get(last_tag, ())
                for target in targets:
                    target[-1] = target[-1].rstrip("\n")
                continue
            last_tag, body = line[:1], line[1:]
            if last_tag == " ":
                old.append(body)
                new.append(body)
            elif last_tag == "-":
                old.append(body)
            elif last_tag == "+":
                new.append(body)
            else:
                raise ChangeSetError(f"Malformed diff line {line!r}.")
        if len(old) != old_count or len(new) != new_count:
            raise ChangeSetError("Malformed diff: a hunk is shorter than its header says.")
        hunks.append(Hunk(int(m.group(1)), int(m.group(3)), tuple(old), tuple(new)))
    return tuple(hunks)


def apply_hunks(original: str, hunks: Sequence[Hunk], *, reverse: bool = False) -> str:
    """Apply (or un-apply) hunks to ``original``; every context line must match exactly."""
    src = original.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for hunk in hunks:
        if reverse:
            before, after, start = hunk.new_lines, hunk.old_lines, hunk.new_start
        else:
            before, after, start = hunk.old_lines, hunk.new_lines, hunk.old_start
        # "-N,0" means "insert after line N"; otherwise the hunk starts at line N.
        index = start if not before else start - 1
        if index < pos or src[index : index + len(before)] != list(before):
            raise ChangeSetError(f"The diff does not apply: the lines at {index + 1} differ from the hunk's context.")
        out.extend(src[pos:index])
        out.extend(after)
        pos = index + len(before)
    out.extend(src[pos:])
    return "".join(out)


# ---------------------------------------------------------------------------
# Change sets
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileChange:
    path: str
    kind: str  # "patch" or "add"
    patched_sha256: str
    pristine_sha256: str | None = None
    hunks: tuple[Hunk, ...] | None = ()  # None: the diff was not provided (see load_inline_changeset)
    added: bytes | None = None  # None for an "add" entry: the file was not provided
    source: str = ""  # the diff or added file, relative to the change-set root

    @property
    def has_content(self) -> bool:
        return self.added is not None if self.kind == "add" else self.hunks is not None


@dataclass(frozen=True)
class ChangeSet:
    patchset: str
    vllm_version: str
    description: str
    manifest_sha256: str
    files: tuple[FileChange, ...]


def changeset_dir(root: str, version: str) -> Path:
    return Path(root) / f"vllm-{version}"


def available_versions(root: str) -> list[str]:
    base = Path(root)
    if not base.is_dir():
        return []
    return sorted(p.name[len("vllm-") :] for p in base.glob("vllm-*") if (p / MANIFEST).is_file())


def _safe_relpath(path: str, what: str) -> str:
    p = Path(path)
    if not path or p.is_absolute() or ".." in p.parts:
        raise ChangeSetError(f"The manifest names an unsafe {what} path {path!r}: it must be relative.")
    return path


def load_changeset(root: str, version: str, patchset: str) -> ChangeSet:
    """Load the change set ``patchset`` for vLLM ``version`` kept under ``root``.

    Refuses an unknown release, an unknown patchset and a change set whose files do
    not match its own manifest.
    """
    cdir = changeset_dir(root, version)
    manifest_path = cdir / MANIFEST
    if not manifest_path.is_file():
        known = ", ".join(available_versions(root)) or "none"
        raise ChangeSetError(_no_changeset_msg(version, f" (looked for {manifest_path})", known))

    def read(relpath: str) -> bytes:
        src = Path(root) / relpath
        if not src.is_file():
            raise ChangeSetError(f"The change set is incomplete: {src} is missing.")
        return _bounded(src, MAX_SOURCE_BYTES)

    return parse_changeset(
        _bounded(manifest_path, MAX_MANIFEST_BYTES),
        str(manifest_path),
        version,
        patchset,
        read,
        lambda rel: str(Path(root) / rel),
    )


def _bounded(path: Path, limit: int) -> bytes:
    try:
        return read_regular(str(path), limit, follow=True)
    except UnsafeFileError as exc:
        raise ChangeSetError(f"{exc}.") from None


def load_inline_changeset(
    manifests: dict[str, str], sources: dict[str, bytes], version: str, patchset: str
) -> ChangeSet:
    """The change set for vLLM ``version`` from manifests and files passed in (not read from disk).

    ``manifests`` maps a vLLM release to its manifest.json text; ``sources`` maps a diff or added
    file, relative to the change-set root, to its bytes. Files not in ``sources`` are left out
    (:func:`plan` says which of them a change needs, see :class:`SourcesNeeded`); files given are
    checked like :func:`load_changeset` checks them.
    """
    if version not in manifests:
        known = ", ".join(sorted(manifests)) or "none"
        raise ChangeSetError(_no_changeset_msg(version, "", known))
    where = f"the manifest for vLLM {version}"
    return parse_changeset(
        manifests[version].encode("utf-8"), where, version, patchset, sources.get, lambda rel: f"the file {rel} sent"
    )


def _no_changeset_msg(version: str, looked: str, known: str) -> str:
    return (
        f"There is no change set for vLLM {version}{looked}; "
        f"change sets exist for vLLM: {known}. Install a vLLM release this project "
        "supports (role vllm_install), or write and verify a change set for this release first."
    )


def parse_changeset(
    raw: bytes,
    where: str,
    version: str,
    patchset: str,
    read: Callable[[str], bytes | None],
    describe: Callable[[str], str],
) -> ChangeSet:
    """Check a manifest (``raw``, named ``where`` in errors) and the files ``read`` returns.

    ``read`` gets a path relative to the change-set root and returns its bytes, or None when
    the file is not at hand (the entry then carries no content); ``describe`` names such a
    path in errors.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ChangeSetError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes; it is not a change-set manifest.")
    try:
        manifest = loads_json(raw, where)
    except UnsafeFileError as exc:
        raise ChangeSetError(f"{exc}.") from None
    if not isinstance(manifest, dict):
        raise ChangeSetError(f"{where} is not a JSON object.")
    if manifest.get("format") != FORMAT:
        raise ChangeSetError(f"{where}: unsupported format {manifest.get('format')!r}.")
    if manifest.get("vllm_version") != version:
        raise ChangeSetError(f"{where} is for vLLM {manifest.get('vllm_version')!r}, not {version}.")
    if manifest.get("patchset") != patchset:
        raise ChangeSetError(
            f"The change set for vLLM {version} is {manifest.get('patchset')!r}; "
            f"patchset {patchset!r} does not exist for this release."
        )
    files: list[FileChange] = []
    seen: set[str] = set()
    entries = manifest.get("files", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ChangeSetError(f"{where}: 'files' must be a list of objects (path, kind, ...).")
    for entry in entries:
        path = _safe_relpath(str(entry.get("path", "")), "target")
        if path in seen:
            raise ChangeSetError(f"{where} names {path} twice.")
        seen.add(path)
        kind = entry.get("kind")
        patched_sha = str(entry.get("patched_sha256", ""))
        if kind == "add":
            rel = _safe_relpath(str(entry.get("source", "")), "source")
            data = read(rel)
            if data is not None and sha256_bytes(data) != patched_sha:
                raise ChangeSetError(
                    f"The change set is corrupt: {describe(rel)} has sha256 {sha256_bytes(data)}, "
                    f"the manifest says {patched_sha}."
                )
            files.append(FileChange(path, "add", patched_sha, added=data, source=rel))
        elif kind == "patch":
            rel = _safe_relpath(str(entry.get("diff", "")), "diff")
            text = read(rel)
            try:
                hunks = parse_unified_diff(text.decode("utf-8")) if text is not None else None
            except UnicodeDecodeError as exc:
                raise ChangeSetError(
                    f"The change set is corrupt: {describe(rel)} is not UTF-8 text ({exc.reason})."
                ) from None
            files.append(
                FileChange(
                    path,
                    "patch",
                    patched_sha,
                    pristine_sha256=str(entry.get("pristine_sha256", "")),
                    hunks=hunks,
                    source=rel,
                )
            )
        else:
            raise ChangeSetError(f"{where}: {path} has unknown kind {kind!r}.")
    if not files:
        raise ChangeSetError(f"{where} lists no files.")
    return ChangeSet(
        patchset=patchset,
        vllm_version=version,
        description=str(manifest.get("description", "")),
        manifest_sha256=sha256_bytes(raw),
        files=tuple(files),
    )


# ---------------------------------------------------------------------------
# Planning: what is on disk, what must be written
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileAction:
    path: str
    found: str  # PRISTINE, PATCHED or MISSING
    want: str  # PRISTINE, PATCHED or MISSING
    before: bytes | None
    after: bytes | None

    @property
    def changes(self) -> bool:
        return self.found != self.want


@dataclass(frozen=True)
class Plan:
    site_packages: str
    state: str
    actions: tuple[FileAction, ...] = field(default_factory=tuple)

    @property
    def changed(self) -> bool:
        return any(a.changes for a in self.actions)

    @property
    def changed_paths(self) -> list[str]:
        return [a.path for a in self.actions if a.changes]

    def file_states(self) -> dict[str, str]:
        return {a.path: a.found for a in self.actions}


def _read(path: Path) -> bytes | None:
    """A file in site-packages as it is now (None: absent); only a regular file, bounded."""
    try:
        return read_regular(str(path), MAX_SOURCE_BYTES, follow=True)
    except FileNotFoundError:
        return None
    except UnsafeFileError as exc:
        raise ChangeSetError(f"{exc}; vLLM's files must be plain files: reinstall vLLM.") from None


def _classify(change: FileChange, current: bytes | None, target: Path, version: str) -> tuple[str | None, str]:
    """The state of one file on disk from its digest alone, or (None, the problem)."""
    digest = sha256_bytes(current) if current is not None else None
    if change.kind == "add":
        if current is None:
            return MISSING, ""
        if digest == change.patched_sha256:
            return PATCHED, ""
        return None, (
            f"{target} exists but is not this change set's file (sha256 {digest}, expected {change.patched_sha256})"
        )
    if current is None:
        return None, f"{target} is missing (expected pristine sha256 {change.pristine_sha256})"
    if digest == change.pristine_sha256:
        return PRISTINE, ""
    if digest == change.patched_sha256:
        return PATCHED, ""
    return None, (
        f"{target} has sha256 {digest}, which is neither pristine vLLM "
        f"{version} ({change.pristine_sha256}) nor patched ({change.patched_sha256})"
    )


def _other_side(change: FileChange, found: str, current: bytes) -> bytes:
    """The patched bytes of a pristine file, or the pristine bytes of a patched one, verified."""
    assert change.hunks is not None
    if found == PRISTINE:
        patched = apply_hunks(current.decode("utf-8"), change.hunks).encode("utf-8")
        if sha256_bytes(patched) != change.patched_sha256:
            raise ChangeSetError(
                f"The change set is corrupt: the diff for {change.path} gives sha256 "
                f"{sha256_bytes(patched)}, the manifest says {change.patched_sha256}."
            )
        return patched
    pristine = apply_hunks(current.decode("utf-8"), change.hunks, reverse=True).encode("utf-8")
    if sha256_bytes(pristine) != change.pristine_sha256:
        raise ChangeSetError(
            f"The change set is corrupt: un-applying the diff for {change.path} gives "
            f"sha256 {sha256_bytes(pristine)}, the manifest says {change.pristine_sha256}."
        )
    return pristine


def plan(changeset: ChangeSet, site_packages: str, state: str) -> Plan:
    """Work out every file's current and wanted bytes; refuse anything unexpected.

    Raises :class:`ChangeSetError` (and so changes nothing) if any file is neither
    pristine nor carrying exactly this change set. Files are first judged by digest alone;
    only the files that must change need their diff or added file, and if any of those
    was not provided :class:`SourcesNeeded` names them all. A file already in the wanted
    state needs nothing: with the diff at hand it is still checked against it.
    """
    if state not in (PRESENT, ABSENT):
        raise ChangeSetError(f"state must be {PRESENT!r} or {ABSENT!r}, not {state!r}.")
    site = Path(site_packages)
    found_files: list[tuple[FileChange, str, bytes | None]] = []
    problems: list[str] = []
    for change in changeset.files:
        target = site / change.path
        current = _read(target)
        found, problem = _classify(change, current, target, changeset.vllm_version)
        if found is None:
            problems.append(problem)
        else:
            found_files.append((change, found, current))
    if problems:
        raise ChangeSetError(
            "Refusing to touch vLLM: "
            + "; ".join(problems)
            + ". Someone changed these files by hand or another patch is applied. Nothing was "
            f"changed. Reinstall vLLM {changeset.vllm_version} (role vllm_install, or "
            f"pip install --force-reinstall --no-deps vllm=={changeset.vllm_version}) and run again."
        )

    def wanted(change: FileChange) -> str:
        if state == PRESENT:
            return PATCHED
        return MISSING if change.kind == "add" else PRISTINE

    needed = [
        change.source
        for change, found, _ in found_files
        if found != wanted(change) and not change.has_content and not (change.kind == "add" and state == ABSENT)
    ]
    if needed:
        raise SourcesNeeded(
            f"vLLM {changeset.vllm_version} needs a change but these change-set files were not provided: "
            f"{', '.join(needed)}. Nothing was changed. Pass them in sources (or use changeset_root).",
            needed,
        )
    actions: list[FileAction] = []
    for change, found, current in found_files:
        want = wanted(change)
        if change.kind == "add":
            after = change.added if want == PATCHED else None
            if found == want:
                after = current
        elif current is not None and change.hunks is not None:
            other = _other_side(change, found, current)
            after = current if found == want else other
        else:  # already in the wanted state, its diff not at hand
            after = current
        actions.append(FileAction(change.path, found, want, current, after))
    return Plan(site_packages=site_packages, state=state, actions=tuple(actions))


# ---------------------------------------------------------------------------
# Executing a plan atomically
# ---------------------------------------------------------------------------


def _atomic_write(target: Path, data: bytes, mode: int) -> None:
    """Replace ``target`` in one rename, keeping its owner (a new file takes its directory's owner)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The directory itself (stat follows /proc/self/fd/N to it), or the file's own entry.
    ref = os.lstat(target) if os.path.lexists(target) else os.stat(target.parent)
    owner = None
    if os.geteuid() == 0 and (ref.st_uid, ref.st_gid) != (os.getuid(), os.getgid()):
        owner = (ref.st_uid, ref.st_gid)
    atomic_write(str(target), data, mode, owner, prefix=".")


def _drop_bytecode(target: Path) -> None:
    cache = target.parent / "__pycache__"
    if cache.is_dir() and not cache.is_symlink():
        for pyc in cache.glob(f"{target.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


def _held_directory(site: Path, relative: str, held: list[int]) -> Path:
    """The directory of site/relative as a path through a descriptor held open (``/proc/self/fd/N``),
    reached from site-packages without following a symlink and created where missing.

    site-packages belongs to the service account: a directory below it swapped for a symlink would
    otherwise take the files root writes to wherever the link points."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(site, flags)
    held.append(fd)
    walked = site
    for part in Path(relative).parent.parts:
        walked = walked / part
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
            st = os.fstat(fd)
            if os.geteuid() == 0:  # a new directory takes its parent's owner, as a new file does
                os.chown(part, st.st_uid, st.st_gid, dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            pass
        try:
            fd = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as exc:
            raise UnsafeFileError(
                f"{walked} is a symlink or not a directory ({exc.strerror}); vLLM's own directories are never"
                " links: reinstall vLLM (vllm_install) and run again"
            ) from None
        held.append(fd)
    return Path(f"/proc/self/fd/{fd}")


def execute(plan_: Plan, *, write: Callable[[Path, bytes, int], None] = _atomic_write) -> list[str]:
    """Carry out ``plan_``; on any failure restore every file already changed, then re-raise."""
    site = Path(plan_.site_packages)
    done: list[tuple[Path, bytes | None, int]] = []
    changed: list[str] = []
    held: list[int] = []
    target = shown = site
    try:
        for action in plan_.actions:
            if not action.changes:
                continue
            shown = site / action.path
            target = _held_directory(site, action.path, held) / Path(action.path).name
            mode = target.stat().st_mode & 0o7777 if action.before is not None else 0o644
            # Recorded once changed: a write that failed left its file as it was (all or nothing),
            # so restoring it is not needed and must not be reported as failing.
            if action.after is None:
                target.unlink()
            else:
                write(target, action.after, mode)
            done.append((target, action.before, mode))
            _drop_bytecode(target)
            changed.append(action.path)
    except BaseException as exc:
        failures: list[str] = []
        for written, before, mode in reversed(done):
            try:
                if before is None:
                    written.unlink(missing_ok=True)
                else:
                    _atomic_write(written, before, mode)
            except OSError as restore_exc:  # pragma: no cover - double fault
                failures.append(f"{written}: {restore_exc}")
        if failures:  # pragma: no cover - double fault
            raise ChangeSetError(
                f"Writing failed ({exc}) and restoring failed too for: {'; '.join(failures)}. Reinstall vLLM."
            ) from exc
        if isinstance(exc, OSError):
            problem, remedy = write_problem(exc, str(shown))
            raise ChangeSetError(
                f"Writing {shown} failed ({problem}), every file was put back as it was: {remedy}"
            ) from exc
        if isinstance(exc, UnsafeFileError):
            raise ChangeSetError(f"Writing failed, every file was put back as it was: {exc}") from exc
        raise
    finally:
        for fd in held:
            os.close(fd)
    return changed


def record(changeset: ChangeSet, plan_: Plan) -> dict[str, object]:
    """What the module reports and stores beside the venv after a change."""
    return {
        "patchset": changeset.patchset,
        "vllm_version": changeset.vllm_version,
        "state": plan_.state,
        "manifest_sha256": changeset.manifest_sha256,
        "files": {a.path: (sha256_bytes(a.after) if a.after is not None else None) for a in plan_.actions},
    }


def unified_diff(path: str, before: bytes | None, after: bytes | None) -> dict[str, str]:
    """An Ansible ``diff`` entry for one file (text; empty for a missing file)."""
    return {
        "before_header": path,
        "after_header": path,
        "before": before.decode("utf-8", errors="replace") if before is not None else "",
        "after": after.decode("utf-8", errors="replace") if after is not None else "",
    }


def make_unified_diff(path: str, pristine: bytes, patched: bytes) -> str:
    """A ``diff -u`` style diff of one file that :func:`parse_unified_diff` reads back."""
    import difflib

    old = pristine.decode("utf-8")
    new = patched.decode("utf-8")
    if not old.endswith("\n") or not new.endswith("\n"):
        raise ChangeSetError(f"{path}: both versions must end with a newline.")
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
        n=3,
    )
    return "".join(lines)
