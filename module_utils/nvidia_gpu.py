"""Pure parsing and checking of NVIDIA GPU state for GPU nodes in LXC containers.

Everything here takes text or plain data and returns plain data (dicts, lists, strings) so that
it can be unit tested without a GPU and without Ansible. The ``nvidia_gpu_facts`` and
``lxc_gpu_config`` modules gather the raw inputs (nvidia-smi output, /proc files, stat results)
and call into this file.

Problems are sentences for an operator: what is wrong, and what to do about it.
"""

from __future__ import annotations

import re
from typing import Any

# The structured queries the facts module runs (and the fixtures were captured with).
QUERY_GPU_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "memory.used",
    "memory.free",
    "compute_cap",
)
QUERY_APPS_FIELDS = ("pid", "process_name", "used_gpu_memory", "gpu_uuid")

# Values nvidia-smi prints instead of a number when a field has no value.
_NO_VALUE = re.compile(r"^\[(N/A|Not Supported|Unknown Error|Insufficient Permissions|GPU is lost)\]$|^N/A$")
_WITH_UNIT = re.compile(r"^(-?\d+(?:\.\d+)?) (MiB|W|%|MHz|C)$")

# CUDA driver API results of cuInit that a GPU node can plausibly return.
CUDA_ERRORS = {
    0: "CUDA_SUCCESS",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}

NVIDIA_MAJOR = 195  # fixed by the driver: /dev/nvidiaN (minor N) and /dev/nvidiactl (minor 255)
NVIDIACTL_MINOR = 255


class NvidiaParseError(ValueError):
    """Output that does not have the shape the structured query asked for."""


# --------------------------------------------------------------------------- nvidia-smi output


def _cell(value: str) -> str | None:
    value = value.strip()
    if _NO_VALUE.match(value):
        return None
    unit = _WITH_UNIT.match(value)
    return unit.group(1) if unit else value


# Far beyond any MiB, MHz, watt or percent nvidia-smi reports: a bigger "number" is garbage.
_MAX_COUNT = 2**63


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = int(float(value))
    except (ValueError, OverflowError):  # OverflowError: inf, 1e400 or a number of hundreds of digits
        raise NvidiaParseError(f"expected a number, got {value[:40]!r}") from None
    if abs(number) > _MAX_COUNT:
        raise NvidiaParseError(f"expected a number nvidia-smi can report, got {value[:40]!r}")
    return number


def parse_csv(text: str, fields: tuple[str, ...] | list[str]) -> list[dict[str, str | None]]:
    """Parse ``--format=csv[,noheader][,nounits]`` output for the given fields into raw cells.

    A header line (with or without units) is skipped, units after values are dropped, and the
    placeholders nvidia-smi prints for missing values ([N/A], [Not Supported], ...) become None.
    """
    rows: list[dict[str, str | None]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if number == 1 and [re.sub(r" \[.*\]$", "", c) for c in cells] == list(fields):
            continue
        if len(cells) != len(fields):
            raise NvidiaParseError(
                f"line {number} has {len(cells)} values where the query asked for {len(fields)} "
                f"({', '.join(fields)}): {line!r}"
            )
        rows.append({f: _cell(c) for f, c in zip(fields, cells, strict=True)})
    return rows


def parse_query_gpu(text: str) -> list[dict[str, Any]]:
    """Per-GPU facts from ``--query-gpu=<QUERY_GPU_FIELDS> --format=csv,noheader,nounits``."""
    gpus = []
    for row in parse_csv(text, QUERY_GPU_FIELDS):
        index = _int_or_none(row["index"])
        if index is None:
            raise NvidiaParseError(f"a GPU without an index: {row!r}")
        gpus.append(
            {
                "index": index,
                "name": row["name"],
                "uuid": row["uuid"],
                "pci_bus_id": row["pci.bus_id"],
                "driver_version": row["driver_version"],
                "memory_total_mib": _int_or_none(row["memory.total"]),
                "memory_used_mib": _int_or_none(row["memory.used"]),
                "memory_free_mib": _int_or_none(row["memory.free"]),
                "compute_capability": row["compute_cap"],
            }
        )
    return gpus


def parse_compute_apps(text: str) -> list[dict[str, Any]]:
    """Processes from ``--query-compute-apps=<QUERY_APPS_FIELDS> --format=csv,noheader,nounits``.

    Inside a container the pids are the HOST's pids: they name no local process in general.
    """
    return [
        {
            "pid": _int_or_none(row["pid"]),
            "process_name": row["process_name"],
            "used_memory_mib": _int_or_none(row["used_gpu_memory"]),
            "gpu_uuid": row["gpu_uuid"],
        }
        for row in parse_csv(text, QUERY_APPS_FIELDS)
    ]


def parse_smi_version(text: str) -> dict[str, str]:
    """``nvidia-smi --version``: the userspace tool and NVML versions, the driver, the CUDA version."""
    keys = {"NVIDIA-SMI version": "nvidia_smi", "NVML version": "nvml", "DRIVER version": "driver"}
    keys["CUDA Version"] = "cuda"
    found = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in keys and re.match(r"^\d+(\.\d+)*$", value.strip()):
            found[keys[name.strip()]] = value.strip()
    return found


def parse_kernel_driver_version(text: str) -> str | None:
    """The kernel module version from /proc/driver/nvidia/version (``NVRM version: ... 580.159.04 ...``)."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)\s", line + " ")
            if match:
                return match.group(1)
            match = re.search(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s", line + " ")
            if match:
                return match.group(1)
    return None


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character device majors by name from /proc/devices (``195 nvidia``, ``238 nvidia-uvm``)."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices:"):
            in_char = True
            continue
        if line.startswith("Block devices:"):
            in_char = False
            continue
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def parse_ls_devices(text: str) -> list[dict[str, Any]]:
    """Device nodes from an ``ls -l /dev/nvidia*`` listing: path, major and minor of each character node."""
    nodes = []
    for line in text.splitlines():
        match = re.match(r"^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+.*?\s(/dev/\S+)$", line)
        if match:
            nodes.append({"path": match.group(3), "major": int(match.group(1)), "minor": int(match.group(2))})
    return nodes


# --------------------------------------------------------------------------- failures, in words


def classify_nvidia_smi_failure(
    output: str,
    rc: int | None,
    path: str,
    kernel_version: str | None = None,
) -> dict[str, Any]:
    """Turn a failed nvidia-smi run into ``{"kind", "message", "library_version"}``.

    ``rc`` None means nvidia-smi could not be run at all (not found, not executable).
    """
    kernel = kernel_version or "unknown (no /proc/driver/nvidia/version)"
    first = next((line.strip() for line in output.splitlines() if line.strip()), "")
    library = None
    lib_match = re.search(r"NVML library version:\s*(\S+)", output)
    if lib_match:
        library = lib_match.group(1)
    if rc is None:
        kind = "absent"
        message = (
            f"nvidia-smi was not found or cannot run ({path}): the NVIDIA userspace driver is not "
            f"installed in this node. Install the userspace driver of exactly the host's kernel module "
            f"version ({kernel}), without the kernel module (the .run installer with --no-kernel-module), "
            "and hold it against upgrades."
        )
    elif rc in (124, 137, -9):
        # 124: timeout's own status; 137 or -9: the command ignored SIGTERM and timeout sent KILL.
        kind = "timeout"
        message = (
            f"nvidia-smi did not answer in time ({path}): the GPU or the driver hangs. Look at the "
            "host's kernel log (dmesg: Xid errors) and nvidia-smi on the host; a GPU reset or a host "
            "reboot may be needed."
        )
    elif "Driver/library version mismatch" in output:
        kind = "driver-mismatch"
        message = (
            f"The NVIDIA userspace driver in this node (NVML library {library or 'of another version'}) "
            f"does not match the host's kernel module ({kernel}): nvidia-smi and CUDA refuse to start. "
            f"Install userspace driver {kernel_version or 'of the host kernel module version'} in the "
            "container (the .run installer with --no-kernel-module, or the distribution packages of that "
            "exact version) and hold it against upgrades (apt-mark hold) so the two cannot drift apart "
            "again; or, if the host was upgraded and not rebooted, reboot the host."
        )
    elif first.startswith("No devices were found"):
        kind = "no-devices"
        message = (
            "nvidia-smi sees no GPU: /dev/nvidiactl reaches the driver but no /dev/nvidiaN is passed "
            "into this container. On the Proxmox host, pass each GPU's device node into the container "
            "(lxc.cgroup2.devices.allow: c 195:* rwm and an lxc.mount.entry for /dev/nvidia0.., or "
            "devN: /dev/nvidia0 lines on PVE 8.1+) and restart the container."
        )
    elif "couldn't communicate with the NVIDIA driver" in output:
        kind = "driver-not-loaded"
        message = (
            "nvidia-smi cannot reach the NVIDIA driver: /dev/nvidiactl is missing in this container or "
            "the kernel module is not loaded on the host. Check that nvidia-smi works on the Proxmox "
            "host, then pass /dev/nvidiactl (and /dev/nvidia0.., /dev/nvidia-uvm) into the container "
            "and restart it."
        )
    elif "GPU access blocked by the operating system" in output:
        kind = "access-blocked"
        message = (
            "The NVIDIA device nodes in this container are not usable as devices (not the host's "
            "character devices, or blocked by a security policy): NVML reports 'GPU access blocked by "
            "the operating system'. Bind-mount the host's /dev/nvidia* character devices into the "
            "container (lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,create=file) instead of "
            "copies, and restart it."
        )
    elif "Failed to initialize NVML: Unknown Error" in output:
        kind = "nvml-unknown"
        message = (
            "NVML could not open the GPU devices ('Failed to initialize NVML: Unknown Error'): in an "
            "LXC container this is the cgroup denying the device. On the Proxmox host add "
            "lxc.cgroup2.devices.allow: c 195:* rwm and c <nvidia-uvm major>:* rwm (see /proc/devices "
            "on the host) to the container's config and restart the container."
        )
    elif first.startswith("Failed to initialize NVML"):
        kind = "nvml-init"
        message = (
            f"NVML cannot initialise ({first!r}, exit code {rc}). Check the driver on the Proxmox host "
            f"(kernel module {kernel}) and the device nodes passed into this container."
        )
    else:
        kind = "unknown"
        message = (
            f"nvidia-smi failed with exit code {rc}: {first or 'no output'}. Run '{path}' on the node "
            "to see the full error."
        )
    return {"kind": kind, "message": message, "library_version": library}


def cuda_init_result(code: int | None, uvm_present: bool) -> dict[str, Any]:
    """Describe what cuInit(0) returned (None: libcuda is not installed, the test did not run)."""
    if code is None:
        return {"status": "not available", "code": None, "name": None, "ok": None, "message": ""}
    name = CUDA_ERRORS.get(code, f"CUDA error {code}")
    if code == 0:
        return {"status": "passed", "code": 0, "name": name, "ok": True, "message": ""}
    message = f"CUDA cannot initialise in this node: cuInit returned {code} ({name})."
    if not uvm_present:
        message += (
            " /dev/nvidia-uvm is missing: CUDA needs it. On the Proxmox host load nvidia-uvm and create "
            "the node (nvidia-modprobe -u -c=0, or a udev rule/systemd unit that does it at boot), pass it "
            "into the container (its major is in the host's /proc/devices) and restart the container."
        )
    elif code in (35, 803):
        message += " The container's userspace driver does not match the host's kernel module."
    elif code == 100:
        message += " No GPU device node is usable in this container."
    return {"status": "failed", "code": code, "name": name, "ok": False, "message": message}


def cuda_smoke_test_failure(rc: int | None, err: str, timeout: int, libcuda: str) -> str:
    """The warning for a CUDA smoke test that gave no cuInit result: a timeout named as one.

    ``rc`` is what the probe run under coreutils ``timeout --kill-after=5`` exited with: 124 when the
    timeout ended it, 137 or -9 when it ignored SIGTERM and was killed 5 s later.
    """
    if rc in (124, 137, -9):
        killed = " and ignored SIGTERM (killed 5 s later)" if rc in (137, -9) else ""
        return (
            f"CUDA smoke test timed out after {timeout} s{killed}: cuInit(0) through {libcuda} did not return. "
            "A hung GPU or driver does this (look at the host's kernel log, dmesg, for Xid errors, and run "
            "nvidia-smi on the host; a GPU reset or a host reboot may be needed), and so does a libcuda that "
            "is not the CUDA driver library (check the libcuda option). Raise timeout only for a node known "
            "to take that long to initialise CUDA."
        )
    return f"CUDA smoke test did not finish cleanly (exit {rc}): {err.strip()[:300]}"


# --------------------------------------------------------------------------- device nodes


def expected_device_nodes(gpu_indices: list[int]) -> list[str]:
    """The nodes a CUDA process opens: control, one per GPU, and the unified memory pair."""
    return (
        ["/dev/nvidiactl"]
        + [f"/dev/nvidia{i}" for i in sorted(gpu_indices)]
        + ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    )


def check_device_nodes(
    nodes: dict[str, dict[str, Any] | None],
    gpu_indices: list[int],
    proc_majors: dict[str, int] | None = None,
) -> tuple[list[str], list[str]]:
    """Check device nodes (path -> {"char": bool, "major", "minor"} or None when absent).

    Returns (problems, warnings). ``proc_majors`` is /proc/devices (the host's, as LXC does not
    virtualise it) used to catch a uvm node whose major is stale after a driver change.
    """
    problems: list[str] = []
    warnings: list[str] = []
    majors = proc_majors or {}
    for path in expected_device_nodes(gpu_indices):
        node = nodes.get(path)
        if node is None:
            if path == "/dev/nvidia-uvm-tools":
                warnings.append(
                    "/dev/nvidia-uvm-tools is missing: CUDA runs without it, but profilers and some "
                    "tools need it; pass it into the container next to /dev/nvidia-uvm."
                )
            elif path == "/dev/nvidia-uvm":
                problems.append(
                    "/dev/nvidia-uvm is missing: nvidia-smi works without it but every CUDA program fails "
                    "(cuInit error 999, 'unknown error'). On the Proxmox host load nvidia-uvm and create "
                    "the node (nvidia-modprobe -u -c=0), pass it into the container "
                    "(lxc.cgroup2.devices.allow with its major from /proc/devices, and an lxc.mount.entry) "
                    "and restart the container."
                )
            else:
                problems.append(
                    f"{path} is missing: pass it into the container from the Proxmox host "
                    f"(lxc.cgroup2.devices.allow: c 195:* rwm and lxc.mount.entry: {path} "
                    f"{path[1:]} none bind,create=file, or a devN: {path} line on PVE 8.1+) and restart it."
                )
            continue
        if not node.get("char"):
            problems.append(
                f"{path} exists but is not a character device (a plain file or a copy): bind-mount the "
                "host's device node instead and restart the container."
            )
            continue
        want_major: int | None = None
        want_minor: int | None = None
        if path == "/dev/nvidiactl":
            want_major, want_minor = NVIDIA_MAJOR, NVIDIACTL_MINOR
        elif re.fullmatch(r"/dev/nvidia\d+", path):
            want_major, want_minor = NVIDIA_MAJOR, int(path[len("/dev/nvidia") :])
        elif path == "/dev/nvidia-uvm":
            want_major = majors.get("nvidia-uvm")
        if want_major is not None and node.get("major") != want_major:
            problems.append(
                f"{path} has major {node.get('major')} but the driver uses {want_major}: the node is stale "
                "(made for another driver load). Recreate it on the host, fix the container's "
                "lxc.cgroup2.devices.allow major to match /proc/devices, and restart the container."
            )
        elif want_minor is not None and node.get("minor") != want_minor:
            problems.append(f"{path} has minor {node.get('minor')} where the driver uses {want_minor}.")
    return problems, warnings


# --------------------------------------------------------------------------- who holds the GPUs


def unit_from_cgroup(text: str) -> str | None:
    """The systemd unit (service or scope) a process runs in, from /proc/PID/cgroup."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" or controllers == "name=systemd":
            units = [p for p in path.split("/") if p.endswith((".service", ".scope"))]
            if units:
                return units[-1]
    return None


def gpu_device_paths(fd_targets: list[str]) -> list[str]:
    """The /dev/nvidia* device paths among a process's open file targets, deduplicated, sorted."""
    return sorted({t for t in fd_targets if re.fullmatch(r"/dev/nvidia(\d+|ctl|-uvm|-uvm-tools)", t)})


def summarize_holders(processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Local holders from per-process raw data.

    Each input: {"pid", "comm", "fd_targets": [...], "cgroup": text}. Output (only processes with
    /dev/nvidia* open): {"pid", "comm", "unit", "devices"}, sorted by pid.
    """
    holders = []
    for proc in processes:
        devices = gpu_device_paths(proc.get("fd_targets") or [])
        if not devices:
            continue
        holders.append(
            {
                "pid": proc["pid"],
                "comm": proc.get("comm"),
                "unit": unit_from_cgroup(proc.get("cgroup") or ""),
                "devices": devices,
            }
        )
    return sorted(holders, key=lambda h: h["pid"])


# --------------------------------------------------------------------------- thresholds


def _version_tuple(value: str | None) -> tuple[int, ...] | None:
    if value is None or not re.fullmatch(r"\d+(\.\d+)*", str(value)):
        return None
    return tuple(int(x) for x in str(value).split("."))


def evaluate_thresholds(facts: dict[str, Any], limits: dict[str, Any]) -> dict[str, list[str]]:
    """Compare GPU facts with the inventory's thresholds; return the problems of each check.

    facts: {"gpus": [...parse_query_gpu...], "holders": [...summarize_holders...]}
    limits (each optional, None = not checked):
      gpu_count               at least this many GPUs
      min_memory_mib          memory.total of every GPU at least this
      min_compute_capability  e.g. "8.6"
      max_memory_used_mib     memory already used on any GPU at most this, unless every local holder
                              is one of swappable_units (the engine the deployment replaces)
      swappable_units         list of systemd units whose memory the swap frees
      memory_needed_mib       target + drafter + KV budget, compared with memory_utilization x total
      memory_utilization      fraction of each GPU the engine may use (vLLM --gpu-memory-utilization)
    Keys of the result: gpu_count, memory_total, compute_capability, memory_used, memory_needed.
    """
    result: dict[str, list[str]] = {
        "gpu_count": [],
        "memory_total": [],
        "compute_capability": [],
        "memory_used": [],
        "memory_needed": [],
    }
    gpus = facts.get("gpus") or []
    holders = facts.get("holders") or []
    count = limits.get("gpu_count")
    if count is not None and len(gpus) < int(count):
        result["gpu_count"].append(
            f"This node has {len(gpus)} GPU(s) but the inventory needs {count}: pass the missing GPUs into "
            "the container on the Proxmox host, or lower the tensor-parallel size for this node's group."
        )
    min_mem = limits.get("min_memory_mib")
    if min_mem is not None:
        for gpu in gpus:
            total = gpu.get("memory_total_mib")
            if total is None or total < int(min_mem):
                result["memory_total"].append(
                    f"GPU {gpu['index']} ({gpu.get('name')}) has {total} MiB of memory, less than the "
                    f"{min_mem} MiB the inventory requires: this GPU class cannot hold the model as planned."
                )
    min_cc = limits.get("min_compute_capability")
    if min_cc is not None:
        want = _version_tuple(str(min_cc))
        for gpu in gpus:
            have = _version_tuple(gpu.get("compute_capability"))
            if want is not None and (have is None or have < want):
                result["compute_capability"].append(
                    f"GPU {gpu['index']} ({gpu.get('name')}) has compute capability "
                    f"{gpu.get('compute_capability')}, below the {min_cc} the inventory requires for the "
                    "engine's kernels."
                )
    max_used = limits.get("max_memory_used_mib")
    if max_used is not None:
        swappable = set(limits.get("swappable_units") or [])
        foreign = [h for h in holders if h.get("unit") not in swappable]
        expected = [h for h in holders if h.get("unit") in swappable]
        for gpu in gpus:
            used = gpu.get("memory_used_mib") or 0
            if used <= int(max_used):
                continue
            if expected and not foreign:
                continue  # the engine being replaced holds it; the swap frees it
            limit = f"at most {max_used} MiB may be in use before the swap"
            if foreign:
                who = ", ".join(f"pid {h['pid']} ({h.get('comm')}, unit {h.get('unit') or 'none'})" for h in foreign)
                result["memory_used"].append(
                    f"GPU {gpu['index']} already has {used} MiB in use ({limit}), held by {who}: stop "
                    "these first; only the engine being replaced "
                    f"({', '.join(sorted(swappable)) or 'none named'}) may hold the GPUs."
                )
            else:
                result["memory_used"].append(
                    f"GPU {gpu['index']} already has {used} MiB in use ({limit}) and no process in this "
                    "container holds it: another container or the Proxmox host is using this GPU. Find "
                    "it on the host (nvidia-smi there lists the process) and stop it, or give this node "
                    "another GPU."
                )
    needed = limits.get("memory_needed_mib")
    if needed is not None and gpus:
        util = float(limits.get("memory_utilization") or 1.0)
        usable = sum(int((g.get("memory_total_mib") or 0) * util) for g in gpus)
        if int(needed) > usable:
            result["memory_needed"].append(
                f"The deployment needs {needed} MiB of GPU memory (target + drafter + KV budget) but "
                f"{len(gpus)} GPU(s) give {usable} MiB at memory utilization {util}: use a node with more "
                "GPU memory, a shorter context (smaller KV budget) or a smaller drafter."
            )
    return result


def merge_app_holders(
    holders: list[dict[str, Any]], apps: list[dict[str, Any]], local: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Add compute apps that are provably local processes to the /proc fd holders.

    Inside a container nvidia-smi reports host pids, so an app counts as local only when a local
    process with that pid exists AND has the same name. local: pid -> {"comm", "cgroup"}.
    """
    merged = list(holders)
    known = {h["pid"] for h in holders}
    for app in apps:
        pid = app.get("pid")
        proc = local.get(pid) if pid is not None else None
        if proc is None or pid in known:
            continue
        name = (app.get("process_name") or "").rsplit("/", 1)[-1]
        if not name or name[:15] != (proc.get("comm") or ""):
            continue
        known.add(pid)
        merged.append(
            {
                "pid": pid,
                "comm": proc.get("comm"),
                "unit": unit_from_cgroup(proc.get("cgroup") or ""),
                "devices": [],
            }
        )
    return sorted(merged, key=lambda h: h["pid"])


def check_driver_versions(kernel: str | None, userspace: str | None) -> list[str]:
    """The container's userspace driver must be exactly the host kernel module's version."""
    if kernel is None or userspace is None or kernel == userspace:
        return []
    return [
        f"The userspace NVIDIA driver in this node is {userspace} but the host's kernel module is {kernel}: "
        f"install userspace {kernel} in the container (--no-kernel-module) and hold it against upgrades."
    ]


# --------------------------------------------------------------------------- container config (host side)


def parse_lxc_config(text: str) -> dict[str, Any]:
    """Parse an LXC config (/var/lib/lxc/NAME/config, ``key = value``) or a Proxmox one
    (/etc/pve/lxc/VMID.conf, ``key: value``), up to the first snapshot section.

    Returns {"allow": [{"type", "major", "minor", "access", "line"}], "cgroup1_allow": [...],
    "mount_entries": [{"source", "target", "fstype", "options", "optional", "line"}],
    "dev_entries": [{"key", "path", "options", "line"}]}.
    """
    allow: list[dict[str, Any]] = []
    cgroup1: list[str] = []
    mounts: list[dict[str, Any]] = []
    devs: list[dict[str, Any]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            break  # Proxmox snapshot sections follow the current config
        match = re.match(r"^([A-Za-z0-9_.]+)\s*[:=]\s*(.*)$", line)
        if not match:
            continue
        key, value = match.group(1), match.group(2).strip()
        if key == "lxc.cgroup2.devices.allow":
            rule = re.match(r"^([abc])\s*(?:(\*|\d+):(\*|\d+))?\s*([rwm]*)$", value)
            if rule:
                allow.append(
                    {
                        "type": rule.group(1),
                        "major": rule.group(2) or "*",
                        "minor": rule.group(3) or "*",
                        "access": rule.group(4) or "rwm",
                        "line": number,
                    }
                )
        elif key == "lxc.cgroup.devices.allow":
            cgroup1.append(value)
        elif key == "lxc.mount.entry":
            fields = value.split()
            if len(fields) >= 4:
                options = fields[3].split(",")
                mounts.append(
                    {
                        "source": fields[0],
                        "target": "/" + fields[1].lstrip("/"),
                        "fstype": fields[2],
                        "options": options,
                        "optional": "optional" in options,
                        "line": number,
                    }
                )
        elif re.fullmatch(r"dev\d+", key):
            path, _, options = value.partition(",")
            devs.append({"key": key, "path": path.strip(), "options": options, "line": number})
    return {"allow": allow, "cgroup1_allow": cgroup1, "mount_entries": mounts, "dev_entries": devs}


def _allowed(allow: list[dict[str, Any]], major: int, minor: int) -> bool:
    for rule in allow:
        if rule["type"] == "a":
            return True
        if rule["type"] != "c" or "r" not in rule["access"] or "w" not in rule["access"]:
            continue
        if rule["major"] in ("*", str(major)) and rule["minor"] in ("*", str(minor)):
            return True
    return False


def check_container_config(
    config: dict[str, Any],
    sources: dict[str, dict[str, Any] | None],
    gpu_count: int | None = None,
    uvm_major: int | None = None,
) -> dict[str, Any]:
    """Check a parsed container config passes the GPU device nodes in.

    sources: host path -> {"char", "major", "minor"} (or None: absent on the host) for every
    source named by the config's /dev/nvidia* mount entries and devN: lines (the module stats them).
    Returns {"problems", "warnings", "devices": {target: how}}.
    """
    problems: list[str] = []
    warnings: list[str] = []
    devices: dict[str, str] = {}
    gpu_target = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm|-uvm-tools)$")
    for entry in config["dev_entries"]:
        if gpu_target.match(entry["path"]):
            devices[entry["path"]] = f"{entry['key']} (line {entry['line']})"
            if sources.get(entry["path"]) is None:
                problems.append(
                    f"{entry['key']}: {entry['path']} (line {entry['line']}) names a device the host "
                    "does not have: load the driver on the host (and nvidia-modprobe -u -c=0 for uvm) "
                    "before starting the container."
                )
    for entry in config["mount_entries"]:
        if not gpu_target.match(entry["target"]):
            continue
        where = f"lxc.mount.entry for {entry['target']} (line {entry['line']})"
        if "bind" not in entry["options"] and "rbind" not in entry["options"]:
            problems.append(f"{where} is not a bind mount: use 'none bind,create=file'.")
            continue
        if entry["optional"]:
            warnings.append(
                f"{where} is 'optional': if the device is missing the container still starts, without "
                "the GPU, and the engine fails later or runs without it. Remove 'optional' so a missing "
                "GPU stops the container from starting."
            )
        node = sources.get(entry["source"])
        if node is None:
            problems.append(f"{where} binds {entry['source']}, which does not exist on the host.")
            continue
        if not node.get("char"):
            problems.append(f"{where} binds {entry['source']}, which is not a character device on the host.")
            continue
        if not _allowed(config["allow"], node["major"], node["minor"]):
            problems.append(
                f"{where} binds device {node['major']}:{node['minor']} but no lxc.cgroup2.devices.allow line "
                f"allows it: add 'lxc.cgroup2.devices.allow: c {node['major']}:* rwm' and restart the "
                "container (NVML otherwise fails with 'Unknown Error')."
            )
            continue
        if entry["target"] == "/dev/nvidia-uvm" and uvm_major is not None and node["major"] != uvm_major:
            problems.append(
                f"{where} binds a node with major {node['major']} but the host's nvidia-uvm major is "
                f"{uvm_major} (/proc/devices): recreate the node and fix the allow line."
            )
            continue
        devices[entry["target"]] = f"lxc.mount.entry (line {entry['line']})"
    if config["cgroup1_allow"]:
        warnings.append(
            "lxc.cgroup.devices.allow (cgroup v1) lines are ignored on a cgroup v2 host (Proxmox 7 and "
            "later): use lxc.cgroup2.devices.allow."
        )
    for required in ("/dev/nvidiactl", "/dev/nvidia-uvm"):
        if required not in devices:
            problems.append(
                f"The container config does not pass {required} into the container: add "
                f"'lxc.mount.entry: {required} {required[1:]} none bind,create=file' with a matching "
                f"lxc.cgroup2.devices.allow line, or a devN: {required} line on PVE 8.1+."
            )
    if "/dev/nvidia-uvm-tools" not in devices:
        warnings.append("The container config does not pass /dev/nvidia-uvm-tools (profilers need it).")
    gpus = sorted(t for t in devices if re.fullmatch(r"/dev/nvidia\d+", t))
    if gpu_count is not None and len(gpus) < gpu_count:
        problems.append(
            f"The container config passes {len(gpus)} GPU device node(s) ({', '.join(gpus) or 'none'}) "
            f"but the node needs {gpu_count}: add the missing /dev/nvidiaN entries."
        )
    return {"problems": problems, "warnings": warnings, "devices": devices}
