#!/usr/bin/python
"""Apply or remove the project's hash-verified change set on the vLLM installed in a venv."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_patch
short_description: Apply or remove a hash-verified change set (DDTree, DFlash fixes) on an installed vLLM
description:
  - Finds vLLM in O(venv) from its dist-info METADATA, without importing it (no torch needed).
  - Loads the change set kept for that exact vLLM release under O(changeset_root)
    (C(vllm-<version>/manifest.json)), or from O(manifests) and O(sources) passed in (what the
    controller side of this module does; no change-set file is copied to the node). A release
    without a change set is refused.
  - With O(manifests), files are first judged by digest alone; when a change is needed and a diff or
    added file it needs is not in O(sources), the module fails with nothing changed and names them
    in RV(missing_sources) (the controller side then sends exactly those and runs it again).
  - Every file the change set touches must be exactly pristine (the release's sha256) or exactly patched
    (this change set's sha256). Anything else is refused and nothing is changed.
  - Computes every file in memory, verifies it, then replaces the files atomically; any failure puts
    back every file already written. Files already carrying the change set are left alone.
  - O(state=absent) restores the release's pristine bytes exactly and removes added files.
  - Records what it did in C(<venv>/vllm-changeset.json).
extends_documentation_fragment:
  - attributes
options:
  venv:
    description: The virtual environment that holds vLLM (the directory with C(bin/) and C(lib/)).
    type: path
    required: true
  state:
    description: V(present) applies the change set, V(absent) restores pristine vLLM.
    type: str
    choices: [present, absent]
    default: present
  patchset:
    description: Name of the change set; it must match the manifest kept for the installed release.
    type: str
    default: ddtree
  changeset_root:
    description:
      - Directory on the node holding C(vllm-<version>/) change sets.
      - Exactly one of O(changeset_root) and O(manifests) is required.
    type: path
  manifests:
    description:
      - The change sets' C(manifest.json) texts, keyed by vLLM release (C(0.20.1)).
      - The controller side fills it from O(changeset_src).
    type: dict
  sources:
    description:
      - Diffs and added files of the change set, base64, keyed by their path relative to the
        change-set root (as the manifest names them). Only with O(manifests).
    type: dict
    default: {}
  changeset_src:
    description:
      - Directory on the controller holding C(vllm-<version>/) change sets (the role's C(files/)).
      - Read by the controller side, which sends O(manifests) and, only when something must
        change, the O(sources) the change needs.
    type: path
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
author:
  - dflash-deploy
"""

EXAMPLES = r"""
- name: Apply the DDTree change set kept on the controller to vLLM 0.20.1
  vllm_patch:
    venv: /opt/vllm/0.20.1
    changeset_src: ddtree
    state: present

- name: Apply a change set already on the node
  vllm_patch:
    venv: /opt/vllm/0.20.1
    changeset_root: /var/lib/dflash-deploy/changesets

- name: Show what would change, touching nothing
  vllm_patch:
    venv: /opt/vllm/0.20.1
    changeset_root: /var/lib/dflash-deploy/changesets
  check_mode: true
  diff: true

- name: Put pristine vLLM back
  vllm_patch:
    venv: /opt/vllm/0.20.1
    changeset_root: /var/lib/dflash-deploy/changesets
    state: absent
"""

RETURN = r"""
vllm_version:
  description: Version read from vLLM's dist-info METADATA.
  type: str
  returned: always
  sample: 0.20.1
site_packages:
  description: The site-packages directory that holds vLLM.
  type: str
  returned: always
  sample: /opt/vllm/0.20.1/lib/python3.12/site-packages
patchset:
  description: The change set applied or removed.
  type: str
  returned: always
  sample: ddtree
manifest_sha256:
  description: sha256 of the change set's manifest.json.
  type: str
  returned: always
  sample: feb6fb598c1635a28c8be9558309404e4161448dee012ea7f63087d292e0af97
files_before:
  description: State of each file before the run (pristine, patched or missing).
  type: dict
  returned: always
  sample: {"vllm/config/speculative.py": "pristine", "vllm/v1/spec_decode/ddtree.py": "missing"}
changed_files:
  description: Files written or removed (in check mode, the ones that would be).
  type: list
  elements: str
  returned: always
  sample: ["vllm/config/speculative.py"]
patch_state:
  description: State of vLLM after the run, V(present) or V(absent).
  type: str
  returned: always
  sample: present
check_mode:
  description: Whether this run only reported what it would change.
  type: bool
  returned: always
  sample: false
missing_sources:
  description: Change-set files a needed change lacks (only when it fails for that reason).
  type: list
  elements: str
  returned: failure
  sample: ["vllm-0.20.1/patches/vllm__config__vllm.py.diff"]
sources_sent:
  description: Change-set files the controller side sent to the node (with O(changeset_src)).
  type: list
  elements: str
  returned: when O(changeset_src) is used
  sample: []
record_path:
  description: JSON record of the last change written beside the venv.
  type: str
  returned: always
  sample: /opt/vllm/0.20.1/vllm-changeset.json
"""

import base64
import binascii
import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.safe_io import UnsafeFileError, atomic_write, read_regular, write_problem
from ansible.module_utils.vllm_changeset import (
    ABSENT,
    PRESENT,
    RECORD_NAME,
    ChangeSetError,
    SourcesNeeded,
    execute,
    find_vllm,
    load_changeset,
    load_inline_changeset,
    plan,
    record,
    unified_diff,
)


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec=dict(
            venv=dict(type="path", required=True),
            state=dict(type="str", default=PRESENT, choices=[PRESENT, ABSENT]),
            patchset=dict(type="str", default="ddtree"),
            changeset_root=dict(type="path"),
            manifests=dict(type="dict"),
            sources=dict(type="dict", default={}),
        ),
        mutually_exclusive=[("changeset_root", "manifests")],
        required_one_of=[("changeset_root", "manifests")],
        supports_check_mode=True,
    )


def decode_sources(sources: dict) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, value in sources.items():
        try:
            out[str(name)] = base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ChangeSetError(f"sources[{name!r}] is not base64 ({exc}); send each file base64-encoded.") from exc
    return out


def _read_record(path: str) -> str | None:
    try:
        return read_regular(path, 4 * 1024 * 1024).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except UnsafeFileError:
        return ""  # not a regular file: replaced by the write (a rename, never through it)


def run(module: AnsibleModule) -> dict:
    params = module.params
    install = find_vllm(params["venv"])
    if params["manifests"] is not None:
        manifests = {str(k): str(v) for k, v in params["manifests"].items()}
        changeset = load_inline_changeset(
            manifests, decode_sources(params["sources"]), install.version, params["patchset"]
        )
    else:
        if params["sources"]:
            raise ChangeSetError("sources go with manifests; with changeset_root the files are read on the node.")
        changeset = load_changeset(params["changeset_root"], install.version, params["patchset"])
    the_plan = plan(changeset, install.site_packages, params["state"])
    record_path = os.path.join(params["venv"], RECORD_NAME)
    text = json.dumps(record(changeset, the_plan), indent=2, sort_keys=True) + "\n"
    # A record that a failed write left missing or stale is written again even when no file changes.
    present = params["state"] == PRESENT
    record_stale = _read_record(record_path) != text if present else os.path.lexists(record_path)
    result: dict = {
        "changed": the_plan.changed or record_stale,
        "vllm_version": install.version,
        "site_packages": install.site_packages,
        "patchset": changeset.patchset,
        "manifest_sha256": changeset.manifest_sha256,
        "files_before": the_plan.file_states(),
        "changed_files": the_plan.changed_paths,
        "patch_state": params["state"],
        "record_path": record_path,
        "check_mode": module.check_mode,
    }
    if module._diff:
        result["diff"] = [unified_diff(a.path, a.before, a.after) for a in the_plan.actions if a.changes]
    if (the_plan.changed or record_stale) and not module.check_mode:
        execute(the_plan)
        if params["state"] == PRESENT:
            try:
                atomic_write(record_path, text, 0o644, prefix=".")
            except OSError as exc:
                problem, remedy = write_problem(exc, record_path)
                raise ChangeSetError(
                    f"vLLM was patched but its record {record_path} could not be written ({problem}); {remedy}"
                ) from None
        elif os.path.lexists(record_path):
            try:
                os.unlink(record_path)
            except OSError as exc:
                problem, remedy = write_problem(exc, record_path)
                raise ChangeSetError(
                    f"vLLM's files were put back but its record {record_path} could not be removed ({problem});"
                    f" {remedy}"
                ) from None
    return result


def main() -> None:
    module = build_module()
    try:
        result = run(module)
    except SourcesNeeded as exc:
        module.fail_json(msg=str(exc), missing_sources=exc.sources)
    except ChangeSetError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:  # a path the module cannot use (too long, a loop of links): named, no traceback
        where = exc.filename or module.params["venv"]
        paths = "the venv and changeset_root paths" if module.params["changeset_root"] else "the venv's path"
        module.fail_json(msg=f"{str(where)[:300]}: {exc.strerror or exc}; check {paths}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
