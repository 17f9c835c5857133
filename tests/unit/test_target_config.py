"""service_swap's memory fit validates what it reads from the target's files (issue 43, class 6).

config.json's Gated DeltaNet sizes are the node's: a non-numeric, infinite, null, negative or
absurd field refuses the fit with the file and the field named (never "invalid literal for int()"),
unit by unit and through ansible-playbook on the role's own tasks.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
from pathlib import Path

import pytest
from ansible.module_utils.target_config import TargetConfigError, gdn_shape, layer_kinds
from ddtree_method import target_is_hybrid, target_layer_problem
from memory_fit import service_swap_memory_fit
from playbook_run import ansible_playbook, local_play, localhost_inventory

CFG = "/m/config.json"
DRAFTER = {
    "hidden_size": 5120,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]},
}


def qwen36(**text_overrides) -> dict:
    text = {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 248320,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }
    text.update(text_overrides)
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}


def check(config, **kw) -> dict:
    settings = {
        "gpus": [{"memory_total_mib": 143771}],
        "gpu_memory_utilization": 0.9,
        "tensor_parallel_size": 1,
        "max_model_len": 32768,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 16384,
        "verify_tokens": 16,
        "depth": 15,
        "method": "ddtree",
        "reserve_mib": 2048,
        "lower": False,
    }
    settings.update(kw)
    return service_swap_memory_fit(config, DRAFTER, 55_600_000_000, 3_460_000_000, settings, "h", CFG)


def test_a_real_shape_passes() -> None:
    assert check(qwen36())["refuse"] == ""
    assert gdn_shape(qwen36(), CFG).layers == 48


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("linear_num_key_heads", "sixteen", "is 'sixteen', not a whole number"),
        ("linear_num_value_heads", None, "is None, not a whole number"),
        ("linear_key_head_dim", math.inf, "is inf, not a whole number"),
        ("linear_value_head_dim", -128, "is -128, outside 1 to 65536"),
        ("linear_value_head_dim", 0, "is 0, outside 1 to 65536"),
        ("linear_num_key_heads", 10**400, "is an integer of 401 digits, outside 1 to 4096"),
        ("linear_conv_kernel_dim", 2.5, "is 2.5, not a whole number"),
        ("linear_num_key_heads", True, "is True, not a whole number"),
    ],
)
def test_a_bad_gdn_field_refuses_naming_the_file_and_the_field(field, value, why) -> None:
    result = check(qwen36(**{field: value}))
    assert result["note"] == ""
    assert result["refuse"] == (
        f"the memory fit cannot run: {CFG}: text_config.{field} {why}; fix or replace {CFG} (the model's own"
        " config.json), or set shared_settings_target_dir to a complete model"
    )


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ([1, 2], f"{CFG} holds list, not a JSON object"),
        ({"text_config": "qwen"}, f"{CFG}: text_config is str, not a JSON object"),
        ({"text_config": {"layer_types": 48}}, f"{CFG}: text_config.layer_types is not a list of layer kinds"),
        ({"layer_types": ["linear_attention", 3]}, f"{CFG}.layer_types is not a list of layer kinds"),
    ],
)
def test_a_config_of_the_wrong_shape_is_named(config, problem) -> None:
    assert target_layer_problem(config, CFG).startswith(problem)
    assert check(config)["refuse"].startswith(f"the memory fit cannot run: {problem}")
    assert target_is_hybrid(config) is False
    with pytest.raises(TargetConfigError):
        layer_kinds(config, CFG)


def test_settings_and_gpu_facts_are_checked_too() -> None:
    assert "the tokens verified per step is -1, outside 0 to 4096" in check(qwen36(), verify_tokens=-1)["refuse"]
    lots = [{"memory_total_mib": "lots"}]
    assert "memory_total_mib (gpu_check's facts) is 'lots'" in check(qwen36(), gpus=lots)["refuse"]
    assert check(qwen36(), verify_tokens="16")["refuse"] == ""  # digits templating handed over as a string


# --- the play path: the role's own tasks through ansible-playbook ---------------------------------------------


def weights(directory: Path, values: int) -> None:
    """A valid safetensors file holding ``values`` bf16 values, sparse: the size the fit reads, no disk used."""
    directory.mkdir()
    raw = json.dumps({"w": {"dtype": "BF16", "shape": [values], "data_offsets": [0, 2 * values]}}).encode()
    raw += b" " * (-len(raw) % 8)
    with (directory / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 2 * values)


def role_play(tmp_path: Path, config: object, budget: int = 15) -> subprocess.CompletedProcess:
    target = tmp_path / "target"
    weights(target, 27_800_000_000)
    (target / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    drafter = tmp_path / "drafter"
    weights(drafter, 1_730_000_000)
    (drafter / "config.json").write_text(json.dumps(DRAFTER))
    play = local_play(
        tmp_path / "memory_fit.yml",
        "    - ansible.builtin.set_fact:\n"
        "        gpu_check_facts: {gpus: [{memory_total_mib: 143771}]}\n"
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: target.yml}\n"
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: memory_fit.yml}\n"
        f"      vars: {{service_swap_spec_method: ddtree, shared_settings_ddtree_budget: {budget},"
        " service_swap_max_num_seqs: 8}\n",
    )
    return ansible_playbook(
        localhost_inventory(tmp_path),
        play,
        *("-e", f"shared_settings_target_dir={target}", "-e", f"shared_settings_drafter_dir={drafter}"),
        ANSIBLE_INJECT_FACT_VARS="False",
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_NOCOLOR="1",
    )


def test_the_role_refuses_a_word_where_a_size_belongs_without_a_raw_exception(tmp_path) -> None:
    res = role_play(tmp_path, qwen36(linear_num_key_heads="sixteen"))
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "config.json: text_config.linear_num_key_heads is 'sixteen', not a whole number" in out, out
    assert "invalid literal" not in out and "Traceback" not in out
    assert "Nothing was changed." in out


def test_the_role_refuses_layer_types_of_the_wrong_kind_before_reading_them(tmp_path) -> None:
    res = role_play(tmp_path, {"text_config": {"layer_types": 48}})
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "config.json: text_config.layer_types is not a list of layer kinds (strings)" in out, out


def test_the_role_passes_a_good_target_and_refuses_a_budget_no_gpu_holds(tmp_path) -> None:
    res = role_play(tmp_path, qwen36())
    assert res.returncode == 0, res.stdout + res.stderr
    # Budget 4000: 4001 state slots in every Gated DeltaNet layer per request; not one request fits an H200.
    (tmp_path / "b").mkdir()
    res = role_play(tmp_path / "b", qwen36(), budget=4000)
    out = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 2, out
    assert "(4001 slots of " in out and "not even one request fits" in out, out
