"""The GPU checks against a real NVIDIA GPU: real nvidia-smi, real device nodes, real cuInit, real holders.

Run on any machine with an NVIDIA GPU and its driver (no Ansible needed):

    python3 tests/gpu/test_nvidia_gpu_probe.py        # prints a JSON summary, exit 0 when all pass
    python3 -m pytest tests/gpu/test_nvidia_gpu_probe.py

It skips when nvidia-smi is absent. The holder test starts a child process that creates a CUDA
context and allocates 1 GiB through libcuda, then checks that the probe finds it by its open
/dev/nvidia* files and in nvidia-smi's compute apps, with the memory it uses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HOLD = r"""
import ctypes, sys, time
lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0
dev = ctypes.c_int()
assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
ptr = ctypes.c_void_p()
assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)) == 0
print("holding", flush=True)
time.sleep(60)
"""


def load_probe():
    """module_utils/nvidia_gpu_probe.py, importable with or without Ansible installed."""
    try:
        import ansible.module_utils  # noqa: F401
    except ImportError:
        for name in ("ansible", "ansible.module_utils"):
            pkg = types.ModuleType(name)
            pkg.__path__ = []
            sys.modules[name] = pkg
    for name in ("nvidia_gpu", "nvidia_gpu_probe"):
        full = f"ansible.module_utils.{name}"
        if full in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(full, REPO / "module_utils" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules["ansible.module_utils.nvidia_gpu_probe"]


def skip_without_gpu():
    if shutil.which("nvidia-smi") is None:
        if "pytest" not in sys.modules:  # run as a script
            print(json.dumps({"skipped": "no nvidia-smi on this machine"}))
            sys.exit(0)
        import pytest

        pytest.skip("no nvidia-smi on this machine")


def test_real_gpu_passes_every_check():
    skip_without_gpu()
    probe = load_probe()
    facts = probe.gather(probe.Runner(), {"thresholds": {"gpu_count": 1, "min_compute_capability": "8.0"}})
    assert facts["nvidia_smi"]["ok"], facts["nvidia_smi"]
    assert facts["gpu_count"] >= 1
    assert facts["driver"]["kernel"] == facts["driver"]["userspace"], facts["driver"]
    assert facts["driver"]["match"] is True
    assert facts["device_nodes"]["/dev/nvidiactl"] == {"char": True, "major": 195, "minor": 255}
    assert facts["device_nodes"]["/dev/nvidia0"] == {"char": True, "major": 195, "minor": 0}
    assert facts["device_nodes"]["/dev/nvidia-uvm"]["major"] == facts["majors"]["nvidia-uvm"]
    assert facts["cuda_init"]["status"] == "passed", facts["cuda_init"]
    for check in ("nvidia_smi", "driver", "device_nodes", "cuda", "gpu_count", "compute_capability"):
        assert facts["checks"][check] == [], (check, facts["checks"][check])
    return facts


def test_a_cuda_process_is_found_as_holder():
    skip_without_gpu()
    probe = load_probe()
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        time.sleep(1)
        facts = probe.gather(probe.Runner(), {"thresholds": {"max_memory_used_mib": 512}})
    finally:
        child.kill()
        child.wait()
    local = [h for h in facts["holders"]["local"] if h["pid"] == child.pid]
    assert len(local) == 1, facts["holders"]
    assert {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"} <= set(local[0]["devices"]), local
    apps = [a for a in facts["holders"]["compute_apps"] if a["pid"] == child.pid]
    assert len(apps) == 1 and apps[0]["used_memory_mib"] >= 1024, facts["holders"]["compute_apps"]
    assert facts["holders"]["memory_used_mib"]["0"] >= 1024
    # held by a process outside any swappable unit: the memory_used check must name it
    assert any(f"held by pid {child.pid}" in p for p in facts["checks"]["memory_used"]), facts["checks"]
    return {"holder": local[0], "app": apps[0], "memory_used_mib": facts["holders"]["memory_used_mib"]}


HIDE_UVM = r"""
set -eu
mkdir -p "$1"
mount -t tmpfs tmpfs "$1"
for f in null zero urandom random nvidiactl nvidia0; do touch "$1/$f"; mount --bind "/dev/$f" "$1/$f"; done
mount --rbind "$1" /dev
shift
exec setpriv --inh-caps=-mknod --bounding-set=-mknod "$@"
"""


def test_container_without_uvm_fails_cuda_init():
    """/dev as a container without nvidia-uvm sees it (private mount namespace, no mknod): nvidia-smi
    still works, cuInit fails, and the device node and CUDA checks both say what to do."""
    skip_without_gpu()
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        print("needs root, unshare and setpriv", file=sys.stderr)
        return {"skipped": "needs root, unshare and setpriv"}
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", HIDE_UVM, "hide-uvm", "/tmp/gpu-test-dev", sys.executable, __file__, "--gather"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    facts = json.loads(res.stdout)
    assert facts["nvidia_smi"]["ok"] is True
    assert facts["device_nodes"]["/dev/nvidia-uvm"] is None
    assert facts["checks"]["device_nodes"][0].startswith("/dev/nvidia-uvm is missing")
    assert facts["cuda_init"]["status"] == "failed", facts["cuda_init"]
    assert "/dev/nvidia-uvm is missing" in facts["cuda_init"]["message"]
    return {"cuda_init": facts["cuda_init"], "device_nodes": facts["checks"]["device_nodes"]}


if __name__ == "__main__":
    if sys.argv[1:] == ["--gather"]:
        probe = load_probe()
        print(json.dumps(probe.gather(probe.Runner(), {}), default=str))
        sys.exit(0)
    summary = {}
    failed = False
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                result = fn()
                summary[name] = {"passed": True, "facts": result}
            except AssertionError as exc:
                failed = True
                summary[name] = {"passed": False, "error": repr(exc)[:4000]}
    print(json.dumps(summary, indent=1, default=str))
    sys.exit(1 if failed else 0)
