#!/usr/bin/python
"""Ansible module: check, on the container host, that an LXC/Proxmox container config passes the GPUs in."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: lxc_gpu_config
short_description: Check that an LXC or Proxmox container config passes NVIDIA GPUs into the container
description:
  - Runs on the container host (the Proxmox node). Reads the container's config and checks that
    C(/dev/nvidiactl), C(/dev/nvidia-uvm) and enough C(/dev/nvidiaN) reach the container, either as
    PVE 8.1+ C(devN:) entries or as C(lxc.mount.entry) bind mounts whose device numbers an
    C(lxc.cgroup2.devices.allow) line allows. Each bound source is looked up on the host (it must be
    a character device; C(nvidia-uvm) must have the major in the host's C(/proc/devices)).
  - Warns on mount entries marked C(optional) (the container then starts without the GPU) and on
    cgroup v1 allow lines. Never fails because of what it finds; returns the problems.
  - Fails when the config file cannot be read, saying where it looked.
extends_documentation_fragment:
  - attributes
  - attributes.read_only
options:
  config_path:
    description:
      - The container's config, C(/etc/pve/lxc/<vmid>.conf) on Proxmox, C(/var/lib/lxc/<name>/config)
        for plain LXC.
    type: path
    required: true
  gpu_count:
    description: How many C(/dev/nvidiaN) the container must get; not checked when omitted.
    type: int
  proc_devices_path:
    description: The host's device major list.
    type: path
    default: /proc/devices
author:
  - Speculative decoding deployment maintainers
"""

EXAMPLES = r"""
- name: Check the container config on its Proxmox host
  lxc_gpu_config:
    config_path: /etc/pve/lxc/{{ gpu_check_proxmox_vmid }}.conf
    gpu_count: 2
  delegate_to: "{{ gpu_check_proxmox_host }}"
  register: ct

- name: Plain LXC, in check mode
  lxc_gpu_config:
    config_path: /var/lib/lxc/lab-1/config
  check_mode: true
"""

RETURN = r"""
ok:
  description: True when the config passes every needed GPU device in.
  returned: always
  type: bool
  sample: true
problems:
  description: One operator sentence per problem.
  returned: always
  type: list
  elements: str
  sample: ["The container config does not pass /dev/nvidia-uvm into the container: ..."]
warnings_found:
  description: Non-fatal findings (optional mount entries, cgroup v1 lines), also emitted as warnings.
  returned: always
  type: list
  elements: str
devices:
  description: Each GPU device node the config passes in, and how.
  returned: always
  type: dict
  sample: {"/dev/nvidia0": "lxc.mount.entry (line 14)", "/dev/nvidiactl": "dev0 (line 3)"}
sources:
  description: Host device nodes the config names, null when absent.
  returned: always
  type: dict
  sample: {"/dev/nvidia0": {"char": true, "major": 195, "minor": 0}}
uvm_major:
  description: The host's nvidia-uvm major from /proc/devices, null when the module is not loaded.
  returned: always
  type: int
  sample: 238
config:
  description: The parsed GPU-relevant lines (allow rules, mount entries, devN entries).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_gpu_probe import (
    LXC_GPU_CONFIG_ARGS,
    ContainerConfigUnreadable,
    check_container_config_file,
)


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=LXC_GPU_CONFIG_ARGS, supports_check_mode=True)


def main() -> None:
    module = build_module()
    gpu_count = module.params["gpu_count"]
    if gpu_count is not None and gpu_count < 0:
        module.fail_json(msg=f"gpu_count must not be negative, got {gpu_count}.")
    try:
        result = check_container_config_file(
            module.params["config_path"], gpu_count, module.params["proc_devices_path"]
        )
    except ContainerConfigUnreadable as exc:
        module.fail_json(msg=str(exc))
    for warning in result["warnings_found"]:
        module.warn(warning)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
