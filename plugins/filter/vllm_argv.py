"""The `vllm serve` command line service_swap's unit runs, built from named settings.

The decisions (which keys the speculative config carries, which CUDA-graph setting applies, whether
prefix caching is forced off) live here, tested directly (tests/unit/test_vllm_argv.py) and through
the rendered unit (tests/unit/test_service_swap_render.py); the role's vars/main.yml only names the
settings. JSON arguments are compact and keep their key order, so the rendered unit is byte-for-byte
stable across runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# The options always on the command line, in the unit's order: serve setting -> vLLM flag.
OPTIONS = (
    ("host", "--host"),
    ("port", "--port"),
    ("served_model_name", "--served-model-name"),
    ("tensor_parallel_size", "--tensor-parallel-size"),
    ("max_model_len", "--max-model-len"),
    ("gpu_memory_utilization", "--gpu-memory-utilization"),
    ("max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _budget(value: Any) -> int | None:
    return None if value is None or value == "" else int(value)


def vllm_spec_config(method: str, drafter_dir: str, num_speculative_tokens: Any, ddtree_budget: Any = None) -> dict:
    """--speculative-config: method, drafter, draft length, and the node budget for DDTree when one is set."""
    config: dict[str, Any] = {
        "method": method,
        "model": drafter_dir,
        "num_speculative_tokens": int(num_speculative_tokens),
    }
    budget = _budget(ddtree_budget)
    if method == "ddtree" and budget is not None:
        config["ddtree_budget"] = budget
    return config


def vllm_verify_tokens(spec_config: Mapping[str, Any]) -> int:
    """Tokens the target verifies per request and step: the DDTree budget, else the draft length."""
    budget = spec_config.get("ddtree_budget")
    return int(budget if budget is not None else spec_config["num_speculative_tokens"])


def vllm_compilation_config(max_cudagraph_capture_size: Any, graph_sizes: Sequence[int] = ()) -> dict:
    """--compilation-config's CUDA graphs: "auto" gives the sizes computed for DDTree's uniform
    batches (none for the chain: vLLM's default); an integer above 0 is vLLM's cap; 0 is vLLM's default."""
    if max_cudagraph_capture_size == "auto":
        return {"cudagraph_capture_sizes": [int(s) for s in graph_sizes]} if graph_sizes else {}
    cap = int(max_cudagraph_capture_size)
    return {"max_cudagraph_capture_size": cap} if cap > 0 else {}


def vllm_prefix_caching_args(prefix_caching: Any, hybrid_target: Any) -> list[str]:
    """ "auto" turns prefix caching off on a hybrid target (spec decode corrupts it there, vLLM #47194)
    and leaves vLLM's default elsewhere; a boolean forces it either way."""
    if isinstance(prefix_caching, bool):
        return ["--enable-prefix-caching"] if prefix_caching else ["--no-enable-prefix-caching"]
    if prefix_caching == "auto" and _truthy(hybrid_target):
        return ["--no-enable-prefix-caching"]
    return []


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "on")
    return bool(value)


def vllm_serve_argv(serve: Mapping[str, Any]) -> list[str]:
    """The exact argv of ExecStart, one item per argument.

    ``serve`` names: executable, model, host, port, served_model_name, tensor_parallel_size,
    max_model_len, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, speculative_config
    (a dict), compilation_config (a dict, {} for none), prefix_caching (auto, true, false),
    hybrid_target, extra_args (a list).
    """
    argv = [serve["executable"], "serve", serve["model"]]
    for key, flag in OPTIONS:
        argv += [flag, serve[key]]
    argv += ["--speculative-config", _compact(dict(serve["speculative_config"]))]
    if serve.get("compilation_config"):
        argv += ["--compilation-config", _compact(dict(serve["compilation_config"]))]
    argv += vllm_prefix_caching_args(serve.get("prefix_caching", "auto"), serve.get("hybrid_target", True))
    argv += list(serve.get("extra_args") or [])
    return [str(a) for a in argv]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "vllm_spec_config": vllm_spec_config,
            "vllm_verify_tokens": vllm_verify_tokens,
            "vllm_compilation_config": vllm_compilation_config,
            "vllm_prefix_caching_args": vllm_prefix_caching_args,
            "vllm_serve_argv": vllm_serve_argv,
        }
