"""Gathering of NVIDIA GPU state on a node: runs nvidia-smi, reads /proc and /dev, probes CUDA.

The I/O half of the GPU checks (the pure half is nvidia_gpu.py). Standard library only and no
Ansible API: the caller passes a Runner (how to run a command), so the nvidia_gpu_facts module
and the GPU tests in tests/gpu/ (on a machine with an NVIDIA GPU, without Ansible) share it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from typing import Any

from ansible.module_utils.nvidia_gpu import (
    QUERY_APPS_FIELDS,
    QUERY_GPU_FIELDS,
    NvidiaParseError,
    check_container_config,
    check_device_nodes,
    check_driver_versions,
    classify_nvidia_smi_failure,
    cuda_init_result,
    cuda_smoke_test_failure,
    evaluate_thresholds,
    expected_device_nodes,
    merge_app_holders,
    parse_compute_apps,
    parse_kernel_driver_version,
    parse_lxc_config,
    parse_proc_devices,
    parse_query_gpu,
    parse_smi_version,
    summarize_holders,
)
from ansible.module_utils.safe_io import UnsafeFileError, read_regular
from ansible.module_utils.safe_io import read_text as read_safe_text


class Runner:
    """How commands run and warnings are reported; this default runs subprocesses directly."""

    def run(self, argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
        res = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, check=False)
        return res.returncode, res.stdout, res.stderr

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def warn(self, message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)


DEFAULTS: dict[str, Any] = {
    "nvidia_smi_path": None,
    "driver_version_path": "/proc/driver/nvidia/version",
    "dev_dir": "/dev",
    "proc_dir": "/proc",
    "cuda_smoke_test": True,
    "libcuda": "libcuda.so.1",
    "timeout": 60,
    "thresholds": {},
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


# /proc/driver/nvidia/version, /proc/devices, a process's comm and cgroup: a few KiB at most.
MAX_TEXT_BYTES = 1024 * 1024
# A container config is a few KiB; Proxmox keeps snapshots in the same file, still far below this.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def read_text(path: str) -> str | None:
    """A small text file from /proc (None: unreadable); a FIFO, a huge file or a NUL in the path never hangs or raises."""
    try:
        return read_regular(path, MAX_TEXT_BYTES, follow=True).decode("utf-8", "replace")
    except (OSError, ValueError):  # UnsafeFileError is a ValueError
        return None


def stat_node(path: str) -> dict | None:
    try:
        info = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in a path taken from a config file
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


def limited(runner: Runner, timeout: int, argv: list[str]) -> list[str]:
    """Prefix coreutils timeout so a hung driver cannot hang the caller (exit 124 on expiry)."""
    binary = runner.which("timeout")
    return [binary, "--kill-after=5", str(timeout), *argv] if binary else argv


def run_smi(runner: Runner, timeout: int, path: str, args: list[str]) -> tuple[int, str, str]:
    return runner.run(limited(runner, timeout, [path, *args]), {"LC_ALL": "C", "LANG": "C"})


def cuda_smoke_test(runner: Runner, timeout: int, libcuda: str) -> int | None:
    rc, out, err = runner.run(limited(runner, timeout, [sys.executable, "-c", CUDA_PROBE, libcuda]), {"LC_ALL": "C"})
    text = out.strip()
    if text == "absent":
        return None
    if rc == 0 and text.lstrip("-").isdigit():
        return int(text)
    # the probe crashed or hung inside libcuda: report it as CUDA's unknown error
    runner.warn(cuda_smoke_test_failure(rc, err, timeout, libcuda))
    return 999


def gather(runner: Runner, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything nvidia_gpu_facts returns (see its RETURN), for the given options (see DEFAULTS)."""
    params = {**DEFAULTS, **{k: v for k, v in (options or {}).items() if v is not None}}
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

    path = params["nvidia_smi_path"] or runner.which("nvidia-smi") or "nvidia-smi"
    smi: dict = {"path": path, "ok": False, "rc": None, "error": None}
    gpus: list[dict] = []
    apps: list[dict] = []
    versions: dict[str, str] = {}
    runnable = os.path.isfile(path) and os.access(path, os.X_OK)
    if not runnable:
        smi["error"] = classify_nvidia_smi_failure("", None, path, kernel)
    else:
        rc, out, err = run_smi(
            runner,
            params["timeout"],
            path,
            [f"--query-gpu={','.join(QUERY_GPU_FIELDS)}", "--format=csv,noheader,nounits"],
        )
        smi["rc"] = rc
        if rc != 0:
            smi["error"] = classify_nvidia_smi_failure(out + err, rc, path, kernel)
        else:
            try:
                gpus = parse_query_gpu(out)
                rc, out, err = run_smi(
                    runner,
                    params["timeout"],
                    path,
                    [f"--query-compute-apps={','.join(QUERY_APPS_FIELDS)}", "--format=csv,noheader,nounits"],
                )
                if rc == 0:
                    apps = parse_compute_apps(out)
                else:
                    warnings.append(f"nvidia-smi --query-compute-apps failed (exit {rc}): {(out + err).strip()[:200]}")
            except NvidiaParseError as exc:
                smi["error"] = {
                    "kind": "unparsable",
                    "message": f"nvidia-smi output could not be read ({exc}): is {path} the real nvidia-smi?",
                    "library_version": None,
                }
            else:
                smi["ok"] = True
        vrc, vout, _ = run_smi(runner, params["timeout"], path, ["--version"])
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
    code = cuda_smoke_test(runner, params["timeout"], params["libcuda"]) if params["cuda_smoke_test"] else None
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


# lxc_gpu_config's options: the module and its action plugin (which runs it in-process on the
# controller) validate against the same spec.
LXC_GPU_CONFIG_ARGS: dict[str, dict[str, Any]] = {
    "config_path": {"type": "path", "required": True},
    "gpu_count": {"type": "int"},
    "proc_devices_path": {"type": "path", "default": "/proc/devices"},
}


class ContainerConfigUnreadable(Exception):
    """The container config cannot be read; the message says where it looked and what to check."""


def check_container_config_file(path: str, gpu_count: int | None, proc_devices_path: str = "/proc/devices") -> dict:
    """lxc_gpu_config's result for the container config at path, read on this host (the container's):
    each GPU device node it passes in and how, the host's device nodes it binds, the problems."""
    try:
        # Only a regular file (a FIFO would hang), bounded, UTF-8; a symlink is followed (/etc/pve/lxc is one).
        text = read_safe_text(path, MAX_CONFIG_BYTES, f"the container config {path}", follow=True)
    except (OSError, UnsafeFileError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ContainerConfigUnreadable(
            f"Cannot read the container config {path} on this host ({reason}): check the "
            "container id/name in the inventory (Proxmox: /etc/pve/lxc/<vmid>.conf) and that this is "
            "the container's host."
        ) from exc
    config = parse_lxc_config(text)
    names = [e["source"] for e in config["mount_entries"] if e["target"].startswith("/dev/nvidia")]
    names += [e["path"] for e in config["dev_entries"]]
    sources = {name: stat_node(name) for name in names}
    devices = read_text(proc_devices_path)
    uvm_major = None if devices is None else parse_proc_devices(devices).get("nvidia-uvm")
    result = check_container_config(config, sources, gpu_count, uvm_major)
    return {
        "ok": not result["problems"],
        "problems": result["problems"],
        "warnings_found": result["warnings"],
        "devices": result["devices"],
        "sources": sources,
        "uvm_major": uvm_major,
        "config": config,
    }
