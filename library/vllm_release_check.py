#!/usr/bin/python
"""Ansible module: check a vLLM release against this project's release knowledge base."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_release_check
short_description: Refuse vLLM releases and setups known to break DFlash or DDTree
description:
  - Looks the vLLM release up in the project's release knowledge base (module_utils/vllm_releases.py,
    read off the real release wheels) and combines it with the target (hybrid or not), the drafter
    (sliding-window layers or not), the speculative method and this project's ddtree_patch change set.
  - Fails with every refusal, each a sentence with the reason and the fix. Warnings are reported
    with C(module.warn) and returned.
  - Reads and changes nothing on the host.
version_added: "1.0.0"
extends_documentation_fragment:
  - attributes
  - attributes.read_only
options:
  version:
    description: The exact vLLM release to be installed, such as C(0.20.1).
    type: str
    required: true
  method:
    description: The speculative method the service will run.
    type: str
    choices: [dflash, ddtree]
    default: dflash
  hybrid_target:
    description: The target model has recurrent (Gated DeltaNet / Mamba) layers, as Qwen3.5/3.6 do.
    type: bool
    default: false
  sliding_drafter:
    description: The drafter's config marks some layers C(sliding_attention) (Qwen3.6 DFlash drafters).
    type: bool
    default: false
  ddtree_patch:
    description: This project's ddtree_patch role will apply its change set to this release.
    type: bool
    default: false
  patch_fixes:
    description:
      - What ddtree_patch's change set fixes in this release (C(aux_layer_offset), C(sliding_drafter),
        C(ddtree), C(hybrid_tree), C(prompt_as_decode)), as the C(fixes) of its base descriptor ddtree/vllm-<release>/base.json
        list them (vllm_install passes them). Counted only when O(ddtree_patch) is true.
    type: list
    elements: str
    default: []
  ddtree_bases:
    description:
      - The vLLM releases ddtree_patch has a change set for (one ddtree/vllm-<release>/ folder each), offered
        as a fix in refusals.
    type: list
    elements: str
    default: []
  num_speculative_tokens:
    description: Draft tokens per step, where known.
    type: int
  allow_unknown:
    description: Install a release the knowledge base does not know, with a warning instead of a refusal.
    type: bool
    default: false
author:
  - dflash-deploy maintainers
"""

EXAMPLES = r"""
- name: Refuse a vLLM release that cannot serve this drafter
  vllm_release_check:
    version: "0.20.1"
    method: ddtree
    hybrid_target: true
    sliding_drafter: true
    ddtree_patch: true
    patch_fixes: [aux_layer_offset, sliding_drafter, ddtree, hybrid_tree, prompt_as_decode]
    ddtree_bases: ["0.20.1"]

- name: Only report (check mode changes nothing either way)
  vllm_release_check:
    version: "0.30.0"
    method: dflash
  check_mode: true
"""

RETURN = r"""
release:
  description: The knowledge-base row covering the version, or null for an unknown release.
  type: dict
  returned: always
  sample:
    since: "0.20.0"
    before: "0.21.0"
    torch: "2.11.0"
    dflash: true
    aux_offset_fixed: false
    sliding: silent_full
    tree_attention: true
    bugs: [aux_layer_offset, sliding_silent_full]
    verified: ["0.20.0", "0.20.1"]
    notes: ""
torch:
  description: The torch release this vLLM release pins, where known.
  type: str
  returned: always
  sample: "2.11.0"
refusals:
  description: Why this setup is refused, each with the fix.
  type: list
  elements: str
  returned: always
  sample: []
warnings_found:
  description: Known problems that do not stop the install, each with what to do.
  type: list
  elements: str
  returned: always
  sample: ["vLLM releases before 0.30.0, reportedly including 0.20.1, can collapse ..."]
notes_found:
  description: Known problems this deployment already handles (the change set fixes them, or the roles always avoid them); not printed as warnings.
  type: list
  elements: str
  returned: always
  sample: ["vLLM 0.20.1 feeds the DFlash drafter one target layer too early ...; ddtree_patch fixes it here ..."]
findings:
  description: Every finding with its level (refuse, warn or note) and a stable code.
  type: list
  elements: dict
  returned: always
  sample: [{"level": "warn", "code": "fa3-aot-cuda-graphs", "message": "..."}]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.vllm_releases import (
    METHODS,
    PATCH_FIXES,
    Request,
    evaluate,
    find_release,
    notes,
    parse_version,
    refusals,
    warnings,
)

ARGUMENT_SPEC = {
    "version": {"type": "str", "required": True},
    "method": {"type": "str", "choices": list(METHODS), "default": "dflash"},
    "hybrid_target": {"type": "bool", "default": False},
    "sliding_drafter": {"type": "bool", "default": False},
    "ddtree_patch": {"type": "bool", "default": False},
    "patch_fixes": {"type": "list", "elements": "str", "default": []},
    "ddtree_bases": {"type": "list", "elements": "str", "default": []},
    "num_speculative_tokens": {"type": "int"},
    "allow_unknown": {"type": "bool", "default": False},
}


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    unknown = sorted(set(p["patch_fixes"]) - set(PATCH_FIXES))
    if unknown:
        module.fail_json(
            msg=f"patch_fixes names {', '.join(unknown)}, which ddtree_patch does not fix; "
            f"use only {', '.join(PATCH_FIXES)}"
        )
    for base in p["ddtree_bases"]:
        try:
            parse_version(base)
        except ValueError as exc:
            module.fail_json(msg=f"ddtree_bases names {base!r}: {exc}")
    fixes = frozenset(p["patch_fixes"]) if p["ddtree_patch"] else frozenset()
    if p["num_speculative_tokens"] is not None and p["num_speculative_tokens"] < 1:
        module.fail_json(msg=f"num_speculative_tokens is {p['num_speculative_tokens']}; it must be at least 1")
    findings = evaluate(
        Request(
            version=p["version"],
            method=p["method"],
            hybrid_target=p["hybrid_target"],
            sliding_drafter=p["sliding_drafter"],
            patch_fixes=fixes,
            patch_releases=tuple(p["ddtree_bases"]),
            num_speculative_tokens=p["num_speculative_tokens"],
            allow_unknown=p["allow_unknown"],
        )
    )
    row = None
    try:
        parse_version(p["version"])
        row = find_release(p["version"])
    except ValueError:
        row = None
    result = {
        "changed": False,
        "release": row.as_dict() if row else None,
        "torch": row.torch if row else None,
        "refusals": [f.message for f in refusals(findings)],
        "warnings_found": [f.message for f in warnings(findings)],
        "notes_found": [f.message for f in notes(findings)],
        "findings": [f.as_dict() for f in findings],
    }
    for finding in warnings(findings):
        module.warn(finding.message)
    if result["refusals"]:
        count = len(result["refusals"])
        head = f"vLLM {p['version']} is refused for this deployment ({count} reason{'s' if count > 1 else ''})"
        module.fail_json(msg=head + ": " + " | ".join(result["refusals"]), **result)
    module.exit_json(**result)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
