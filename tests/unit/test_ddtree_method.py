"""ddtree_patch's decision between trees and the DFlash chain, and the CUDA graphs DDTree runs with.

The tree state's memory cost is part of service_swap's memory fit: tests/unit/test_memory_fit.py."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from ddtree_method import (
    ddtree_bases,
    ddtree_cudagraph_sizes,
    ddtree_fallback_reason,
)
from safetensors_files import fake
from swap_gates import service_swap_capture_size_problem
from vllm_argv import vllm_compilation_config

from ddtree.tests import release_files

REPO = Path(__file__).resolve().parents[2]


def qwen36() -> dict:
    """The lab's Qwen3.6-27B config.json (tests/fakes/target_model.py writes the real layout), a fresh copy."""
    return copy.deepcopy(fake("target_model").config())


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


# --- CUDA graphs: what vLLM 0.20.1's own code makes of the sizes service_swap renders ------------


def _wheel_method(source: str, cls: str, name: str):
    """One method of the real wheel's config code, with what it uses from its module: CUDAGraphMode's
    NONE, a logger, vLLM's round_up."""
    namespace = {
        "CUDAGraphMode": SimpleNamespace(NONE="NONE"),
        "logger": logging.getLogger("vllm-0.20.1"),
        "round_up": lambda x, y: ((x + y - 1) // y) * y,
    }
    return release_files.method(source, cls, name, namespace)


@pytest.fixture(scope="module")
def vllm_sizing():
    """vLLM 0.20.1's VllmConfig._set_cudagraph_sizes and CompilationConfig.adjust_cudagraph_sizes_for_spec_decode
    from the wheel, and stand-in configs to run them on: ``(set_sizes, adjust, configs)``."""
    # vllm/config/vllm.py as the change set leaves it (it patches that file); compilation.py as released.
    sources = {p: data.decode() for p, data in release_files.patched(["vllm/config/vllm.py"]).items()}
    sources.update({p: data.decode() for p, data in release_files.pristine(["vllm/config/compilation.py"]).items()})
    set_sizes = _wheel_method(sources["vllm/config/vllm.py"], "VllmConfig", "_set_cudagraph_sizes")
    adjust = _wheel_method(
        sources["vllm/config/compilation.py"], "CompilationConfig", "adjust_cudagraph_sizes_for_spec_decode"
    )

    def configs(compilation_config: dict, query_len: int, max_num_seqs: int, max_num_batched_tokens: int):
        compilation = SimpleNamespace(
            cudagraph_mode="FULL_AND_PIECEWISE",
            max_cudagraph_capture_size=compilation_config.get("max_cudagraph_capture_size"),
            cudagraph_capture_sizes=compilation_config.get("cudagraph_capture_sizes"),
            pass_config=SimpleNamespace(enable_sp=False),
            post_init_cudagraph_sizes=lambda: None,
        )
        config = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False),
            compilation_config=compilation,
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            speculative_config=SimpleNamespace(num_speculative_tokens=query_len - 1),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            performance_mode="balanced",
        )
        return config, compilation

    return set_sizes, adjust, configs


@pytest.fixture(scope="module")
def vllm_graph_sizes(vllm_sizing):
    """vLLM 0.20.1's VllmConfig._set_cudagraph_sizes then CompilationConfig.adjust_cudagraph_sizes_for_spec_decode
    (what the engine runs with full decode graphs and spec decode, the change set applied), on stand-in
    configs: the sizes it captures, or None where it refuses to start."""
    set_sizes, adjust, configs = vllm_sizing

    def sizes(compilation_config: dict, query_len: int, max_num_seqs: int, max_num_batched_tokens: int):
        config, compilation = configs(compilation_config, query_len, max_num_seqs, max_num_batched_tokens)
        try:
            set_sizes(config)
            adjust(compilation, query_len, 1)
        except ValueError as exc:  # "No valid cudagraph sizes after rounding ...": vLLM does not start
            assert "cudagraph" in str(exc)
            return None
        return list(compilation.cudagraph_capture_sizes)

    return sizes


def test_a_cap_leaves_batches_without_their_graph_and_the_rendered_sizes_do_not(vllm_graph_sizes) -> None:
    # What vLLM logged on the H200 with a cap of 520 (8 requests at budget 64): "Truncating
    # max_cudagraph_capture_size to 512", "FULL=7 (largest=455)": the 520-token batch had no graph.
    assert vllm_graph_sizes({"max_cudagraph_capture_size": 520}, 65, 8, 65536) == [65, 130, 195, 260, 325, 390, 455]
    assert vllm_graph_sizes({"cudagraph_capture_sizes": ddtree_cudagraph_sizes(8, 64, 65536)}, 65, 8, 65536) == [
        65,
        130,
        195,
        260,
        325,
        390,
        455,
        520,
    ]
    # 33 requests at budget 14 (495 tokens): no cap gives that batch a graph (the grid's sizes near it
    # round up to 480 and 510), where the rendered sizes do.
    for cap in range(495, 700):
        assert 495 not in (vllm_graph_sizes({"max_cudagraph_capture_size": cap}, 15, 33, 65536) or [])
    assert 495 in vllm_graph_sizes({"cudagraph_capture_sizes": ddtree_cudagraph_sizes(33, 14, 65536)}, 15, 33, 65536)


def test_every_uniform_batch_the_scheduler_can_make_has_its_own_graph(vllm_graph_sizes) -> None:
    for seqs in (1, 2, 3, 5, 8, 12, 32, 33, 49):
        for verify in (1, 2, 3, 7, 14, 15, 16, 31, 64):
            for tokens in (64, 300, 2048, 16384):
                sizes = ddtree_cudagraph_sizes(seqs, verify, tokens)
                requests = min(seqs, (tokens - seqs * (verify - 1)) // (verify + 1))
                assert len(sizes) == max(requests, 0)
                if sizes:
                    captured = vllm_graph_sizes({"cudagraph_capture_sizes": sizes}, verify + 1, seqs, tokens)
                    assert captured == sizes, (seqs, verify, tokens)


@pytest.fixture(scope="module")
def vllm_cut_cap(vllm_sizing):
    """What vLLM 0.20.1's VllmConfig._set_cudagraph_sizes cuts a max_cudagraph_capture_size down to ("Truncating
    max_cudagraph_capture_size to %d"), before any rounding to a request's tokens."""
    set_sizes, _, configs = vllm_sizing

    def cut(cap: int, query_len: int) -> int:
        config, compilation = configs({"max_cudagraph_capture_size": cap}, query_len, 8, 65536)
        set_sizes(config)
        return compilation.max_cudagraph_capture_size

    return cut


def test_the_rendered_sizes_are_captured_as_given_at_every_budget(vllm_graph_sizes) -> None:
    """vLLM 0.20.1 cuts only a cap down to its size grid: a list of sizes is kept as given, so for every budget
    1..64 each uniform batch's size (a multiple of budget + 1, mostly off the grid) gets its own graph."""
    for verify in range(1, 65):
        for seqs, tokens in ((1, 16384), (8, 65536), (32, 16384), (33, 65536)):
            sizes = ddtree_cudagraph_sizes(seqs, verify, tokens)
            assert sizes == [(verify + 1) * k for k in range(1, seqs + 1)]  # written out: one per batch
            assert vllm_graph_sizes({"cudagraph_capture_sizes": sizes}, verify + 1, seqs, tokens) == sizes, (
                verify,
                seqs,
            )


def test_the_smallest_capture_size_is_where_vllm_0_20_1_starts(vllm_graph_sizes) -> None:
    """service_swap_capture_size_problem's floor (the base's cudagraphs.capture_size and its grid) against vLLM's
    own code: one token under it vLLM refuses ("No valid cudagraph sizes after rounding"), at it vLLM starts."""
    # Written out: the smallest size of 1, 2, 4, every 8 that holds one request's verified tokens and its root.
    for verify, seqs, floor in ((15, 8, 16), (7, 33, 8), (63, 4, 64), (1, 2, 2), (3, 5, 4), (8, 3, 16), (14, 33, 16)):
        assert service_swap_capture_size_problem(floor - 1, verify, 16384, "0.20.1") != ""
        assert service_swap_capture_size_problem(floor, verify, 16384, "0.20.1") == ""
        assert vllm_graph_sizes({"max_cudagraph_capture_size": floor - 1}, verify + 1, seqs, 65536) is None
        assert vllm_graph_sizes({"max_cudagraph_capture_size": floor}, verify + 1, seqs, 65536) == [
            (floor // (verify + 1)) * (verify + 1)
        ]


def test_a_cap_off_vllms_size_grid_is_refused_as_vllm_refuses_it(vllm_graph_sizes) -> None:
    assert vllm_graph_sizes({"max_cudagraph_capture_size": 15}, 15, 33, 65536) is None  # truncated to 8
    assert vllm_graph_sizes({"max_cudagraph_capture_size": 16}, 15, 33, 65536) == [15]
    assert service_swap_capture_size_problem(15, 14, 16384, "0.20.1") != ""
    assert service_swap_capture_size_problem(16, 14, 16384, "0.20.1") == ""


_AT_MOST = re.compile(r"captures CUDA graphs of at most (\d+) tokens, less than the (\d+) tokens")
_AT_LEAST = re.compile(r"or at least (\d+), the smallest grid size")


def test_every_budget_s_capture_check_agrees_with_vllm_s_own_sizing(vllm_graph_sizes, vllm_cut_cap) -> None:
    """For every budget 1..64 and every cap up to two requests' tokens past the next grid size, the preflight
    refuses exactly the caps vLLM 0.20.1's own sizing code refuses, names the size vLLM cuts the cap down to,
    and the value it asks for is the smallest cap vLLM starts with."""
    for verify in range(1, 65):
        query_len = verify + 1
        starts = [
            cap
            for cap in range(1, 4 * query_len + 32)
            if vllm_graph_sizes({"max_cudagraph_capture_size": cap}, query_len, 8, 65536) is not None
        ]
        for cap in range(1, 4 * query_len + 32):
            problem = service_swap_capture_size_problem(cap, verify, 16384, "0.20.1")
            assert (problem == "") == (cap in starts), (verify, cap, problem)
            if problem:
                at_most, need = (int(n) for n in _AT_MOST.search(problem).groups())
                assert (at_most, need) == (vllm_cut_cap(cap, query_len), query_len), (verify, cap)
                assert int(_AT_LEAST.search(problem).group(1)) == min(starts), (verify, cap)


_LOWERED = re.compile(r"lowers the largest CUDA graph it captures to max_num_batched_tokens .* at most (\d+) tokens,")
_RAISE_TOKENS = re.compile(r"Raise service_swap_max_num_batched_tokens to at least (\d+)\.")


def test_every_budget_s_capture_check_agrees_with_vllm_where_the_batched_tokens_lower_it(vllm_sizing) -> None:
    """For every budget 1..64, as the unit renders it (auto, 0 and caps around one request's tokens and the
    smallest grid size), 1 and 8 sequences, and every max_num_batched_tokens up to two requests' tokens and around
    the smallest grid size: the preflight refuses exactly where vLLM 0.20.1's own sizing code refuses after
    lowering the cap (or its default) to max_num_batched_tokens, names what vLLM then captures, and the values
    it asks for start."""
    set_sizes, adjust, configs = vllm_sizing

    def vllm(compilation_config: dict, query_len: int, seqs: int, tokens: int) -> int | None:
        """The largest size vLLM captures after _set_cudagraph_sizes, or None where it refuses to start."""
        config, compilation = configs(compilation_config, query_len, seqs, tokens)
        set_sizes(config)
        lowered = compilation.max_cudagraph_capture_size
        try:
            adjust(compilation, query_len, 1)
        except ValueError as exc:
            assert "No valid cudagraph sizes after rounding" in str(exc)
            return None
        return lowered

    refused = {"lowered": 0, "cut to the grid": 0}
    for verify in range(1, 65):
        query_len = verify + 1
        floor = service_swap_capture_size_problem(1, verify, 16384, "0.20.1")
        smallest = int(_AT_LEAST.search(floor).group(1))
        caps = ("auto", 0, 1, verify, query_len, query_len + 1, smallest - 1, smallest, 2 * query_len, 520)
        for seqs in (1, 8):
            for tokens in {*range(1, 2 * query_len + 9), smallest - 1, smallest, smallest + 1, 16384} - {0}:
                for cap in caps:
                    rendered = vllm_compilation_config(cap, ddtree_cudagraph_sizes(seqs, verify, tokens))
                    problem = service_swap_capture_size_problem(cap, verify, tokens, "0.20.1")
                    captured = vllm(rendered, query_len, seqs, tokens)
                    assert (problem == "") == (captured is not None), (verify, seqs, tokens, cap, problem)
                    if not problem:
                        continue
                    lowered = _LOWERED.search(problem)
                    refused["lowered" if lowered else "cut to the grid"] += 1
                    if lowered:  # vLLM's own lowered size, before any rounding
                        config, compilation = configs(rendered, query_len, seqs, tokens)
                        set_sizes(config)
                        assert int(lowered.group(1)) == compilation.max_cudagraph_capture_size == tokens
                    # What the sentence asks for starts.
                    fixed_tokens = int(m.group(1)) if (m := _RAISE_TOKENS.search(problem)) else tokens
                    fixed_cap = int(m.group(1)) if (m := _AT_LEAST.search(problem)) else cap
                    assert fixed_tokens > tokens or fixed_cap != cap, problem
                    fixed = vllm_compilation_config(fixed_cap, ddtree_cudagraph_sizes(seqs, verify, fixed_tokens))
                    assert vllm(fixed, query_len, seqs, fixed_tokens) is not None, (problem, fixed_cap, fixed_tokens)
                    assert service_swap_capture_size_problem(fixed_cap, verify, fixed_tokens, "0.20.1") == ""
    assert min(refused.values()) > 1000, refused  # both kinds of refusal were seen, not only starts


def test_the_service_swap_defaults_render_32_graphs_at_budget_64() -> None:
    assert ddtree_cudagraph_sizes(32, 64, 16384) == [65 * k for k in range(1, 33)]
    assert ddtree_cudagraph_sizes(32, 64, 2300) == [65, 130, 195, 260]  # 2300 - 32 x 63 = 284 tokens left
    assert ddtree_cudagraph_sizes("8", "64", "65536")[-1] == 520  # inventory values arrive as text too


def test_no_sizes_where_the_scheduler_leaves_no_uniform_batch() -> None:
    assert ddtree_cudagraph_sizes(32, 64, 100) == []  # 100 tokens < 32 x 63 draft slots
    assert ddtree_cudagraph_sizes(0, 64, 16384) == []
    assert ddtree_cudagraph_sizes(8, 0, 16384) == []


@pytest.mark.parametrize("values", [(True, 64, 16384), ("x", 64, 16384), (32, -1.5, 16384), (32, 64, None)])
def test_values_that_are_not_whole_numbers_are_refused_with_a_sentence(values) -> None:
    with pytest.raises(ValueError, match="must be whole numbers"):
        ddtree_cudagraph_sizes(*values)


def test_huge_settings_are_refused_before_any_list_is_built() -> None:
    with pytest.raises(ValueError, match="lower service_swap_max_num_seqs"):
        ddtree_cudagraph_sizes(10**9, 64, 10**12)


# --- The rules come from the base's descriptor: a second base needs no code ----------------------


def test_a_second_base_drives_every_rule_without_code_changes(tmp_path: Path, synthetic_base) -> None:
    home = synthetic_base(tmp_path)
    config = qwen36()
    # Its tree state covers a width of 3, not Qwen3.6's 4; Mamba-2 gets trees, Mamba does not.
    assert ddtree_fallback_reason(config, "9.9.9", engine_home=home) == (
        "the target's Gated DeltaNet layers convolve over 4 tokens: the change set's tree state covers a width "
        "of 3 (Qwen3.5/3.6), so the DFlash chain runs"
    )
    config["text_config"]["linear_conv_kernel_dim"] = 3
    assert ddtree_fallback_reason(config, "9.9.9+cu130", engine_home=home) == ""
    assert ddtree_fallback_reason({"layers_block_type": ["mamba2", "attention"]}, "9.9.9", engine_home=home) == ""
    assert ddtree_fallback_reason({"layers_block_type": ["mamba", "mamba2"]}, "9.9.9", engine_home=home) == (
        "the target has Mamba layers (mamba): trees need branch-local state, which this project's change set "
        "for vLLM 9.9.9 gives only to Gated DeltaNet and Mamba layers, so the DFlash chain runs"
    )
    # 66 tokens per request; 4 graphs at most.
    assert ddtree_cudagraph_sizes(3, 64, 8192, vllm_version="9.9.9", engine_home=home) == [66, 132, 198]
    # 64 draft slots per sequence at budget 64: 3 x 64 leave 131 of 323 tokens, one request's graph (0.20.1's
    # 63 per sequence would leave two).
    assert ddtree_cudagraph_sizes(3, 64, 323, vllm_version="9.9.9", engine_home=home) == [66]
    with pytest.raises(ValueError, match=r"would need 5 CUDA graphs \(more than 4\)"):
        ddtree_cudagraph_sizes(5, 64, 8192, vllm_version="9.9.9", engine_home=home)


def test_the_sole_base_applies_where_no_release_is_named_and_two_need_one(tmp_path: Path, synthetic_base) -> None:
    home = synthetic_base(tmp_path)
    # 43 tokens, budget 10 (12 per request): 2 x 10 draft slots leave one request's graph.
    assert ddtree_cudagraph_sizes(2, 10, 43, engine_home=home) == [12]
    synthetic_base(tmp_path, "9.10.0", scheduler={"draft_slots_per_sequence": {"verified_tokens_plus": -1}})
    # 9.10.0's 2 x 9 leave two.
    assert ddtree_cudagraph_sizes(2, 10, 43, vllm_version="9.10.0", engine_home=home) == [12, 24]
    with pytest.raises(ValueError, match=r"has 2 bases \(9\.9\.9, 9\.10\.0\): name the vLLM release"):
        ddtree_cudagraph_sizes(2, 10, 43, engine_home=home)


def test_a_release_without_a_base_runs_the_chain_and_says_which_bases_exist(tmp_path: Path, synthetic_base) -> None:
    home = synthetic_base(tmp_path)
    assert ddtree_fallback_reason(qwen36(), "0.22.0", engine_home=home) == (
        "this project's DDTree change set has no base for vLLM 0.22.0 (it has: 9.9.9), so the DFlash chain runs"
    )
    with pytest.raises(ValueError, match=r"no base for vLLM 0\.22\.0 .*bases: 9\.9\.9\); pick a release"):
        ddtree_cudagraph_sizes(2, 10, 43, vllm_version="0.22.0", engine_home=home)


def test_the_repository_base_is_the_default() -> None:
    assert ddtree_cudagraph_sizes(3, 16, 8192, vllm_version="0.20.1") == ddtree_cudagraph_sizes(3, 16, 8192)
    assert ddtree_fallback_reason(qwen36(), "0.20.1+cu130") == ""


def test_the_bases_are_listed_oldest_first(tmp_path: Path, synthetic_base) -> None:
    synthetic_base(tmp_path, "9.10.0")
    synthetic_base(tmp_path, "9.9.9")
    (tmp_path / "vllm-9.11.0").mkdir()  # a folder without a descriptor is no base
    assert ddtree_bases(tmp_path) == ["9.9.9", "9.10.0"]
    assert ddtree_bases() == ["0.20.1"]
