"""The `vllm serve` argv service_swap renders (plugins/filter/vllm_argv.py), expectations written out."""

from __future__ import annotations

import pytest
from vllm_argv import (
    vllm_compilation_config,
    vllm_prefix_caching_args,
    vllm_serve_argv,
    vllm_spec_config,
    vllm_verify_tokens,
)

SERVE = {
    "executable": "/opt/vllm/0.20.1/bin/vllm",
    "model": "/opt/models/Qwen3.6-27B",
    "host": "0.0.0.0",
    "port": 8000,
    "served_model_name": "Qwen3.6-27B",
    "tensor_parallel_size": 2,
    "max_model_len": 32768,
    "gpu_memory_utilization": 0.9,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 16384,
    "speculative_config": {"method": "dflash", "model": "/opt/models/d", "num_speculative_tokens": 15},
    "compilation_config": {},
    "prefix_caching": "auto",
    "hybrid_target": True,
    "extra_args": ["--reasoning-parser", "qwen3"],
}


def test_the_chain_on_a_hybrid_target() -> None:
    assert vllm_serve_argv(SERVE) == [
        "/opt/vllm/0.20.1/bin/vllm", "serve", "/opt/models/Qwen3.6-27B",
        "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "Qwen3.6-27B",
        "--tensor-parallel-size", "2", "--max-model-len", "32768", "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "32", "--max-num-batched-tokens", "16384",
        "--speculative-config", '{"method":"dflash","model":"/opt/models/d","num_speculative_tokens":15}',
        "--no-enable-prefix-caching", "--reasoning-parser", "qwen3",
    ]  # fmt: skip


def test_ddtree_with_graphs_on_a_dense_target() -> None:
    serve = dict(
        SERVE,
        speculative_config=vllm_spec_config("ddtree", "/opt/models/d", "15", 32),
        compilation_config=vllm_compilation_config("auto", [33, 66]),
        hybrid_target=False,
        extra_args=[],
    )
    assert vllm_serve_argv(serve)[-4:] == [
        "--speculative-config",
        '{"method":"ddtree","model":"/opt/models/d","num_speculative_tokens":15,"ddtree_budget":32}',
        "--compilation-config",
        '{"cudagraph_capture_sizes":[33,66]}',
    ]


@pytest.mark.parametrize(
    ("method", "budget", "config"),
    [
        ("ddtree", 64, {"method": "ddtree", "model": "d", "num_speculative_tokens": 15, "ddtree_budget": 64}),
        ("ddtree", None, {"method": "ddtree", "model": "d", "num_speculative_tokens": 15}),
        ("ddtree", "", {"method": "ddtree", "model": "d", "num_speculative_tokens": 15}),
        ("dflash", 64, {"method": "dflash", "model": "d", "num_speculative_tokens": 15}),
    ],
)
def test_the_budget_is_only_ddtree_s(method, budget, config) -> None:
    out = vllm_spec_config(method, "d", 15, budget)
    assert out == config and list(out) == list(config)  # key order: the unit stays byte-for-byte stable


def test_verified_tokens_are_the_budget_else_the_depth() -> None:
    assert vllm_verify_tokens({"num_speculative_tokens": 15, "ddtree_budget": 64}) == 64
    assert vllm_verify_tokens({"num_speculative_tokens": 15}) == 15


@pytest.mark.parametrize(
    ("setting", "sizes", "config"),
    [
        ("auto", [65, 130], {"cudagraph_capture_sizes": [65, 130]}),
        ("auto", [], {}),
        (512, [65], {"max_cudagraph_capture_size": 512}),
        ("256", [], {"max_cudagraph_capture_size": 256}),
        (0, [65], {}),
    ],
)
def test_graphs(setting, sizes, config) -> None:
    assert vllm_compilation_config(setting, sizes) == config


@pytest.mark.parametrize(
    ("setting", "hybrid", "args"),
    [
        ("auto", True, ["--no-enable-prefix-caching"]),
        ("auto", "True", ["--no-enable-prefix-caching"]),
        ("auto", False, []),
        (True, True, ["--enable-prefix-caching"]),
        (False, False, ["--no-enable-prefix-caching"]),
    ],
)
def test_prefix_caching(setting, hybrid, args) -> None:
    assert vllm_prefix_caching_args(setting, hybrid) == args
