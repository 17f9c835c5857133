"""The vLLM bases the engine builds on, read from their descriptors (``vllm-<release>/base.json``).

A base is one vLLM release with this engine's change set for it: the manifest (and the diffs and
added files it names), and ``base.json``, which says as data what the rest of the project must know
about that release: the manifest's digest (what the ddtree_patch role consumes), what the change set
fixes there (what vllm_install's release check is told), the request features DDTree refuses on it,
which recurrent layers get branch-local tree state, and its scheduler and CUDA-graph rules. Adding a
base is adding its folder; nothing outside it names a release.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ddtree import HOME

DESCRIPTOR = "base.json"


def releases() -> list[str]:
    """Every release with a base folder here, oldest first."""
    found = [p.parent.name.removeprefix("vllm-") for p in HOME.glob(f"vllm-*/{DESCRIPTOR}")]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def folder(release: str) -> Path:
    return HOME / f"vllm-{release}"


def load(release: str) -> dict[str, Any]:
    """The descriptor of ``release``; KeyError naming the known ones when there is none."""
    path = folder(release) / DESCRIPTOR
    if not path.is_file():
        raise KeyError(f"no vLLM base {release} in {HOME} (there are: {', '.join(releases()) or 'none'})")
    return json.loads(path.read_text(encoding="utf-8"))


def manifest_sha256(release: str) -> str:
    """The digest of the manifest as it is on disk (what vllm_patch reports as manifest_sha256)."""
    manifest = folder(release) / load(release)["changeset"]["manifest"]
    return hashlib.sha256(manifest.read_bytes()).hexdigest()
