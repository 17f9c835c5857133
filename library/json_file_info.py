#!/usr/bin/python
"""Ansible module: read one JSON file on the node, bounded and checked, and return its value."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: json_file_info
short_description: Read a JSON file on the node as a regular file, bounded in size and depth
description:
  - Reads one JSON file on the managed node and returns its parsed value in C(data). Use it instead of
    C(ansible.builtin.slurp) followed by C(b64decode | from_json) on the controller.
  - Opens only a regular file, without blocking (a FIFO is refused, never waited on; a directory or a
    device, such as C(/dev/zero) behind a symlink, is refused), and reads at most C(max_bytes).
  - The content must be UTF-8 JSON without C(NaN) or C(Infinity), at most 64 levels deep and without
    lone surrogate escapes. Every refusal names the file and says what to do; nothing is ever changed.
version_added: "1.0.0"
author: drafter_config maintainers
extends_documentation_fragment:
  - attributes
  - attributes.read_only
options:
  path:
    description: The JSON file to read.
    type: path
    required: true
  max_bytes:
    description:
      - The largest file read, in bytes (1 to 1073741824); a bigger one is refused. The default, 16 MiB, is
        the bound this project's other readers put on JSON files (C(MAX_JSON_BYTES) in C(safe_io)).
    type: int
    default: 16777216
  follow:
    description:
      - Read through a symlink to a regular file. On by default because a Hugging Face model directory
        holds its files as symlinks into C(blobs/); a link to anything but a regular file is refused either
        way, and nothing is ever written through it.
      - C(false) refuses a symlink at C(path), for files in directories another account can write to.
    type: bool
    default: true
  missing_ok:
    description:
      - An absent file (or a dangling symlink) returns C(exists=false) instead of failing.
    type: bool
    default: false
notes:
  - Needs only the Python standard library on the managed node.
"""

EXAMPLES = r"""
- name: Read the target's config.json
  json_file_info:
    path: /opt/models/Qwen3.6-27B/config.json
  check_mode: false
  register: target_config

- name: Read a local fact that earlier runs may not have written
  json_file_info:
    path: /etc/ansible/facts.d/service_swap.fact
    missing_ok: true
    follow: false
  check_mode: false
  register: swap_fact

- name: Works unchanged in check mode
  json_file_info:
    path: /opt/models/Qwen3.6-27B/model.safetensors.index.json
    max_bytes: 4194304
  check_mode: true
"""

RETURN = r"""
exists:
  description: Whether the file exists (always true unless C(missing_ok) is set).
  returned: success
  type: bool
  sample: true
data:
  description: The JSON value in the file (any JSON type); null when the file does not exist.
  returned: success
  type: raw
  sample: {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"num_hidden_layers": 64}}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.json_file import MAX_JSON_BYTES, UnsafeFileError, read_json_file

ARGUMENT_SPEC = {
    "path": {"type": "path", "required": True},
    "max_bytes": {"type": "int", "default": MAX_JSON_BYTES},
    "follow": {"type": "bool", "default": True},
    "missing_ok": {"type": "bool", "default": False},
}


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    try:
        found = read_json_file(p["path"], p["max_bytes"], p["follow"], p["missing_ok"])
    except UnsafeFileError as exc:
        module.fail_json(msg=str(exc))
    # No "path" key: AnsibleModule would add the file's owner, mode and size (lstat) to the result.
    module.exit_json(changed=False, exists=found.exists, data=found.data)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
