"""Parsers and checks of module_utils/nvidia_gpu.py against real captured H200 outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils import nvidia_gpu as ng

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
X1 = FIXTURES / "h200-x1"
X2 = FIXTURES / "h200-x2"
EXTRA = FIXTURES.parent / "nvidia-smi-extra"

H200_X1_GPU0 = {
    "index": 0,
    "name": "NVIDIA H200",
    "uuid": "GPU-5173b07a-0d44-bc21-3393-ff7bfaf497d5",
    "pci_bus_id": "00000000:00:06.0",
    "driver_version": "580.159.04",
    "memory_total_mib": 143771,
    "memory_used_mib": 0,
    "memory_free_mib": 143156,
    "compute_capability": "9.0",
}


# --------------------------------------------------------------------------- nvidia-smi output


def test_query_gpu_one_h200():
    assert ng.parse_query_gpu((X1 / "query-gpu-noheader.csv").read_text()) == [H200_X1_GPU0]


def test_query_gpu_two_h200():
    gpus = ng.parse_query_gpu((X2 / "query-gpu-noheader.csv").read_text())
    assert [(g["index"], g["uuid"], g["pci_bus_id"]) for g in gpus] == [
        (0, "GPU-f65200df-1105-763f-f85d-b3e482295931", "00000000:00:06.0"),
        (1, "GPU-d7591872-da88-51cf-78ae-7109632ee706", "00000000:00:07.0"),
    ]
    assert {g["memory_total_mib"] for g in gpus} == {143771}


def test_header_and_units_are_tolerated():
    text = (X1 / "query-gpu.csv").read_text()
    fields = (*ng.QUERY_GPU_FIELDS, "temperature.gpu", "power.draw", "utilization.gpu")
    rows = ng.parse_csv(text, fields)
    assert rows == [
        {
            "index": "0",
            "name": "NVIDIA H200",
            "uuid": "GPU-5173b07a-0d44-bc21-3393-ff7bfaf497d5",
            "pci.bus_id": "00000000:00:06.0",
            "driver_version": "580.159.04",
            "memory.total": "143771",
            "memory.used": "0",
            "memory.free": "143156",
            "compute_cap": "9.0",
            "temperature.gpu": "32",
            "power.draw": "118.35",
            "utilization.gpu": "0",
        }
    ]
    nounits = ng.parse_csv((EXTRA / "query-gpu-nounits.csv").read_text(), ("index", "memory.total", "memory.used"))
    assert nounits == [{"index": "0", "memory.total": "143771", "memory.used": "0"}]


def test_not_available_values_become_none():
    rows = ng.parse_csv((EXTRA / "query-na-noheader.csv").read_text(), ("index", "fan.speed", "power.draw"))
    assert rows == [{"index": "0", "fan.speed": None, "power.draw": "77.61"}]


def test_wrong_shape_is_an_error_that_says_what_was_expected():
    with pytest.raises(ng.NvidiaParseError) as err:
        ng.parse_query_gpu("0, NVIDIA H200, 143771\n")
    assert str(err.value) == (
        "line 1 has 3 values where the query asked for 9 (index, name, uuid, pci.bus_id, driver_version, "
        "memory.total, memory.used, memory.free, compute_cap): '0, NVIDIA H200, 143771'"
    )
    with pytest.raises(ng.NvidiaParseError):
        ng.parse_query_gpu("x, a, b, c, d, lots, 0, 0, 9.0\n")


def test_compute_apps_real_captures():
    assert ng.parse_compute_apps((X1 / "query-apps.csv").read_text()) == []
    assert ng.parse_compute_apps("") == []
    held = [
        {
            "pid": 535,
            "process_name": "python3",
            "used_memory_mib": 1542,
            "gpu_uuid": "GPU-f89c703d-666c-640f-b225-f22050fd660c",
        }
    ]
    assert ng.parse_compute_apps((EXTRA / "apps-held-noheader.csv").read_text()) == held
    assert ng.parse_compute_apps((EXTRA / "apps-held.csv").read_text()) == held
    busy_x2 = (X2 / "apps-busy.csv").read_text().split("\n\n")[0]
    assert ng.parse_compute_apps(busy_x2) == [
        {
            "pid": 572,
            "process_name": "python3",
            "used_memory_mib": 3380,
            "gpu_uuid": "GPU-d7591872-da88-51cf-78ae-7109632ee706",
        }
    ]


def test_versions_from_the_real_driver_capture():
    text = (X1 / "driver.txt").read_text()
    assert ng.parse_smi_version(text) == {
        "nvidia_smi": "580.159.04",
        "nvml": "580.159",
        "driver": "580.159.04",
        "cuda": "13.0",
    }
    assert ng.parse_kernel_driver_version(text) == "580.159.04"


@pytest.mark.parametrize(
    ("line", "version"),
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024",
            "535.183.01",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)",
            "570.86.15",
        ),
        ("GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)", None),
        ("", None),
    ],
)
def test_kernel_driver_version_line_formats(line, version):
    assert ng.parse_kernel_driver_version(line) == version


def test_majors_from_proc_devices():
    majors = ng.parse_proc_devices((EXTRA / "proc-devices.txt").read_text())
    assert {k: v for k, v in majors.items() if k.startswith("nvidia")} == {
        "nvidia": 195,
        "nvidiactl": 195,
        "nvidia-uvm": 238,
        "nvidia-nvswitch": 239,
        "nvidia-nvlink": 240,
        "nvidia-caps": 241,
        "nvidia-caps-imex-channels": 242,
    }
    assert "loop" not in majors  # block devices are not character majors


def test_device_listing_from_the_real_capture():
    assert ng.parse_ls_devices((X2 / "driver.txt").read_text()) == [
        {"path": "/dev/nvidia0", "major": 195, "minor": 0},
        {"path": "/dev/nvidia1", "major": 195, "minor": 1},
        {"path": "/dev/nvidiactl", "major": 195, "minor": 255},
        {"path": "/dev/nvidia-uvm", "major": 238, "minor": 0},
        {"path": "/dev/nvidia-uvm-tools", "major": 238, "minor": 1},
    ]


# --------------------------------------------------------------------------- failures in words


@pytest.mark.parametrize(
    ("fixture", "rc", "kind", "says"),
    [
        ("no-devices.txt", 6, "no-devices", "no /dev/nvidiaN is passed into this container"),
        ("driver-not-loaded.txt", 9, "driver-not-loaded", "/dev/nvidiactl is missing in this container"),
        ("access-blocked.txt", 17, "access-blocked", "not usable as devices"),
        ("nvml-unknown.HAND-WRITTEN.txt", 255, "nvml-unknown", "the cgroup denying the device"),
        ("invalid-field.txt", 2, "unknown", 'exit code 2: Field "bogus" is not a valid field to query.'),
    ],
)
def test_failures_are_classified(fixture, rc, kind, says):
    result = ng.classify_nvidia_smi_failure((EXTRA / fixture).read_text(), rc, "/usr/bin/nvidia-smi", "580.159.04")
    assert result["kind"] == kind
    assert says in result["message"]


def test_driver_mismatch_names_both_versions_and_the_fix():
    text = (EXTRA / "driver-mismatch.HAND-WRITTEN.txt").read_text()
    result = ng.classify_nvidia_smi_failure(text, 18, "/usr/bin/nvidia-smi", "580.159.04")
    assert result["kind"] == "driver-mismatch"
    assert result["library_version"] == "580.126"
    assert result["message"] == (
        "The NVIDIA userspace driver in this node (NVML library 580.126) does not match the host's kernel "
        "module (580.159.04): nvidia-smi and CUDA refuse to start. Install userspace driver 580.159.04 in "
        "the container (the .run installer with --no-kernel-module, or the distribution packages of that "
        "exact version) and hold it against upgrades (apt-mark hold) so the two cannot drift apart again; "
        "or, if the host was upgraded and not rebooted, reboot the host."
    )


def test_absent_nvidia_smi_and_timeout():
    absent = ng.classify_nvidia_smi_failure("", None, "/usr/bin/nvidia-smi", "580.159.04")
    assert absent["kind"] == "absent"
    assert "version (580.159.04)" in absent["message"]
    assert ng.classify_nvidia_smi_failure("", 124, "nvidia-smi")["kind"] == "timeout"


def test_cuda_init_results():
    assert ng.cuda_init_result(None, True)["status"] == "not available"
    assert ng.cuda_init_result(0, True) == {
        "status": "passed",
        "code": 0,
        "name": "CUDA_SUCCESS",
        "ok": True,
        "message": "",
    }
    missing_uvm = ng.cuda_init_result(999, False)
    assert missing_uvm["ok"] is False
    assert missing_uvm["message"].startswith(
        "CUDA cannot initialise in this node: cuInit returned 999 (CUDA_ERROR_UNKNOWN). /dev/nvidia-uvm is missing"
    )
    assert ng.cuda_init_result(100, True)["message"].endswith("No GPU device node is usable in this container.")


# --------------------------------------------------------------------------- device nodes


def real_nodes(driver_txt: Path) -> dict:
    return {
        n["path"]: {"char": True, "major": n["major"], "minor": n["minor"]}
        for n in ng.parse_ls_devices(driver_txt.read_text())
    }


def test_real_device_nodes_pass():
    majors = ng.parse_proc_devices((EXTRA / "proc-devices.txt").read_text())
    assert ng.check_device_nodes(real_nodes(X2 / "driver.txt"), [0, 1], majors) == ([], [])


def test_missing_uvm_is_a_problem_and_missing_uvm_tools_a_warning():
    nodes = real_nodes(X1 / "driver.txt")
    del nodes["/dev/nvidia-uvm"]
    del nodes["/dev/nvidia-uvm-tools"]
    problems, warnings = ng.check_device_nodes(nodes, [0], {"nvidia-uvm": 238})
    assert len(problems) == 1
    assert problems[0].startswith(
        "/dev/nvidia-uvm is missing: nvidia-smi works without it but every CUDA program fails"
    )
    assert warnings[0].startswith("/dev/nvidia-uvm-tools is missing")


def test_missing_gpu_node_plain_file_and_stale_major():
    nodes = real_nodes(X2 / "driver.txt")
    del nodes["/dev/nvidia1"]
    nodes["/dev/nvidiactl"] = {"char": False, "major": None, "minor": None}
    nodes["/dev/nvidia-uvm"] = {"char": True, "major": 511, "minor": 0}
    problems, _ = ng.check_device_nodes(nodes, [0, 1], {"nvidia-uvm": 238})
    assert [p.split(":")[0] for p in problems] == [
        "/dev/nvidiactl exists but is not a character device (a plain file or a copy)",
        "/dev/nvidia1 is missing",
        "/dev/nvidia-uvm has major 511 but the driver uses 238",
    ]


# --------------------------------------------------------------------------- holders


def test_units_from_cgroup():
    captured = (EXTRA / "proc-535-fd-and-cgroup.txt").read_text().splitlines()[-1]
    assert captured == "0::/process_api/3cec071bb7842729aca76b1b61582b94"
    assert ng.unit_from_cgroup(captured) is None
    assert ng.unit_from_cgroup("0::/system.slice/sglang-qwen.service\n") == "sglang-qwen.service"
    assert ng.unit_from_cgroup("0::/user.slice/user-0.slice/session-4.scope\n") == "session-4.scope"
    assert ng.unit_from_cgroup("12:pids:/x\n1:name=systemd:/system.slice/vllm.service\n") == "vllm.service"


def test_holders_from_the_real_fd_listing():
    lines = (EXTRA / "proc-535-fd-and-cgroup.txt").read_text().splitlines()
    targets = [line.split(" -> ")[1] for line in lines if " -> " in line]
    processes = [
        {
            "pid": 535,
            "comm": "python3",
            "fd_targets": targets,
            "cgroup": "0::/system.slice/sglang-qwen.service",
        },
        {"pid": 7, "comm": "sshd", "fd_targets": [], "cgroup": "0::/system.slice/ssh.service"},
    ]
    assert ng.summarize_holders(processes) == [
        {
            "pid": 535,
            "comm": "python3",
            "unit": "sglang-qwen.service",
            "devices": ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"],
        }
    ]


def test_compute_apps_count_as_local_only_when_pid_and_name_match():
    apps = [
        {"pid": 535, "process_name": "python3", "used_memory_mib": 1542, "gpu_uuid": "GPU-x"},
        {"pid": 900, "process_name": "/usr/bin/python3", "used_memory_mib": 10, "gpu_uuid": "GPU-x"},
        {"pid": 4242, "process_name": "python3", "used_memory_mib": 10, "gpu_uuid": "GPU-x"},
    ]
    local = {
        535: {"comm": "python3", "cgroup": "0::/system.slice/sglang-qwen.service"},
        900: {"comm": "bash", "cgroup": "0::/system.slice/cron.service"},  # a host pid colliding
    }
    assert ng.merge_app_holders([], apps, local) == [
        {"pid": 535, "comm": "python3", "unit": "sglang-qwen.service", "devices": []}
    ]


# --------------------------------------------------------------------------- thresholds

GPUS_X2 = [
    dict(H200_X1_GPU0),
    dict(H200_X1_GPU0, index=1, uuid="GPU-2"),
]
SGLANG = {"pid": 812, "comm": "python3", "unit": "sglang-qwen.service", "devices": ["/dev/nvidia0"]}
ROGUE = {"pid": 99, "comm": "python3", "unit": "session-3.scope", "devices": ["/dev/nvidia1"]}
NO_PROBLEMS = {
    "gpu_count": [],
    "memory_total": [],
    "compute_capability": [],
    "memory_used": [],
    "memory_needed": [],
}


def test_thresholds_pass():
    limits = {
        "gpu_count": 2,
        "min_memory_mib": 143771,
        "min_compute_capability": "8.6",
        "max_memory_used_mib": 1024,
        "memory_needed_mib": 250000,
        "memory_utilization": 0.9,
    }
    assert ng.evaluate_thresholds({"gpus": GPUS_X2, "holders": []}, limits) == NO_PROBLEMS
    assert ng.evaluate_thresholds({"gpus": GPUS_X2}, {}) == NO_PROBLEMS


def test_each_threshold_fails_when_it_must():
    gpus = [dict(GPUS_X2[0], memory_used_mib=70000), dict(GPUS_X2[1])]
    limits = {
        "gpu_count": 4,
        "min_memory_mib": 143772,
        "min_compute_capability": "10.0",
        "max_memory_used_mib": 1024,
        "memory_needed_mib": 258787,  # 2 x int(143771 x 0.9) = 258786
        "memory_utilization": 0.9,
    }
    result = ng.evaluate_thresholds({"gpus": gpus, "holders": []}, limits)
    assert result["gpu_count"] == [
        "This node has 2 GPU(s) but the inventory needs 4: pass the missing GPUs into the container on the "
        "Proxmox host, or lower the tensor-parallel size for this node's group."
    ]
    assert [p[:60] for p in result["memory_total"]] == [
        "GPU 0 (NVIDIA H200) has 143771 MiB of memory, less than the ",
        "GPU 1 (NVIDIA H200) has 143771 MiB of memory, less than the ",
    ]
    assert result["compute_capability"][0].startswith("GPU 0 (NVIDIA H200) has compute capability 9.0, below the 10.0")
    assert result["memory_used"] == [
        "GPU 0 already has 70000 MiB in use (at most 1024 MiB may be in use before the swap) and no process "
        "in this container holds it: another container or the Proxmox host is using this GPU. Find it on "
        "the host (nvidia-smi there lists the process) and stop it, or give this node another GPU."
    ]
    assert result["memory_needed"] == [
        "The deployment needs 258787 MiB of GPU memory (target + drafter + KV budget) but 2 GPU(s) give "
        "258786 MiB at memory utilization 0.9: use a node with more GPU memory, a shorter context (smaller "
        "KV budget) or a smaller drafter."
    ]


def test_memory_needed_boundary():
    limits = {"memory_needed_mib": 258786, "memory_utilization": 0.9}
    assert ng.evaluate_thresholds({"gpus": GPUS_X2}, limits)["memory_needed"] == []


def test_memory_held_by_the_engine_being_replaced_is_expected():
    gpus = [dict(GPUS_X2[0], memory_used_mib=130000)]
    facts = {"gpus": gpus, "holders": [SGLANG]}
    limits = {"max_memory_used_mib": 1024, "swappable_units": ["sglang-qwen.service"]}
    assert ng.evaluate_thresholds(facts, limits)["memory_used"] == []
    not_swappable = ng.evaluate_thresholds(facts, {"max_memory_used_mib": 1024})["memory_used"]
    assert not_swappable == [
        "GPU 0 already has 130000 MiB in use (at most 1024 MiB may be in use before the swap), held by pid "
        "812 (python3, unit sglang-qwen.service): stop these first; only the engine being replaced (none "
        "named) may hold the GPUs."
    ]
    facts["holders"] = [SGLANG, ROGUE]
    mixed = ng.evaluate_thresholds(facts, limits)["memory_used"]
    assert "held by pid 99 (python3, unit session-3.scope)" in mixed[0]


def test_driver_versions_must_match_exactly():
    assert ng.check_driver_versions("580.159.04", "580.159.04") == []
    assert ng.check_driver_versions(None, "580.159.04") == []
    assert ng.check_driver_versions("580.159.04", "580.126.09") == [
        "The userspace NVIDIA driver in this node is 580.126.09 but the host's kernel module is 580.159.04: "
        "install userspace 580.159.04 in the container (--no-kernel-module) and hold it against upgrades."
    ]


# --------------------------------------------------------------------------- container config

HOST = {
    "/dev/nvidia0": {"char": True, "major": 195, "minor": 0},
    "/dev/nvidia1": {"char": True, "major": 195, "minor": 1},
    "/dev/nvidiactl": {"char": True, "major": 195, "minor": 255},
    "/dev/nvidia-uvm": {"char": True, "major": 238, "minor": 0},
    "/dev/nvidia-uvm-tools": {"char": True, "major": 238, "minor": 1},
}

LXC_CONFIG = """\
lxc.include = /usr/share/lxc/config/common.conf
lxc.net.0.type = veth
lxc.cgroup2.devices.allow = c 195:* rwm
lxc.cgroup2.devices.allow = c 238:* rwm
lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind,create=file
lxc.mount.entry = /dev/nvidiactl dev/nvidiactl none bind,create=file
lxc.mount.entry = /dev/nvidia-uvm dev/nvidia-uvm none bind,create=file
lxc.mount.entry = /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,create=file
"""

PVE_CONFIG = """\
arch: amd64
cores: 16
dev0: /dev/nvidia0,gid=44
dev1: /dev/nvidia1
dev2: /dev/nvidiactl
dev3: /dev/nvidia-uvm
dev4: /dev/nvidia-uvm-tools
hostname: gpu-node-1
lxc.cgroup.devices.allow: c 195:* rwm

[before-driver-upgrade]
dev0: /dev/nvidia7
"""


def test_plain_lxc_config_passes():
    result = ng.check_container_config(ng.parse_lxc_config(LXC_CONFIG), HOST, gpu_count=1, uvm_major=238)
    assert result == {
        "problems": [],
        "warnings": [],
        "devices": {
            "/dev/nvidia0": "lxc.mount.entry (line 5)",
            "/dev/nvidiactl": "lxc.mount.entry (line 6)",
            "/dev/nvidia-uvm": "lxc.mount.entry (line 7)",
            "/dev/nvidia-uvm-tools": "lxc.mount.entry (line 8)",
        },
    }


def test_proxmox_dev_lines_pass_and_snapshots_are_ignored():
    parsed = ng.parse_lxc_config(PVE_CONFIG)
    assert [e["path"] for e in parsed["dev_entries"]] == [
        "/dev/nvidia0",
        "/dev/nvidia1",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    result = ng.check_container_config(parsed, HOST, gpu_count=2, uvm_major=238)
    assert result["problems"] == []
    assert result["warnings"] == [
        "lxc.cgroup.devices.allow (cgroup v1) lines are ignored on a cgroup v2 host (Proxmox 7 and later): "
        "use lxc.cgroup2.devices.allow."
    ]


def test_optional_mount_entry_warns():
    text = LXC_CONFIG.replace("dev/nvidia0 none bind,create=file", "dev/nvidia0 none bind,optional,create=file")
    result = ng.check_container_config(ng.parse_lxc_config(text), HOST, gpu_count=1, uvm_major=238)
    assert result["problems"] == []
    assert result["warnings"] == [
        "lxc.mount.entry for /dev/nvidia0 (line 5) is 'optional': if the device is missing the container "
        "still starts, without the GPU, and the engine fails later or runs without it. Remove 'optional' so "
        "a missing GPU stops the container from starting."
    ]


def test_missing_allow_missing_uvm_and_too_few_gpus_fail():
    text = "\n".join(line for line in LXC_CONFIG.splitlines() if "238:*" not in line and "dev/nvidia-uvm " not in line)
    result = ng.check_container_config(ng.parse_lxc_config(text), HOST, gpu_count=2, uvm_major=238)
    assert result["problems"] == [
        "lxc.mount.entry for /dev/nvidia-uvm-tools (line 6) binds device 238:1 but no "
        "lxc.cgroup2.devices.allow line allows it: add 'lxc.cgroup2.devices.allow: c 238:* rwm' and restart "
        "the container (NVML otherwise fails with 'Unknown Error').",
        "The container config does not pass /dev/nvidia-uvm into the container: add 'lxc.mount.entry: "
        "/dev/nvidia-uvm dev/nvidia-uvm none bind,create=file' with a matching lxc.cgroup2.devices.allow "
        "line, or a devN: /dev/nvidia-uvm line on PVE 8.1+.",
        "The container config passes 1 GPU device node(s) (/dev/nvidia0) but the node needs 2: add the "
        "missing /dev/nvidiaN entries.",
    ]


def test_stale_uvm_major_and_absent_source_fail():
    host = dict(HOST)
    host["/dev/nvidia-uvm"] = {"char": True, "major": 237, "minor": 0}
    del host["/dev/nvidia0"]
    text = LXC_CONFIG.replace("238:* rwm", "237:* rwm")
    result = ng.check_container_config(ng.parse_lxc_config(text), host, gpu_count=None, uvm_major=238)
    assert result["problems"][:2] == [
        "lxc.mount.entry for /dev/nvidia0 (line 5) binds /dev/nvidia0, which does not exist on the host.",
        "lxc.mount.entry for /dev/nvidia-uvm (line 7) binds a node with major 237 but the host's nvidia-uvm "
        "major is 238 (/proc/devices): recreate the node and fix the allow line.",
    ]


@pytest.mark.parametrize("value", ["inf", "1e400", "9" * 5000, "nan", str(2**70)])
def test_numbers_nvidia_smi_cannot_report_are_parse_errors_not_crashes(value):
    """inf, 1e400 or huge numbers gave OverflowError (issue 23, LOW)."""
    line = (X1 / "query-gpu-noheader.csv").read_text().splitlines()[0].split(", ")
    line[ng.QUERY_GPU_FIELDS.index("memory.total")] = value
    with pytest.raises(ng.NvidiaParseError, match="expected a number"):
        ng.parse_query_gpu(", ".join(line) + "\n")


@pytest.mark.parametrize("rc", [124, 137, -9])
def test_a_hang_that_ignores_sigterm_is_a_timeout(rc):
    assert ng.classify_nvidia_smi_failure("", rc, "nvidia-smi")["kind"] == "timeout"


def test_a_cuda_smoke_test_timeout_says_it_timed_out():
    """Issue 23: a hung smoke test was reported as "did not finish cleanly (exit 124)"."""
    assert ng.cuda_smoke_test_failure(124, "", 7, "libcuda.so.1") == (
        "CUDA smoke test timed out after 7 s: cuInit(0) through libcuda.so.1 did not return. A hung GPU or "
        "driver does this (look at the host's kernel log, dmesg, for Xid errors, and run nvidia-smi on the "
        "host; a GPU reset or a host reboot may be needed), and so does a libcuda that is not the CUDA "
        "driver library (check the libcuda option). Raise timeout only for a node known to take that long "
        "to initialise CUDA."
    )
    for rc in (137, -9):
        assert ng.cuda_smoke_test_failure(rc, "", 7, "x.so").startswith(
            "CUDA smoke test timed out after 7 s and ignored SIGTERM (killed 5 s later): cuInit(0) through x.so"
        )
    # Any other exit is the probe crashing: its exit status and stderr, as before.
    assert ng.cuda_smoke_test_failure(1, "  Segmentation fault\n", 7, "x.so") == (
        "CUDA smoke test did not finish cleanly (exit 1): Segmentation fault"
    )
