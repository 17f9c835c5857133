"""Seeded, time-bounded fuzzing of what the project reads back and validates (issue 23).

Each target gets mutated inputs (bytes flipped, cut, repeated, nested, numbers blown up, control
characters, ``\\"`` escapes and lone surrogate escapes inserted) for at most BUDGET_S seconds; only
the documented exception type may come out, never a traceback of another kind, and no one call may
take longer than CALL_DEADLINE_S (a quadratic parser fails the test, naming the input). FUZZ_SEED
picks another seed, FUZZ_BUDGET_S another budget, FUZZ_CALL_S another per-call deadline
(docs/development.md, "Hostile inputs").
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from ansible.module_utils.dflash_drafter import DFlashConfigError, find_mask_token_id, read_target
from ansible.module_utils.model_stage import parse_sidecar
from ansible.module_utils.nvidia_gpu import (
    NvidiaParseError,
    check_container_config,
    parse_compute_apps,
    parse_kernel_driver_version,
    parse_lxc_config,
    parse_proc_devices,
    parse_query_gpu,
    parse_smi_version,
)
from ansible.module_utils.openai_bench import BenchError, parse_sse_line
from ansible.module_utils.openai_probe import (
    MetricsParseError,
    parse_prometheus_text,
    parse_systemctl_show,
    spec_decode_counters,
    unit_is_crashing,
)
from ansible.module_utils.safe_io import UnsafeFileError, loads_json
from ansible.module_utils.safetensors_header import SafetensorsError, inspect_path, parse_header_bytes
from ansible.module_utils.vllm_changeset import ChangeSetError, parse_changeset
from ansible.module_utils.vllm_venvs import MARKER, list_venvs, read_venv
from inventory_checks import type_problem
from module_results import all_text_is_utf8
from rollout_report import failure_message, summary_rows, summary_table, tune_levels, tune_rows, tune_table
from unit_values import unit_value_problems

SEED = int(os.environ.get("FUZZ_SEED", "23"))
BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "1.0"))
# No reader may take longer than this on one input (the largest mutated inputs are about 1 MiB).
CALL_DEADLINE_S = float(os.environ.get("FUZZ_CALL_S", "2.0"))

PIECES = [
    b"[",
    b"]",
    b"{",
    b"}",
    b'"',
    b"\\u",
    b"\\ud800",
    b"NaN",
    b"1e400",
    b"9" * 5000,
    b"\n",
    b"\x00",
    b"\xff",
    b":",
    b'\\"',  # an escaped quote inside a string
    b'"\\ud800"',  # a whole string holding a lone surrogate
    b'"a\\udfffb"',
    b'{"\\ud800": 1}',
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        at = rng.randint(0, len(out))
        if op == 0 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 1:
            out[at:at] = rng.choice(PIECES) * rng.choice((1, 1, 2, 200))
        elif op == 2:
            del out[at : at + rng.randint(1, 16)]
        elif op == 3:
            out = out[:at]
        elif op == 4:
            out[at:at] = b"[" * 3000 + b"]" * 3000
        elif op == 5:
            # deep nesting of objects too, closed or left open
            out[at:at] = b'{"a":' * 3000 + (b"1" + b"}" * 3000 if rng.random() < 0.5 else b"")
        else:
            # a string opened and then many escaped quotes: what a backtracking string regex chokes on
            out[at:at] = b'"' + b'\\"' * rng.choice((200, 20000)) + rng.choice((b"", b'"'))
    return bytes(out)


class Overran(BaseException):
    """One call ran past twice CALL_DEADLINE_S (SIGALRM): the loop stops it there and fails."""


def described(data: bytes) -> str:
    """An input for a failure message: its length and its start (the seed reproduces the rest)."""
    return f"{len(data)} bytes starting {data[:120]!r} (FUZZ_SEED={SEED})"


def fuzz(seed_input: bytes, check, allowed: tuple[type[BaseException], ...]) -> int:
    """Mutations of ``seed_input`` through ``check`` for BUDGET_S seconds, each within CALL_DEADLINE_S."""
    rng = random.Random(SEED)
    deadline = time.monotonic() + BUDGET_S
    runs = 0

    def overran(_signum: int, _frame: object) -> None:
        raise Overran

    previous = signal.signal(signal.SIGALRM, overran)
    try:
        while time.monotonic() < deadline or runs == 0:
            data = mutate(rng, seed_input)
            started = time.monotonic()
            # A hard stop at twice the deadline (Python code and the re module see the signal; C code
            # that never checks for signals is measured when it returns).
            signal.setitimer(signal.ITIMER_REAL, 2 * CALL_DEADLINE_S)
            try:
                with contextlib.suppress(*allowed):
                    check(data)
            except Overran:
                pass
            except Exception as exc:  # not the documented type: a traceback, named with its input
                raise AssertionError(f"{type(exc).__name__}: {str(exc)[:200]} on {described(data)}") from exc
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.monotonic() - started
            if took > CALL_DEADLINE_S:
                pytest.fail(f"one call took {took:.1f} s (the limit is {CALL_DEADLINE_S} s) on {described(data)}")
            runs += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return runs


HEADER = json.dumps(
    {"__metadata__": {"format": "pt"}, "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
).encode()
SIDECAR = json.dumps({"version": 1, "files": {"model.safetensors": {"size": 1, "mtime": 2, "sha256": "0" * 64}}})
CONFIG = json.dumps(
    {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 9, "max_position_embeddings": 9, "rope_theta": 1e6}
).encode()
TOKENIZER = json.dumps({"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2}]}).encode()
MANIFEST = json.dumps(
    {"format": 1, "patchset": "p", "vllm_version": "1", "files": [{"path": "x.py", "kind": "add", "source": "a"}]}
).encode()
SSE = b'data: {"choices": [{"text": "x"}], "usage": {"completion_tokens": 3}}'
SMI = b"0, NVIDIA H200, GPU-1, 00000000:01:00.0, 570.1, 143771, 1, 143770, 0, 9.0, 30, 70, 700"


def test_safetensors_headers():
    assert fuzz(HEADER, lambda d: parse_header_bytes(d, 16, "f"), (SafetensorsError,)) > 0


def test_sidecars_never_raise():
    # An unreadable sidecar counts as no record: nothing at all may come out.
    assert fuzz(SIDECAR.encode(), lambda d: parse_sidecar(d.decode("utf-8", "replace")), ()) > 0


def test_json_read_back():
    assert fuzz(CONFIG, lambda d: loads_json(d, "f"), (UnsafeFileError,)) > 0


TOKENIZER_CONFIG = json.dumps(
    {"added_tokens_decoder": {"2": {"content": "<|mask|>", "special": True}}, "model_max_length": 9}
).encode()
VOCAB = json.dumps({"a": 0, "b": 1}).encode()
ADDED_TOKENS = json.dumps({"<|mask|>": 2}).encode()
# Every file dflash_drafter reads in a target directory; all present ones count.
TARGET_FILES = {
    "config.json": CONFIG,
    "tokenizer.json": TOKENIZER,
    "tokenizer_config.json": TOKENIZER_CONFIG,
    "vocab.json": VOCAB,
    "added_tokens.json": ADDED_TOKENS,
}


@pytest.mark.parametrize("name", sorted(TARGET_FILES))
def test_target_config_and_tokenizer_files(tmp_path, name):
    for other, content in TARGET_FILES.items():
        (tmp_path / other).write_bytes(content)

    def check(data: bytes) -> None:
        (tmp_path / name).write_bytes(data)
        read_target(str(tmp_path))
        find_mask_token_id(str(tmp_path))

    assert fuzz(TARGET_FILES[name], check, (DFlashConfigError,)) > 0


def test_changeset_manifests():
    assert fuzz(MANIFEST, lambda d: parse_changeset(d, "m", "1", "p", lambda r: b"", str), (ChangeSetError,)) > 0


def test_stream_lines():
    assert fuzz(SSE, lambda d: parse_sse_line(d.decode("utf-8", "replace")), (BenchError,)) > 0


def test_nvidia_smi_output():
    assert fuzz(SMI, lambda d: parse_query_gpu(d.decode("utf-8", "replace")), (NvidiaParseError,)) > 0


def test_inventory_and_unit_values_never_raise():
    def check(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        for value in (text, len(data) * 10**300, [text], {text: text}):
            type_problem("demo_api_key", value, {"type": "str"})
            type_problem("demo_port", value, {"type": "int", "choices": [1]})
        unit_value_problems({"a": text}, {"b": [text]}, {"c": {text: text}}, {"d": text})

    assert fuzz(b"Qwen3.6-27B --x=1", check, ()) > 0


INDEX = json.dumps(
    {"metadata": {"total_size": 16}, "weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}
).encode()
METRICS = (
    b'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 10\n'
    b'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7\n'
    b"vllm:spec_decode_num_accepted_tokens_total 15\n# HELP x y\n"
)
SYSTEMCTL = b"ActiveState=active\nSubState=running\nNRestarts=0\nResult=success\nMainPID=42\n"
APPS = b"123, GPU-1, python3, 2426\n"
LXC = (
    b"lxc.cgroup2.devices.allow = c 195:* rwm\n"
    b"lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\ndev0: /dev/nvidia-uvm\n"
)


def test_shard_indexes(tmp_path):
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(len(HEADER).to_bytes(8, "little") + HEADER + bytes(16))

    def check(data: bytes) -> None:
        (tmp_path / "model.safetensors.index.json").write_bytes(data)
        inspect_path(str(tmp_path))

    assert fuzz(INDEX, check, (SafetensorsError,)) > 0


def test_metrics_bodies():
    def check(data: bytes) -> None:
        spec_decode_counters(parse_prometheus_text(data.decode("utf-8", "replace")), "m")

    assert fuzz(METRICS, check, (MetricsParseError,)) > 0


def test_systemctl_show_output_never_raises():
    def check(data: bytes) -> None:
        unit_is_crashing(parse_systemctl_show(data.decode("utf-8", "replace")), 2)

    assert fuzz(SYSTEMCTL, check, ()) > 0


def test_other_nvidia_smi_and_proc_texts():
    def check(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        parse_proc_devices(text)
        parse_kernel_driver_version(text)
        parse_smi_version(text)
        parse_compute_apps(text)

    assert fuzz(APPS, check, (NvidiaParseError,)) > 0


def test_container_configs_never_raise():
    def check(data: bytes) -> None:
        config = parse_lxc_config(data.decode("utf-8", "replace"))
        names = [e["source"] for e in config["mount_entries"]] + [e["path"] for e in config["dev_entries"]]
        check_container_config(config, {n: None for n in names}, 1, 238)

    assert fuzz(LXC, check, ()) > 0


METADATA = b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1\nRequires-Dist: torch==2.9.0\n\nvLLM\n"
VENV_MARKER = json.dumps({"version": "0.20.1", "installed_at": "2026-01-01T00:00:00Z", "method": "ddtree"}).encode()


@pytest.mark.parametrize("name", ["METADATA", MARKER])
def test_venv_metadata_and_marker(tmp_path, name):
    """vllm_venv_info and vllm_venvs read a venv's dist-info METADATA and the role's install marker."""
    venv = tmp_path / "0.20.1"
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm-0.20.1.dist-info").mkdir()
    path = site / "vllm-0.20.1.dist-info" / "METADATA" if name == "METADATA" else venv / MARKER
    (site / "vllm-0.20.1.dist-info" / "METADATA").write_bytes(METADATA)
    (venv / MARKER).write_bytes(VENV_MARKER)

    def check(data: bytes) -> None:
        path.write_bytes(data)
        state = read_venv(str(venv), "ddtree").as_dict()
        entries = [vars(e) for e in list_venvs(str(tmp_path))]
        # What the modules return must reach the controller: JSON, UTF-8 text.
        json.dumps([state, entries])
        assert all_text_is_utf8(state), f"read_venv returned text the controller refuses on {described(data)}"

    assert fuzz(METADATA if name == "METADATA" else VENV_MARKER, check, ()) > 0


ACTION = Path(__file__).resolve().parents[2] / "plugins" / "action" / "safetensors_stage.py"
STAGE_DIGEST = "5020823fe0e40834133cbf04f57dc4d8db9a5c8f267dd8dcd2ac0d86e1877658"
QUICK_LISTING = (
    "|4096|1796026849.9072278980|root|vllm|750|d\r\n"
    "model.safetensors|268435664|1796026301.1552340770|vllm|vllm|640|f\r\n"
    ".model_stage.json|247|1796026849.9011244160|vllm|vllm|644|f\r\n"
    "--model-stage-sidecar--\r\n"
    '{"files": {"model.safetensors": {"mtime": 1796026301, "sha256": "' + STAGE_DIGEST + '",'
    ' "size": 268435664, "source": "/w/a.safetensors"}}, "version": 1}\r\n'
).encode()


def test_the_quick_check_listing():
    """safetensors_stage's action plugin judges a node's find listing and sidecar: anything odd is None."""
    spec = importlib.util.spec_from_file_location("safetensors_stage_action_fuzz", ACTION)
    action = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(action)
    sources = [{"name": "model.safetensors", "origin": "/w/a.safetensors", "size": 268435664, "mtime": 1796026301}]
    args = {"owner": "vllm", "group": "vllm", "mode": "0640", "dir_mode": "0750"}
    assert action.unchanged_on_node(QUICK_LISTING.decode(), sources, args) is not None

    def check(data: bytes) -> None:
        found = action.unchanged_on_node(data.decode("utf-8", "replace"), sources, args)
        assert found is None or set(found) == {"model.safetensors"}

    assert fuzz(QUICK_LISTING, check, ()) > 0


NODE_REPORT = json.dumps(
    {
        "gpu_check": {"summary": "1x NVIDIA H200"},
        "service_swap": {
            "serving": "vllm",
            "mean_acceptance_length": 3.4,
            "tokens_per_second": 181.2,
            "probe_requests": 3,
            "probe_max_tokens": 64,
            "rolled_back": False,
        },
        "tune": {
            "winner": "ddtree",
            "reason": "faster",
            "traffic": [{"concurrency": 4, "weight": 1.0}],
            "rows": [
                {
                    "method": "ddtree",
                    "budget": 8,
                    "levels": [{"concurrency": 4, "tok_s": 190.0, "acceptance": 3.5, "vs_chain": 1.1}],
                    "acceptance": 3.5,
                    "vs_chain": 1.1,
                }
            ],
        },
    }
).encode()
FAILED_RESULT = json.dumps({"msg": "n1: gpu_check failed", "results": [{"failed": True, "msg": "x"}]}).encode()


@pytest.mark.parametrize(
    ("what", "seed"),
    [
        pytest.param("report", NODE_REPORT, id="report"),
        pytest.param("failed result", FAILED_RESULT, id="failed-result"),
    ],
)
def test_rollout_report_inputs_never_raise(what, seed):
    """The rollout report callback's inputs: a node's dflash_report fact and a failed task's result.

    Ansible delivers them as decoded JSON; what does not decode never reaches the callback."""

    def check(data: bytes) -> None:
        try:
            value = json.loads(data.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            return
        host = {"outcome": "failed", "report": {}, "errors": [], "stats": {"failures": 1}}
        if what == "report":
            host["report"] = value
        elif isinstance(value, dict):
            host["errors"].append({"task": "t", "msg": failure_message(value)})
        hosts = {"n1": host, "n2": {"outcome": "ok", "report": value, "errors": []}}
        summary_table(summary_rows(hosts))
        levels = tune_levels(hosts)
        tune_table(tune_rows(hosts, levels), levels)
        json.dumps({"hosts": hosts}, indent=2, sort_keys=True, default=str)

    assert fuzz(seed, check, ()) > 0
