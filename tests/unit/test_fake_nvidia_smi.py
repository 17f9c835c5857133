"""The lab's fake nvidia-smi answers exactly what the real one printed (tests/fixtures/nvidia-smi)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "fakes" / "nvidia_smi.py"
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
EXTRA = FIXTURES.parent / "nvidia-smi-extra"
ALL_FIELDS = "index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used,memory.free,compute_cap"


class Node:
    def __init__(self, tmp: Path, fixture: str, fault: str | None = None) -> None:
        self.state = tmp / "gpu.json"
        self.holders = tmp / "holders"
        self.holders.mkdir()
        self.set(fixture, fault)
        self.procs: list[subprocess.Popen] = []

    def set(self, fixture: str, fault: str | None = None) -> None:
        self.state.write_text(json.dumps({"fixture": fixture, "fault": fault}))

    def hold(self, gpus: list[int], mib: int, name: str = "python3") -> int:
        proc = subprocess.Popen(["sleep", "60"])
        self.procs.append(proc)
        data = {"pid": proc.pid, "gpus": gpus, "mib": mib, "name": name}
        (self.holders / f"{proc.pid}.json").write_text(json.dumps(data))
        return proc.pid

    def run(self, *args: str) -> tuple[str, int]:
        env = dict(
            os.environ,
            LAB_FAKES_GPU_STATE=str(self.state),
            LAB_FAKES_NVIDIA_SMI_FIXTURES=str(FIXTURES),
            LAB_FAKES_GPU_HOLDERS=str(self.holders),
        )
        res = subprocess.run([sys.executable, str(FAKE), *args], env=env, capture_output=True, text=True, check=False)
        return res.stdout + res.stderr, res.returncode


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, "h200-x1")
    yield n
    for proc in n.procs:
        proc.kill()
        proc.wait()


def test_first_line_says_what_it_stands_in_for():
    lines = FAKE.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/python3"
    assert lines[1].startswith('"""Stand-in for NVIDIA\'s nvidia-smi')


@pytest.mark.parametrize("fixture", ["h200-x1", "h200-x2"])
def test_structured_query_is_the_real_capture(node, fixture):
    node.set(fixture)
    out, rc = node.run(f"--query-gpu={ALL_FIELDS}", "--format=csv,noheader,nounits")
    assert rc == 0
    assert out == (FIXTURES / fixture / "query-gpu-noheader.csv").read_text()


@pytest.mark.parametrize("fixture", ["h200-x1", "h200-x2"])
def test_query_with_header_and_units_is_the_real_capture(node, fixture):
    node.set(fixture)
    fields = ALL_FIELDS + ",temperature.gpu,power.draw,utilization.gpu"
    out, rc = node.run(f"--query-gpu={fields}", "--format=csv")
    assert rc == 0
    assert out == (FIXTURES / fixture / "query-gpu.csv").read_text()


def test_nounits_keeps_units_in_the_header(node):
    out, rc = node.run("--query-gpu=index,memory.total,memory.used", "--format=csv,nounits")
    assert (out, rc) == ((EXTRA / "query-gpu-nounits.csv").read_text(), 0)


@pytest.mark.parametrize("fixture", ["h200-x1", "h200-x2"])
def test_table_and_empty_process_list_are_the_real_capture(node, fixture):
    node.set(fixture)
    assert node.run() == ((FIXTURES / fixture / "nvidia-smi.txt").read_text(), 0)
    out, rc = node.run("--query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid", "--format=csv")
    assert (out, rc) == ((FIXTURES / fixture / "query-apps.csv").read_text(), 0)


def test_detail_is_the_real_capture(node):
    assert node.run("-q") == ((FIXTURES / "h200-x1" / "nvidia-smi-q.txt").read_text(), 0)


def test_list_and_version(node):
    node.set("h200-x2")
    assert node.run("-L") == (
        "GPU 0: NVIDIA H200 (UUID: GPU-f65200df-1105-763f-f85d-b3e482295931)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-d7591872-da88-51cf-78ae-7109632ee706)\n",
        0,
    )
    assert node.run("--version") == (
        "NVIDIA-SMI version  : 580.159.04\n"
        "NVML version        : 580.159\n"
        "DRIVER version      : 580.159.04\n"
        "CUDA Version        : 13.0\n",
        0,
    )


def test_a_live_holder_uses_memory_and_shows_as_compute_app(node):
    node.set("h200-x2")
    pid = node.hold([1], 3380)
    out, rc = node.run("--query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid", "--format=csv")
    assert rc == 0
    assert out == (
        "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n"
        f"{pid}, sleep, 3380 MiB, GPU-d7591872-da88-51cf-78ae-7109632ee706\n"
    )
    out, rc = node.run("--query-gpu=index,memory.used,memory.free", "--format=csv,noheader,nounits")
    assert (out, rc) == ("0, 0, 143156\n1, 3380, 139776\n", 0)
    table, _ = node.run()
    assert "|    3380MiB / 143771MiB |" in table
    assert f"|    1   N/A  N/A{pid:>16}      C   sleep      " in table
    assert "No running processes found" not in table


def test_process_name_is_argv0_like_real_nvidia_smi(node):
    proc = subprocess.Popen(["/bin/sleep", "60"])
    node.procs.append(proc)
    data = {"pid": proc.pid, "gpus": [0], "mib": 100, "name": "sglang"}
    (node.holders / "sglang.json").write_text(json.dumps(data))
    out, rc = node.run("--query-compute-apps=pid,process_name", "--format=csv,noheader")
    assert (out, rc) == (f"{proc.pid}, /bin/sleep\n", 0)


def test_a_dead_holder_is_ignored(node):
    (node.holders / "gone.json").write_text(json.dumps({"pid": 2**22 + 7, "gpus": [0], "mib": 900}))
    out, rc = node.run("--query-gpu=memory.used", "--format=csv,noheader,nounits")
    assert (out, rc) == ("0\n", 0)


@pytest.mark.parametrize(
    ("fault", "args", "expected_file", "code"),
    [
        ("no-devices", ["--query-gpu=index", "--format=csv"], "no-devices.txt", 6),
        ("no-devices", ["-L"], "list-no-devices.txt", 0),
        ("driver-not-loaded", [], "driver-not-loaded.txt", 9),
        ("access-blocked", ["-L"], "access-blocked.txt", 17),
        ("driver-mismatch", ["--query-gpu=index", "--format=csv"], "driver-mismatch.HAND-WRITTEN.txt", 18),
        ("nvml-fail", ["-q"], "nvml-unknown.HAND-WRITTEN.txt", 255),
    ],
)
def test_faults_print_the_real_text_and_exit_code(node, fault, args, expected_file, code):
    node.set("h200-x1", fault)
    assert node.run(*args) == ((EXTRA / expected_file).read_text(), code)


def test_bad_arguments_answer_like_the_real_tool(node):
    assert node.run("--query-gpu=bogus", "--format=csv") == ((EXTRA / "invalid-field.txt").read_text(), 2)
    assert node.run("--bogus") == ((EXTRA / "unknown-option.txt").read_text(), 255)
    no_devices = (EXTRA / "no-devices.txt").read_text()
    assert node.run("-i", "7", "--query-gpu=index", "--format=csv") == (no_devices, 6)
    assert node.run("--query-gpu=index", "--format=xml") == ("Format modifier is not recognized.\n", 2)


def test_broken_node_state_says_what_is_wrong(node):
    node.state.write_text(json.dumps({"fixture": "h200-x1", "fault": "melted"}))
    out, rc = node.run("-L")
    assert rc == 1
    assert "unknown fault 'melted'" in out
