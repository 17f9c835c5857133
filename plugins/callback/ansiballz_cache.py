"""Keeps ansible-core's AnsiballZ payload cache from one ansible-playbook run to the next.

Before a module first runs, ansible-core builds its payload (the module plus every module_util it
imports, found by compiling each one's source) and caches it in the run's own temporary directory
(``DEFAULT_LOCAL_TMP/ansiballz_cache``), which is deleted when the run ends. Each distinct module
costs 0.1-0.5 CPU-seconds to build: about 4 CPU-seconds of every site.yml run (18 modules), a
third of an idempotent run on one node (issue 25). ansible-core has no setting to keep it.

At the start of a run this links that directory to a persistent one beside the run's temporary
directory (the user's ``local_tmp``, mode 0700), named by a digest of everything a payload is
built from: the ansible-core version and its location, the Python version, and the path and
content of every file in the configured module and module_utils directories and in roles'
``library``/``module_utils``. A change to any of them gives a new directory, so a payload is never
reused across a change to its sources; older directories are removed. ansible-core's own locking
and atomic writes keep concurrent runs safe. Anything that goes wrong leaves the run with its
ordinary per-run cache. Nothing about what runs, or its output, changes; no options, loaded without
being listed in ``callbacks_enabled``.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: ansiballz_cache
type: aggregate
short_description: keep module payloads built by earlier runs
description:
  - Links the run's AnsiballZ cache to a persistent directory keyed by a digest of ansible-core and
    every module and module_utils source, so a module's payload is built once, not once per run.
requirements:
  - in the callback plugin path (ansible.cfg callback_plugins); it needs no enabling
"""

import hashlib
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ansible
from ansible import constants as C
from ansible.module_utils.ansible_release import __version__ as ansible_version
from ansible.plugins.callback import CallbackBase

PREFIX = "ansiballz-"
KEEP = 8  # persistent caches kept (the newest); each is a few MB


def source_dirs(
    module_paths: Iterable[str], module_utils_paths: Iterable[str], roles_paths: Iterable[str]
) -> list[Path]:
    """Every existing directory a payload's sources can come from, in a stable order."""
    dirs = [Path(p) for p in (*module_paths, *module_utils_paths)]
    for roles in roles_paths:
        root = Path(roles)
        if root.is_dir():
            dirs += sorted(d for r in root.iterdir() for d in (r / "library", r / "module_utils"))
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def cache_key(dirs: Iterable[Path], salt: Iterable[str]) -> str:
    """A digest of the salt and of the path and content of every regular file under dirs."""
    h = hashlib.sha256()
    for part in salt:
        h.update(part.encode() + b"\0")
    for d in dirs:
        for f in sorted(p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(f.resolve()).encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:24]


def link_cache(run_tmp: Path, key: str, keep: int = KEEP) -> Path | None:
    """Point run_tmp/ansiballz_cache at the persistent cache for key; the persistent directory, or
    None where the run already has a cache of its own (then it is left as it is)."""
    link = run_tmp / "ansiballz_cache"
    if os.path.lexists(link):
        return None
    store = run_tmp.parent / f"{PREFIX}{key}"
    store.mkdir(mode=0o700, exist_ok=True)
    st = store.stat()
    if store.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None  # payloads are unpickled: only a private directory of this user is trusted
    os.utime(store)  # the newest are kept
    link.symlink_to(store, target_is_directory=True)
    others = sorted(
        (p for p in run_tmp.parent.glob(f"{PREFIX}*") if p != store and p.is_dir() and not p.is_symlink()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in others[keep - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
    return store


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "ansiballz_cache"
    CALLBACK_NEEDS_ENABLED = False

    def v2_playbook_on_start(self, playbook: Any) -> None:
        try:
            dirs = source_dirs(C.DEFAULT_MODULE_PATH, C.DEFAULT_MODULE_UTILS_PATH, C.DEFAULT_ROLES_PATH)
            salt = [ansible_version, os.path.dirname(ansible.__file__), sys.version]
            store = link_cache(Path(C.DEFAULT_LOCAL_TMP), cache_key(dirs, salt))
        except OSError as exc:
            self._display.vvv(f"ansiballz_cache: per-run payload cache only ({exc})")
            return
        if store is not None:
            self._display.vvv(f"ansiballz_cache: module payloads kept in {store}")
