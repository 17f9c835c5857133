"""Whether ddtree_patch's change set can verify trees on a target, from the target's config.json.

Trees need branch-local recurrent state on targets with recurrent layers. The vLLM 0.20.1 change
set gives it to Gated DeltaNet layers with a width-4 convolution (Qwen3.5/3.6, Qwen3-Next): each
tree node continues its parent's state. Mamba layers have none, so those targets run the DFlash
chain. The same rule is in the change set itself (vllm/config/speculative.py), which vLLM applies
at start; this copy lets the role say so before anything is started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C

for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.target_config import GDN, GDN_CONV_WIDTH, TargetConfigError, layer_kinds

MAMBA = ("mamba", "mamba2")


def _text_config(config: Any) -> Mapping[str, Any]:
    """The text model's settings; {} for a config that is not a JSON object."""
    if not isinstance(config, Mapping):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _layer_kinds(text: Mapping[str, Any]) -> list[str]:
    kinds = text.get("layer_types") or text.get("layers_block_type") or []
    return [str(k) for k in kinds] if isinstance(kinds, list) else []


def target_layer_problem(config: Any, config_path: str = "config.json") -> str:
    """'' when the target's config.json is an object whose layer kinds (if listed) are a list of strings;
    else the sentence naming the file and the field (service_swap asserts on it before reading them)."""
    try:
        layer_kinds(config, config_path)
    except TargetConfigError as exc:
        return str(exc)
    return ""


def target_is_hybrid(config: Any) -> bool:
    """Whether the target has Gated DeltaNet (linear attention) layers; False where the config cannot say
    (target_layer_problem then says why, and service_swap stops on it)."""
    try:
        return GDN in layer_kinds(config)
    except TargetConfigError:
        return False


def ddtree_fallback_reason(config: Mapping[str, Any], vllm_version: str) -> str:
    """'' when DDTree can verify trees on this target; else why the DFlash chain runs."""
    text = _text_config(config)
    kinds = _layer_kinds(text)
    mamba = sorted({k for k in kinds if k in MAMBA})
    if mamba:
        return (
            f"the target has Mamba layers ({', '.join(mamba)}): trees need branch-local state, which "
            f"this project's change set for vLLM {vllm_version} gives only to Gated DeltaNet layers, "
            "so the DFlash chain runs"
        )
    width = text.get("linear_conv_kernel_dim")
    if GDN in kinds and width != GDN_CONV_WIDTH:
        return (
            f"the target's Gated DeltaNet layers convolve over {width!r} tokens: the change set's tree "
            f"state covers a width of {GDN_CONV_WIDTH} (Qwen3.5/3.6), so the DFlash chain runs"
        )
    return ""


# More CUDA graphs than this per engine make start-up long for little gain; past it, set
# service_swap_max_cudagraph_capture_size instead.
MAX_GRAPH_SIZES = 512


def draft_slots(max_num_seqs: Any, verify_tokens: Any) -> int:
    """Batched-token slots vLLM 0.20.1's scheduler reserves for drafting: verify_tokens - 1 per
    sequence. vLLM refuses to start unless max_num_batched_tokens exceeds them (service_swap's
    preflight says so first), and they bound how many requests one verification step holds."""
    return int(max_num_seqs) * (int(verify_tokens) - 1)


def ddtree_cudagraph_sizes(max_num_seqs: int, verify_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """The CUDA-graph sizes that give every uniform DDTree verification batch its own full graph:
    ``[q, 2q, ..., n q]`` with ``q = verify_tokens + 1`` tokens per request (the budget and the root)
    and ``n`` the most requests the scheduler can put in one step (max_num_seqs, and the batched
    tokens left after the (verify_tokens - 1) draft slots it reserves per sequence). Empty when no
    uniform batch fits.

    vLLM 0.20.1 pads a decode batch up to the next captured size and makes full decode graphs only
    up to ``max_num_seqs x q``, from sizes on its own grid (multiples of 8, of 16 from 256) rounded
    up to multiples of ``q``: no cap gives ``n q`` itself a graph where no grid point lies within a
    request's tokens below it (33 requests at budget 14), and a cap off the grid is truncated (8
    requests at budget 64, docs/benchmarks.md). Sizes given explicitly are kept as given
    (tests/unit/test_ddtree_method.py runs vLLM's own code from the wheel on them).
    """
    values = (max_num_seqs, verify_tokens, max_num_batched_tokens)
    if any(isinstance(v, bool) or not str(v).strip().isdigit() for v in values):
        raise ValueError(
            f"max_num_seqs, the verified tokens and max_num_batched_tokens must be whole numbers, not {values!r}"
        )
    seqs, verify, tokens = (int(str(v).strip()) for v in values)
    if seqs < 1 or verify < 1:
        return []
    query_len = verify + 1
    requests = min(seqs, (tokens - draft_slots(seqs, verify)) // query_len)
    if requests > MAX_GRAPH_SIZES:
        raise ValueError(
            f"{requests} requests per step would need {requests} CUDA graphs (more than {MAX_GRAPH_SIZES}): lower "
            "service_swap_max_num_seqs, or set service_swap_max_cudagraph_capture_size to a number of tokens"
        )
    return [k * query_len for k in range(1, requests + 1)]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "ddtree_fallback_reason": ddtree_fallback_reason,
            "ddtree_target_layer_problem": target_layer_problem,
            "ddtree_target_is_hybrid": target_is_hybrid,
            "ddtree_cudagraph_sizes": ddtree_cudagraph_sizes,
            "ddtree_draft_slots": draft_slots,
        }
