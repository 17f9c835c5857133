"""Whether ddtree_patch's change set can verify trees on a target, from the target's config.json.

Trees need branch-local recurrent state on targets with recurrent layers. The vLLM 0.20.1 change
set gives it to Gated DeltaNet layers with a width-4 convolution (Qwen3.5/3.6, Qwen3-Next): each
tree node continues its parent's state. Mamba layers have none, so those targets run the DFlash
chain. The same rule is in the change set itself (vllm/config/speculative.py), which vLLM applies
at start; this copy lets the role say so before anything is started.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GDN = "linear_attention"
MAMBA = ("mamba", "mamba2")
GDN_CONV_WIDTH = 4
# Bytes per element of vLLM 0.20.1's Gated DeltaNet state: the recurrent state in float32, the
# convolution window in the model's dtype (bf16).
_SSM_BYTES = 4
_CONV_BYTES = 2


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _layer_kinds(text: Mapping[str, Any]) -> list[str]:
    kinds = text.get("layer_types") or text.get("layers_block_type") or []
    return [str(k) for k in kinds] if isinstance(kinds, list) else []


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


def recurrent_state_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of one state slot across the target's Gated DeltaNet layers (unsharded).

    A DDTree step keeps budget + 1 slots per request (one per verified row).
    Qwen3.6-27B: 48 layers x (48 x 128 x 128 float32 + 10240 x 3 bf16) = about 147 MiB.
    """
    text = _text_config(config)
    layers = sum(1 for k in _layer_kinds(text) if k == GDN)
    if not layers:
        return 0
    kh = int(text.get("linear_num_key_heads", 0))
    vh = int(text.get("linear_num_value_heads", 0))
    kd = int(text.get("linear_key_head_dim", 0))
    vd = int(text.get("linear_value_head_dim", 0))
    width = int(text.get("linear_conv_kernel_dim", GDN_CONV_WIDTH))
    ssm = vh * vd * kd * _SSM_BYTES
    conv = (2 * kh * kd + vh * vd) * (width - 1) * _CONV_BYTES
    return layers * (ssm + conv)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def ddtree_state_check(
    config: Mapping[str, Any],
    budget: int,
    max_num_seqs: int,
    tensor_parallel_size: int,
    gpu_memory_mib: int,
    gpu_memory_utilization: float,
    weights_bytes: int = 0,
) -> dict[str, str]:
    """Whether the tree's recurrent state fits: ``{"refuse": ..., "warn": ...}`` (empty strings if fine).

    A request keeps ``budget + 1`` state slots, sharded over the tensor-parallel GPUs with the
    heads. What a GPU holds for vLLM is ``gpu_memory_mib x gpu_memory_utilization`` less its share
    of the weights (``weights_bytes``, 0 when unknown, which only makes the check more lenient).
    One request that cannot fit is refused; fewer than ``max_num_seqs`` at once is a warning (vLLM
    then admits fewer requests at a time).
    """
    slot = recurrent_state_bytes(config)
    if slot == 0:
        return {"refuse": "", "warn": ""}
    tp = max(int(tensor_parallel_size), 1)
    per_request = (int(budget) + 1) * slot / tp
    free = int(gpu_memory_mib) * 2**20 * float(gpu_memory_utilization) - int(weights_bytes) / tp
    what = (
        f"a DDTree request keeps {int(budget) + 1} recurrent state slots of {slot / 2**20:.1f} MiB "
        f"({_gib(per_request)} per GPU at tensor parallel {tp})"
    )
    if per_request > free:
        return {
            "refuse": (
                f"{what}, more than the {_gib(max(free, 0))} a GPU has left for vLLM after the weights; "
                "lower shared_settings_ddtree_budget (or raise the tensor parallel size)"
            ),
            "warn": "",
        }
    fits = int(free // per_request)
    if fits < int(max_num_seqs):
        return {
            "refuse": "",
            "warn": (
                f"{what}: at most {fits} of service_swap_max_num_seqs={max_num_seqs} requests fit at once "
                "beside the weights, before any KV cache; vLLM admits fewer at a time (lower the budget or "
                "max_num_seqs to match)"
            ),
        }
    return {"refuse": "", "warn": ""}


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
            "recurrent_state_bytes": recurrent_state_bytes,
            "ddtree_state_check": ddtree_state_check,
            "ddtree_cudagraph_sizes": ddtree_cudagraph_sizes,
            "ddtree_draft_slots": draft_slots,
        }
