#!/usr/bin/python
"""Ansible module: what a vLLM venv holds, read from its files (optionally imported)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_venv_info
short_description: Read an installed vLLM's version and check what DFlash/DDTree need, without importing it
description:
  - Reads the vLLM version from the package metadata in the venv's site-packages and checks that
    the files and classes the speculative method needs are there (DFlash proposer, the DFlash
    drafter model and its registry entry; tree attention for DDTree). vLLM is not imported, so this
    works where torch cannot load (no GPU, or vLLM installed with C(--no-deps)).
  - With O(verify_import), also imports those classes in the venv's Python (needs torch and a
    working CUDA stack; use on GPU nodes). Run as root on a venv that another user owns (the
    service account), the import runs as that user (setpriv, no supplementary groups), so nothing
    that user can change in the venv runs as root.
  - Also reports what the files say about the release (torch pin, aux-layer fix, sliding layers).
version_added: "1.0.0"
extends_documentation_fragment:
  - attributes
  - attributes.read_only
options:
  venv:
    description: The venv directory, such as C(/opt/vllm/0.20.1).
    type: path
    required: true
  method:
    description: The speculative method whose files must be present.
    type: str
    choices: [dflash, ddtree]
    default: dflash
  expected_version:
    description: Fail unless the venv holds exactly this vLLM version.
    type: str
  require:
    description:
      - Fail when the venv has no vLLM, a different version than O(expected_version), or misses a
        required file or class. False only reports (used to decide whether to install).
    type: bool
    default: true
  verify_import:
    description: Also import the required classes with the venv's Python.
    type: bool
    default: false
  import_timeout:
    description: Seconds the import check may take.
    type: int
    default: 300
author:
  - dflash-deploy maintainers
"""

EXAMPLES = r"""
- name: Check the installed vLLM has what DDTree needs
  vllm_venv_info:
    venv: /opt/vllm/0.20.1
    method: ddtree
    expected_version: "0.20.1"

- name: Only report what a venv holds
  vllm_venv_info:
    venv: /opt/vllm/0.20.1
    require: false
  check_mode: true
"""

RETURN = r"""
exists:
  description: The venv directory exists.
  type: bool
  returned: always
  sample: true
version:
  description: The vLLM version in the venv's package metadata, or null.
  type: str
  returned: always
  sample: "0.20.1"
complete:
  description: The install finished (the role's marker names this version).
  type: bool
  returned: always
  sample: true
marker:
  description: The install marker the role wrote, or null.
  type: dict
  returned: always
  sample: {"version": "0.20.1", "installed_at": "2026-11-30T08:00:00Z"}
site_packages:
  description: The site-packages directory holding vLLM.
  type: str
  returned: always
  sample: /opt/vllm/0.20.1/lib/python3.11/site-packages
python:
  description: The venv's Python, or null.
  type: str
  returned: always
  sample: /opt/vllm/0.20.1/bin/python
detected:
  description: What the files say about the release (null when no vLLM is installed).
  type: dict
  returned: always
  sample: {"version": "0.20.1", "torch": "2.11.0", "dflash": true, "aux_offset_fixed": false,
           "sliding": "silent_full", "tree_attention": true}
present:
  description: Required files and classes found.
  type: list
  elements: str
  returned: always
  sample: ["vllm/v1/spec_decode/dflash.py: class DFlashProposer"]
missing:
  description: Required files and classes not found.
  type: list
  elements: str
  returned: always
  sample: []
imports:
  description: Result per imported class (C(ok) or the error), when O(verify_import) is true.
  type: dict
  returned: when verify_import is true
  sample: {"vllm.v1.spec_decode.dflash.DFlashProposer": "ok"}
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.vllm_releases import METHODS
from ansible.module_utils.vllm_venvs import (
    as_user,
    import_check_code,
    import_check_user,
    parse_import_result,
    read_venv,
)

ARGUMENT_SPEC = {
    "venv": {"type": "path", "required": True},
    "method": {"type": "str", "choices": list(METHODS), "default": "dflash"},
    "expected_version": {"type": "str"},
    "require": {"type": "bool", "default": True},
    "verify_import": {"type": "bool", "default": False},
    "import_timeout": {"type": "int", "default": 300},
}


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    state = read_venv(p["venv"], p["method"])
    result = {"changed": False, **state.as_dict()}
    result.pop("venv")
    if p["require"]:
        if not state.exists or state.version is None:
            module.fail_json(
                msg=f"{p['venv']} holds no installed vLLM (no vllm-*.dist-info in its site-packages); "
                "install it with the vllm_install role",
                **result,
            )
        if p["expected_version"] and state.version != p["expected_version"]:
            module.fail_json(
                msg=f"{p['venv']} holds vLLM {state.version}, not {p['expected_version']}; "
                "remove the venv and run the vllm_install role again",
                **result,
            )
        if state.missing:
            module.fail_json(
                msg=f"vLLM {state.version} in {p['venv']} lacks what {p['method']} needs: "
                + "; ".join(state.missing)
                + ". Pick a release that has it (see docs/vllm_install.md)",
                **result,
            )
    if p["verify_import"]:
        if state.python is None:
            module.fail_json(msg=f"{p['venv']} has no bin/python to import vLLM with", **result)
        owners = [(st.st_uid, st.st_gid) for st in map(os.stat, filter(None, [p["venv"], state.site_packages]))]
        user = import_check_user(os.geteuid(), owners)
        argv = ["timeout", str(p["import_timeout"]), state.python, "-c", import_check_code(p["method"])]
        env = {"LC_ALL": "C", "PYTHONDONTWRITEBYTECODE": "1"}
        if user is not None:  # the service account's HOME, not root's, for anything the import writes
            env["HOME"] = p["venv"]
        rc, out, err = module.run_command(as_user(argv, user), environ_update=env)
        try:
            imports = parse_import_result(out)
        except ValueError as exc:
            module.fail_json(
                msg=f"importing vLLM with {state.python} failed (rc {rc}): {exc}; stderr: {err[-2000:]}",
                **result,
            )
        result["imports"] = imports
        failed = {k: v for k, v in imports.items() if v != "ok"}
        if failed and p["require"]:
            module.fail_json(
                msg="vLLM is installed but these do not import: "
                + "; ".join(f"{k} ({v})" for k, v in failed.items())
                + ". Check torch and the CUDA driver on this node (vllm_install_no_deps must be false)",
                **result,
            )
    module.exit_json(**result)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
