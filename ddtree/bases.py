"""The vLLM bases the engine builds on, read from their descriptors (``vllm-<release>/base.json``).

A base is one vLLM release with this engine's change set for it: the manifest (and the diffs and
added files it names), and ``base.json``, which says as data what the rest of the project must know
about that release: the manifest's digest (what the ddtree_patch role consumes), what the change set
fixes there (what vllm_install's release check is told), the request features DDTree refuses on it,
which recurrent layers get branch-local tree state, and its scheduler and CUDA-graph rules. Adding a
base is adding its folder; nothing outside it names a release. Reading and checking a descriptor is
module_utils/ddtree_base.py's, which the Ansible side's filters use too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ddtree import HOME, repo

_base = repo.module_util("ddtree_base")
DESCRIPTOR = _base.DESCRIPTOR


def releases() -> list[str]:
    """Every release with a base folder here, oldest first."""
    return _base.releases(HOME)


def folder(release: str) -> Path:
    return HOME / f"vllm-{release}"


def load(release: str) -> dict[str, Any]:
    """The descriptor of ``release``; ValueError naming the known ones when there is none."""
    return _base.load(HOME, release)


def rules(release: str):
    """The rules the Ansible side computes with (module_utils/ddtree_base.py BaseRules), checked."""
    return _base.load_rules(HOME, release)


def manifest_sha256(release: str) -> str:
    """The digest of the manifest as it is on disk (what vllm_patch reports as manifest_sha256)."""
    manifest = folder(release) / load(release)["changeset"]["manifest"]
    return hashlib.sha256(manifest.read_bytes()).hexdigest()
