"""The lab tool against real LXC: repair after an interrupted run, refusals, nothing left behind.

Needs root and LXC (tests/lab/host-deps.sh); these are the faults an operator meets.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

LABCTL = Path(__file__).with_name("labctl.py")
STATE = Path("/var/lib/dflash-lab/labs")


def labctl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LABCTL), *args], capture_output=True, text=True, **kw)


def lxc_names() -> set[str]:
    return set(subprocess.run(["lxc-ls", "-1"], capture_output=True, text=True).stdout.split())


def bridges() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


@pytest.fixture
def lab(tmp_path: Path):
    name = f"pt{os.getpid()}"  # one per test process: two runs on one machine never share a lab
    labctl("down", "--lab", name)
    yield name, tmp_path / "inv"
    labctl("down", "--lab", name)


def test_interrupted_up_is_repaired_and_down_leaves_nothing(lab) -> None:
    name, inv = lab
    proc = subprocess.Popen(
        [sys.executable, str(LABCTL), "up", "--lab", name, "--nodes", "1", "--inventory-dir", str(inv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell starts background jobs with SIGINT ignored, and children inherit that: restore the
        # default so the interrupt below arrives however the tests were launched.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Interrupt once the node is recorded but before it is complete.
    deadline = time.monotonic() + 120
    state = STATE / name / "state.json"
    while time.monotonic() < deadline and not (state.exists() and json.loads(state.read_text())["nodes"]):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert f"run 'labctl.py up --lab {name}' again" in err
    assert json.loads(state.read_text())["nodes"][0]["complete"] is False

    res = labctl("up", "--lab", name, "--nodes", "1", "--inventory-dir", str(inv))
    assert res.returncode == 0, res.stderr
    assert f"lab: {name}-1: found a half-made container from an interrupted run; rebuilding it" in res.stdout
    assert f"{name}-1:\n          ansible_host: 10.213." in (inv / "hosts.yml").read_text()
    bridge = json.loads(state.read_text())["bridge"]
    assert bridge in bridges()

    res = labctl("down", "--lab", name)
    assert res.returncode == 0, res.stderr
    assert f"{name}-1" not in lxc_names()
    assert bridge not in bridges()
    assert not (STATE / name).exists()


def test_a_container_the_lab_did_not_make_is_never_touched(lab) -> None:
    name, inv = lab
    foreign = Path(f"/var/lib/lxc/{name}-1")
    foreign.mkdir(parents=True)
    (foreign / "config").write_text("lxc.uts.name = someone-elses\n")
    try:
        res = labctl("up", "--lab", name, "--nodes", "1", "--inventory-dir", str(inv))
        assert res.returncode == 1
        assert f"a container named {name}-1 already exists and was not made by this lab" in res.stderr
        assert (foreign / "config").read_text() == "lxc.uts.name = someone-elses\n"
    finally:
        (foreign / "config").unlink()
        foreign.rmdir()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "--lab", "9bad"], "lab name '9bad' must start with a letter"),
        (["up", "--lab", "ok", "--nodes", "0"], "--nodes must be between 1 and 32, not 0"),
        (
            ["up", "--lab", "ok", "--fixtures", "a100-x9"],
            "unknown nvidia-smi fixture 'a100-x9'; available: h200-x1, h200-x2",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_made(args, message) -> None:
    res = labctl(*args)
    assert res.returncode == 1
    assert message in res.stderr
    assert not (STATE / "ok").exists()


def test_not_root_is_refused_with_the_reason() -> None:
    # The unprivileged user must be able to read the script and run the interpreter, wherever root
    # cloned the repository (a clone under /root, mode 0700, is not readable by it). Run a copy from
    # a world-readable directory, laid out as in the repository (labctl finds the repo two levels
    # up), with the interpreter the venv links to.
    python = os.path.realpath(sys.executable)
    with tempfile.TemporaryDirectory(prefix="labctl-nobody-") as tmp:
        copy = Path(tmp) / "tests" / "lab" / "labctl.py"
        copy.parent.mkdir(parents=True)
        shutil.copy2(LABCTL, copy)
        for p in (Path(tmp), copy.parent.parent, copy.parent):
            p.chmod(0o755)
        copy.chmod(0o644)
        res = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, str(copy), "up", "--lab", "ok"],
            capture_output=True,
            text=True,
            cwd=tmp,
        )
    assert res.returncode == 1, res.stderr
    assert "needs root: run it as root (sudo make lab)" in res.stderr
