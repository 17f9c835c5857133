"""ddtree_patch's decision between trees and the DFlash chain, and the tree state's memory cost."""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import release_files
from ddtree_method import (
    cudagraph_sizes,
    ddtree_cudagraph_cap,
    ddtree_fallback_reason,
    ddtree_state_check,
    recurrent_state_bytes,
)

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


# --- CUDA-graph sizes: the project's rule against vLLM 0.20.1's own code ---------------------------


def _wheel_method(source: str, cls: str, name: str):
    """One method of a class in the real wheel's source, compiled on its own (its module's imports
    replaced by what the method uses: CUDAGraphMode's NONE, a logger, vLLM's round_up)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    namespace = {
                        "CUDAGraphMode": SimpleNamespace(NONE="NONE"),
                        "logger": logging.getLogger("vllm-0.20.1"),
                        "round_up": lambda x, y: ((x + y - 1) // y) * y,
                    }
                    exec(compile(ast.Module([item], []), f"{cls}.{name}", "exec"), namespace)
                    return namespace[name]
    raise AssertionError(f"{cls}.{name} is not in the wheel")


@pytest.fixture(scope="module")
def wheel_sizes():
    """vLLM 0.20.1's VllmConfig._set_cudagraph_sizes then CompilationConfig.adjust_cudagraph_sizes_for_spec_decode
    (what the engine runs with full decode graphs and spec decode), on stand-in configs."""
    with zipfile.ZipFile(release_files.wheel()) as whl:
        set_sizes = _wheel_method(whl.read("vllm/config/vllm.py").decode(), "VllmConfig", "_set_cudagraph_sizes")
        adjust = _wheel_method(
            whl.read("vllm/config/compilation.py").decode(),
            "CompilationConfig",
            "adjust_cudagraph_sizes_for_spec_decode",
        )

    def sizes(cap: int, query_len: int, max_num_batched_tokens: int) -> list[int]:
        compilation = SimpleNamespace(
            cudagraph_mode="FULL_AND_PIECEWISE",
            max_cudagraph_capture_size=cap,
            cudagraph_capture_sizes=None,
            pass_config=SimpleNamespace(enable_sp=False),
            post_init_cudagraph_sizes=lambda: None,
        )
        config = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False),
            compilation_config=compilation,
            scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
            speculative_config=None,
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            performance_mode="balanced",
        )
        set_sizes(config)
        try:
            adjust(compilation, query_len, 1)
        except ValueError as exc:  # vLLM refuses to start: "No valid cudagraph sizes after rounding ..."
            assert "No valid cudagraph sizes" in str(exc)
            return []
        return list(compilation.cudagraph_capture_sizes)

    return sizes


def test_vllm_truncates_a_cap_of_520_and_captures_no_graph_for_8_requests_at_budget_64(wheel_sizes) -> None:
    # What vLLM logged on the H200: "Truncating max_cudagraph_capture_size to 512",
    # "FULL=7 (largest=455)"; the 520-token batch of 8 requests ran without a graph.
    assert wheel_sizes(520, 65, 65536) == [65, 130, 195, 260, 325, 390, 455]
    assert cudagraph_sizes(520, 65, 65536) == [65, 130, 195, 260, 325, 390, 455]


@pytest.mark.parametrize("query_len", [2, 3, 8, 16, 17, 33, 65, 129])
def test_the_project_computes_the_sizes_vllm_does(wheel_sizes, query_len) -> None:
    for tokens in (100, 700, 65536):
        for cap in [*range(1, 700), 1056, 2080, 2081, 4100]:
            assert cudagraph_sizes(cap, query_len, tokens) == wheel_sizes(cap, query_len, tokens), (cap, tokens)


@pytest.mark.parametrize(
    ("seqs", "verify", "tokens", "cap"),
    [
        (8, 64, 65536, 528),  # the step benchmark's batch 8 at budget 64 (520 tokens)
        (32, 64, 16384, 2080),  # service_swap's defaults at budget 64: 32 x 65 is on the grid
        (32, 15, 16384, 512),
        (32, 64, 2300, 272),  # the scheduler leaves 2300 - 32 x 63 = 284 tokens: 4 x 65 = 260
        (12, 16, 16384, 208),
        (1, 64, 65536, 72),
    ],
)
def test_the_cap_gives_the_largest_uniform_batch_a_graph_and_is_the_smallest_that_does(
    wheel_sizes, seqs, verify, tokens, cap
) -> None:
    assert ddtree_cudagraph_cap(seqs, verify, tokens) == cap
    bound = tokens - seqs * (verify - 1)
    batch = min(seqs, bound // (verify + 1)) * (verify + 1)
    assert batch in wheel_sizes(cap, verify + 1, tokens)
    assert max(wheel_sizes(cap - 1, verify + 1, tokens), default=0) < batch


def test_every_schedulable_batch_gets_a_graph_whatever_the_settings(wheel_sizes) -> None:
    for seqs in (1, 2, 3, 5, 8, 12, 32, 33):
        for verify in (1, 2, 3, 7, 15, 16, 31, 64):
            for tokens in (64, 300, 2048, 16384):
                cap = ddtree_cudagraph_cap(seqs, verify, tokens)
                batch = min(seqs, (tokens - seqs * (verify - 1)) // (verify + 1)) * (verify + 1)
                if batch < 1:
                    assert cap == 0
                else:
                    assert max(wheel_sizes(cap, verify + 1, tokens), default=0) >= batch, (seqs, verify, tokens)


def test_no_cap_where_the_scheduler_leaves_no_uniform_batch() -> None:
    assert ddtree_cudagraph_cap(32, 64, 100) == 0  # 100 tokens < 32 x 63 draft slots
    assert ddtree_cudagraph_cap(0, 64, 16384) == 0
    assert ddtree_cudagraph_cap(8, 0, 16384) == 0
