#!/usr/bin/env python3
"""A unit's SystemCallFilter=, applied to a command the way systemd 252 applies it, without systemd.

The GPU machines that run tests/gpu/serve_check.py have no systemd as PID 1, so the unit's sandboxing
would not apply there; this module gives the started process the unit's seccomp filter, so that a
syscall vLLM, CUDA, NCCL or Triton's compiler needs and the filter denies shows up on the GPU.

    python3 tests/gpu/syscall_filter.py show --unit vllm.service         # the resolved filter, as JSON
    python3 tests/gpu/syscall_filter.py exec --unit vllm.service -- CMD  # run CMD under it
    python3 tests/gpu/syscall_filter.py probe                            # try calls, print each errno
    python3 tests/gpu/syscall_filter.py table > tests/gpu/syscall_table_x86_64.json

Semantics (systemd 252, src/core/load-fragment.c config_parse_syscall_filter and
src/core/execute.c apply_syscall_filter; systemd.exec(5)):
  - each SystemCallFilter= line is a space-separated list of syscall names and @groups; a line that
    starts with ~ lists what to deny; an empty assignment drops every line before it;
  - the first line decides the kind of filter: an allow list (then @default is allowed with it) or a
    deny list; later lines of the same kind add to the set, lines of the other kind take from it;
  - a deny-list entry may carry its own errno (``name:EACCES``); the first one given for a name stays;
  - what an allow list leaves out, and what a deny list names without its own errno, returns
    SystemCallErrorNumber= (systemd 252: also for syscalls it does not know; from systemd 255 those
    get ENOSYS), or kills the process when SystemCallErrorNumber= is unset;
  - names are resolved to x86_64 numbers as systemd does, through libseccomp; names with no x86_64
    number (_llseek, mmap2, ...) are ignored, as systemd ignores them;
  - SystemCallArchitectures=native: a syscall made through another ABI (i386, x32) kills the process.

Groups and numbers come from syscall_table_x86_64.json beside this file, generated once on a Debian
12 controller (systemd 252, libseccomp 2.5.4, the release the GPU nodes run) with the ``table``
command, so the GPU machine needs neither systemd-analyze nor headers. The filter is installed with
libseccomp through ctypes when libseccomp.so.2 loads, else as a classic BPF program built here;
both set no_new_privs first (NoNewPrivileges=, which the unit sets too).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TABLE = Path(__file__).resolve().with_name("syscall_table_x86_64.json")
TABLE_COMMAND = "python3 tests/gpu/syscall_filter.py table > tests/gpu/syscall_table_x86_64.json"

# linux/audit.h, linux/seccomp.h, linux/filter.h, linux/prctl.h
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_RET_K = 0x06
BPF_MAXINSNS = 4096


@dataclass(frozen=True)
class UnitFilter:
    """The seccomp-related settings of a unit, as written (one entry per line)."""

    filters: tuple[str, ...] = ()
    error_number: str = ""
    architectures: tuple[str, ...] = ()


@dataclass
class Resolved:
    """What systemd builds from a unit's lines: the kind of list and the names in it."""

    allow_list: bool | None = None  # None: no filter (none given, or reset by an empty line)
    names: dict[str, int | None] = field(default_factory=dict)  # name -> its own errno (deny lists)
    error_number: int | None = None  # SystemCallErrorNumber=; None: kill
    native_only: bool = False


def unit_lines(text: str, key: str) -> list[str]:
    """Values of ``key=`` lines in the [Service] part of a unit, continuation lines joined."""
    joined = text.replace("\\\n", " ")
    return [line.split("=", 1)[1].strip() for line in joined.splitlines() if line.startswith(key + "=")]


def parse_unit(text: str) -> UnitFilter:
    errnos = unit_lines(text, "SystemCallErrorNumber")
    archs: list[str] = []
    for value in unit_lines(text, "SystemCallArchitectures"):
        archs = [] if not value else archs + value.split()
    return UnitFilter(tuple(unit_lines(text, "SystemCallFilter")), errnos[-1] if errnos else "", tuple(archs))


def errno_value(name: str, where: str) -> int:
    """An errno name (EPERM) or number (1..4095), as systemd takes it."""
    if name.isdigit() and 0 < int(name) < 4096:
        return int(name)
    value = getattr(errno, name, None)
    if not name.startswith("E") or not isinstance(value, int):
        raise ValueError(f"{where}: {name!r} is not an errno name (EPERM, EACCES, ...) or number")
    return value


def resolve(unit: UnitFilter, groups: Mapping[str, Sequence[str]], numbers: Mapping[str, int]) -> Resolved:
    """The filter systemd 252 builds from the unit's lines (names without an x86_64 number dropped)."""
    res = Resolved()
    for line in unit.filters:
        if not line:
            res = Resolved()  # an empty assignment resets the filter
            continue
        invert = line.startswith("~")
        words = line[1:].split() if invert else line.split()
        if res.allow_list is None:
            res.allow_list = not invert
            if res.allow_list:
                _apply(res, "@default", None, True, groups, numbers, "@default")
        add = invert != res.allow_list  # allow list + allow line, or deny list + deny line
        for word in words:
            name, _, own_errno = word.partition(":")
            code = None
            if own_errno:
                if not invert:
                    raise ValueError(f"SystemCallFilter={line}: only denied calls take an errno ({word!r})")
                code = errno_value(own_errno, f"SystemCallFilter={line}")
            _apply(res, name, code, add, groups, numbers, line)
    if unit.error_number:
        res.error_number = (
            None if unit.error_number == "kill" else errno_value(unit.error_number, "SystemCallErrorNumber")
        )
    for arch in unit.architectures:
        if arch != "native":
            raise ValueError(f"SystemCallArchitectures={arch}: only 'native' (x86_64) is emulated here")
    res.native_only = bool(unit.architectures)
    return res


def _apply(
    res: Resolved,
    name: str,
    code: int | None,
    add: bool,
    groups: Mapping[str, Sequence[str]],
    numbers: Mapping[str, int],
    line: str,
    seen: tuple[str, ...] = (),
) -> None:
    if name.startswith("@"):
        if name not in groups:
            raise ValueError(
                f"SystemCallFilter={line}: unknown group {name!r} (systemd-analyze syscall-filter lists them)"
            )
        if name in seen:
            return
        for member in groups[name]:
            _apply(res, member, code, add, groups, numbers, line, (*seen, name))
        return
    if name not in numbers:
        return  # systemd ignores names with no number on this architecture
    if add:
        res.names.setdefault(name, code)
    else:
        res.names.pop(name, None)


def rules(res: Resolved, numbers: Mapping[str, int]) -> tuple[int, dict[int, int]]:
    """The default seccomp action and the action for each syscall number that differs from it."""
    deny = RET_KILL_PROCESS if res.error_number is None else RET_ERRNO | res.error_number
    if res.allow_list is None:
        return RET_ALLOW, {}
    if res.allow_list:
        return deny, {numbers[n]: RET_ALLOW for n in res.names}
    return RET_ALLOW, {numbers[n]: (deny if c is None else RET_ERRNO | c) for n, c in res.names.items()}


def bpf_program(default: int, actions: Mapping[int, int], native_only: bool) -> list[tuple[int, int, int, int]]:
    """A classic BPF seccomp program (code, jt, jf, k) for x86_64: other ABIs killed, then one
    compare-and-return pair per syscall whose action is not the default."""
    prog = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64)]
    prog.append((BPF_RET_K, 0, 0, RET_KILL_PROCESS if native_only else RET_ALLOW))
    prog.append((BPF_LD_W_ABS, 0, 0, 0))
    if native_only:  # x32 uses AUDIT_ARCH_X86_64 with bit 30 set in the number
        prog += [(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, RET_KILL_PROCESS)]
    for nr in sorted(actions):
        prog += [(BPF_JEQ_K, 0, 1, nr), (BPF_RET_K, 0, 0, actions[nr])]
    prog.append((BPF_RET_K, 0, 0, default))
    if len(prog) > BPF_MAXINSNS:
        raise ValueError(f"the filter needs {len(prog)} BPF instructions, more than the kernel's {BPF_MAXINSNS}")
    return prog


def load_table(path: Path = TABLE) -> tuple[dict[str, list[str]], dict[str, int]]:
    data = json.loads(path.read_text())
    return data["groups"], data["x86_64"]


def resolve_unit_text(text: str, path: Path = TABLE) -> Resolved:
    groups, numbers = load_table(path)
    return resolve(parse_unit(text), groups, numbers)


def describe(res: Resolved) -> dict:
    """The filter in words and names: what serve_check records, and what `systemctl show` lists."""
    kind = {None: "none", True: "allow list", False: "deny list"}[res.allow_list]
    return {
        "kind": kind,
        "names": sorted(res.names),
        "own_errno": {n: errno.errorcode.get(c, c) for n, c in sorted(res.names.items()) if c is not None},
        "error_number": "kill" if res.error_number is None else errno.errorcode.get(res.error_number, res.error_number),
        "architectures": "native" if res.native_only else "any",
    }


# --- installing it (the only part that touches the kernel) ------------------------------------


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno() or -rc
        raise OSError(err, f"{what}: {os.strerror(err)}")


def install_bpf(default: int, actions: Mapping[int, int], native_only: bool) -> None:
    prog = bpf_program(default, actions, native_only)
    array = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), array)
    libc = _libc()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _libseccomp() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def install_libseccomp(lib: ctypes.CDLL, default: int, actions: Mapping[int, int], native_only: bool) -> None:
    ctx = lib.seccomp_init(default)  # the native architecture only, no_new_privs set on load
    if not ctx:
        raise OSError(errno.EINVAL, "seccomp_init failed")
    try:
        # SCMP_FLTATR_ACT_BADARCH: another ABI is killed (native) or let through unfiltered.
        _check(lib.seccomp_attr_set(ctx, 2, RET_KILL_PROCESS if native_only else RET_ALLOW), "seccomp_attr_set")
        for nr, action in sorted(actions.items()):
            _check(lib.seccomp_rule_add(ctx, action, nr, 0), f"seccomp_rule_add({nr})")
        _check(lib.seccomp_load(ctx), "seccomp_load")
    finally:
        lib.seccomp_release(ctx)


def install(res: Resolved, numbers: Mapping[str, int], backend: str = "auto") -> str:
    """Install the filter on this process (inherited by every child); returns the backend used."""
    default, actions = rules(res, numbers)
    if res.allow_list is None:
        return "none"
    if os.uname().machine != "x86_64":  # another ABI's numbers would filter the wrong calls
        raise OSError(errno.ENOTSUP, "the table holds x86_64 syscall numbers; this machine is " + os.uname().machine)
    lib = _libseccomp() if backend in ("auto", "libseccomp") else None
    if backend == "libseccomp" and lib is None:
        raise OSError(errno.ENOENT, "libseccomp.so.2 does not load here; use --backend bpf")
    if lib is not None:
        install_libseccomp(lib, default, actions, res.native_only)
        return "libseccomp"
    install_bpf(default, actions, res.native_only)
    return "bpf"


def seccomp_status(pid: int | str = "self") -> dict[str, str]:
    """NoNewPrivs, Seccomp (2: a filter) and Seccomp_filters of a process, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("NoNewPrivs", "Seccomp", "Seccomp_filters"):
            out[key] = value.strip()
    return out


# --- probe: calls a filter should deny or allow, each one's result ------------------------------


def probe() -> dict[str, str]:
    """Try calls the chosen filter denies (they succeed, or fail otherwise, without it) and calls
    vLLM needs; each result is "ok" or the errno name."""
    import tempfile
    import threading

    libc = _libc()
    libc.syscall.restype = ctypes.c_long

    def call(fn) -> str:
        try:
            fn()
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))

    def sys_call(nr: int, *args: int) -> None:
        ctypes.set_errno(0)
        if libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args]) < 0:
            raise OSError(ctypes.get_errno(), "")

    _, numbers = load_table()
    results: dict[str, str] = {}
    with tempfile.NamedTemporaryFile() as f:
        results["chown own file to self"] = call(lambda: os.chown(f.name, os.getuid(), os.getgid()))
    results["setuid to self"] = call(lambda: os.setuid(os.getuid()))
    # reboot with a bad magic number: EINVAL for root, EPERM for others, EPERM under the filter.
    results["reboot with bad magic"] = call(lambda: sys_call(numbers["reboot"], 0, 0, 0, 0))
    missing = ctypes.create_string_buffer(b"/nonexistent-swap")
    results["swapon of a missing file"] = call(lambda: sys_call(numbers["swapon"], ctypes.addressof(missing), 0))
    # What vLLM, CUDA, NCCL and Python's multiprocessing do.
    results["sched_setaffinity"] = call(lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))
    results["set_mempolicy MPOL_DEFAULT"] = call(lambda: sys_call(numbers["set_mempolicy"], 0, 0, 0))
    results["get_mempolicy"] = call(lambda: sys_call(numbers["get_mempolicy"], 0, 0, 0, 0, 0))
    results["memfd_create"] = call(lambda: os.close(os.memfd_create("probe")))
    results["ioctl FIONREAD on a pipe"] = call(lambda: _fionread(libc))
    results["process_vm_readv of itself"] = call(lambda: _vm_readv_self(libc, numbers["process_vm_readv"]))
    results["fork and wait"] = call(_fork_wait)
    results["thread start"] = call(lambda: _thread(threading))
    results["exec /bin/true"] = call(lambda: subprocess.run(["/bin/true"], check=True))
    return results


def _fionread(libc: ctypes.CDLL) -> None:
    r, w = os.pipe()
    n = ctypes.c_int()
    try:
        ctypes.set_errno(0)
        if libc.ioctl(r, 0x541B, ctypes.byref(n)) != 0:
            raise OSError(ctypes.get_errno(), "")
    finally:
        os.close(r)
        os.close(w)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_readv_self(libc: ctypes.CDLL, nr: int) -> None:
    src, dst = ctypes.create_string_buffer(b"probe", 8), ctypes.create_string_buffer(8)
    local, remote = _IoVec(ctypes.addressof(dst), 8), _IoVec(ctypes.addressof(src), 8)
    ctypes.set_errno(0)
    one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
    got = libc.syscall(
        ctypes.c_long(nr), ctypes.c_long(os.getpid()), ctypes.byref(local), one, ctypes.byref(remote), one, zero
    )
    if got != 8:
        raise OSError(ctypes.get_errno(), "")


def _fork_wait() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _thread(threading) -> None:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()


# --- the committed table ------------------------------------------------------------------------


def generate_table() -> dict:
    """Group contents from this machine's systemd-analyze, x86_64 numbers from its libseccomp
    (what systemd resolves names with), checked against the kernel headers where they have one."""

    def analyze(*args: str) -> list[str]:
        out = subprocess.run(
            ["systemd-analyze", "syscall-filter", "--no-pager", *args],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "LC_ALL": "C"},
        ).stdout
        return [ln.strip() for ln in out.splitlines()]

    names = [ln for ln in analyze() if ln.startswith("@")]
    groups = {}
    for group in names:
        lines = analyze(group)
        groups[group] = [ln for ln in lines[1:] if ln and not ln.startswith("#")]
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    known = sorted({m for members in groups.values() for m in members if not m.startswith("@")})
    numbers = {}
    for name in known:
        nr = lib.seccomp_syscall_resolve_name_arch(AUDIT_ARCH_X86_64, name.encode())
        if nr >= 0:
            numbers[name] = nr
    headers = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if headers.exists():
        import re

        for name, nr in re.findall(r"#define __NR_(\w+) (\d+)", headers.read_text()):
            if name in numbers and numbers[name] != int(nr):
                raise SystemExit(f"{name}: libseccomp says {numbers[name]}, {headers} says {nr}")
    version = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    lib.seccomp_version.restype = ctypes.POINTER(ctypes.c_uint * 3)
    return {
        "generated_by": TABLE_COMMAND,
        "systemd": version,
        "libseccomp": ".".join(map(str, lib.seccomp_version().contents)),
        "groups": groups,
        "x86_64": dict(sorted(numbers.items(), key=lambda kv: kv[1])),
    }


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="print the unit's resolved filter as JSON")
    show.add_argument("--unit", required=True)
    ex = sub.add_parser("exec", help="install the unit's filter, then exec the command")
    ex.add_argument("--unit", required=True)
    ex.add_argument("--backend", choices=["auto", "libseccomp", "bpf"], default="auto")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("probe", help="try denied and needed calls, print each result as JSON")
    sub.add_parser("table", help="print the group and number table (systemd-analyze, libseccomp)")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.cmd == "show":
        print(json.dumps(describe(resolve_unit_text(Path(a.unit).read_text())), indent=1))
    elif a.cmd == "exec":
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not command:
            ap.error("exec needs a command after --")
        _, numbers = load_table()
        res = resolve_unit_text(Path(a.unit).read_text())
        used = install(res, numbers, a.backend)
        kind = describe(res)["kind"]
        print(f"syscall_filter: {kind} of {len(res.names)} calls installed with {used}", file=sys.stderr, flush=True)
        os.execvp(command[0], command)
    elif a.cmd == "probe":
        print(json.dumps({"seccomp": seccomp_status(), "calls": probe()}, indent=1))
    else:
        print(json.dumps(generate_table(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
