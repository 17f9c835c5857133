#!/usr/bin/python
"""Ansible module: write a DFlash drafter's config.json inferred from its weights and its target."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_config
short_description: Write a DFlash drafter's config.json from its tensor shapes and its target model
description:
  - Reads the drafter's safetensors header(s) (never the tensor data) and infers hidden size, draft layer
    count, attention heads, KV heads, head_dim, intermediate size, attention bias, dtype and the number of
    tapped target layers (from C(fc.weight)).
  - Reads the target's C(config.json) (including the nested C(text_config) of Qwen3.5/3.6) for layer
    count, vocabulary, rope settings, context length and norm epsilon, and the target's tokenizer for the
    mask token id (the first id past every token it knows).
  - Computes C(target_layer_ids) with DFlash's default rule (Python rounding) unless given.
  - Writes deterministic JSON (sorted keys, two-space indent, trailing newline); reports C(changed) only when
    the content (or the file attributes) change. Supports check mode, diff and backup.
  - Refuses, writing nothing, when the drafter does not fit the target (hidden size, layer ids, mask id,
    tensor layout) or when shapes cannot tell the attention layer pattern of a published drafter
    (Qwen3.6-27B-DFlash and Qwen3.5-27B-DFlash have the same shapes); then C(layer_types) is required.
version_added: "1.0.0"
author: drafter_config maintainers
options:
  drafter:
    description: The drafter's C(.safetensors) file, or a directory with one file or shards plus index.
    type: path
    required: true
  target:
    description: The target model directory (C(config.json) and tokenizer files).
    type: path
    required: true
  dest:
    description: Path of the config.json to write. Its directory must exist.
    type: path
    required: true
  block_size:
    description: Tokens per drafted block (the drafter was trained with one; shapes cannot tell it).
    type: int
    default: 16
  mask_token_id:
    description: Mask token id; by default the first id past the target tokenizer's tokens.
    type: int
  target_layer_ids:
    description: Target layers tapped by C(fc), one per tapped layer; by default DFlash's rule.
    type: list
    elements: int
  layer_types:
    description:
      - Attention type per draft layer, C(full_attention) or C(sliding_attention). Required where the
        drafter's shapes match published drafters with different patterns.
    type: list
    elements: str
  sliding_window:
    description: Window of the C(sliding_attention) layers; required when any layer slides.
    type: int
  backup:
    description: Keep a timestamped copy of the previous file when it changes.
    type: bool
    default: false
extends_documentation_fragment:
  - ansible.builtin.files
  - attributes
attributes:
  check_mode:
    support: full
    details: Computes the config and the diff, writes nothing.
  diff_mode:
    support: full
    details: Returns the old and new file content.
"""

EXAMPLES = r"""
- name: Write the drafter's config.json (check first)
  dflash_config:
    drafter: /opt/models/Qwen3.6-27B-DFlash
    target: /opt/models/Qwen3.6-27B
    dest: /opt/models/Qwen3.6-27B-DFlash/config.json
    layer_types: [sliding_attention, sliding_attention, sliding_attention, sliding_attention, full_attention]
    sliding_window: 2048
  check_mode: true
  diff: true

- name: Qwen3-8B drafter, explicit block size and backup
  dflash_config:
    drafter: /opt/models/Qwen3-8B-DFlash-b16/model.safetensors
    target: /opt/models/Qwen3-8B
    dest: /opt/models/Qwen3-8B-DFlash-b16/config.json
    block_size: 16
    backup: true
    mode: "0644"
"""

RETURN = r"""
config:
  description: The config written (or that would be written in check mode).
  returned: success
  type: dict
  sample: {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 248070,
           "target_layer_ids": [1, 16, 31, 46, 61]}, "hidden_size": 5120, "num_target_layers": 64}
inferred:
  description:
    - What was inferred and from where - drafter shapes, target values, layer ids and mask id with their
      source, the published drafter matched (or null) and any assumption made.
  returned: success
  type: dict
  sample: {"target_layer_ids_source": "DFlash default rule for 64 target layers and 5 draft layers",
           "published_match": "Qwen3.6-27B-DFlash", "assumptions": []}
dest:
  description: The file written.
  returned: success
  type: str
  sample: /opt/models/Qwen3.6-27B-DFlash/config.json
backup_file:
  description: The backup made, when C(backup) was set and the file changed.
  returned: changed and backup
  type: str
  sample: /opt/models/Qwen3.6-27B-DFlash/config.json.1234.2026-11-30@08:00:00~
"""

import contextlib
import os
import stat
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_drafter import DFlashConfigError, generate
from ansible.module_utils.safe_io import (
    UnsafeFileError,
    atomic_write,
    attributes_differ,
    parse_mode,
    read_regular,
    resolve_owner,
    set_attributes,
    write_problem,
)
from ansible.module_utils.safetensors_header import SafetensorsError, inspect_path

ARGUMENT_SPEC = {
    "drafter": {"type": "path", "required": True},
    "target": {"type": "path", "required": True},
    "dest": {"type": "path", "required": True},
    "block_size": {"type": "int", "default": 16},
    "mask_token_id": {"type": "int"},
    "target_layer_ids": {"type": "list", "elements": "int"},
    "layer_types": {"type": "list", "elements": "str"},
    "sliding_window": {"type": "int"},
    "backup": {"type": "bool", "default": False},
}


def build_module() -> AnsibleModule:
    # A copy: add_file_common_args adds the file options to the dict it is given.
    return AnsibleModule(argument_spec=dict(ARGUMENT_SPEC), supports_check_mode=True, add_file_common_args=True)


# A drafter's config.json is about 2 KiB.
MAX_CONFIG_BYTES = 1024 * 1024


def _read_existing(path: str) -> bytes | None:
    """The bytes of the config.json there now (None: absent); only a regular file, never through a link."""
    try:
        return read_regular(path, MAX_CONFIG_BYTES, f"the existing {path}")
    except FileNotFoundError:
        return None


def _backup(path: str, data: bytes, mode: int) -> str:
    """A copy of the old bytes beside ``path``, named as Ansible names backups, written safely."""
    backup = f"{path}.{os.getpid()}.{time.strftime('%Y-%m-%d@%H:%M:%S')}~"
    atomic_write(backup, data, mode & 0o7777)
    return backup


def run(module: AnsibleModule) -> None:
    p = module.params
    dest = p["dest"]
    for name in ("drafter", "target", "dest"):
        if not p[name] or "\x00" in p[name]:
            what = "is empty" if not p[name] else "holds a NUL character, which no path can hold"
            module.fail_json(msg=f"{name} {what}; give the path of the {name}")
    if os.path.isdir(dest):
        module.fail_json(msg=f"dest {dest} is a directory; give the path of the config.json file to write")
    parent = os.path.dirname(dest) or "."
    if not os.path.isdir(parent):
        module.fail_json(msg=f"the directory of dest, {parent}, does not exist; stage the drafter there first")
    try:
        checkpoint = inspect_path(p["drafter"])
        tensors = {name: (t.dtype, t.shape) for name, t in checkpoint.tensors.items()}
        text, config, report = generate(
            tensors,
            p["target"],
            block_size=p["block_size"],
            mask_token_id=p["mask_token_id"],
            target_layer_ids=p["target_layer_ids"],
            layer_types=p["layer_types"],
            sliding_window=p["sliding_window"],
        )
    except (SafetensorsError, DFlashConfigError) as exc:
        module.fail_json(msg=str(exc))
    for warning in checkpoint.warnings:
        module.warn(warning)
    for assumption in report["assumptions"]:
        module.warn(f"assumed {assumption}")

    try:
        raw = _read_existing(dest)
    except UnsafeFileError as exc:
        module.fail_json(msg=f"{exc}; nothing was read or written (dest must be a regular config.json)")
    # Owner, group and mode are set on a descriptor, never by path: the drafter directory belongs to
    # the service account, which could swap config.json for a link between a check and a chmod.
    current = os.lstat(dest) if raw is not None else None
    try:
        owner, mode = _wanted(module, current)
    except UnsafeFileError as exc:
        module.fail_json(msg=f"{exc}; nothing was written")
    before = None if raw is None else raw.decode("utf-8", "replace")
    changed = before != text
    attributes_change = current is not None and attributes_differ(current, owner, mode)
    result = {"config": config, "inferred": report, "dest": dest}
    if module._diff:
        result["diff"] = {
            "before": before or "",
            "after": text,
            "before_header": dest if before is not None else "(absent)",
            "after_header": dest,
        }
    if changed and not module.check_mode:
        backup = None
        try:
            if p["backup"] and raw is not None:
                backup = result["backup_file"] = _backup(dest, raw, os.lstat(dest).st_mode)
            atomic_write(
                dest,
                text,
                0o644 if mode is None else mode,
                None if owner == (-1, -1) else owner,
                prefix=".config.json.",
            )
        except (OSError, UnsafeFileError) as exc:
            if backup is not None:
                # dest kept its bytes: a backup of them beside it would only look like a change happened.
                with contextlib.suppress(OSError):
                    os.unlink(backup)
            if isinstance(exc, OSError):
                problem, remedy = write_problem(exc, dest)
            else:
                problem, remedy = str(exc), "fix that and run again"
            module.fail_json(msg=f"cannot write {dest} ({problem}); it was left as it was: {remedy}")
    elif attributes_change and not module.check_mode:
        try:
            set_attributes(dest, owner, mode, f"the existing {dest}")
        except (OSError, UnsafeFileError) as exc:
            problem = write_problem(exc, dest)[0] if isinstance(exc, OSError) else str(exc)
            module.fail_json(msg=f"cannot set the owner or mode of {dest} ({problem}); its content is current")
    changed = changed or attributes_change
    # SELinux context and chattr attributes, if asked for (owner, group and mode are done above).
    file_args = module.load_file_common_arguments(p, path=dest)
    file_args.update(owner=None, group=None, mode=None)
    if not (module.check_mode and not os.path.exists(dest)):
        changed = module.set_fs_attributes_if_different(file_args, changed)
    module.exit_json(changed=changed, **result)


def _wanted(module: AnsibleModule, current: os.stat_result | None) -> tuple[tuple[int, int], int | None]:
    """(uid, gid) (-1: as written) and mode (None: 0644 on a write, else as it is) from the file options."""
    p = module.params
    owner = resolve_owner(p["owner"], p["group"])
    if p["mode"] is None:
        return owner, None
    now = 0o644 if current is None else stat.S_IMODE(current.st_mode)
    return owner, parse_mode(p["mode"], now, _symbolic)


def _symbolic(now: int, text: str) -> int:
    return AnsibleModule._symbolic_mode_to_octal(os.stat_result((stat.S_IFREG | now,) + (0,) * 9), text)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
