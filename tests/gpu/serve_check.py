#!/usr/bin/env python3
"""Start real `vllm serve` from a unit file service_swap rendered, and probe it as the role does.

Needs an NVIDIA GPU, the vLLM the unit names, and ansible-core importable by this Python (the
probe is the project's own openai_probe module, run in-process exactly as Ansible runs it).

    ansible-playbook tests/gpu/render_unit.yml -e render_dest=/tmp/vllm.service ...   # see that file
    python3 tests/gpu/serve_check.py --unit /tmp/vllm.service --api-key KEY --out /tmp/out [--syscall-filter off]

What it does, in the order service_swap does it on a node:
  1. reads ExecStart and Environment= from the unit (systemd's quoting and %/$ escapes undone);
     ExecStart is run exactly, as the current user, under the unit's syscall filter
     (SystemCallFilter=, SystemCallErrorNumber=, SystemCallArchitectures=: installed before exec by
     syscall_filter.py beside this file as systemd 252 would, libseccomp through ctypes or a BPF
     program of its own, with no_new_privs; --syscall-filter off runs it without). Before that, a
     probe under the same filter must see the denied calls it tries fail with the unit's errno and
     the calls vLLM needs give what they give without the filter. systemd's User= and the rest of the sandboxing and EnvironmentFile
     are the lab's to prove (tests/molecule/service_swap checks them as systemd reports them). The
     API key reaches vLLM as the EnvironmentFile gives it: the VLLM_API_KEY variable.
  2. waits for /health 200, printing progress, failing early if the process exits; once healthy,
     every process of vLLM's process group (API server, engine core, workers) must show the filter
     in /proc/PID/status (Seccomp: 2, NoNewPrivs: 1);
  3. runs openai_probe with requests=N: one real completion must come back non-empty, and the mean
     acceptance length is computed from the /metrics spec-decode counters over those requests;
  4. checks that /v1/models refuses a request without the key;
  5. stops the server and writes OUT/serve_check.json (plus OUT/vllm_serve.log).
Exits 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import syscall_filter  # tests/gpu/, beside this script
from in_process import run_module

HERE = Path(__file__).resolve().parent
# Probe calls made as direct syscalls, so the syscall each one tests is exact: the filter denies
# them by default (they succeed, or fail otherwise, without it).
PROBE_DENIED = {"reboot with bad magic": "reboot", "swapon of a missing file": "swapon"}
PROBE_NEEDED = [
    "sched_setaffinity",
    "set_mempolicy MPOL_DEFAULT",
    "get_mempolicy",
    "memfd_create",
    "ioctl FIONREAD on a pipe",
    "process_vm_readv of itself",
    "fork and wait",
    "thread start",
    "exec /bin/true",
]


def unit_values(text: str, key: str) -> list[str]:
    """Values of ``key=`` lines in a unit file, continuation lines (trailing backslash) joined."""
    joined = text.replace("\\\n", " ")
    return [line.split("=", 1)[1] for line in joined.splitlines() if line.startswith(key + "=")]


def split_command(value: str) -> list[str]:
    """Split a systemd command line: words, '...' or "..." with backslash escapes, %% and $$ undone."""
    words: list[str] = []
    i, n = 0, len(value)
    while i < n:
        if value[i].isspace():
            i += 1
            continue
        word = []
        while i < n and not value[i].isspace():
            c = value[i]
            if c in "'\"":
                i += 1
                while i < n and value[i] != c:
                    if value[i] == "\\" and i + 1 < n:
                        i += 1
                    word.append(value[i])
                    i += 1
                if i >= n:
                    raise ValueError(f"unterminated quote in: {value}")
                i += 1
            else:
                word.append(c)
                i += 1
        words.append("".join(word).replace("%%", "%").replace("$$", "$"))
    return words


def make_launcher(path: str) -> None:
    """An executable at the path ExecStart names that runs vLLM's CLI with this Python."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        # What pip writes for vLLM's console script; the __main__ guard matters: vLLM starts its
        # engine core with multiprocessing's spawn, which re-imports this file.
        f.write(
            f"#!{sys.executable}\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
            "if __name__ == '__main__':\n    sys.exit(main())\n"
        )
    os.chmod(path, 0o755)


def http_status(url: str, headers: dict | None = None, timeout: float = 5) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def filter_probe(unit: str | None, backend: str, env: dict) -> dict:
    """syscall_filter.py's probe, run under the unit's filter (unit None: without it): what each call returned."""
    cmd = [sys.executable, str(HERE / "syscall_filter.py"), "exec", "--unit", unit, "--backend", backend, "--"]
    cmd = (cmd if unit else []) + [sys.executable, str(HERE / "syscall_filter.py"), "probe"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        return {"error": (res.stdout + res.stderr)[-2000:]}
    return {"installed": res.stderr.strip(), **json.loads(res.stdout)}


def group_seccomp(pgid: int) -> dict[str, dict]:
    """NoNewPrivs and Seccomp of every process in the process group (vLLM and its children)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            out[entry.name] = {"comm": name, **syscall_filter.seccomp_status(entry.name)}
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unit", required=True, help="unit file rendered by service_swap")
    ap.add_argument("--api-key", required=True, help="what the unit's EnvironmentFile gives as VLLM_API_KEY")
    ap.add_argument("--out", required=True)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=420, help="seconds to wait for /health")
    ap.add_argument("--make-launcher", action="store_true", help="create ExecStart's executable (no venv here)")
    ap.add_argument(
        "--syscall-filter",
        choices=["unit", "off"],
        default="unit",
        help="unit (default): run ExecStart under the unit's SystemCallFilter=; off: without it",
    )
    ap.add_argument(
        "--syscall-filter-backend",
        choices=["auto", "libseccomp", "bpf"],
        default="auto",
        help="how the filter is installed (auto: libseccomp.so.2 where it loads, else BPF built here)",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    text = Path(a.unit).read_text()
    (exec_start,) = unit_values(text, "ExecStart")
    argv = split_command(exec_start)
    env = dict(os.environ)
    for value in unit_values(text, "Environment"):
        for item in split_command(value):
            k, _, v = item.partition("=")
            env[k] = v
    env["VLLM_API_KEY"] = a.api_key
    # What the role creates on a node: the service home (WorkingDirectory, HOME, the caches).
    for d in [*unit_values(text, "WorkingDirectory"), env.get("HOME", ""), env.get("XDG_CACHE_HOME", "")]:
        if d:
            os.makedirs(d, exist_ok=True)
    if a.make_launcher:
        make_launcher(argv[0])
    result: dict = {"unit": a.unit, "argv": argv, "env_from_unit": unit_values(text, "Environment")}
    resolved = syscall_filter.resolve_unit_text(text)
    filtered = a.syscall_filter == "unit" and resolved.allow_list is not None
    result["syscall_filter"] = {
        "applied": filtered,
        "unit_lines": [
            f"{k}={v}"
            for k in ("SystemCallFilter", "SystemCallErrorNumber", "SystemCallArchitectures")
            for v in unit_values(text, k)
        ],
        **syscall_filter.describe(resolved),
    }
    run_argv = argv
    if filtered:
        result["syscall_filter"]["probe_without"] = filter_probe(None, a.syscall_filter_backend, env)
        result["syscall_filter"]["probe"] = filter_probe(a.unit, a.syscall_filter_backend, env)
        run_argv = [sys.executable, str(HERE / "syscall_filter.py"), "exec", "--unit", a.unit]
        run_argv += ["--backend", a.syscall_filter_backend, "--", *argv]
    log = open(os.path.join(a.out, "vllm_serve.log"), "w")  # noqa: SIM115 - closed in finally
    t0 = time.time()
    proc = subprocess.Popen(run_argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        status = None
        while time.time() - t0 < a.timeout:
            status = http_status(a.url + "/health")
            if status == 200 or proc.poll() is not None:
                break
            print(f"waiting for /health: {time.time() - t0:.0f} s, status {status}", flush=True)
            time.sleep(3)
        result["health_status"] = status
        result["seconds_to_healthy"] = round(time.time() - t0, 1) if status == 200 else None
        result["exit_code_before_healthy"] = proc.poll()
        if status == 200:
            result["syscall_filter"]["processes"] = group_seccomp(proc.pid)
            probe_args = {"url": a.url, "api_key": a.api_key, "requests": a.requests, "max_tokens": 64}
            result["probe"] = run_module("openai_probe", probe_args)
            result["models_without_key_status"] = http_status(a.url + "/v1/models")
            result["models_with_key_status"] = http_status(
                a.url + "/v1/models", {"Authorization": f"Bearer {a.api_key}"}
            )
            with urllib.request.urlopen(a.url + "/metrics", timeout=10) as r:
                metrics = r.read().decode()
            result["metrics_spec_decode_lines"] = [
                ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode") and not ln.startswith("#")
            ]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    probe = result.get("probe", {})
    checks = {
        "healthy": result.get("health_status") == 200,
        "completion_non_empty": probe.get("completions", 0) >= 1 and bool(probe.get("completion_text")),
        "mean_acceptance_length_computed": probe.get("mean_acceptance_length") is not None,
        "key_required": result.get("models_without_key_status") == 401 and result.get("models_with_key_status") == 200,
        "spec_decode_counters_exposed": any(
            ln.startswith("vllm:spec_decode_num_drafts") for ln in result.get("metrics_spec_decode_lines", [])
        ),
    }
    if filtered:
        sf = result["syscall_filter"]
        calls = sf["probe"].get("calls", {})
        denied = [n for n, call in PROBE_DENIED.items() if (call in sf["names"]) == (sf["kind"] == "deny list")]
        expected = {n: sf["own_errno"].get(PROBE_DENIED[n], sf["error_number"]) for n in denied}
        checks["filter_denies_with_the_units_errno"] = bool(expected) and all(
            calls.get(name) == want for name, want in expected.items()
        )
        # What this kernel gives without the filter (gVisor, say, may lack a call): the filter changes none of it.
        without = sf["probe_without"].get("calls", {})
        checks["filter_lets_needed_calls_through"] = bool(without) and all(
            calls.get(name) == without.get(name) for name in PROBE_NEEDED
        )
        procs = sf.get("processes", {})
        checks["filter_in_force_in_every_vllm_process"] = bool(procs) and all(
            p.get("Seccomp") == "2" and p.get("NoNewPrivs") == "1" for p in procs.values()
        )
    result["checks"] = checks
    result["ok"] = all(checks.values())
    if a.api_key in json.dumps(result):
        raise SystemExit("the API key leaked into the result; refusing to write it")
    with open(os.path.join(a.out, "serve_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    shown = {k: v for k, v in result.items() if k not in ("metrics_spec_decode_lines", "syscall_filter")}
    shown["syscall_filter"] = {k: v for k, v in result["syscall_filter"].items() if k != "names"}
    print(json.dumps(shown, indent=1)[-6000:])
    if not result["ok"]:
        print(Path(log.name).read_text()[-4000:])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
