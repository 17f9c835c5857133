"""Installed vLLM venvs on a node: what a venv holds (read without importing vLLM), and pruning.

A venv per vLLM version lives at ``<root>/<version>``; the role writes a marker file
(``MARKER``) into it as the last step of a successful install, so a venv without the marker is an
interrupted install. Reading is done from files only (package metadata and source text), because
vLLM cannot be imported where torch cannot load (no GPU, or installed with ``--no-deps``).

Standard library and ``ansible.module_utils`` only: this runs on managed nodes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ansible.module_utils.safe_io import UnsafeFileError, loads_json, read_json, read_regular
from ansible.module_utils.vllm_releases import (
    Detected,
    detect_features,
    imports_for,
    metadata_version,
    parse_version,
    requirements_for,
)

MARKER = ".vllm-install.json"
_SITE_RE = re.compile(r"^python3\.\d+$")

# A marker is a few hundred bytes; vLLM's largest source file is well below 64 MiB.
MAX_READ_BYTES = 4 * 1024 * 1024
MAX_SOURCE_BYTES = 64 * 1024 * 1024


def find_site_packages(venv: str) -> str | None:
    """``<venv>/lib/python3.X/site-packages`` that holds vLLM (or the first one), else None."""
    lib = os.path.join(venv, "lib")
    if not os.path.isdir(lib):
        return None
    candidates = sorted(
        os.path.join(lib, name, "site-packages")
        for name in os.listdir(lib)
        if _SITE_RE.match(name) and os.path.isdir(os.path.join(lib, name, "site-packages"))
    )
    for site in candidates:
        if os.path.isdir(os.path.join(site, "vllm")):
            return site
    return candidates[0] if candidates else None


def find_dist_info(site: str, name: str = "vllm") -> str | None:
    """The ``<name>-<version>.dist-info`` directory in ``site``, or None."""
    wanted = name.lower().replace("-", "_")
    matches = sorted(
        entry
        for entry in os.listdir(site)
        if entry.endswith(".dist-info") and entry.split("-", 1)[0].lower().replace("-", "_") == wanted
    )
    return os.path.join(site, matches[-1]) if matches else None


def _reader(site: str):
    def read(rel: str) -> str | None:
        path = os.path.join(site, rel)
        try:
            return read_regular(path, MAX_SOURCE_BYTES, follow=True).decode("utf-8", "replace")
        except (FileNotFoundError, NotADirectoryError, UnsafeFileError):
            return None

    return read


@dataclass(frozen=True)
class VenvState:
    """What a venv holds, read from its files."""

    venv: str
    exists: bool
    python: str | None
    site_packages: str | None
    version: str | None
    complete: bool
    marker: dict[str, object] | None
    detected: Detected | None
    present: tuple[str, ...]
    missing: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "venv": self.venv,
            "exists": self.exists,
            "python": self.python,
            "site_packages": self.site_packages,
            "version": self.version,
            "complete": self.complete,
            "marker": self.marker,
            "detected": self.detected.as_dict() if self.detected else None,
            "present": list(self.present),
            "missing": list(self.missing),
        }


def read_marker(venv: str) -> dict[str, object] | None:
    path = os.path.join(venv, MARKER)
    try:
        data = read_json(path, MAX_READ_BYTES)
    except (FileNotFoundError, NotADirectoryError, UnsafeFileError):
        return None
    return data if isinstance(data, dict) else None


def read_venv(venv: str, method: str) -> VenvState:
    """Read ``venv``: vLLM's version from its metadata, and the files ``method`` needs."""
    exists = os.path.isdir(venv)
    python = os.path.join(venv, "bin", "python")
    site = find_site_packages(venv) if exists else None
    version = None
    detected = None
    present: list[str] = []
    missing: list[str] = []
    if site is not None:
        dist = find_dist_info(site)
        metadata = None
        if dist is not None:
            metadata = _reader(dist)("METADATA")
            version = metadata_version(metadata) if metadata else None
        read = _reader(site)
        if version is not None:
            detected = detect_features(read, metadata)
            for rel, symbol in requirements_for(method):
                text = read(rel)
                label = f"{rel}: {symbol}"
                if text is not None and symbol in text:
                    present.append(label)
                else:
                    missing.append(label if text is not None else f"{rel} (file missing)")
    marker = read_marker(venv) if exists else None
    complete = bool(marker) and version is not None and marker.get("version") == version
    return VenvState(
        venv=venv,
        exists=exists,
        python=python if os.path.exists(python) else None,
        site_packages=site,
        version=version,
        complete=complete,
        marker=marker,
        detected=detected,
        present=tuple(present),
        missing=tuple(missing),
    )


def import_check_code(method: str) -> str:
    """Python source that imports what ``method`` needs and prints one JSON line of results."""
    pairs = json.dumps([list(p) for p in imports_for(method)])
    return (
        "import importlib, json\n"
        "out = {}\n"
        f"for mod, name in {pairs}:\n"
        "    try:\n"
        "        getattr(importlib.import_module(mod), name)\n"
        "        out[mod + '.' + name] = 'ok'\n"
        "    except Exception as exc:\n"
        "        out[mod + '.' + name] = type(exc).__name__ + ': ' + str(exc)[:300]\n"
        "print(json.dumps(out))\n"
    )


def import_check_user(euid: int, owners: list[tuple[int, int]]) -> tuple[int, int] | None:
    """Whom the import check runs as: None (as we are) unless we are root and a directory of the
    venv (its root, then site-packages) belongs to another user, whose (uid, gid) it is then. The
    venv belongs to the service account: as root, its bin/python or a .pth file it planted in
    site-packages would run as root."""
    if euid != 0:
        return None
    return next(((uid, gid) for uid, gid in owners if uid != 0), None)


def as_user(argv: list[str], user: tuple[int, int] | None) -> list[str]:
    """``argv`` run as ``user`` (uid, gid) with no supplementary groups (util-linux setpriv), or as is."""
    if user is None:
        return argv
    uid, gid = user
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]


def parse_import_result(stdout: str) -> dict[str, str]:
    """The JSON line ``import_check_code`` printed (last line of stdout), or raise ValueError."""
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("the import check printed nothing")
    # Printed by the venv's Python, which the service account owns: bounded and checked like a file.
    data = loads_json(lines[-1][: 1024 * 1024], "the import check's output")
    if not isinstance(data, dict):
        raise ValueError("the import check printed something other than a JSON object")
    return {str(k): str(v) for k, v in data.items()}


# --- pruning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VenvEntry:
    version: str
    path: str
    complete: bool
    installed_at: str


def list_venvs(root: str) -> list[VenvEntry]:
    """Directories under ``root`` named like a release (``0.20.1``), with their marker state."""
    if not os.path.isdir(root):
        return []
    entries: list[VenvEntry] = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            parse_version(name)
        except ValueError:
            continue
        marker = read_marker(path)
        entries.append(
            VenvEntry(
                version=name,
                path=path,
                complete=bool(marker) and marker.get("version") == name,
                installed_at=str(marker.get("installed_at", "")) if marker else "",
            )
        )
    return entries


def plan_prune(entries: list[VenvEntry], current: str, history: list[str], keep: int) -> list[VenvEntry]:
    """Venvs to remove so that ``keep`` complete venvs stay: the current one first, then the
    most recently used (``history``, newest first), then the most recently installed.

    Interrupted installs (no marker) other than the current version are always removed.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the current venv), not {keep}")
    complete = [e for e in entries if e.complete]
    rank: dict[str, int] = {}
    for index, version in enumerate([current, *history]):
        rank.setdefault(version, index)

    ranked = sorted((e for e in complete if e.version in rank), key=lambda e: rank[e.version])
    others = sorted(
        (e for e in complete if e.version not in rank),
        key=lambda e: (e.installed_at, parse_version(e.version)),
        reverse=True,
    )
    kept = {e.version for e in [*ranked, *others][:keep]}
    kept.add(current)
    return [e for e in entries if e.version not in kept]


def updated_history(history: list[str], current: str, existing: list[str]) -> list[str]:
    """``current`` first, then the previous history, keeping only versions still installed."""
    out = [current]
    for version in history:
        if version not in out and version in existing:
            out.append(version)
    return out
