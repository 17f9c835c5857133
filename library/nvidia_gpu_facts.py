#!/usr/bin/python
"""Ansible module: read-only NVIDIA GPU facts and problems for a GPU node (LXC container or host)."""

from __future__ import annotations

import os
import stat
import sys

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_gpu import (
    QUERY_APPS_FIELDS,
    QUERY_GPU_FIELDS,
    NvidiaParseError,
    check_device_nodes,
    check_driver_versions,
    classify_nvidia_smi_failure,
    cuda_init_result,
    evaluate_thresholds,
    expected_device_nodes,
    merge_app_holders,
    parse_compute_apps,
    parse_kernel_driver_version,
    parse_proc_devices,
    parse_query_gpu,
    parse_smi_version,
    summarize_holders,
)

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
    description: Seconds each nvidia-smi call and the smoke test may take.
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
attributes:
  check_mode:
    support: full
    description: Read-only; runs the same in check mode.
  diff_mode:
    support: none
    description: Changes nothing, so there is nothing to diff.
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

THRESHOLD_OPTIONS = {
    "gpu_count": {"type": "int"},
    "min_memory_mib": {"type": "int"},
    "min_compute_capability": {"type": "str"},
    "max_memory_used_mib": {"type": "int"},
    "swappable_units": {"type": "list", "elements": "str", "default": []},
    "memory_needed_mib": {"type": "int"},
    "memory_utilization": {"type": "float", "default": 1.0},
}

CUDA_PROBE = """
import ctypes, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError:
    print("absent")
    sys.exit(0)
print(lib.cuInit(0))
"""


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


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def stat_node(path: str) -> dict | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(info.st_mode):
        return {"char": False, "major": None, "minor": None}
    return {"char": True, "major": os.major(info.st_rdev), "minor": os.minor(info.st_rdev)}


def scan_processes(proc_dir: str) -> tuple[list[dict], dict[int, dict]]:
    """Raw data of every local process: fd targets, comm and cgroup (skipping ones that vanish)."""
    processes = []
    local: dict[int, dict] = {}
    me = os.getpid()
    try:
        entries = os.listdir(proc_dir)
    except OSError:
        return processes, local
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        base = os.path.join(proc_dir, entry)
        comm = (read_text(os.path.join(base, "comm")) or "").strip()
        cgroup = read_text(os.path.join(base, "cgroup")) or ""
        local[pid] = {"comm": comm, "cgroup": cgroup}
        targets = []
        try:
            fds = os.listdir(os.path.join(base, "fd"))
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(os.path.join(base, "fd", fd))
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                targets.append(target)
        if targets:
            processes.append({"pid": pid, "comm": comm, "fd_targets": targets, "cgroup": cgroup})
    return processes, local


def limited(module: AnsibleModule, argv: list[str]) -> list[str]:
    """Prefix coreutils timeout so a hung driver cannot hang the play (exit 124 on expiry)."""
    timeout = module.get_bin_path("timeout")
    return [timeout, "--kill-after=5", str(module.params["timeout"]), *argv] if timeout else argv


def run_smi(module: AnsibleModule, path: str, args: list[str]) -> tuple[int, str, str]:
    return module.run_command(
        limited(module, [path, *args]),
        environ_update={"LC_ALL": "C", "LANG": "C"},
        check_rc=False,
    )


def cuda_smoke_test(module: AnsibleModule, libcuda: str) -> int | None:
    rc, out, err = module.run_command(
        limited(module, [sys.executable, "-c", CUDA_PROBE, libcuda]),
        environ_update={"LC_ALL": "C"},
        check_rc=False,
    )
    text = out.strip()
    if text == "absent":
        return None
    if rc == 0 and text.lstrip("-").isdigit():
        return int(text)
    # the probe crashed or hung inside libcuda: report it as CUDA's unknown error
    module.warn(f"CUDA smoke test did not finish cleanly (exit {rc}): {err.strip()[:300]}")
    return 999


def gather(module: AnsibleModule) -> dict:
    params = module.params
    checks: dict[str, list[str]] = {"nvidia_smi": [], "driver": [], "device_nodes": [], "cuda": []}
    warnings: list[str] = []

    kernel_text = read_text(params["driver_version_path"])
    kernel = parse_kernel_driver_version(kernel_text) if kernel_text is not None else None
    if kernel_text is None:
        checks["driver"].append(
            f"{params['driver_version_path']} cannot be read: the NVIDIA kernel module is not loaded on the "
            "host. Load it on the Proxmox host (modprobe nvidia, or install the driver there) first."
        )
    elif kernel is None:
        checks["driver"].append(
            f"{params['driver_version_path']} has no 'NVRM version' line with a version: is it the "
            "NVIDIA driver's version file?"
        )

    path = params["nvidia_smi_path"] or module.get_bin_path("nvidia-smi") or "nvidia-smi"
    smi: dict = {"path": path, "ok": False, "rc": None, "error": None}
    gpus: list[dict] = []
    apps: list[dict] = []
    versions: dict[str, str] = {}
    runnable = os.path.isfile(path) and os.access(path, os.X_OK)
    if not runnable:
        smi["error"] = classify_nvidia_smi_failure("", None, path, kernel)
    else:
        rc, out, err = run_smi(
            module, path, [f"--query-gpu={','.join(QUERY_GPU_FIELDS)}", "--format=csv,noheader,nounits"]
        )
        smi["rc"] = rc
        if rc != 0:
            smi["error"] = classify_nvidia_smi_failure(out + err, rc, path, kernel)
        else:
            try:
                gpus = parse_query_gpu(out)
                rc, out, err = run_smi(
                    module,
                    path,
                    [f"--query-compute-apps={','.join(QUERY_APPS_FIELDS)}", "--format=csv,noheader,nounits"],
                )
                if rc == 0:
                    apps = parse_compute_apps(out)
                else:
                    warnings.append(
                        f"nvidia-smi --query-compute-apps failed (exit {rc}): {(out + err).strip()[:200]}"
                    )
            except NvidiaParseError as exc:
                smi["error"] = {
                    "kind": "unparsable",
                    "message": f"nvidia-smi output could not be read ({exc}): is {path} the real nvidia-smi?",
                    "library_version": None,
                }
            else:
                smi["ok"] = True
        vrc, vout, _ = run_smi(module, path, ["--version"])
        versions = parse_smi_version(vout) if vrc == 0 else {}
    if smi["error"]:
        checks["nvidia_smi"].append(smi["error"]["message"])
    if smi["ok"] and not gpus:
        checks["nvidia_smi"].append("nvidia-smi ran but listed no GPU: pass the GPUs into the container.")

    userspace = versions.get("nvidia_smi")
    if userspace is None and smi["error"] and smi["error"].get("library_version"):
        userspace = smi["error"]["library_version"]
    if smi["error"] is None or smi["error"]["kind"] != "driver-mismatch":
        checks["driver"].extend(check_driver_versions(kernel, userspace))
    driver = {
        "kernel": kernel,
        "userspace": userspace,
        "nvml": versions.get("nvml"),
        "cuda": versions.get("cuda"),
        "match": kernel is not None and userspace is not None and kernel == userspace,
    }

    majors = parse_proc_devices(read_text(os.path.join(params["proc_dir"], "devices")) or "")
    majors = {k: v for k, v in majors.items() if k.startswith("nvidia")}
    indices = [g["index"] for g in gpus]
    if not indices:  # nvidia-smi could not tell: look at what is there
        try:
            names = os.listdir(params["dev_dir"])
        except OSError:
            names = []
        indices = sorted(int(n[6:]) for n in names if n.startswith("nvidia") and n[6:].isdigit())
    nodes = {}
    for node in expected_device_nodes(indices):
        nodes[node] = stat_node(os.path.join(params["dev_dir"], node[len("/dev/") :]))
    node_problems, node_warnings = check_device_nodes(nodes, indices, majors)
    checks["device_nodes"].extend(node_problems)
    warnings.extend(node_warnings)

    uvm_ok = bool(nodes.get("/dev/nvidia-uvm"))
    code = cuda_smoke_test(module, params["libcuda"]) if params["cuda_smoke_test"] else None
    cuda = cuda_init_result(code, uvm_ok)
    if cuda["ok"] is False:
        checks["cuda"].append(cuda["message"])

    processes, local = scan_processes(params["proc_dir"])
    holders_local = merge_app_holders(summarize_holders(processes), apps, local)
    holders = {
        "memory_used_mib": {str(g["index"]): g["memory_used_mib"] for g in gpus},
        "compute_apps": apps,
        "local": holders_local,
    }

    checks.update(evaluate_thresholds({"gpus": gpus, "holders": holders_local}, params["thresholds"] or {}))
    problems = [p for group in checks.values() for p in group]
    return {
        "ok": not problems,
        "problems": problems,
        "warnings_found": warnings,
        "checks": checks,
        "nvidia_smi": smi,
        "gpus": gpus,
        "gpu_count": len(gpus),
        "driver": driver,
        "device_nodes": nodes,
        "majors": majors,
        "cuda_init": cuda,
        "holders": holders,
    }


def main() -> None:
    module = build_module()
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
    result = gather(module)
    for warning in result["warnings_found"]:
        module.warn(warning)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
