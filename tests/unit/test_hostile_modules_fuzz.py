"""Seeded, time-bounded fuzzing of every module in library/, in-process (issue 23, "Tests").

Two suites, both seeded (FUZZ_SEED) and bounded (FUZZ_BUDGET_S seconds per target, as in
test_hostile_inputs_fuzz.py):

- every module's inputs: each run takes one module's good arguments and replaces one or two of
  them with hostile values (empty, NUL, newlines, huge numbers, paths to a FIFO, a directory, a
  symlink to a root-only file outside the sandbox, /dev/zero behind a link, wrong types);
- HTTP bodies: openai_probe and openai_bench against a hostile server on 127.0.0.1 whose every
  answer (status line, headers and body) is a mutation of a good one.

Every run must end the way a module ends (exit_json or fail_json: one JSON object, no traceback),
within its deadline, with text the controller accepts (UTF-8) and no no_log value (the API key) in
it, without changing anything outside the sandbox (the root-only files the links point at, and the
directory above the sandbox), and without leaving a half-written file (a safe_io temporary) behind.
A path through the sandbox's link to a directory outside is the operator's choice of destination:
the module may write into that directory, never into the root-only file. Paths stay inside the
sandbox or under that link, URLs on 127.0.0.1: no traffic leaves the machine. The seeds 1, 2, 7
and 23 pass at FUZZ_BUDGET_S=8.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import sys
import time
import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import dflash_config
import json_file_info
import lxc_gpu_config
import nvidia_gpu_facts
import openai_bench
import openai_probe
import pytest
import safetensors_info
import safetensors_stage
import vllm_patch
import vllm_release_check
import vllm_venv_info
import vllm_venvs
from ansible.module_utils.testing import patch_module_args
from module_results import all_text_is_utf8
from safetensors_files import dflash_shapes, fake, write_real
from test_hostile_inputs_fuzz import BUDGET_S, SEED, mutate
from test_openai_hostile import KEY, MODELS, Hostile, fixed
from test_vllm_patch import TOUCHED, make_venv

from ddtree import HOME
from ddtree.tests import release_files

REPO = Path(__file__).resolve().parents[2]
FAKE_SMI = REPO / "tests" / "fakes" / "nvidia_smi.py"
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
CHANGESET = str(HOME)
RUN_DEADLINE_S = 30.0
# nvidia_gpu_facts's timeout in these runs: each nvidia-smi call and the smoke test may take it, plus
# the 5 s that coreutils timeout waits before KILL; well under RUN_DEADLINE_S.
GPU_TIMEOUT_S = 5
# What safe_io.atomic_write names its temporary files: a run that fails must remove its own.
HALF_WRITTEN = re.compile(r"\.[0-9a-f]{16}(\.tmp|\.part)$")


def tree(path: Path) -> dict[str, tuple[bytes | str, int, int, int]]:
    """Every entry under ``path`` (not following links): content or link target, owner, group, mode."""
    out: dict[str, tuple[bytes | str, int, int, int]] = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            if os.path.islink(p):
                what: bytes | str = os.readlink(p)
            elif os.path.isfile(p):
                what = Path(p).read_bytes()
            else:
                what = "dir"
            out[os.path.relpath(p, path)] = (what, st.st_uid, st.st_gid, st.st_mode)
    return out


class Sandbox:
    """The box the modules work in, the root-only files outside it, and hostile values pointing at both."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.outside = tmp / "outside"
        self.outside.mkdir()
        secret = self.outside / "sudoers"
        secret.write_text("root ALL=(ALL) ALL\n")
        secret.chmod(0o600)
        self.box = tmp / "box"
        (self.box / "cwd" / "deep").mkdir(parents=True)
        os.mkfifo(self.box / "fifo")
        (self.box / "link-out").symlink_to(secret)
        (self.box / "link-dir-out").symlink_to(self.outside)
        (self.box / "zero").symlink_to("/dev/zero")
        (self.box / "a-dir").mkdir()
        self.top = sorted(os.listdir(tmp))
        self.original = tree(self.outside)
        self.before = dict(self.original)

    def strings(self) -> list[str]:
        b = self.box
        return [
            "",
            "\x00",
            "a\x00b",
            "\n[Service]\nExecStartPre=/bin/sh -c id",
            "x" * 5000,
            "../x",
            "-1",
            "1e400",
            "\uff10",  # a fullwidth digit: isdigit() says yes, int() takes it
            " ",
            str(b / "fifo"),
            str(b / "link-out"),
            # A directory symlink given as the path itself names that directory (the operator's choice:
            # check_unchanged lets the module write there); links planted at the last component must
            # never be written through (the root-only file never changes).
            str(b / "link-dir-out") + "/absent",
            str(b / "zero"),
            str(b / "a-dir"),
            str(b / "absent" / "deeper"),
            str(b / "fifo") + "/x",
        ]

    def hostile(self, rng: random.Random, good: Any) -> Any:
        numbers = [0, -1, 1, 2**31, 2**63, 10**30, -(10**30)]
        if isinstance(good, bool):
            return rng.choice([not good, "maybe", None])
        if isinstance(good, int):
            return rng.choice([*numbers, "abc", None])
        if isinstance(good, str):
            return rng.choice([*self.strings(), None, 5, ["x"]])
        if isinstance(good, list):
            return rng.choice(
                [[], [rng.choice(self.strings())], [0, -1, 10**30], ["x"] * 2000, [[]], [{}], "x", None, good[:1] * 3]
            )
        if isinstance(good, dict):
            key = rng.choice(list(good) or ["a"])
            return rng.choice(
                [{}, {"\x00": "x"}, {"a": [1]}, {key: rng.choice(self.strings())}, {key: 10**30}, "x", None]
            )
        return rng.choice([*self.strings(), *numbers, None])

    def through_the_dir_link(self, value: Any) -> bool:
        """Whether an argument names a path under ``link-dir-out/``: the operator's own choice of place."""
        if isinstance(value, str):
            return value.startswith(str(self.box / "link-dir-out") + "/")
        if isinstance(value, list):
            return any(self.through_the_dir_link(v) for v in value)
        if isinstance(value, dict):
            return any(self.through_the_dir_link(v) for v in value.values())
        return False

    def check_unchanged(self, args: dict[str, Any]) -> None:
        now = tree(self.outside)
        # The root-only file is never written, whatever the arguments: not through a link planted at a
        # path's last component (link-out), not through the directory link either.
        assert now.get("sudoers") == self.original["sudoers"], f"the root-only file outside changed with {shown(args)}"
        if self.through_the_dir_link(args):
            # A path through link-dir-out names the directory the link points at: writing there is
            # writing where the operator pointed, so new entries there are the module's own results
            # (never half-written ones), and they count as the outside's state from now on.
            for name in now:
                assert not HALF_WRITTEN.search(name), f"outside/{name} was left half-written with {shown(args)}"
            self.before = now
        assert now == self.before, f"a file outside the sandbox changed with {shown(args)}"
        assert sorted(os.listdir(self.tmp)) == self.top, f"something was written beside the sandbox with {shown(args)}"
        for root, _dirs, files in os.walk(self.box):
            for name in files:
                assert not HALF_WRITTEN.search(name), f"{root}/{name} was left half-written with {shown(args)}"


def shown(value: Any) -> str:
    """The arguments of a failing run, long values cut, for the failure message (the seed reproduces them)."""
    if isinstance(value, str) and len(value) > 60:
        return repr(value[:60] + f"...<{len(value)} chars>")
    if isinstance(value, list) and len(value) > 5:
        return "[" + ", ".join(shown(v) for v in value[:5]) + f", ...<{len(value)} items>]"
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{shown(k)}: {shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def no_log_values(made: list[Any], args: dict[str, Any]) -> set[str]:
    """The values of the run's no_log parameters (an API key), as given and as Ansible collected them.

    Values of fewer than 4 characters are left out: Ansible masks those wherever they occur, and they
    occur in any text by chance."""
    values: set[str] = set()
    for m in made:
        values.update(str(v) for v in getattr(m, "no_log_values", ()))
        for name, spec in (getattr(m, "argument_spec", None) or {}).items():
            if isinstance(spec, dict) and spec.get("no_log") and args.get(name) is not None:
                values.add(args[name] if isinstance(args[name], str) else json.dumps(args[name]))
    return {v for v in values if len(v) >= 4}


def run_module(module: Any, args: dict[str, Any], capsys: pytest.CaptureFixture[str], deadline: Any) -> dict:
    """One run in-process; anything but a module's own exit is a failure naming the arguments."""
    started = time.monotonic()
    made: list[Any] = []

    class Recording(module.AnsibleModule):  # the module's AnsibleModule, to read its no_log values back
        def __init__(self, *a: Any, **kw: Any) -> None:
            made.append(self)
            super().__init__(*a, **kw)

    try:
        with deadline(RUN_DEADLINE_S), patch_module_args(args), mock.patch.object(module, "AnsibleModule", Recording):
            module.main()
    except SystemExit:
        pass
    except BaseException as exc:  # a traceback, or Hung from the deadline
        pytest.fail(f"{module.__name__} raised {type(exc).__name__}: {str(exc)[:300]} with {shown(args)}")
    out = capsys.readouterr().out
    try:
        result = json.loads(out)
    except ValueError:
        pytest.fail(f"{module.__name__} printed no JSON result with {shown(args)}: {out[:300]!r}")
    assert isinstance(result, dict)
    if result.get("failed"):
        assert isinstance(result.get("msg"), str) and result["msg"], result
    assert all_text_is_utf8(result), f"{module.__name__} returned text the controller refuses with {shown(args)}"
    text = json.dumps(result, ensure_ascii=False)
    for secret in no_log_values(made, args):
        assert secret not in text, f"{module.__name__} returned a no_log value ({secret[:8]!r}...) with {shown(args)}"
    assert time.monotonic() - started < RUN_DEADLINE_S
    return result


def fuzz_module(
    module: Any,
    variants: list[dict[str, Any]],
    extra: dict[str, Any],
    box: Sandbox,
    capsys: pytest.CaptureFixture[str],
    deadline: Any,
    budget: float = BUDGET_S,
    instead_of_default: dict[str, Any] | None = None,
) -> int:
    """Run ``module`` with hostile arguments until the budget is spent; returns the number of runs.

    ``instead_of_default``: arguments given this value where the fuzz drops them, for a default (the
    gpu module's 60 s timeout) that would outlast the harness's RUN_DEADLINE_S; hostile values of
    them are still tried."""
    rng = random.Random(f"{SEED}-{module.__name__}")
    stop = time.monotonic() + budget
    runs = 0
    while time.monotonic() < stop or runs == 0:
        args = copy.deepcopy(rng.choice(variants))
        names = sorted(set(args) | set(extra))
        for name in rng.sample(names, rng.randint(1, min(2, len(names)))):
            good = args.get(name, extra.get(name))
            value = box.hostile(rng, good)
            if value is None and name in (instead_of_default or {}):
                args[name] = instead_of_default[name]
            elif value is None:
                args.pop(name, None)
            else:
                args[name] = value
        if rng.random() < 0.3:
            args["_ansible_check_mode"] = True
        run_module(module, args, capsys, deadline)
        box.check_unchanged(args)
        runs += 1
    return runs


@pytest.fixture
def box(tmp_path, monkeypatch) -> Sandbox:
    sandbox = Sandbox(tmp_path)
    # Relative paths resolve inside the sandbox, never in the repository.
    monkeypatch.chdir(sandbox.box / "cwd" / "deep")
    return sandbox


def test_drafter_modules(box, capsys, deadline):
    drafter = box.box / "drafter"
    drafter.mkdir()
    write_real(drafter / "model.safetensors", dflash_shapes(64, 2, 4, 2, 16, 128, 2))
    target = fake("target_configs").tiny(box.box / "target")
    good = {"drafter": str(drafter), "target": str(target), "dest": str(drafter / "config.json")}
    extra = {
        "block_size": 16,
        "mask_token_id": 5,
        "target_layer_ids": [1, 5],
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": 2048,
        "backup": True,
        "mode": "0640",
        "owner": "root",
        "group": "root",
    }
    assert fuzz_module(dflash_config, [good], extra, box, capsys, deadline) > 0
    assert fuzz_module(safetensors_info, [{"path": str(drafter)}], {"checksum": "sha256"}, box, capsys, deadline) > 0


def test_json_file_info(box, capsys, deadline):
    config = fake("target_configs").tiny(box.box / "target") / "config.json"
    extra = {"max_bytes": 16 * 1024 * 1024, "follow": True, "missing_ok": True}
    assert fuzz_module(json_file_info, [{"path": str(config)}], extra, box, capsys, deadline) > 0


def test_safetensors_stage(box, capsys, deadline):
    src = box.box / "src" / "model.safetensors"
    src.parent.mkdir()
    write_real(src, {"fc.weight": (8, 16), "norm.weight": (8,)})
    dest = box.box / "dest"
    base = {"src": str(src), "dest": str(dest), "owner": "root", "group": "root", "space_margin": 0}
    st = src.stat()
    listing = [{"name": "model.safetensors", "origin": str(src), "size": st.st_size, "mtime": int(st.st_mtime)}]
    temp = str(dest / f".model_stage-model.safetensors.{st.st_size}-{int(st.st_mtime)}.part")
    transfer = {**listing[0], "temp": temp, "kind": "transfer", "digest": "0" * 64, "digest_from": "source"}
    variants = [
        {**base, "step": "plan", "files": listing},
        {**base, "remote_src": True},
        {**base, "remote_src": True, "step": "copy", "files": [transfer]},
        {**base, "step": "follow", "files": [{"name": "model.safetensors", "temp": temp, "size": 1, "stall": 0.1}]},
        {**base, "step": "commit", "files": [transfer, {"name": "config.json", "kind": "keep"}]},
    ]
    extra = {"sha256": "0" * 64, "mode": "0640", "dir_mode": "0750", "rsync_opts": ["--x"]}
    assert fuzz_module(safetensors_stage, variants, extra, box, capsys, deadline) > 0


def test_vllm_modules(box, capsys, deadline):
    with zipfile.ZipFile(release_files.wheel()) as whl:
        names = whl.namelist()
        pristine = {name: whl.read(name) for name in TOUCHED}
        pristine["METADATA"] = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    venv = make_venv(box.box, pristine)
    root = box.box / "opt-vllm"
    for version in ("0.19.0", "0.20.1"):
        (root / version / "bin").mkdir(parents=True)
    patch_extra = {"state": "absent", "patchset": "ddtree", "manifests": {"m": "{}"}, "sources": {"a": "YQ=="}}
    patch = [{"venv": str(venv), "changeset_root": CHANGESET}]
    assert fuzz_module(vllm_patch, patch, patch_extra, box, capsys, deadline) > 0
    info_extra = {"method": "ddtree", "expected_version": "0.20.1", "require": True, "import_timeout": 5}
    info = [{"venv": str(venv)}, {"venv": str(venv), "verify_import": True}]
    assert fuzz_module(vllm_venv_info, info, info_extra, box, capsys, deadline) > 0
    venvs = [{"root": str(root), "current": "0.20.1", "keep": 1, "history": ["0.19.0"]}]
    assert fuzz_module(vllm_venvs, venvs, {"wheelhouse_root": str(box.box / "wheels")}, box, capsys, deadline) > 0
    check_extra = {
        "method": "ddtree",
        "hybrid_target": True,
        "sliding_drafter": True,
        "ddtree_patch": True,
        "patch_fixes": ["dflash_layer_ids"],
        "num_speculative_tokens": 15,
        "allow_unknown": False,
    }
    assert fuzz_module(vllm_release_check, [{"version": "0.20.1"}], check_extra, box, capsys, deadline) > 0


def test_gpu_modules(box, capsys, deadline, monkeypatch):
    state = box.box / "gpu.json"
    state.write_text(json.dumps({"fixture": "h200-x1", "fault": None}))
    monkeypatch.setenv("LAB_FAKES_GPU_STATE", str(state))
    monkeypatch.setenv("LAB_FAKES_NVIDIA_SMI_FIXTURES", str(FIXTURES))
    monkeypatch.setenv("LAB_FAKES_GPU_HOLDERS", str(box.box / "holders"))
    (box.box / "holders").mkdir()
    (box.box / "proc").mkdir()
    (box.box / "proc" / "devices").write_text("Character devices:\n195 nvidia\n238 nvidia-uvm\n")
    (box.box / "version").write_text((FIXTURES / "h200-x1" / "driver.txt").read_text())
    (box.box / "dev").mkdir()
    good = {
        "nvidia_smi_path": str(FAKE_SMI),
        "driver_version_path": str(box.box / "version"),
        "dev_dir": str(box.box / "dev"),
        "proc_dir": str(box.box / "proc"),
        "libcuda": "libcuda-not-installed.so.1",
        "timeout": GPU_TIMEOUT_S,
    }
    extra = {"cuda_smoke_test": True, "thresholds": {"gpu_count": 1, "min_memory_mib": 1000}}
    # The module's contract is its own timeout (a FIFO as libcuda hangs the smoke test until then):
    # never its 60 s default here, which outlasts RUN_DEADLINE_S.
    pinned = {"timeout": GPU_TIMEOUT_S}
    assert fuzz_module(nvidia_gpu_facts, [good], extra, box, capsys, deadline, instead_of_default=pinned) > 0
    config = box.box / "lxc.conf"
    config.write_text("lxc.cgroup2.devices.allow = c 195:* rwm\nlxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind\n")
    lxc = [{"config_path": str(config), "gpu_count": 1, "proc_devices_path": str(box.box / "proc" / "devices")}]
    assert fuzz_module(lxc_gpu_config, lxc, {}, box, capsys, deadline) > 0


COMPLETION = json.dumps({"choices": [{"text": " Rome"}], "usage": {"completion_tokens": 1}}).encode()
STREAM = (
    b'data: {"choices": [{"text": " a"}]}\n\ndata: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)
METRICS = (
    b"vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_draft_tokens_total 30\n"
    b"vllm:spec_decode_num_accepted_tokens_total 15\n"
)


def serve(server: Hostile, completions: bytes) -> dict[str, bytes]:
    good = {
        "/health": fixed(b""),
        "/v1/models": fixed(MODELS),
        "/metrics": fixed(METRICS),
        "/v1/completions": fixed(completions),
    }
    server.behaviour.update(good)
    return good


@pytest.fixture
def servers():
    made = [Hostile(), Hostile()]
    yield made
    for s in made:
        s.close()


def test_module_arguments_of_the_http_modules(box, capsys, deadline, servers):
    probe_server, bench_server = servers
    serve(probe_server, COMPLETION)
    serve(bench_server, STREAM)
    probe = [{"url": probe_server.url, "api_key": KEY, "requests": 1, "timeout": 2}]
    probe_extra = {"model": "m", "prompt": "p", "max_tokens": 4, "unit": "vllm.service", "max_restarts": 2}
    assert fuzz_module(openai_probe, probe, probe_extra, box, capsys, deadline) > 0
    bench = [{"url": bench_server.url, "api_key": KEY, "prompts": ["p"], "concurrency": [1], "timeout": 2}]
    bench_extra = {"model": "m", "requests_per_level": 1, "max_tokens": 4, "ignore_eos": True, "warmup": 0}
    # Without requests_per_level a level sends every prompt: 2000 hostile prompts are 2000 requests of
    # up to `timeout` each, the operator's own long run rather than a hang; keep it to one.
    pinned = {"requests_per_level": 1}
    assert fuzz_module(openai_bench, bench, bench_extra, box, capsys, deadline, instead_of_default=pinned) > 0


@pytest.mark.parametrize("module", ["probe", "bench"])
def test_http_bodies_from_a_hostile_server(box, capsys, deadline, servers, module):
    """Status lines, headers and bodies of every endpoint mutated; the modules must only ever report."""
    server = servers[0]
    good = serve(server, COMPLETION if module == "probe" else STREAM)
    if module == "probe":
        mod, args = openai_probe, {"url": server.url, "api_key": KEY, "requests": 1, "timeout": 2}
    else:
        args = {"url": server.url, "api_key": KEY, "prompts": ["p"], "concurrency": [1], "warmup": 0, "timeout": 2}
        mod = openai_bench
    rng = random.Random(f"{SEED}-http-{module}")
    stop = time.monotonic() + BUDGET_S
    runs = 0
    while time.monotonic() < stop or runs == 0:
        server.behaviour.update(good)
        for path in rng.sample(sorted(good), rng.randint(1, 2)):
            server.behaviour[path] = mutate(rng, good[path])
        result = run_module(mod, dict(args), capsys, deadline)
        assert KEY not in json.dumps(result)
        box.check_unchanged(args)
        runs += 1
    assert runs > 0


def test_the_fuzzed_modules_are_every_module():
    fuzzed = {
        "dflash_config",
        "json_file_info",
        "safetensors_info",
        "safetensors_stage",
        "vllm_patch",
        "vllm_venv_info",
        "vllm_venvs",
        "vllm_release_check",
        "nvidia_gpu_facts",
        "lxc_gpu_config",
        "openai_probe",
        "openai_bench",
    }
    assert {p.stem for p in (REPO / "library").glob("*.py")} == fuzzed
    assert sys.modules["vllm_patch"] is vllm_patch
