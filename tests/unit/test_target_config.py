"""service_swap's DDTree state check validates what it reads from the target's files (issue 43, class 6).

config.json's Gated DeltaNet sizes and the weight index's metadata.total_size are the node's: a
non-numeric, infinite, null, negative or absurd field refuses the check with the file and the
field named (never "invalid literal for int()", never a check turned off by a negative size),
unit by unit and through ansible-playbook on the role's own tasks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.module_utils.target_config import TargetConfigError, gdn_shape, index_total_size, layer_kinds
from ddtree_method import ddtree_state_check, target_is_hybrid, target_layer_problem

REPO = Path(__file__).resolve().parents[2]
CFG = "/m/config.json"
IDX = "/m/model.safetensors.index.json"


def qwen36(**text_overrides) -> dict:
    text = {
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }
    text.update(text_overrides)
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}


def check(config, index=None, **kw) -> dict:
    args = {"budget": 16, "max_num_seqs": 8, "tensor_parallel_size": 1, "gpu_memory_mib": 143771}
    args.update(kw)
    return ddtree_state_check(
        config,
        args["budget"],
        args["max_num_seqs"],
        args["tensor_parallel_size"],
        args["gpu_memory_mib"],
        0.9,
        index=index,
        config_path=CFG,
        index_path=IDX,
    )


def test_a_real_shape_passes_with_its_index() -> None:
    assert check(qwen36(), {"metadata": {"total_size": 55_600_000_000}}) == {"refuse": "", "warn": ""}
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
    assert result["warn"] == ""
    assert result["refuse"] == (
        f"the DDTree state check cannot run: {CFG}: text_config.{field} {why}; fix or replace {CFG} (the model's own"
        " config.json), or set shared_settings_target_dir to a complete model"
    )


@pytest.mark.parametrize(
    ("index", "why"),
    [
        ({"metadata": {"total_size": -(10**12)}}, "is -1000000000000, outside 0 to 1125899906842624"),
        ({"metadata": {"total_size": "55 GB"}}, "is '55 GB', not a whole number"),
        ({"metadata": {"total_size": math.inf}}, "is inf, not a whole number"),
        ({"metadata": {"total_size": 2**60}}, "is 1152921504606846976, outside 0 to 1125899906842624"),
    ],
)
def test_a_bad_total_size_refuses_instead_of_turning_the_check_off(index, why) -> None:
    """A negative total_size made free memory huge: a budget of 10,000 passed."""
    result = check(qwen36(), index, budget=4000)
    assert result["refuse"] == (
        f"the DDTree state check cannot run: {IDX}: metadata.total_size {why}; fix {IDX} (the model's weight index)"
        " or replace the model"
    )


def test_an_index_or_metadata_of_the_wrong_kind_is_named() -> None:
    assert check(qwen36(), ["not", "an", "index"])["refuse"].endswith(
        f"{IDX} holds list, not a JSON object; fix {IDX} (the model's weight index) or replace the model"
    )
    assert f"{IDX}: metadata is str, not a JSON object" in check(qwen36(), {"metadata": "x"})["refuse"]
    assert index_total_size({}) == 0 and index_total_size({"metadata": {}}) == 0


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
    assert check(config)["refuse"].startswith(f"the DDTree state check cannot run: {problem}")
    assert target_is_hybrid(config) is False
    with pytest.raises(TargetConfigError):
        layer_kinds(config, CFG)


def test_settings_and_gpu_facts_are_checked_too() -> None:
    assert "the DDTree budget is -1, outside 1 to 4096" in check(qwen36(), budget=-1)["refuse"]
    assert "memory_total_mib (gpu_check's facts) is 'lots'" in check(qwen36(), gpu_memory_mib="lots")["refuse"]
    assert check(qwen36(), budget="16")["refuse"] == ""  # digits templating handed over as a string


# --- the play path: the role's own tasks through ansible-playbook ---------------------------------------------


def role_play(tmp_path: Path, config: object, index: object | None) -> subprocess.CompletedProcess:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if index is not None:
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    play = tmp_path / "tree_state.yml"
    play.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.set_fact:\n"
        "        gpu_check_facts: {gpus: [{memory_total_mib: 143771}]}\n"
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: target.yml}\n"
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: tree_state.yml}\n"
        "      vars: {service_swap_spec_method: ddtree, _service_swap_ddtree_budget: 4000}\n"
    )
    inventory = tmp_path / "localhost.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_INJECT_FACT_VARS="False",
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_NOCOLOR="1",
    )
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            *("-i", str(inventory), str(play), "-e", f"shared_settings_target_dir={target}"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_role_refuses_a_negative_total_size_naming_the_file(tmp_path) -> None:
    res = role_play(tmp_path, qwen36(), {"metadata": {"total_size": -(10**15)}, "weight_map": {}})
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "model.safetensors.index.json: metadata.total_size is -1000000000000000, outside 0 to" in out, out
    assert "Nothing was changed." in out


def test_the_role_refuses_a_word_where_a_size_belongs_without_a_raw_exception(tmp_path) -> None:
    res = role_play(tmp_path, qwen36(linear_num_key_heads="sixteen"), None)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "config.json: text_config.linear_num_key_heads is 'sixteen', not a whole number" in out, out
    assert "invalid literal" not in out and "Traceback" not in out


def test_the_role_refuses_layer_types_of_the_wrong_kind_before_reading_them(tmp_path) -> None:
    res = role_play(tmp_path, {"text_config": {"layer_types": 48}}, None)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "config.json: text_config.layer_types is not a list of layer kinds (strings)" in out, out


def test_the_role_passes_a_good_target(tmp_path) -> None:
    res = role_play(tmp_path, qwen36(), {"metadata": {"total_size": 55_600_000_000}, "weight_map": {}})
    out = res.stdout + res.stderr
    # Budget 4000 of 147 MiB slots is more than an H200 holds: refused for the right reason, with good fields.
    assert res.returncode == 2, out
    assert "a DDTree request keeps 4001 recurrent state slots" in out, out
