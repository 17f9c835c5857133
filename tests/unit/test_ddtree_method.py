"""ddtree_patch's decision between trees and the DFlash chain, and the tree state's memory cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ddtree_method import ddtree_fallback_reason, ddtree_state_check, recurrent_state_bytes

REPO = Path(__file__).resolve().parents[2]


def qwen36() -> dict:
    """The lab's Qwen3.6-27B config.json (tests/fakes/target_model.py writes the real layout)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json,sys; sys.path.insert(0, 'tests/fakes'); import target_model; "
            "print(json.dumps(target_model.config()))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def test_qwen36_gets_trees() -> None:
    assert ddtree_fallback_reason(qwen36(), "0.20.1") == ""


def test_a_pure_attention_target_gets_trees() -> None:
    assert ddtree_fallback_reason({"model_type": "qwen3", "num_hidden_layers": 36}, "0.20.1") == ""


def test_mamba_layers_run_the_chain_with_the_reason() -> None:
    nemotron = {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention", "mamba"]}
    assert ddtree_fallback_reason(nemotron, "0.20.1") == (
        "the target has Mamba layers (mamba): trees need branch-local state, which this project's "
        "change set for vLLM 0.20.1 gives only to Gated DeltaNet layers, so the DFlash chain runs"
    )


def test_a_gdn_convolution_of_another_width_runs_the_chain() -> None:
    config = qwen36()
    config["text_config"]["linear_conv_kernel_dim"] = 3
    assert ddtree_fallback_reason(config, "0.20.1").startswith(
        "the target's Gated DeltaNet layers convolve over 3 tokens"
    )


def test_qwen36_state_slot_is_about_147_mib() -> None:
    # 48 GDN layers x (48 value heads x 128 x 128 float32 + (2 x 16 x 128 + 48 x 128) x 3 bf16)
    assert recurrent_state_bytes(qwen36()) == 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)
    assert round(recurrent_state_bytes(qwen36()) / 2**20, 1) == 146.8


def test_no_recurrent_layers_no_state() -> None:
    assert recurrent_state_bytes({"model_type": "qwen3", "num_hidden_layers": 36}) == 0


def test_qwen36_on_two_a6000s_refuses_a_budget_whose_state_cannot_fit() -> None:
    # 2x RTX A6000 (49140 MiB), 0.9 of it for vLLM, 55.6 GB of bf16 weights: 11.7 GiB per GPU left.
    check = ddtree_state_check(qwen36(), 255, 32, 2, 49140, 0.9, weights_bytes=55_600_000_000)
    assert check["refuse"] == (
        "a DDTree request keeps 256 recurrent state slots of 146.8 MiB (18.4 GiB per GPU at tensor parallel 2), "
        "more than the 17.3 GiB a GPU has left for vLLM after the weights; lower shared_settings_ddtree_budget (or raise "
        "the tensor parallel size)"
    )


def test_qwen36_budget_16_fits_few_requests_at_once() -> None:
    check = ddtree_state_check(qwen36(), 16, 32, 2, 49140, 0.9, weights_bytes=55_600_000_000)
    assert check["refuse"] == ""
    assert check["warn"].startswith("a DDTree request keeps 17 recurrent state slots of 146.8 MiB (1.2 GiB per GPU")
    assert "at most 14 of service_swap_max_num_seqs=32 requests fit at once" in check["warn"]


def test_qwen36_on_an_h200_fits() -> None:
    assert ddtree_state_check(qwen36(), 16, 8, 1, 143771, 0.9, weights_bytes=55_600_000_000) == {
        "refuse": "",
        "warn": "",
    }


def test_a_pure_attention_target_has_no_tree_state() -> None:
    assert ddtree_state_check({"model_type": "qwen3"}, 1024, 256, 1, 1000, 0.5) == {"refuse": "", "warn": ""}
