"""nvidia_gpu_facts and lxc_gpu_config run in-process against the fake nvidia-smi and real device nodes.

Device nodes are made with mknod in a temporary directory (needs root, as CI runs); the process
table is a temporary directory laid out like /proc.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import lxc_gpu_config
import nvidia_gpu_facts
import pytest
from ansible.module_utils.testing import patch_module_args
from module_results import all_text_is_utf8

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "fakes" / "nvidia_smi.py"
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
KERNEL_580_159 = (FIXTURES / "h200-x1" / "driver.txt").read_text().splitlines(keepends=True)[:2]
NODES = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255), "nvidia-uvm": (238, 0)}
NODES["nvidia-uvm-tools"] = (238, 1)


def mknod(path: Path, major: int, minor: int) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("making device nodes needs root (CAP_MKNOD)")


class Node:
    """A GPU node's view: device dir, /proc, kernel version file and the fake nvidia-smi's state."""

    def __init__(self, tmp: Path, monkeypatch, fixture: str = "h200-x1") -> None:
        self.tmp = tmp
        self.dev = tmp / "dev"
        self.proc = tmp / "proc"
        self.holders = tmp / "holders"
        for d in (self.dev, self.proc, self.holders):
            d.mkdir()
        gpus = 2 if fixture == "h200-x2" else 1
        for name, (major, minor) in NODES.items():
            if name.startswith("nvidia") and name[6:].isdigit() and int(name[6:]) >= gpus:
                continue
            mknod(self.dev / name, major, minor)
        (self.proc / "devices").write_text((FIXTURES.parent / "nvidia-smi-extra" / "proc-devices.txt").read_text())
        self.kernel = tmp / "version"
        self.kernel.write_text("".join(KERNEL_580_159))
        self.state = tmp / "gpu.json"
        self.set(fixture)
        self.procs: list[subprocess.Popen] = []
        monkeypatch.setenv("LAB_FAKES_GPU_STATE", str(self.state))
        monkeypatch.setenv("LAB_FAKES_NVIDIA_SMI_FIXTURES", str(FIXTURES))
        monkeypatch.setenv("LAB_FAKES_GPU_HOLDERS", str(self.holders))

    def set(self, fixture: str, fault: str | None = None) -> None:
        self.state.write_text(json.dumps({"fixture": fixture, "fault": fault}))

    def hold(self, gpu: int, mib: int, unit: str) -> int:
        """A live process holding a GPU: nvidia-smi's view (holder file) and /proc's (fds, cgroup)."""
        proc = subprocess.Popen(["sleep", "60"])
        self.procs.append(proc)
        (self.holders / f"{proc.pid}.json").write_text(
            json.dumps({"pid": proc.pid, "gpus": [gpu], "mib": mib, "name": "python3"})
        )
        base = self.proc / str(proc.pid)
        (base / "fd").mkdir(parents=True)
        (base / "comm").write_text("sleep\n")
        (base / "cgroup").write_text(f"0::/system.slice/{unit}\n")
        for fd, target in enumerate(["/dev/nvidiactl", f"/dev/nvidia{gpu}", "/dev/nvidia-uvm", "/dev/null"], 3):
            os.symlink(target, base / "fd" / str(fd))
        return proc.pid

    def args(self, **extra) -> dict:
        args = {
            "nvidia_smi_path": str(FAKE),
            "driver_version_path": str(self.kernel),
            "dev_dir": str(self.dev),
            "proc_dir": str(self.proc),
            "libcuda": "libcuda-not-installed.so.1",
        }
        args.update(extra)
        return args


@pytest.fixture
def node(tmp_path, monkeypatch):
    n = Node(tmp_path, monkeypatch)
    yield n
    for proc in n.procs:
        proc.kill()
        proc.wait()


def run(module, args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)


def test_healthy_one_gpu_node(node, capsys):
    result = run(nvidia_gpu_facts, node.args(thresholds={"gpu_count": 1, "min_memory_mib": 140000}), capsys)
    assert result["changed"] is False
    assert result["ok"] is True
    assert result["problems"] == []
    assert result["gpus"] == [
        {
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
    ]
    assert result["driver"] == {
        "kernel": "580.159.04",
        "userspace": "580.159.04",
        "nvml": "580.159",
        "cuda": "13.0",
        "match": True,
    }
    assert result["device_nodes"] == {
        "/dev/nvidiactl": {"char": True, "major": 195, "minor": 255},
        "/dev/nvidia0": {"char": True, "major": 195, "minor": 0},
        "/dev/nvidia-uvm": {"char": True, "major": 238, "minor": 0},
        "/dev/nvidia-uvm-tools": {"char": True, "major": 238, "minor": 1},
    }
    assert result["majors"]["nvidia-uvm"] == 238
    assert result["cuda_init"]["status"] == "not available"
    assert result["holders"] == {"memory_used_mib": {"0": 0}, "compute_apps": [], "local": []}


def test_check_mode_reads_the_same(node, capsys):
    normal = run(nvidia_gpu_facts, node.args(), capsys)
    checked = run(nvidia_gpu_facts, node.args(_ansible_check_mode=True), capsys)
    assert checked == normal


def test_engine_holding_the_gpu_is_found_with_its_unit(tmp_path, monkeypatch, capsys):
    node = Node(tmp_path, monkeypatch, "h200-x2")
    try:
        pid = node.hold(1, 3380, "sglang-qwen.service")
        limits = {"gpu_count": 2, "max_memory_used_mib": 1024, "swappable_units": ["sglang-qwen.service"]}
        result = run(nvidia_gpu_facts, node.args(thresholds=limits), capsys)
        assert result["ok"] is True
        assert result["holders"]["memory_used_mib"] == {"0": 0, "1": 3380}
        assert result["holders"]["compute_apps"] == [
            {
                "pid": pid,
                "process_name": "sleep",
                "used_memory_mib": 3380,
                "gpu_uuid": "GPU-d7591872-da88-51cf-78ae-7109632ee706",
            }
        ]
        assert result["holders"]["local"] == [
            {
                "pid": pid,
                "comm": "sleep",
                "unit": "sglang-qwen.service",
                "devices": ["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidiactl"],
            }
        ]
        limits["swappable_units"] = []
        held = run(nvidia_gpu_facts, node.args(thresholds=limits), capsys)
        assert held["ok"] is False
        assert held["checks"]["memory_used"] == [
            "GPU 1 already has 3380 MiB in use (at most 1024 MiB may be in use before the swap), "
            f"held by pid {pid} "
            "(sleep, unit sglang-qwen.service): stop these first; only the engine being replaced (none "
            "named) may hold the GPUs."
        ]
    finally:
        for proc in node.procs:
            proc.kill()
            proc.wait()


def test_driver_mismatch_reports_both_versions(node, capsys):
    node.set("h200-x1", "driver-mismatch")
    result = run(nvidia_gpu_facts, node.args(), capsys)
    assert result["ok"] is False
    assert result["nvidia_smi"]["rc"] == 18
    assert result["nvidia_smi"]["error"]["kind"] == "driver-mismatch"
    assert result["driver"]["kernel"] == "580.159.04"
    assert result["driver"]["userspace"] == "580.126"
    assert result["driver"]["match"] is False
    assert result["checks"]["nvidia_smi"][0].startswith(
        "The NVIDIA userspace driver in this node (NVML library 580.126) does not match the host's kernel "
        "module (580.159.04)"
    )
    assert result["checks"]["driver"] == []  # said once, by the nvidia_smi check
    assert result["gpus"] == []


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("no-devices", "no-devices"),
        ("nvml-fail", "nvml-unknown"),
        ("driver-not-loaded", "driver-not-loaded"),
        ("access-blocked", "access-blocked"),
    ],
)
def test_nvml_faults_are_named(node, capsys, fault, kind):
    node.set("h200-x1", fault)
    result = run(nvidia_gpu_facts, node.args(thresholds={"gpu_count": 1}), capsys)
    assert result["ok"] is False
    assert result["nvidia_smi"]["error"]["kind"] == kind
    assert result["checks"]["gpu_count"] == [
        "This node has 0 GPU(s) but the inventory needs 1: pass the missing GPUs into the container on the "
        "Proxmox host, or lower the tensor-parallel size for this node's group."
    ]
    assert "/dev/nvidia0" in result["device_nodes"]  # looked up from what /dev holds


def test_absent_nvidia_smi(node, capsys):
    result = run(nvidia_gpu_facts, node.args(nvidia_smi_path=str(node.tmp / "nvidia-smi")), capsys)
    assert result["nvidia_smi"]["error"]["kind"] == "absent"
    assert result["checks"]["nvidia_smi"][0].startswith(
        f"nvidia-smi was not found or cannot run ({node.tmp}/nvidia-smi)"
    )


def test_missing_uvm_node(node, capsys):
    (node.dev / "nvidia-uvm").unlink()
    result = run(nvidia_gpu_facts, node.args(), capsys)
    assert result["ok"] is False
    assert result["device_nodes"]["/dev/nvidia-uvm"] is None
    assert [p.split(":")[0] for p in result["checks"]["device_nodes"]] == ["/dev/nvidia-uvm is missing"]


def test_kernel_module_and_userspace_differ(node, capsys):
    node.kernel.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.126.09  Release Build  (dvs-builder@U16)\n"
    )
    result = run(nvidia_gpu_facts, node.args(), capsys)
    assert result["checks"]["driver"] == [
        "The userspace NVIDIA driver in this node is 580.159.04 but the host's kernel module is 580.126.09: "
        "install userspace 580.126.09 in the container (--no-kernel-module) and hold it against upgrades."
    ]


def test_no_kernel_module(node, capsys):
    result = run(nvidia_gpu_facts, node.args(driver_version_path=str(node.tmp / "absent")), capsys)
    assert result["checks"]["driver"][0].startswith(f"{node.tmp}/absent cannot be read: the NVIDIA kernel module")


def test_cuda_probe_that_cannot_init_is_a_problem(node, capsys):
    # libc has no cuInit: the probe dies in the library like a broken libcuda would
    result = run(nvidia_gpu_facts, node.args(libcuda="libc.so.6"), capsys)
    assert result["cuda_init"]["status"] == "failed"
    assert result["checks"]["cuda"] == [
        "CUDA cannot initialise in this node: cuInit returned 999 (CUDA_ERROR_UNKNOWN)."
    ]


def test_a_hung_cuda_smoke_test_is_reported_as_a_timeout(node, capsys, tmp_path, deadline, monkeypatch):
    """Issue 23: a smoke test that hangs (here opening a FIFO as libcuda) ends at the module's timeout,
    and the warning says it timed out after that many seconds, not "exit 124"."""
    os.mkfifo(tmp_path / "libcuda-fifo")
    # The warnings as the module gives them to Ansible (in a process that has loaded ansible-core's
    # controller side, as the whole unit suite has, they go to its display, not into the result).
    warnings: list[str] = []
    real_warn = nvidia_gpu_facts.ModuleRunner.warn
    monkeypatch.setattr(nvidia_gpu_facts.ModuleRunner, "warn", lambda self, m: (warnings.append(m), real_warn(self, m)))
    with deadline(20):
        result = run(nvidia_gpu_facts, node.args(libcuda=str(tmp_path / "libcuda-fifo"), timeout=1), capsys)
    assert result["cuda_init"]["status"] == "failed"
    assert any(w.startswith("CUDA smoke test timed out after 1 s: cuInit(0) through ") for w in warnings), warnings
    assert not any("exit 124" in w for w in warnings)


@pytest.mark.parametrize(
    ("thresholds", "message"),
    [
        (
            {"memory_utilization": 1.5},
            "thresholds.memory_utilization must be in (0, 1], got 1.5: use e.g. 0.9.",
        ),
        ({"gpu_count": -1}, "thresholds.gpu_count must not be negative, got -1."),
        (
            {"min_compute_capability": "hopper"},
            "thresholds.min_compute_capability must look like 8.6, got 'hopper'.",
        ),
    ],
)
def test_bad_thresholds_fail_with_the_reason(node, capsys, thresholds, message):
    result = run(nvidia_gpu_facts, node.args(thresholds=thresholds), capsys)
    assert result["failed"] is True
    assert result["msg"] == message


def test_a_zero_timeout_is_refused_not_taken_as_none(node, capsys):
    result = run(nvidia_gpu_facts, {**node.args(), "timeout": 0}, capsys)
    assert result["failed"] is True
    assert result["msg"] == "timeout must be at least 1 second, got 0 (0 would mean none)."


def test_a_timeout_past_an_hour_is_refused(node, capsys):
    """Issue 23: a huge timeout (10**30) let a hung nvidia-smi hold the play for ever."""
    result = run(nvidia_gpu_facts, {**node.args(), "timeout": 3601}, capsys)
    assert result["failed"] is True
    assert result["msg"] == "timeout must be at most 3600 seconds, got 3601: a GPU query that takes longer hangs."
    assert run(nvidia_gpu_facts, {**node.args(), "timeout": 3600}, capsys)["ok"] is True


@pytest.mark.parametrize("name", ["nvidia_smi_path", "driver_version_path", "dev_dir", "proc_dir", "libcuda"])
def test_a_nul_in_a_path_option_is_a_message(node, capsys, name):
    """Issue 23: proc_dir "\\x00" raised ValueError (embedded null byte) out of the module."""
    result = run(nvidia_gpu_facts, {**node.args(cuda_smoke_test=True), name: "a\x00b"}, capsys)
    assert result["failed"] is True
    assert result["msg"] == f"{name} holds a NUL character, which no path can hold; check {name}."


def test_non_utf8_nvidia_smi_output_reaches_the_controller_as_text(node, capsys, tmp_path):
    """Undecodable bytes came back as lone surrogates, which the controller refuses (issue 23, LOW)."""
    garbling = tmp_path / "nvidia-smi-garbled"
    garbling.write_text(
        f"#!/bin/bash\nset -o pipefail\n{sys.executable} {FAKE} \"$@\" | sed 's/NVIDIA H200/NVIDIA H\\xff200/g'\n"
    )
    garbling.chmod(0o755)
    result = run(nvidia_gpu_facts, node.args(nvidia_smi_path=str(garbling)), capsys)
    assert result["gpus"][0]["name"] == "NVIDIA H\ufffd200", result
    assert all_text_is_utf8(result)


@pytest.mark.parametrize("where", ["driver_version_path", "proc_dir"])
def test_a_fifo_where_a_proc_file_should_be_never_hangs(node, capsys, tmp_path, deadline, where):
    """open() of a FIFO blocks until a writer comes: the module hung on one (issue 23, LOW)."""
    if where == "driver_version_path":
        fifo = tmp_path / "version-fifo"
        os.mkfifo(fifo)
        args = node.args(driver_version_path=str(fifo))
    else:
        (node.proc / "devices").unlink()
        os.mkfifo(node.proc / "devices")
        args = node.args()
    with deadline(10):
        result = run(nvidia_gpu_facts, args, capsys)
    if where == "driver_version_path":
        assert result["ok"] is False  # the kernel's version cannot be read: named as a problem
    assert "failed" not in result
    assert all_text_is_utf8(result)


# --------------------------------------------------------------------------- host side


@pytest.fixture
def host(tmp_path):
    dev = tmp_path / "hostdev"
    dev.mkdir()
    for name, (major, minor) in NODES.items():
        mknod(dev / name, major, minor)
    (tmp_path / "devices").write_text((FIXTURES.parent / "nvidia-smi-extra" / "proc-devices.txt").read_text())
    return tmp_path


def lxc_config(host: Path, entries: list[str], allow: tuple[str, ...] = ("c 195:* rwm", "c 238:* rwm")) -> Path:
    lines = ["lxc.include = /usr/share/lxc/config/common.conf"]
    lines += [f"lxc.cgroup2.devices.allow = {a}" for a in allow]
    lines += [f"lxc.mount.entry = {host}/hostdev/{e} dev/{e} none bind,create=file" for e in entries]
    path = host / "config"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_container_config_passes(host, capsys):
    config = lxc_config(host, ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"])
    args = {"config_path": str(config), "gpu_count": 2, "proc_devices_path": str(host / "devices")}
    result = run(lxc_gpu_config, args, capsys)
    assert result["ok"] is True
    assert result["uvm_major"] == 238
    assert result["devices"] == {
        "/dev/nvidia0": "lxc.mount.entry (line 4)",
        "/dev/nvidia1": "lxc.mount.entry (line 5)",
        "/dev/nvidiactl": "lxc.mount.entry (line 6)",
        "/dev/nvidia-uvm": "lxc.mount.entry (line 7)",
        "/dev/nvidia-uvm-tools": "lxc.mount.entry (line 8)",
    }


def test_container_config_without_uvm_allow_fails(host, capsys):
    config = lxc_config(host, ["nvidia0", "nvidiactl", "nvidia-uvm"], allow=("c 195:* rwm",))
    args = {"config_path": str(config), "gpu_count": 1, "proc_devices_path": str(host / "devices")}
    result = run(lxc_gpu_config, args, capsys)
    assert result["ok"] is False
    assert result["problems"][0].startswith(
        "lxc.mount.entry for /dev/nvidia-uvm (line 5) binds device 238:0 but no lxc.cgroup2.devices.allow "
        "line allows it"
    )
    assert result["warnings_found"] == ["The container config does not pass /dev/nvidia-uvm-tools (profilers need it)."]


def test_unreadable_container_config_fails_with_where_it_looked(host, capsys):
    result = run(lxc_gpu_config, {"config_path": str(host / "nope.conf")}, capsys)
    assert result["failed"] is True
    assert result["msg"].startswith(f"Cannot read the container config {host}/nope.conf on this host (No such file")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (
            b"lxc.mount.entry = /dev/nvidia0\xff dev/nvidia0 none bind\n",
            "is not UTF-8 text (invalid start byte at byte 30)",
        ),
        (None, "is not a regular file (a FIFO)"),
        (b"#" * (4 * 1024 * 1024 + 1), "is larger than 4194304 bytes"),
    ],
)
def test_a_garbled_fifo_or_huge_container_config_is_a_message(host, capsys, deadline, content, reason):
    """A non-UTF-8 config raised UnicodeDecodeError, a FIFO hung the module (issue 23, LOW)."""
    path = host / "config"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    with deadline(10):
        result = run(lxc_gpu_config, {"config_path": str(path), "proc_devices_path": str(host / "devices")}, capsys)
    assert result["failed"] is True
    assert result["msg"].startswith(
        f"Cannot read the container config {path} on this host (the container config {path} {reason}"
    )
    assert result["msg"].endswith(
        "check the container id/name in the inventory (Proxmox: /etc/pve/lxc/<vmid>.conf) and that this is the container's host."
    )


def test_nul_characters_in_the_config_path_or_its_entries_are_no_traceback(host, capsys, deadline):
    config = lxc_config(host, ["nvidia0", "nvidiactl", "nvidia-uvm"])
    config.write_bytes(config.read_bytes().replace(b"hostdev/nvidia0", b"hostdev/nvi\x00dia0"))
    os.mkfifo(host / "devices-fifo")
    with deadline(10):
        result = run(
            lxc_gpu_config,
            {"config_path": str(config), "gpu_count": 1, "proc_devices_path": str(host / "devices-fifo")},
            capsys,
        )
    assert result["ok"] is False
    assert result["uvm_major"] is None
    result = run(lxc_gpu_config, {"config_path": f"{host}/con\x00fig"}, capsys)
    assert result["failed"] is True
    assert "holds a NUL character, which no path can hold" in result["msg"]


def test_the_action_checks_in_process_on_the_controller_only_without_become():
    """plugins/action/lxc_gpu_config.py: delegated to the controller itself it reads the config in
    the worker; with become (root) or on another host it runs the module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lxc_gpu_config_action", REPO / "plugins/action/lxc_gpu_config.py")
    action = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(action)
    assert action.runs_in_process("local", become=False) is True
    assert action.runs_in_process("local", become=True) is False
    assert action.runs_in_process("ssh", become=False) is False
    assert action.LXC_GPU_CONFIG_ARGS is lxc_gpu_config.LXC_GPU_CONFIG_ARGS


def test_the_in_process_check_returns_what_the_module_returns(host, capsys):
    from ansible.module_utils.nvidia_gpu_probe import check_container_config_file

    config = lxc_config(host, ["nvidia0", "nvidiactl", "nvidia-uvm"], allow=("c 195:* rwm",))
    args = {"config_path": str(config), "gpu_count": 1, "proc_devices_path": str(host / "devices")}
    module_result = run(lxc_gpu_config, args, capsys)
    found = check_container_config_file(str(config), 1, str(host / "devices"))
    assert {k: module_result[k] for k in found} == json.loads(json.dumps(found))
