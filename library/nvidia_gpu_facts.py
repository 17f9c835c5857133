#!/usr/bin/python
"""Ansible module: read-only NVIDIA GPU facts and problems for a GPU node (LXC container or host)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_gpu_facts
short_description: Read-only NVIDIA GPU facts and preflight problems for a GPU node
description:
  - Runs C(nvidia-smi) structured queries (C(LC_ALL=C), C(--format=csv,noheader,nounits)) and
    returns per-GPU facts, the kernel module and userspace driver versions, the C(/dev/nvidia*)
    device nodes with their majors, the result of a CUDA init smoke test where C(libcuda) exists,
    and who holds the GPUs (memory used, compute apps, local processes with C(/dev/nvidia*) open and
    their systemd units).
  - Never fails because of what it finds; it returns the problems, one operator sentence each,
    grouped by check in C(checks), for the caller to assert on. It fails only on bad parameters.
  - Inside an LXC container C(nvidia-smi --query-compute-apps) reports host pids; a compute app is
    mapped to a local process only when a local process with that pid has the same name.
extends_documentation_fragment:
  - attributes
  - attributes.read_only
options:
  nvidia_smi_path:
    description: The nvidia-smi executable. Default is C(nvidia-smi) found in PATH.
    type: path
  driver_version_path:
    description: File holding the kernel module version (C(NVRM version:) line).
    type: path
    default: /proc/driver/nvidia/version
  dev_dir:
    description: Directory holding the C(nvidia*) device nodes.
    type: path
    default: /dev
  proc_dir:
    description: The proc filesystem (process scan for holders, C(devices) for majors).
    type: path
    default: /proc
  cuda_smoke_test:
    description: Run cuInit(0) through C(libcuda) in a child process where the library exists.
    type: bool
    default: true
  libcuda:
    description: Name or path of the CUDA driver library for the smoke test.
    type: str
    default: libcuda.so.1
  timeout:
    description: Seconds each nvidia-smi call and the smoke test may take, 1 to 3600.
    type: int
    default: 60
  thresholds:
    description:
      - Limits to evaluate (keys as in C(evaluate_thresholds) of module_utils/nvidia_gpu.py); each
        is optional.
    type: dict
    default: {}
    suboptions:
      gpu_count:
        description: At least this many GPUs.
        type: int
      min_memory_mib:
        description: Memory of every GPU at least this (MiB).
        type: int
      min_compute_capability:
        description: Lowest compute capability, as C(major.minor).
        type: str
      max_memory_used_mib:
        description: Memory in use on any GPU at most this, unless only swappable units hold it.
        type: int
      swappable_units:
        description: systemd units whose GPU memory the deployment frees (the engine it replaces).
        type: list
        elements: str
        default: []
      memory_needed_mib:
        description: GPU memory the deployment needs in total (target + drafter + KV budget).
        type: int
      memory_utilization:
        description: Fraction of each GPU the engine may use.
        type: float
        default: 1.0
author:
  - Speculative decoding deployment maintainers
"""

EXAMPLES = r"""
- name: Read GPU facts and evaluate the inventory's thresholds
  nvidia_gpu_facts:
    thresholds:
      gpu_count: 2
      min_memory_mib: 45000
      min_compute_capability: "8.6"
      max_memory_used_mib: 1024
      swappable_units: [sglang-qwen.service]
  register: gpu

- name: Same in check mode (it only reads)
  nvidia_gpu_facts:
    driver_version_path: /var/lib/lab-fakes/proc-driver-nvidia-version
  check_mode: true
  register: gpu
"""

RETURN = r"""
ok:
  description: True when no check found a problem.
  returned: always
  type: bool
  sample: true
problems:
  description: Every problem, one operator sentence each (what is wrong, what to do).
  returned: always
  type: list
  elements: str
  sample: ["/dev/nvidia-uvm is missing: nvidia-smi works without it but every CUDA program fails ..."]
warnings_found:
  description: Non-fatal findings (also emitted as warnings).
  returned: always
  type: list
  elements: str
checks:
  description: Problems grouped by check (nvidia_smi, driver, device_nodes, cuda, gpu_count,
    memory_total, compute_capability, memory_used, memory_needed); an empty list means it passed.
  returned: always
  type: dict
  sample: {"nvidia_smi": [], "driver": [], "device_nodes": [], "cuda": [], "gpu_count": []}
nvidia_smi:
  description: Path used, whether it ran, and the classified failure if it failed.
  returned: always
  type: dict
  sample: {"path": "/usr/bin/nvidia-smi", "ok": false, "rc": 18,
           "error": {"kind": "driver-mismatch", "message": "...", "library_version": "580.126"}}
gpus:
  description: Per GPU facts.
  returned: always
  type: list
  elements: dict
  sample: [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-5173b07a-0d44-bc21-3393-ff7bfaf497d5",
            "pci_bus_id": "00000000:00:06.0", "driver_version": "580.159.04", "memory_total_mib": 143771,
            "memory_used_mib": 0, "memory_free_mib": 143156, "compute_capability": "9.0"}]
gpu_count:
  description: Number of GPUs nvidia-smi reports.
  returned: always
  type: int
  sample: 1
driver:
  description: Kernel module version (driver_version_path) and userspace versions (nvidia-smi).
  returned: always
  type: dict
  sample: {"kernel": "580.159.04", "userspace": "580.159.04", "nvml": "580.159", "cuda": "13.0",
           "match": true}
device_nodes:
  description: Each expected /dev/nvidia* node, null when absent, else character device flag, major, minor.
  returned: always
  type: dict
  sample: {"/dev/nvidiactl": {"char": true, "major": 195, "minor": 255}, "/dev/nvidia-uvm": null}
majors:
  description: NVIDIA character device majors from /proc/devices (empty when the driver is not loaded).
  returned: always
  type: dict
  sample: {"nvidia": 195, "nvidia-uvm": 238}
cuda_init:
  description: The CUDA init smoke test; status is passed, failed or not available (no libcuda).
  returned: always
  type: dict
  sample: {"status": "not available", "code": null, "name": null, "ok": null, "message": ""}
holders:
  description: Who holds the GPUs.
  returned: always
  type: dict
  sample: {"memory_used_mib": {"0": 3380}, "compute_apps": [{"pid": 812, "process_name": "python3",
           "used_memory_mib": 3380, "gpu_uuid": "GPU-..."}],
           "local": [{"pid": 812, "comm": "python3", "unit": "sglang-qwen.service",
                      "devices": ["/dev/nvidia0", "/dev/nvidiactl"]}]}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_gpu_probe import Runner, gather

THRESHOLD_OPTIONS = {
    "gpu_count": {"type": "int"},
    "min_memory_mib": {"type": "int"},
    "min_compute_capability": {"type": "str"},
    "max_memory_used_mib": {"type": "int"},
    "swappable_units": {"type": "list", "elements": "str", "default": []},
    "memory_needed_mib": {"type": "int"},
    "memory_utilization": {"type": "float", "default": 1.0},
}


# An hour: nvidia-smi answers in seconds; longer is a hang that the timeout must end.
MAX_TIMEOUT_S = 3600


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "nvidia_smi_path": {"type": "path"},
            "driver_version_path": {"type": "path", "default": "/proc/driver/nvidia/version"},
            "dev_dir": {"type": "path", "default": "/dev"},
            "proc_dir": {"type": "path", "default": "/proc"},
            "cuda_smoke_test": {"type": "bool", "default": True},
            "libcuda": {"type": "str", "default": "libcuda.so.1"},
            "timeout": {"type": "int", "default": 60},
            "thresholds": {"type": "dict", "default": {}, "options": THRESHOLD_OPTIONS},
        },
        supports_check_mode=True,
    )


class ModuleRunner(Runner):
    """Runs commands through AnsibleModule.run_command and reports warnings with module.warn."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module

    def run(self, argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
        # errors="replace": non-UTF-8 output must not reach the controller as lone surrogates.
        return self.module.run_command(argv, environ_update=env, check_rc=False, errors="replace")

    def which(self, name: str) -> str | None:
        return self.module.get_bin_path(name)

    def warn(self, message: str) -> None:
        self.module.warn(message)


def main() -> None:
    module = build_module()
    if module.params["timeout"] < 1:
        module.fail_json(msg=f"timeout must be at least 1 second, got {module.params['timeout']} (0 would mean none).")
    if module.params["timeout"] > MAX_TIMEOUT_S:
        module.fail_json(
            msg=f"timeout must be at most {MAX_TIMEOUT_S} seconds, got {module.params['timeout']}: a GPU query that"
            " takes longer hangs."
        )
    for name in ("nvidia_smi_path", "driver_version_path", "dev_dir", "proc_dir", "libcuda"):
        if "\x00" in (module.params[name] or ""):
            module.fail_json(msg=f"{name} holds a NUL character, which no path can hold; check {name}.")
    thresholds = module.params["thresholds"] or {}
    util = thresholds.get("memory_utilization")
    if util is not None and not 0 < util <= 1:
        module.fail_json(msg=f"thresholds.memory_utilization must be in (0, 1], got {util}: use e.g. 0.9.")
    for key in ("gpu_count", "min_memory_mib", "max_memory_used_mib", "memory_needed_mib"):
        if thresholds.get(key) is not None and thresholds[key] < 0:
            module.fail_json(msg=f"thresholds.{key} must not be negative, got {thresholds[key]}.")
    cc = thresholds.get("min_compute_capability")
    if cc is not None and not cc.replace(".", "", 1).isdigit():
        module.fail_json(msg=f"thresholds.min_compute_capability must look like 8.6, got {cc!r}.")
    result = gather(ModuleRunner(module), module.params)
    for warning in result["warnings_found"]:
        module.warn(warning)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
