"""Seeded, time-bounded fuzzing of what the project reads back and validates (issue 23).

Each target gets mutated inputs (bytes flipped, cut, repeated, nested, numbers blown up, control
characters inserted) for at most BUDGET_S seconds; only the documented exception type may come
out, never a traceback of another kind. FUZZ_SEED picks another seed, FUZZ_BUDGET_S another
budget (docs/development.md, "Hostile inputs").
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time

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
from inventory_checks import type_problem
from unit_values import unit_value_problems

SEED = int(os.environ.get("FUZZ_SEED", "23"))
BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "1.0"))

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
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        at = rng.randint(0, len(out))
        if op == 0 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 1:
            out[at:at] = rng.choice(PIECES) * rng.choice((1, 1, 2, 200))
        elif op == 2:
            del out[at : at + rng.randint(1, 16)]
        elif op == 3:
            out = out[:at]
        else:
            out[at:at] = b"[" * 3000 + b"]" * 3000
    return bytes(out)


def fuzz(seed_input: bytes, check, allowed: tuple[type[BaseException], ...]) -> int:
    rng = random.Random(SEED)
    deadline = time.monotonic() + BUDGET_S
    runs = 0
    while time.monotonic() < deadline:
        data = mutate(rng, seed_input)
        with contextlib.suppress(*allowed):
            check(data)
        runs += 1
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


@pytest.mark.parametrize(("name", "seed"), [("config.json", CONFIG), ("tokenizer.json", TOKENIZER)])
def test_target_config_and_tokenizer(tmp_path, name, seed):
    (tmp_path / "config.json").write_bytes(CONFIG)
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER)

    def check(data: bytes) -> None:
        (tmp_path / name).write_bytes(data)
        read_target(str(tmp_path))
        find_mask_token_id(str(tmp_path))

    assert fuzz(seed, check, (DFlashConfigError,)) > 0


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
