#!/usr/bin/python
"""Ansible module: list the per-version vLLM venvs on a node and remove the ones beyond a count."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_venvs
short_description: Keep the current vLLM venv and the most recent ones, remove older ones
description:
  - Lists the venvs under O(root) named like a vLLM release (C(0.20.1)).
  - Keeps O(current) and, up to O(keep) venvs in all, the most recently used ones (O(history),
    newest first), then the most recently installed. Removes the others, and interrupted installs
    (no install marker) of any version but O(current), with their node wheelhouse directories.
  - Never touches anything under O(root) that is not named like a release.
version_added: "1.0.0"
extends_documentation_fragment:
  - attributes
options:
  root:
    description: The directory holding one venv per version.
    type: path
    default: /opt/vllm
  current:
    description: The version now installed and in use; never removed.
    type: str
    required: true
  history:
    description: Versions used before, newest first (from the local fact).
    type: list
    elements: str
    default: []
  keep:
    description: How many complete venvs to keep, the current one included (at least 1).
    type: int
    default: 2
  wheelhouse_root:
    description: Per-version wheelhouse directories (C(<wheelhouse_root>/<version>)) removed with their venv.
    type: path
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
author:
  - dflash-deploy maintainers
"""

EXAMPLES = r"""
- name: Keep the current venv and the one before it
  vllm_venvs:
    root: /opt/vllm
    current: "0.22.0"
    history: ["0.20.1"]
    keep: 2

- name: Show what would be removed
  vllm_venvs:
    current: "0.22.0"
    keep: 1
  check_mode: true
"""

RETURN = r"""
venvs:
  description: The venvs that remain (or would remain in check mode), newest release first.
  type: list
  elements: dict
  returned: always
  sample: [{"version": "0.22.0", "path": "/opt/vllm/0.22.0", "complete": true, "installed_at": "..."}]
removed:
  description: Paths removed (or that would be removed in check mode).
  type: list
  elements: str
  returned: always
  sample: ["/opt/vllm/0.19.1"]
"""

import os
import shutil

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.safe_io import write_problem
from ansible.module_utils.vllm_releases import parse_version
from ansible.module_utils.vllm_venvs import MARKER, list_venvs, plan_prune

ARGUMENT_SPEC = {
    "root": {"type": "path", "default": "/opt/vllm"},
    "current": {"type": "str", "required": True},
    "history": {"type": "list", "elements": "str", "default": []},
    "keep": {"type": "int", "default": 2},
    "wheelhouse_root": {"type": "path"},
}


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)


def _remove(module: AnsibleModule, path: str, removed: list[str]) -> None:
    """Remove one pruned tree; a file that cannot go (chattr +i, a read-only mount) is named, no traceback.

    The install marker goes first, so a tree that stops half-way reads as an interrupted install
    (never a complete venv) and the next run removes the rest.
    """
    failed: list[tuple[str, OSError]] = []
    marker = os.path.join(path, MARKER)
    try:
        os.unlink(marker)
    except FileNotFoundError:
        pass  # a wheel directory, or an install interrupted before its marker
    except OSError as exc:
        failed.append((marker, exc))
    if not failed:
        # rmtree unlinks relative to a directory descriptor: the full path comes as the callback's argument.
        shutil.rmtree(path, onerror=lambda _f, where, info: failed.append((where, info[1])))
    if failed:
        where, exc = failed[0]
        problem, remedy = write_problem(exc, where)
        done = removed[: removed.index(path)]
        module.fail_json(
            msg=f"cannot remove {path}: {where}: {problem}; it is partly removed (it is not the current venv):"
            f" {remedy}",
            removed=done,
        )


def run(module: AnsibleModule) -> None:
    p = module.params
    if p["keep"] < 1:
        module.fail_json(msg=f"keep is {p['keep']}; it must be at least 1 (the current venv)")
    try:
        parse_version(p["current"])
    except ValueError as exc:
        module.fail_json(msg=f"current: {exc}")
    entries = list_venvs(p["root"])
    doomed = plan_prune(entries, p["current"], p["history"], p["keep"])
    removed: list[str] = []
    for entry in doomed:
        removed.append(entry.path)
        if p["wheelhouse_root"]:
            wheels = os.path.join(p["wheelhouse_root"], entry.version)
            if os.path.isdir(wheels) and not os.path.islink(wheels):
                removed.append(wheels)
    if removed and not module.check_mode:
        for path in removed:
            _remove(module, path, removed)
    remaining = sorted((e for e in entries if e not in doomed), key=lambda e: parse_version(e.version), reverse=True)
    result = {
        "changed": bool(removed),
        "removed": removed,
        "venvs": [
            {"version": e.version, "path": e.path, "complete": e.complete, "installed_at": e.installed_at}
            for e in remaining
        ],
    }
    if module._diff:
        result["diff"] = {
            "before": "".join(f"{e.path}\n" for e in entries),
            "after": "".join(f"{e.path}\n" for e in remaining),
        }
    module.exit_json(**result)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
