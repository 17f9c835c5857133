"""Whether ddtree_patch's change set can verify trees on a target, and the rules of the vLLM base it runs on.

Trees need branch-local recurrent state on targets with recurrent layers. Which recurrent layers get
it (and at which convolution width), the scheduler's draft slots and the CUDA-graph sizes are rules
of the vLLM base (one release with the engine's change set for it), read from its descriptor
ddtree/vllm-<release>/base.json (module_utils/ddtree_base.py): a target with other recurrent layers
runs the DFlash chain. The same rules are in the change set itself, which vLLM applies at start; the
descriptor lets the roles say so before anything is started. Adding a base is adding its folder, not
changing this file. What the tree state costs in memory is service_swap's memory fit
(module_utils/memory_fit.py).

Each filter takes the vLLM release (``vllm_version``; without it, the engine's sole base) and
``engine_home`` (the folder holding the bases; the repository's ddtree/ by default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ansible.module_utils

try:
    from ansible import constants as C

    _MODULE_UTILS_PATHS = list(C.DEFAULT_MODULE_UTILS_PATH or [])
except ImportError:  # the GPU proofs load this file where Ansible is absent (ddtree/repo.py stands in for it)
    _MODULE_UTILS_PATHS = []

for _p in [*_MODULE_UTILS_PATHS, str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.ddtree_base import ENGINE_HOME, BaseRules, NoBaseError, load_rules, release_of, releases
from ansible.module_utils.target_config import GDN, TargetConfigError, layer_kinds

# Recurrent layer kinds of published models (config.json layer_types or layers_block_type), by the
# name a message gives them; which of them get tree state is the base's rule.
RECURRENT_LAYERS = {GDN: "Gated DeltaNet", "mamba": "Mamba", "mamba2": "Mamba"}


def base_rules(vllm_version: str | None = None, engine_home: str | Path | None = None) -> BaseRules:
    """The rules of ``vllm_version``'s base (the sole base without one); BaseError says what is missing."""
    return load_rules(engine_home or ENGINE_HOME, vllm_version)


def ddtree_bases(engine_home: str | Path | None = None) -> list[str]:
    """The vLLM releases the engine has a base for (a vllm-<release>/base.json each), oldest first."""
    return releases(engine_home or ENGINE_HOME)


def _names(kinds: list[str] | tuple[str, ...]) -> str:
    return " and ".join(dict.fromkeys(RECURRENT_LAYERS.get(k, k) for k in kinds))


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
    requests at budget 64, docs/benchmarks.md). Sizes given explicitly are kept as given: the grid
    applies only to a cap, so these sizes need not lie on it (tests/unit/test_ddtree_method.py runs
    vLLM's own code from the wheel on them for every budget 1..64).
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
            "ddtree_cudagraph_sizes": ddtree_cudagraph_sizes,
            "ddtree_bases": ddtree_bases,
        }
