#!/usr/bin/python
"""Ansible module: validate safetensors headers and describe the tensors, without reading tensor data."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: safetensors_info
short_description: Validate a safetensors checkpoint from its headers and list its tensors
description:
  - Reads only the 8-byte header length and the JSON header of each C(.safetensors) file, never the
    tensor data, so the time taken does not depend on the size of the weights.
  - Validates that the header length is sane (at most 100 MiB and inside the file), that the header is a
    JSON object, that every dtype is known, that shape times dtype size equals each tensor's byte span,
    and that the spans are contiguous, do not overlap and end exactly at the end of the file (a truncated
    download is caught). C(__metadata__) must be a map of strings.
  - For a sharded checkpoint (a directory with C(model.safetensors.index.json)) every shard the index
    names must exist and hold exactly the tensors the index maps to it.
  - Fails with a message that says what is wrong and what to do; never changes anything.
version_added: "1.0.0"
author: drafter_config maintainers
extends_documentation_fragment:
  - attributes
  - attributes.read_only
options:
  path:
    description:
      - A C(.safetensors) file, or a directory holding either one C(.safetensors) file or shards plus
        C(model.safetensors.index.json).
    type: path
    required: true
  checksum:
    description:
      - C(sha256) also streams every file and returns its SHA-256 digest (this reads the whole file).
    type: str
    choices: [none, sha256]
    default: none
notes:
  - Needs only the Python standard library on the managed node.
"""

EXAMPLES = r"""
- name: Validate the staged drafter and list its tensors
  safetensors_info:
    path: /opt/models/Qwen3.6-27B-DFlash
  register: drafter_weights

- name: Validate a sharded target and hash every shard
  safetensors_info:
    path: /opt/models/Qwen3.6-27B
    checksum: sha256
  check_mode: false
  register: target_weights

- name: Works unchanged in check mode
  safetensors_info:
    path: /opt/models/Qwen3.6-27B-DFlash/model.safetensors
  check_mode: true
"""

RETURN = r"""
tensors:
  description: Every tensor, by name, with its dtype, shape and the file that holds it.
  returned: success
  type: dict
  sample: {"fc.weight": {"dtype": "BF16", "shape": [5120, 25600], "file": "model.safetensors"}}
total_parameters:
  description: Sum of the element counts of all tensors.
  returned: success
  type: int
  sample: 1730000000
total_bytes:
  description: Sum of the tensors' byte sizes (headers excluded).
  returned: success
  type: int
  sample: 3460000000
dtypes:
  description: Number of parameters per dtype.
  returned: success
  type: dict
  sample: {"BF16": 1730000000}
files:
  description: Each file read, with its size, header size, tensor count and, when asked, SHA-256.
  returned: success
  type: list
  elements: dict
  sample: [{"path": "/opt/models/d/model.safetensors", "size": 3460012345, "header_bytes": 12345,
            "tensors": 58}]
metadata:
  description: The files' C(__metadata__) maps merged.
  returned: success
  type: dict
  sample: {"format": "pt"}
index:
  description: Path of the shard index read, or null for a single file.
  returned: success
  type: str
  sample: /opt/models/Qwen3.6-27B/model.safetensors.index.json
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.safetensors_header import SafetensorsError, inspect_path

ARGUMENT_SPEC = {
    "path": {"type": "path", "required": True},
    "checksum": {"type": "str", "choices": ["none", "sha256"], "default": "none"},
}


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    if not module.params["path"]:
        module.fail_json(msg="path is empty; give a .safetensors file or the directory that holds the weights")
    try:
        checkpoint = inspect_path(module.params["path"], module.params["checksum"])
    except SafetensorsError as exc:
        module.fail_json(msg=str(exc))
    for warning in checkpoint.warnings:
        module.warn(warning)
    module.exit_json(changed=False, **checkpoint.summary())


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
