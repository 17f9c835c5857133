"""tests/gpu/syscall_filter.py: systemd's SystemCallFilter= semantics, and the filter really in force.

The pure part (parsing, group expansion, allow and deny lines, the BPF program) is checked against
literal expectations; the kernel part runs children under the filter, through libseccomp and through
the hand-built BPF program, and checks what a denied call and a needed call return. The last test
runs tests/gpu/serve_check.py against the lab's stand-in vLLM with the rendered unit's filter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from playbook_run import ansible_playbook, localhost_inventory

REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = REPO / "tests" / "gpu"
SCRIPT = str(GPU_TESTS / "syscall_filter.py")

# The role's default lines, written out (roles/service_swap/defaults/main.yml).
DEFAULT_UNIT = """[Service]
SystemCallArchitectures=native
SystemCallFilter=@system-service pidfd_getfd
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
"""


@pytest.fixture(scope="module")
def sf(gpu_script):
    """The module, tests/gpu/syscall_filter.py, loaded by its path."""
    return gpu_script("syscall_filter")


GROUPS = {
    "@default": ["execve", "exit_group"],
    "@io": ["read", "write", "@inner"],
    "@inner": ["pread64", "_llseek", "@io"],  # _llseek: no x86_64 number; the cycle must end
    "@admin": ["reboot", "mount"],
}
NUMBERS = {"execve": 59, "exit_group": 231, "read": 0, "write": 1, "pread64": 17, "reboot": 169, "mount": 165}


def resolved(sf, *lines: str, error_number: str = "EPERM", archs: tuple[str, ...] = ("native",)):
    return sf.resolve(sf.UnitFilter(lines, error_number, archs), GROUPS, NUMBERS)


def test_an_allow_list_brings_default_with_it_and_later_lines_add_or_take(sf):
    res = resolved(sf, "@io", "~write pread64", "pread64 mount")
    assert res.allow_list is True
    assert sorted(res.names) == ["execve", "exit_group", "mount", "pread64", "read"]
    assert res.error_number == 1
    assert res.native_only is True


def test_a_deny_list_first_makes_everything_else_allowed_and_allow_lines_take_from_it(sf):
    res = resolved(sf, "~@admin write:EACCES", "reboot", "~write:EIO read")
    assert res.allow_list is False
    assert res.names == {"mount": None, "write": 13, "read": None}  # the first errno given stays


def test_an_empty_line_drops_everything_before_it(sf):
    assert resolved(sf, "~@admin", "", "read").names == {"execve": None, "exit_group": None, "read": None}
    assert resolved(sf, "read", "").allow_list is None


def test_refusals(sf):
    with pytest.raises(ValueError, match="only denied calls take an errno"):
        resolved(sf, "read:EPERM")
    with pytest.raises(ValueError, match="unknown group '@nope'"):
        resolved(sf, "@nope")
    with pytest.raises(ValueError, match="'EBOGUS' is not an errno name"):
        resolved(sf, "read", error_number="EBOGUS")
    with pytest.raises(ValueError, match="only 'native'"):
        resolved(sf, "read", archs=("x86",))
    assert resolved(sf, "read", error_number="").error_number is None  # unset: a denied call kills
    assert resolved(sf, "read", error_number="38").error_number == 38


def test_rules_and_the_bpf_program(sf):
    res = resolved(sf, "~@admin")
    assert sf.rules(res, NUMBERS) == (0x7FFF0000, {169: 0x50001, 165: 0x50001})
    res = resolved(sf, "read", error_number="")
    assert sf.rules(res, NUMBERS) == (0x80000000, {59: 0x7FFF0000, 231: 0x7FFF0000, 0: 0x7FFF0000})
    assert sf.bpf_program(0x50001, {0: 0x7FFF0000, 59: 0x7FFF0000}, native_only=True) == [
        (0x20, 0, 0, 4),  # the architecture
        (0x15, 1, 0, 0xC000003E),
        (0x06, 0, 0, 0x80000000),
        (0x20, 0, 0, 0),  # the number
        (0x35, 0, 1, 0x40000000),  # x32
        (0x06, 0, 0, 0x80000000),
        (0x15, 0, 1, 0),
        (0x06, 0, 0, 0x7FFF0000),
        (0x15, 0, 1, 59),
        (0x06, 0, 0, 0x7FFF0000),
        (0x06, 0, 0, 0x50001),
    ]


def test_parse_unit_reads_every_line_of_a_rendered_unit(sf):
    unit = sf.parse_unit(DEFAULT_UNIT + "SystemCallArchitectures=\nSystemCallArchitectures=native\n")
    assert unit == sf.UnitFilter(("@system-service pidfd_getfd", "~@privileged"), "EPERM", ("native",))
    assert sf.parse_unit("[Service]\nExecStart=/bin/true\n") == sf.UnitFilter()


def test_the_default_filter_against_the_committed_table(sf):
    res = sf.resolve_unit_text(DEFAULT_UNIT)
    d = sf.describe(res)
    assert (d["kind"], d["error_number"], d["architectures"], len(d["names"])) == ("allow list", "EPERM", "native", 289)
    needed = [
        "ioctl",
        "mmap",
        "mremap",
        "madvise",
        "clone",
        "clone3",
        "execve",
        "vfork",
        "wait4",
        "prctl",
        "futex",
        "sched_setaffinity",
        "sched_getaffinity",
        "mbind",
        "set_mempolicy",
        "get_mempolicy",
        "memfd_create",
        "shmget",
        "process_vm_readv",
        "pidfd_open",
        "pidfd_getfd",
        "io_uring_setup",
        "mlock",
        "socket",
        "sendmsg",
        "epoll_wait",
        "setrlimit",
        "prlimit64",
        "getrandom",
    ]
    assert [n for n in needed if n not in d["names"]] == []
    denied = [
        "chown",
        "fchownat",
        "setuid",
        "setgroups",
        "capset",
        "mount",
        "umount2",
        "swapon",
        "reboot",
        "bpf",
        "init_module",
        "kexec_load",
        "ptrace",
        "perf_event_open",
        "chroot",
        "settimeofday",
    ]
    assert [n for n in denied if n in d["names"]] == []


def test_the_table_records_how_it_was_made_and_agrees_with_this_systemd(sf):
    data = json.loads(sf.TABLE.read_text())
    assert data["generated_by"] == "python3 tests/gpu/syscall_filter.py table > tests/gpu/syscall_table_x86_64.json"
    assert (data["systemd"], data["libseccomp"]) == ("systemd 252 (252.38-1~deb12u1)", "2.5.4")
    assert (data["x86_64"]["read"], data["x86_64"]["ioctl"], data["x86_64"]["pidfd_getfd"]) == (0, 16, 438)
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here to compare the table with")
    version = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout
    if not version.startswith("systemd 252 "):
        pytest.skip(f"the table is systemd 252's; this is {version.splitlines()[0]}")
    out = subprocess.run([sys.executable, SCRIPT, "table"], capture_output=True, text=True, check=True).stdout
    fresh = json.loads(out)
    assert (fresh["groups"], fresh["x86_64"]) == (data["groups"], data["x86_64"])


# --- the kernel: children under the filter --------------------------------------------------------

DENIED = {
    "chown own file to self": "EPERM",
    "setuid to self": "EPERM",
    "reboot with bad magic": "EPERM",
    "swapon of a missing file": "EPERM",
}
NEEDED = {
    "sched_setaffinity": "ok",
    "set_mempolicy MPOL_DEFAULT": "ok",
    "get_mempolicy": "ok",
    "memfd_create": "ok",
    "ioctl FIONREAD on a pipe": "ok",
    "process_vm_readv of itself": "ok",
    "fork and wait": "ok",
    "thread start": "ok",
    "exec /bin/true": "ok",
}


def under_filter(unit: Path, backend: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
    if backend == "libseccomp" and not _has_libseccomp():
        pytest.skip("libseccomp.so.2 does not load here (the BPF backend is tested without it)")
    return subprocess.run(
        [sys.executable, SCRIPT, "exec", "--unit", str(unit), "--backend", backend, "--", *cmd],
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def _has_libseccomp() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return False
    return True


@pytest.fixture
def unit(tmp_path) -> Path:
    path = tmp_path / "vllm.service"
    path.write_text(DEFAULT_UNIT)
    return path


def test_without_the_filter_the_denied_calls_work_or_fail_otherwise():
    res = subprocess.run([sys.executable, SCRIPT, "probe"], capture_output=True, text=True, check=True)
    out = json.loads(res.stdout)
    assert out["seccomp"]["Seccomp"] == "0"
    assert (out["calls"]["chown own file to self"], out["calls"]["setuid to self"]) == ("ok", "ok")
    assert out["calls"]["reboot with bad magic"] == ("EINVAL" if os.geteuid() == 0 else "EPERM")
    assert out["calls"]["swapon of a missing file"] == ("ENOENT" if os.geteuid() == 0 else "EPERM")
    assert {k: v for k, v in out["calls"].items() if k in NEEDED} == NEEDED


@pytest.mark.parametrize("backend", ["libseccomp", "bpf"])
def test_under_the_filter_denied_calls_get_eperm_and_needed_ones_work(unit, backend):
    res = under_filter(unit, backend, sys.executable, SCRIPT, "probe")
    assert res.returncode == 0, res.stderr
    assert res.stderr == f"syscall_filter: allow list of 289 calls installed with {backend}\n"
    out = json.loads(res.stdout)
    assert (out["seccomp"]["Seccomp"], out["seccomp"]["NoNewPrivs"]) == ("2", "1")
    assert out["calls"] == {**DENIED, **NEEDED}


@pytest.mark.parametrize("backend", ["libseccomp", "bpf"])
def test_without_an_error_number_a_denied_call_kills_the_process(tmp_path, backend):
    unit = tmp_path / "kill.service"
    unit.write_text(DEFAULT_UNIT.replace("SystemCallErrorNumber=EPERM\n", ""))
    code = "import os; print('before', flush=True); os.chown('/', 0, 0); print('after')"
    res = under_filter(unit, backend, sys.executable, "-c", code)
    assert (res.returncode, res.stdout) == (-signal.SIGSYS, "before\n")


@pytest.mark.parametrize("backend", ["libseccomp", "bpf"])
def test_python_multiprocessing_threads_and_a_c_compiler_run_under_the_filter(unit, tmp_path, backend):
    """What vLLM does at start besides CUDA: spawn workers, share memory, and (Triton) compile C."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    (tmp_path / "t.c").write_text("int main(void) { return 0; }\n")
    code = (
        "import multiprocessing as mp, concurrent.futures as cf, subprocess, sys\n"
        "from multiprocessing import shared_memory\n"
        "def sq(x): return x * x\n"
        "if __name__ == '__main__':\n"
        "    mp.set_start_method('spawn')\n"
        "    with mp.Pool(2) as p: assert p.map(sq, range(4)) == [0, 1, 4, 9]\n"
        "    with cf.ThreadPoolExecutor(4) as ex: assert list(ex.map(sq, range(3))) == [0, 1, 4]\n"
        "    shm = shared_memory.SharedMemory(create=True, size=4096); shm.buf[0] = 7; shm.close(); shm.unlink()\n"
        f"    subprocess.run(['cc', '-O2', '-shared', '-fPIC', '-o', {str(tmp_path / 't.so')!r}, {str(tmp_path / 't.c')!r}],"
        " check=True)\n"
        "    print('done')\n"
    )
    script = tmp_path / "work.py"
    script.write_text(code)
    res = under_filter(unit, backend, sys.executable, str(script), cwd=tmp_path)
    assert (res.returncode, res.stdout) == (0, "done\n"), res.stderr
    assert (tmp_path / "t.so").exists()


# --- serve_check.py with the filter, against the lab's stand-in vLLM ---------------------------------


def serve_check(
    tmp_path: Path, target: Path, *render_extra: str, check_extra: tuple[str, ...] = ()
) -> tuple[int, dict, str]:
    """Render the unit (ExecStart: a link named vllm to tests/fakes/inference_server.py) with
    tests/gpu/render_unit.yml, run serve_check.py on it; its exit status, result and output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dflash_config": {"mask_token_id": 248070, "block_size": 16}}))
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.symlink_to(REPO / "tests" / "fakes" / "inference_server.py")
    dest = tmp_path / "vllm.service"
    res = ansible_playbook(
        localhost_inventory(tmp_path),
        "tests/gpu/render_unit.yml",
        *("-e", f"service_swap_vllm_executable={vllm}", "-e", f"shared_settings_target_dir={target}"),
        *("-e", f"shared_settings_drafter_dir={drafter}", "-e", f"service_swap_vllm_port={port}"),
        *("-e", "shared_settings_num_speculative_tokens=7", "-e", f"render_dest={dest}"),
        *("-e", f"shared_settings_service_home={tmp_path / 'home'}", *render_extra),
        ANSIBLE_INJECT_FACT_VARS="False",
        TMPDIR=str(tmp_path),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    holders = tmp_path / "holders"
    holders.mkdir()
    env = dict(os.environ, LAB_FAKES_HOLDERS=str(holders), LAB_FAKES_KNOBS=str(tmp_path / "no-knobs.json"))
    out = tmp_path / "out"
    cmd = [sys.executable, str(GPU_TESTS / "serve_check.py"), "--unit", str(dest), "--api-key", "sk-test-filter"]
    cmd += ["--out", str(out), "--url", f"http://127.0.0.1:{port}", "--timeout", "60", *check_extra]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = (out / "serve_check.json").read_text()
    assert "sk-test-filter" not in text
    return res.returncode, json.loads(text), res.stdout[-3000:] + res.stderr[-3000:]


SERVED = {
    "healthy": True,
    "completion_non_empty": True,
    "mean_acceptance_length_computed": True,
    "key_required": True,
    "spec_decode_counters_exposed": True,
}


def test_serve_check_runs_the_stand_in_under_the_units_filter(tmp_path, target):
    """The probe's denied calls fail, every process shows Seccomp: 2, and every check holds."""
    rc, result, output = serve_check(tmp_path, target)
    assert rc == 0, output
    assert result["checks"] == {
        **SERVED,
        "filter_denies_with_the_units_errno": True,
        "filter_lets_needed_calls_through": True,
        "filter_in_force_in_every_vllm_process": True,
    }
    sf = result["syscall_filter"]
    assert sf["unit_lines"] == [
        "SystemCallFilter=@system-service pidfd_getfd",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
        "SystemCallArchitectures=native",
    ]
    assert (sf["applied"], sf["kind"], len(sf["names"]), sf["probe"]["calls"]) == (
        True,
        "allow list",
        289,
        {**DENIED, **NEEDED},
    )
    assert [p["Seccomp"] for p in sf["processes"].values()] == ["2"]  # the stand-in is one process


def test_serve_check_fails_a_filter_that_denies_what_vllm_needs(tmp_path, target):
    """The guard can fail: denying @resources takes NCCL's sched_setaffinity and CUDA's set_mempolicy;
    the stand-in still serves (it needs neither), the check does not pass."""
    widened = '{"service_swap_system_call_filter": ["@system-service", "~@privileged @resources"]}'
    rc, result, output = serve_check(tmp_path, target, "-e", widened)
    assert rc == 1, output
    assert result["checks"] == {
        **SERVED,
        "filter_denies_with_the_units_errno": True,
        "filter_lets_needed_calls_through": False,
        "filter_in_force_in_every_vllm_process": True,
    }
    calls, without = result["syscall_filter"]["probe"]["calls"], result["syscall_filter"]["probe_without"]["calls"]
    assert (calls["sched_setaffinity"], calls["set_mempolicy MPOL_DEFAULT"]) == ("EPERM", "EPERM")
    assert (without["sched_setaffinity"], without["set_mempolicy MPOL_DEFAULT"]) == ("ok", "ok")


def test_serve_check_with_the_filter_off_runs_as_before(tmp_path, target):
    rc, result, output = serve_check(tmp_path, target, check_extra=("--syscall-filter", "off"))
    assert rc == 0, output
    assert result["checks"] == SERVED
    assert (result["syscall_filter"]["applied"], result["syscall_filter"]["kind"]) == (False, "allow list")
    assert "probe" not in result["syscall_filter"] and "probe_without" not in result["syscall_filter"]
