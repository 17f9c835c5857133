"""Whether ddtree_patch's change set can verify trees on a target, and the rules of the vLLM base it runs on.

Trees need branch-local recurrent state on targets with recurrent layers. Which recurrent layers get
it (and at which convolution width), the bytes of that state, the scheduler's draft slots and the
CUDA-graph sizes are rules of the vLLM base (one release with the engine's change set for it), read
from its descriptor ddtree/vllm-<release>/base.json (module_utils/ddtree_base.py): a target with
other recurrent layers runs the DFlash chain. The same rules are in the change set itself, which
vLLM applies at start; the descriptor lets the roles say so before anything is started. Adding a
base is adding its folder, not changing this file.

Each filter takes the vLLM release (``vllm_version``; without it, the engine's sole base) and
``engine_home`` (the folder holding the bases; the repository's ddtree/ by default).
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

from ansible.module_utils.ddtree_base import BaseRules, NoBaseError, load_rules, release_of, releases
from ansible.module_utils.target_config import (
    GDN,
    MAX_TOTAL_SIZE,
    TargetConfigError,
    gdn_shape,
    index_total_size,
    layer_kinds,
    memory_fraction,
    setting,
)

# The DDTree engine's home: one vllm-<release>/ folder (with its base.json) per base.
ENGINE_HOME = Path(__file__).resolve().parents[2] / "ddtree"
# Recurrent layer kinds of published models (config.json layer_types or layers_block_type), by the
# name a message gives them; which of them get tree state is the base's rule.
RECURRENT_LAYERS = {GDN: "Gated DeltaNet", "mamba": "Mamba", "mamba2": "Mamba"}
# A budget, a batch, a tensor-parallel size and a GPU's MiB beyond these are no setting of a real node.
MAX_BUDGET = 4096
MAX_SEQS = 65536
MAX_TP = 1024
MAX_GPU_MIB = 2**24


def base_rules(vllm_version: str | None = None, engine_home: str | Path | None = None) -> BaseRules:
    """The rules of ``vllm_version``'s base (the sole base without one); BaseError says what is missing."""
    return load_rules(engine_home or ENGINE_HOME, vllm_version)


def ddtree_bases(engine_home: str | Path | None = None) -> list[str]:
    """The vLLM releases the engine has a base for (a vllm-<release>/base.json each), oldest first."""
    return releases(engine_home or ENGINE_HOME)


def _names(kinds: list[str] | tuple[str, ...]) -> str:
    return " and ".join(dict.fromkeys(RECURRENT_LAYERS.get(k, k) for k in kinds))


def _text_config(config: Any) -> Mapping[str, Any]:
    """The text model's settings; {} for a config that is not a JSON object (ddtree_state_check says so)."""
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


def ddtree_fallback_reason(config: Mapping[str, Any], vllm_version: str, engine_home: str | Path | None = None) -> str:
    """'' when DDTree can verify trees on this target with ``vllm_version``'s base; else why the DFlash chain runs."""
    try:
        base = base_rules(vllm_version, engine_home)
    except NoBaseError:
        known = ", ".join(releases(engine_home or ENGINE_HOME)) or "none"
        return (
            f"this project's DDTree change set has no base for vLLM {release_of(vllm_version)} (it has: {known}), "
            "so the DFlash chain runs"
        )
    text = _text_config(config)
    kinds = _layer_kinds(text)
    other = sorted({k for k in kinds if k in RECURRENT_LAYERS and k not in base.tree_layers})
    if other:
        return (
            f"the target has {_names(other)} layers ({', '.join(other)}): trees need branch-local state, which "
            f"this project's change set for vLLM {vllm_version} gives only to {_names(base.tree_layers)} layers, "
            "so the DFlash chain runs"
        )
    width = text.get("linear_conv_kernel_dim")
    if GDN in kinds and width != base.conv_width:
        return (
            f"the target's Gated DeltaNet layers convolve over {width!r} tokens: the change set's tree "
            f"state covers a width of {base.conv_width} (Qwen3.5/3.6), so the DFlash chain runs"
        )
    return ""


def recurrent_state_bytes(
    config: Mapping[str, Any],
    config_path: str = "config.json",
    vllm_version: str | None = None,
    engine_home: str | Path | None = None,
) -> int:
    """Bytes of one state slot across the target's Gated DeltaNet layers (unsharded), at the base's bytes
    per element (vLLM 0.20.1: the recurrent state in float32, the convolution window in bf16).

    A DDTree step keeps budget + 1 slots per request (one per verified row).
    Qwen3.6-27B: 48 layers x (48 x 128 x 128 float32 + 10240 x 3 bf16) = about 147 MiB.
    Every size is validated first (module_utils/target_config.py): TargetConfigError names the field.
    """
    shape = gdn_shape(config, config_path)
    if not shape.layers:
        return 0
    base = base_rules(vllm_version, engine_home)
    ssm = shape.value_heads * shape.value_head_dim * shape.key_head_dim * base.recurrent_bytes
    conv = (
        (2 * shape.key_heads * shape.key_head_dim + shape.value_heads * shape.value_head_dim)
        * (shape.conv_width - 1)
        * base.conv_bytes
    )
    return shape.layers * (ssm + conv)


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
    index: Any = None,
    config_path: str = "config.json",
    index_path: str = "model.safetensors.index.json",
    vllm_version: str | None = None,
    engine_home: str | Path | None = None,
) -> dict[str, str]:
    """Whether the tree's recurrent state fits: ``{"refuse": ..., "warn": ...}`` (empty strings if fine).

    A request keeps ``budget + 1`` state slots, sharded over the tensor-parallel GPUs with the
    heads. What a GPU holds for vLLM is ``gpu_memory_mib x gpu_memory_utilization`` less its share
    of the weights (``weights_bytes``, 0 when unknown, which only makes the check more lenient).
    One request that cannot fit is refused; fewer than ``max_num_seqs`` at once is a warning (vLLM
    then admits fewer requests at a time).

    ``index``: the target's weight index (its metadata.total_size is the weights' size, taken over
    ``weights_bytes``). The target's files are the node's: every field is validated before any
    arithmetic, and one that is not a number in range refuses with the file and the field named
    (``config_path``, ``index_path``), never a raw exception or a check turned off (issue 43).
    """
    try:
        slot = recurrent_state_bytes(config, config_path, vllm_version, engine_home)
        if slot == 0:
            return {"refuse": "", "warn": ""}
        weights = index_total_size(index, index_path) if index not in (None, {}) else None
        if weights is None:
            weights = setting(weights_bytes or 0, "the weights' size", 0, MAX_TOTAL_SIZE)
        budget = setting(budget, "the DDTree budget", 1, MAX_BUDGET)
        max_num_seqs = setting(max_num_seqs, "service_swap_max_num_seqs", 1, MAX_SEQS)
        tp = max(setting(tensor_parallel_size, "service_swap_tensor_parallel_size", 0, MAX_TP), 1)
        gpu_mib = setting(gpu_memory_mib, "the GPU's memory_total_mib (gpu_check's facts)", 1, MAX_GPU_MIB)
        share = memory_fraction(gpu_memory_utilization, "shared_settings_gpu_memory_utilization")
    except TargetConfigError as exc:
        return {"refuse": f"the DDTree state check cannot run: {exc}", "warn": ""}
    per_request = (budget + 1) * slot / tp
    free = gpu_mib * 2**20 * share - weights / tp
    what = (
        f"a DDTree request keeps {budget + 1} recurrent state slots of {slot / 2**20:.1f} MiB "
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
    if fits < max_num_seqs:
        return {
            "refuse": "",
            "warn": (
                f"{what}: at most {fits} of service_swap_max_num_seqs={max_num_seqs} requests fit at once "
                "beside the weights, before any KV cache; vLLM admits fewer at a time (lower the budget or "
                "max_num_seqs to match)"
            ),
        }
    return {"refuse": "", "warn": ""}


def draft_slots(
    max_num_seqs: Any, verify_tokens: Any, vllm_version: str | None = None, engine_home: str | Path | None = None
) -> int:
    """Batched-token slots the base's scheduler reserves for drafting (vLLM 0.20.1: verify_tokens - 1 per
    sequence). vLLM refuses to start unless max_num_batched_tokens exceeds them (service_swap's
    preflight says so first), and they bound how many requests one verification step holds."""
    return int(max_num_seqs) * base_rules(vllm_version, engine_home).draft_slots(int(verify_tokens))


def ddtree_cudagraph_sizes(
    max_num_seqs: int,
    verify_tokens: int,
    max_num_batched_tokens: int,
    vllm_version: str | None = None,
    engine_home: str | Path | None = None,
) -> list[int]:
    """The CUDA-graph sizes that give every uniform DDTree verification batch its own full graph:
    ``[q, 2q, ..., n q]`` with ``q`` the tokens per request in the base's graphs (vLLM 0.20.1:
    verify_tokens + 1, the budget and the root) and ``n`` the most requests the scheduler can put in
    one step (max_num_seqs, and the batched tokens left after the draft slots it reserves per
    sequence). Empty when no uniform batch fits; more requests than the base's max_sizes graphs are
    refused (start-up grows long for little gain: set service_swap_max_cudagraph_capture_size instead).

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
    base = base_rules(vllm_version, engine_home)
    query_len = base.graph_tokens(verify)
    requests = min(seqs, (tokens - seqs * base.draft_slots(verify)) // query_len)
    if requests > base.max_graph_sizes:
        raise ValueError(
            f"{requests} requests per step would need {requests} CUDA graphs (more than {base.max_graph_sizes}): lower "
            "service_swap_max_num_seqs, or set service_swap_max_cudagraph_capture_size to a number of tokens"
        )
    return [k * query_len for k in range(1, requests + 1)]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "ddtree_fallback_reason": ddtree_fallback_reason,
            "ddtree_target_layer_problem": target_layer_problem,
            "ddtree_target_is_hybrid": target_is_hybrid,
            "recurrent_state_bytes": recurrent_state_bytes,
            "ddtree_state_check": ddtree_state_check,
            "ddtree_cudagraph_sizes": ddtree_cudagraph_sizes,
            "ddtree_draft_slots": draft_slots,
            "ddtree_bases": ddtree_bases,
        }
