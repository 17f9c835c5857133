"""A preflight that fails on one rule says that rule only.

Each role's tasks/preflight.yml runs through ansible-playbook on localhost (connection local, the
role's own defaults) with one setting broken; the failure the rollout report records, the sentence
the end-of-run table shows, must be that rule's sentence and nothing about the rules that held.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from playbook_run import ansible_playbook, local_play, localhost_inventory

REPO = Path(__file__).resolve().parents[2]


def run_preflight(tmp_path: Path, role: str, extra: dict) -> tuple[int, list[str]]:
    """Run one role's preflight on localhost; the return code and the failed tasks' messages."""
    play = local_play(
        tmp_path / "preflight.yml",
        f"    - ansible.builtin.include_role: {{name: {role}, tasks_from: preflight.yml}}\n",
    )
    reports = tmp_path / "reports"
    res = ansible_playbook(
        localhost_inventory(tmp_path),
        play,
        "-e",
        json.dumps(extra),
        ANSIBLE_INJECT_FACT_VARS="False",
        DFLASH_REPORT_DIR=str(reports),
    )
    (report,) = reports.glob("preflight-*.json")
    errors = json.loads(report.read_text())["hosts"].get("localhost", {}).get("errors", [])
    return res.returncode, [" ".join(e["msg"].split()) for e in errors]


MODEL_STAGE_OK = {"model_stage_src": "/srv/drafter.safetensors"}

CASES = [
    (
        "service_swap",
        {"shared_settings_num_speculative_tokens": 16},
        "shared_settings_num_speculative_tokens is 16; it must be from 1 to shared_settings_drafter_block_size - 1 (15):"
        " the drafter proposes one block at a time. Fix the inventory; nothing was changed.",
    ),
    (
        "service_swap",
        {"service_swap_min_acceptance_length": 1.0},
        "service_swap_min_acceptance_length is 1.0; it must be above 1.0 (a floor of 1 accepts a drafter that"
        " never hits). Fix the inventory; nothing was changed.",
    ),
    (
        "service_swap",
        {"service_swap_spec_method": "eagle3"},
        "service_swap_spec_method is eagle3; it must be dflash or ddtree. Fix the inventory; nothing was changed.",
    ),
    (
        "service_swap",
        {"service_swap_vllm_port": 30000},
        "service_swap_vllm_port and service_swap_sglang_port are both 30000; vLLM and SGLang need different ports."
        " Fix the inventory; nothing was changed.",
    ),
    (
        "service_swap",
        {"shared_settings_service_user": "root"},
        "shared_settings_service_user is root; vLLM must run as an unprivileged user (the default is vllm)."
        " Fix the inventory; nothing was changed.",
    ),
    (
        "service_swap",
        {"service_swap_spec_method": "ddtree", "shared_settings_ddtree_budget": 8},
        "shared_settings_ddtree_budget is 8, below shared_settings_num_speculative_tokens (15): a DDTree budget is at"
        " least the tree's depth; raise it or leave it empty. Fix the inventory; nothing was changed.",
    ),
    (
        "model_stage",
        {**MODEL_STAGE_OK, "shared_settings_drafter_dir": "/opt/models"},
        'model_stage: shared_settings_drafter_dir is "/opt/models", a directory shared with other things; give the drafter a'
        " directory of its own, such as /opt/models/<drafter>. Fix the inventory; nothing was changed.",
    ),
    (
        "model_stage",
        {**MODEL_STAGE_OK, "model_stage_file_mode": "640x"},
        'model_stage: model_stage_file_mode is "640x"; write it as an octal string such as "0640".'
        " Fix the inventory; nothing was changed.",
    ),
    (
        "model_stage",
        {**MODEL_STAGE_OK, "model_stage_dir_mode": "0770"},
        'model_stage: model_stage_dir_mode is "0770"; write it as an octal string such as "0750", with no write bit for'
        " the group or others (the service account must not create entries in the drafter's directory)."
        " Fix the inventory; nothing was changed.",
    ),
    (
        "model_stage",
        {**MODEL_STAGE_OK, "shared_settings_target_dir": "/opt/models/Qwen3.6-27B-DFlash/"},
        'model_stage: shared_settings_drafter_dir and shared_settings_target_dir are both "/opt/models/Qwen3.6-27B-DFlash"; the'
        " drafter needs a directory of its own, not the target model's. Fix the inventory; nothing was changed.",
    ),
    (
        "drafter_config",
        {"shared_settings_drafter_block_size": 1},
        "drafter_config: shared_settings_drafter_block_size is 1; it must be at least 2. Fix the inventory; nothing was changed.",
    ),
    (
        "drafter_config",
        {
            "shared_settings_drafter_layer_types": ["sliding_attention", "full_attention"],
            "drafter_config_sliding_window": 0,
        },
        "drafter_config: shared_settings_drafter_layer_types has sliding_attention layers but drafter_config_sliding_window"
        " is 0; set the drafter's window (a positive number of tokens). Fix the inventory; nothing was changed.",
    ),
    (
        "gpu_check",
        {"shared_settings_gpu_memory_utilization": 1.5},
        "gpu_check thresholds for localhost are not usable: shared_settings_gpu_memory_utilization is 1.5; it must be above 0"
        " and at most 1. Fix them in the inventory's group_vars.",
    ),
    (
        "ddtree_patch",
        {"shared_settings_ddtree_budget": 8},
        "ddtree_patch settings are wrong: shared_settings_ddtree_budget is 8, below shared_settings_num_speculative_tokens (15): the tree's node"
        " budget per step is at least its depth. Fix them in the inventory.",
    ),
]


@pytest.mark.parametrize(("role", "extra", "message"), CASES, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in CASES])
def test_one_broken_rule_is_the_only_one_named(tmp_path: Path, role: str, extra: dict, message: str) -> None:
    rc, errors = run_preflight(tmp_path, role, extra)
    assert rc == 2
    assert errors == [message]


def test_two_broken_rules_are_both_named_and_nothing_else(tmp_path: Path) -> None:
    rc, errors = run_preflight(
        tmp_path, "service_swap", {"shared_settings_service_user": "root", "service_swap_tensor_parallel_size": 0}
    )
    assert rc == 2
    assert errors == [
        "service_swap_tensor_parallel_size is 0; it must be at least 1. shared_settings_service_user is root; vLLM must run"
        " as an unprivileged user (the default is vllm). Fix the inventory; nothing was changed."
    ]


def test_ddtree_patch_consumes_the_change_set_by_its_digest(tmp_path: Path) -> None:
    # A copy of the engine's 0.20.1 base whose manifest was edited without its descriptor.
    base = tmp_path / "engine" / "vllm-0.20.1"
    base.mkdir(parents=True)
    descriptor = (REPO / "ddtree" / "vllm-0.20.1" / "base.json").read_text()
    (base / "base.json").write_text(descriptor)
    expected = json.loads(descriptor)["changeset"]["manifest_sha256"]
    (base / "manifest.json").write_text((REPO / "ddtree" / "vllm-0.20.1" / "manifest.json").read_text() + " ")
    rc, errors = run_preflight(tmp_path, "ddtree_patch", {"_ddtree_patch_engine": str(tmp_path / "engine")})
    assert rc == 2
    assert len(errors) == 1
    assert errors[0].startswith(
        f"ddtree_patch settings are wrong: The change set is not the one its base names: {base}/manifest.json"
        " has sha256 "
    )
    assert errors[0].endswith(
        f"base.json expects {expected}. Rebuild it (python3 -m ddtree.changeset) and record the new digest in"
        " base.json, or check out a consistent tree. Fix them in the inventory."
    )


def test_ddtree_patch_names_the_base_it_looked_for(tmp_path: Path) -> None:
    rc, errors = run_preflight(tmp_path, "ddtree_patch", {"shared_settings_vllm_version": "0.26.0"})
    assert rc == 2
    assert errors == [
        "ddtree_patch settings are wrong: There is no ddtree change set for vLLM 0.26.0: the DDTree engine has no base"
        f" {REPO}/ddtree/vllm-0.26.0/base.json (see ddtree/README.md). Install a release it has a base for"
        " (shared_settings_vllm_version) or write and verify a change set for it first."
        " Fix them in the inventory."
    ]


PREFLIGHTS = sorted(REPO.glob("roles/*/tasks/preflight.yml"))


def asserts(tasks: list) -> list[dict]:
    found = []
    for task in tasks or []:
        for key in ("block", "rescue", "always"):
            found.extend(asserts(task.get(key)))
        if "ansible.builtin.assert" in task:
            found.append(task)
    return found


@pytest.mark.parametrize("path", PREFLIGHTS, ids=[p.parts[-3] for p in PREFLIGHTS])
def test_every_preflight_assert_checks_one_rule(path: Path) -> None:
    # A list of conditions under one fail_msg is what made a failure print every rule: each assert
    # checks one condition (one rule, or "the list of broken rules is empty").
    for task in asserts(yaml.safe_load(path.read_text())):
        that = task["ansible.builtin.assert"]["that"]
        assert isinstance(that, str) or len(that) == 1, f"{path}: {task['name']!r} asserts {len(that)} conditions"
