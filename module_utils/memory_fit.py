"""Whether the target, the drafter, their KV cache and DDTree's per-node state fit a node's GPUs (issue 42).

vLLM 0.20.1 sizes its KV cache at start-up: of ``memory_total x gpu_memory_utilization`` per GPU it
takes the weights, the peak of its profile run (a dummy forward of ``max_num_batched_tokens``, and
with this project's change set a DDTree step's largest tensors) and what the CUDA context and CUDA
graphs hold; what is left is the KV cache. It refuses to start only when one request of
``max_model_len`` does not fit, and otherwise admits as many requests at once as fit, so a node can
serve far fewer than ``max_num_seqs`` without saying so. service_swap asks the same question
first, before SGLang is stopped, for ``max_num_seqs`` requests of ``max_model_len`` each.

The KV cache is counted as vLLM counts it (vllm/v1/core/kv_cache_utils.py, kv_cache_interface.py,
platforms/interface.py's ``_align_hybrid_block_size``). The numbers that belong to a vLLM release
are its base's rules (``kv_layout`` in ddtree/vllm-<release>/base.json, read by
module_utils/ddtree_base.py, which the caller passes in as ``base``); the arithmetic is here. For
vLLM 0.20.1:

- On a hybrid target (Gated DeltaNet layers) every layer's page is one size: the attention block
  grows to the smallest multiple of the base's block multiple (16 tokens) whose page holds one
  recurrent state slot, and the slot is padded to that page. A slot is the recurrent state (value
  heads x value dim x key dim, in ``mamba_ssm_dtype`` where config.json gives one, else the model's
  dtype) and the convolution window (conv channels x the base's columns, 0.20.1: width - 1 +
  speculative tokens, model dtype), both split over the tensor-parallel GPUs.
- A request holds the base's state slots in every Gated DeltaNet layer (0.20.1: ``1 + speculative
  tokens``, the chain's depth or DDTree's node budget: the change set makes vLLM verify ``budget``
  tokens, so every tree node keeps its own state).
- Layers of one kind (the target's attention layers, its Gated DeltaNet layers, the drafter's
  layers, which the change set keeps in one full-attention group) are split into groups of the
  smallest kind's size (the largest's when that is under the base's merge ratio, 1.5, times the
  smallest), padded; every group of a kind holds the kind's blocks for a request:
  ``ceil(max_model_len / block)`` for attention, the slots for Gated DeltaNet. A request needs
  ``group size x page x sum of blocks``.

The profile's peak is estimated from the shapes (``profile_bytes``); what vLLM holds besides
(the CUDA context, NCCL, CUDA graphs) is the operator's reserve. ddtree/gpu/memory_profile_check.py
compares every part with what vLLM reports on a GPU. Standard library and ansible.module_utils only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.ddtree_base import BaseRules
from ansible.module_utils.figures import FigureError, whole_field
from ansible.module_utils.target_config import (
    GDN,
    TargetConfigError,
    gdn_shape,
    layer_kinds,
    memory_fraction,
    setting,
    text_config,
)

ATTENTION = ("full_attention", "attention", "sliding_attention")
MIB = 2**20
GIB = 2**30
# The most a setting of a real node can be: beyond these it is a typo.
MAX_MODEL_LEN = 2**24
MAX_SEQS = 65536
MAX_TOKENS = 2**24
MAX_TP = 1024
MAX_GPU_MIB = 2**24
MAX_SPEC = 4096
MAX_DIM = 2**20
MAX_WEIGHTS = 2**50
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "half": 2, "float": 4}
# A DDTree step samples the target's rows 128 at a time (ddtree.py's _CHOICE_ROWS); each such chunk
# holds a few vocabulary-sized float32 rows at once (the copy, the scaled logits, the top-k/top-p
# work, the probabilities, the race). 5.6 chunks' worth is what the recorded profiles held beside the
# captured states and the logits (ddtree/results/memory_profile_*_h200.json; the unit tests hold the
# estimate to those records).
CHOICE_ROWS = 128
SAMPLING_CHUNKS = 5.6
# The dummy forward's peak per token: this many times the bytes of one token's MLP input and output
# rows (2 x intermediate + 2 x hidden values); 2.7 is what Qwen3-8B's chain profile held at 2,048
# tokens (memory_profile_8b_h200.json).
FORWARD_FACTOR = 2.7


class MemoryFitError(ValueError):
    """An input of the fit is not what the arithmetic needs; the message names it."""


@dataclass(frozen=True)
class AttentionKind:
    """Layers that share one KV cache spec (KV heads per GPU, head dim, dtype): how many, and the bytes
    one token takes in each on one GPU."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class KvLayout:
    """How vLLM lays out the KV cache of a target and drafter pair on one GPU."""

    block_tokens: int
    page_bytes: int
    group_size: int
    # kind name -> (groups, blocks per request in each group)
    groups: dict[str, tuple[int, int]]
    state_slot_bytes: int = 0
    state_slots: int = 0
    state_layers: int = 0
    # The tokens verified per step that the base's rule turned into state_slots.
    verified_tokens: int = 0

    def pages_per_request(self) -> int:
        return sum(groups * blocks for groups, blocks in self.groups.values())

    def request_bytes(self) -> int:
        """What one request of max_model_len holds on a GPU: vLLM's own 'KV cache is needed' figure."""
        return self.group_size * self.page_bytes * self.pages_per_request()

    def state_bytes(self) -> int:
        """The part of request_bytes that is recurrent state (the base's state slots in every Gated DeltaNet group)."""
        groups, blocks = self.groups.get(GDN, (0, 0))
        return self.group_size * self.page_bytes * groups * blocks


@dataclass(frozen=True)
class Fit:
    """The fit on one GPU: every part in bytes, and how many requests of max_model_len fit."""

    budget: int
    weights_target: int
    weights_drafter: int
    profile: int
    reserve: int
    request: int
    state: int
    max_num_seqs: int
    fits: int
    # None where the deployed release has no base: its KV layout is not known, so request, state and
    # fits are not counted (fits is max_num_seqs while anything is left for the KV cache, else 0).
    layout: KvLayout | None
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def kv_available(self) -> int:
        return self.budget - self.weights_target - self.weights_drafter - self.profile - self.reserve


def _number(value: Any, where: str, low: int, high: int) -> int:
    try:
        return setting(value, where, low, high)
    except TargetConfigError as exc:
        raise MemoryFitError(str(exc)) from None


def _field(mapping: Mapping[str, Any], name: str, where: str, fix: str, low: int = 1, high: int = MAX_DIM) -> int:
    try:
        return whole_field(mapping.get(name), f"{where}.{name}", low, high)
    except FigureError as exc:
        raise MemoryFitError(f"{exc}; {fix}") from None


def _dtype_bytes(text: Mapping[str, Any], key: str, default: int) -> int:
    value = text.get(key)
    return DTYPE_BYTES.get(value, default) if isinstance(value, str) else default


def model_dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes per value of the target's dtype (config.json's dtype or torch_dtype; bf16 when absent)."""
    text, _ = text_config(config)
    return _dtype_bytes(text, "dtype", _dtype_bytes(text, "torch_dtype", 2))


def recurrent_state_bytes(
    config: Mapping[str, Any], spec_tokens: int = 0, tp: int = 1, path: str = "config.json", *, base: BaseRules
) -> int:
    """Bytes of one recurrent state slot of one Gated DeltaNet layer on one GPU, unpadded; 0 without such layers.

    The recurrent state (value heads x value dim x key dim) in config.json's ``mamba_ssm_dtype`` (else
    the model's dtype), and the convolution window (2 x key heads x key dim + value heads x value dim
    channels, ``base.conv_columns(width, spec_tokens)`` columns: 0.20.1 keeps ``width - 1 + spec_tokens``)
    in the model's dtype, each split over ``tp`` GPUs.
    Every size is validated first (module_utils/target_config.py): TargetConfigError names the field.
    """
    shape = gdn_shape(config, path)
    if not shape.layers:
        return 0
    text, _ = text_config(config, path)
    dtype = model_dtype_bytes(config)
    ssm_dtype = _dtype_bytes(text, "mamba_ssm_dtype", dtype)
    ssm = shape.value_heads // tp * shape.value_head_dim * shape.key_head_dim * ssm_dtype
    channels = (2 * shape.key_heads * shape.key_head_dim + shape.value_heads * shape.value_head_dim) // tp
    conv = channels * max(base.conv_columns(shape.conv_width, spec_tokens), 0) * dtype
    return ssm + conv


def _attention(name: str, config: Mapping[str, Any], path: str, tp: int) -> AttentionKind:
    """A model's attention layers (full or sliding: the change set keeps a DFlash drafter's sliding layers
    in its one full-attention group) as vLLM specs them on one GPU."""
    fix = f"fix {path} or set the model's directory to a complete model"
    text, where = text_config(config, path)
    listed = layer_kinds(config, path)
    heads = _field(text, "num_key_value_heads", where, fix)
    hidden = _field(text, "hidden_size", where, fix)
    attention_heads = _field(text, "num_attention_heads", where, fix)
    head_dim = text.get("head_dim")
    head_dim = hidden // attention_heads if head_dim is None else _field(text, "head_dim", where, fix)
    layers = sum(1 for k in listed if k in ATTENTION) if listed else _field(text, "num_hidden_layers", where, fix)
    # vLLM replicates KV heads when there are fewer than GPUs.
    return AttentionKind(name, layers, max(heads // tp, 1), head_dim, model_dtype_bytes(config))


def kv_layout(
    target: Mapping[str, Any],
    drafter: Mapping[str, Any] | None,
    spec_tokens: int,
    max_model_len: int,
    tp: int = 1,
    target_path: str = "config.json",
    drafter_path: str = "drafter config.json",
    *,
    base: BaseRules,
) -> KvLayout:
    """The KV cache layout ``base``'s vLLM release gives the pair on one GPU (see the module's docstring)."""
    kinds = [_attention("target", target, target_path, tp)]
    if drafter:
        kind = _attention("drafter", drafter, drafter_path, tp)
        same = (kind.kv_heads, kind.head_dim, kind.dtype_bytes) == (
            kinds[0].kv_heads,
            kinds[0].head_dim,
            kinds[0].dtype_bytes,
        )
        # Layers of one spec are one kind (Qwen3-8B and its drafter: 8 KV heads of 128 each).
        kinds = (
            [AttentionKind("target", kinds[0].layers + kind.layers, kind.kv_heads, kind.head_dim, kind.dtype_bytes)]
            if same
            else [*kinds, kind]
        )
    slot = recurrent_state_bytes(target, spec_tokens, tp, target_path, base=base)
    state_layers = gdn_shape(target, target_path).layers
    multiple = base.kv_block_multiple
    block = multiple
    if slot:
        # The smallest block of the base's multiple whose attention page holds one state slot.
        one_token = kinds[0].token_bytes
        block = multiple * -(-slot // (multiple * one_token))
    page = block * kinds[0].token_bytes
    sizes = [k.layers for k in kinds if k.layers] + ([state_layers] if state_layers else [])
    group_size = base.group_size(sizes)
    blocks = -(-max_model_len // block)
    groups = {k.name: (-(-k.layers // group_size), blocks) for k in kinds if k.layers}
    slots = base.state_slots(spec_tokens) if slot else 0
    if state_layers:
        groups[GDN] = (-(-state_layers // group_size), base.state_slots(spec_tokens))
    return KvLayout(block, page, group_size, groups, slot, slots, state_layers, spec_tokens)


def captured_bytes_per_token(layers: int, hidden: int, dtype: str) -> int:
    """Bytes a DDTree step keeps per scheduled token for the target's captured hidden states (ddtree.py's
    function of the same name): one row per tapped layer and their concatenation; float32 rows under fp16."""
    if dtype == "float16":
        return layers * hidden * (2 * 4 + 2)
    return 2 * layers * hidden * DTYPE_BYTES.get(dtype, 2)


def profile_bytes(
    hidden: int,
    intermediate: int,
    vocab: int,
    captured_layers: int,
    dtype: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    verify_tokens: int,
    depth: int,
    ddtree: bool,
) -> int:
    """The peak of vLLM's profile run above the weights (the worker's peak_activation_memory), estimated.

    The dummy forward of ``max_num_batched_tokens``: FORWARD_FACTOR x the token's MLP rows (``intermediate``:
    one GPU's share). With DDTree
    the change set then holds a tree step's largest tensors (profile_step_memory): the captured states of
    every scheduled token, the target's logits at every verified row (``max_num_seqs x (budget + 1)``, at
    most the scheduled tokens), the drafter's logits at every depth of every request, and the sampling
    temporaries of CHOICE_ROWS rows. The larger of the two is the peak.
    """
    width = DTYPE_BYTES.get(dtype, 2)
    forward = int(FORWARD_FACTOR * max_num_batched_tokens * (2 * intermediate + 2 * hidden) * width)
    if not ddtree:
        return forward
    rows = min(max_num_batched_tokens, max_num_seqs * (verify_tokens + 1))
    held = (
        max_num_batched_tokens * captured_bytes_per_token(captured_layers, hidden, dtype)
        + (rows + max_num_seqs * depth) * vocab * width
        + int(SAMPLING_CHUNKS * CHOICE_ROWS * vocab * 4)
    )
    return max(forward, held)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def memory_fit(
    target: Mapping[str, Any],
    drafter: Mapping[str, Any],
    *,
    target_weights: int,
    drafter_weights: int,
    gpu_memory_mib: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    spec_tokens: int,
    depth: int,
    ddtree: bool,
    reserve_mib: int,
    base: BaseRules | None,
    target_path: str = "config.json",
    drafter_path: str = "drafter config.json",
) -> Fit:
    """Every part one GPU holds, and how many requests of max_model_len fit beside them.

    ``target_weights``/``drafter_weights``: the checkpoints' tensor bytes (split over the tensor-parallel
    GPUs); ``spec_tokens``: tokens verified per step (the chain's depth, DDTree's budget); ``depth``: the
    drafter's depth; ``reserve_mib``: what vLLM holds outside weights, profile and KV cache per GPU;
    ``base``: the deployed vLLM release's rules (module_utils/ddtree_base.py), its KV cache layout; None
    where the release has no base (then only the weights, the profile and the reserve are counted).
    """
    try:
        tp = _number(tensor_parallel_size, "service_swap_tensor_parallel_size", 1, MAX_TP)
        gpu_mib = _number(gpu_memory_mib, "the GPU's memory_total_mib (gpu_check's facts)", 1, MAX_GPU_MIB)
        share = memory_fraction(gpu_memory_utilization, "shared_settings_gpu_memory_utilization")
        model_len = _number(max_model_len, "service_swap_max_model_len", 1, MAX_MODEL_LEN)
        seqs = _number(max_num_seqs, "service_swap_max_num_seqs", 1, MAX_SEQS)
        tokens = _number(max_num_batched_tokens, "service_swap_max_num_batched_tokens", 1, MAX_TOKENS)
        spec = _number(spec_tokens, "the tokens verified per step", 0, MAX_SPEC)
        depth = _number(depth, "shared_settings_num_speculative_tokens", 0, MAX_SPEC)
        reserve = _number(reserve_mib, "service_swap_fit_reserve_mib", 0, MAX_GPU_MIB) * MIB
        t_weights = _number(target_weights, "the target's weight bytes", 0, MAX_WEIGHTS)
        d_weights = _number(drafter_weights, "the drafter's weight bytes", 0, MAX_WEIGHTS)
        # Without a base the fit runs partly: the weights (the checkpoints' bytes) and the profile run (the
        # model's shapes) are no release's rule, so a node they alone fill is refused as any release would
        # refuse it (no room for a KV cache); the KV layout is the base's rule, so requests are not counted.
        layout = (
            None
            if base is None
            else kv_layout(target, drafter, spec, model_len, tp, target_path, drafter_path, base=base)
        )
        text, where = text_config(target, target_path)
        fix = f"fix {target_path} or set shared_settings_target_dir to a complete model"
        hidden = _field(text, "hidden_size", where, fix)
        intermediate = _field(text, "intermediate_size", where, fix)
        vocab = _field(text, "vocab_size", where, fix, high=2**24)
        d_text = drafter.get("dflash_config") if isinstance(drafter, Mapping) else None
        captured = len(d_text.get("target_layer_ids") or []) if isinstance(d_text, Mapping) else 0
    except TargetConfigError as exc:
        raise MemoryFitError(str(exc)) from None
    dtype = text.get("dtype") or text.get("torch_dtype")
    dtype = dtype if dtype in DTYPE_BYTES else "bfloat16"
    profile = profile_bytes(hidden, intermediate // tp, vocab, captured, dtype, tokens, seqs, spec, depth, ddtree)
    budget = int(gpu_mib * MIB * share)
    weights_target, weights_drafter = t_weights // tp, d_weights // tp
    request = layout.request_bytes() if layout else 0
    free = budget - weights_target - weights_drafter - profile - reserve
    fits = max(int(free // request), 0) if request else seqs
    if layout is None and free <= 0:
        fits = 0
    return Fit(
        budget=budget,
        weights_target=weights_target,
        weights_drafter=weights_drafter,
        profile=profile,
        reserve=reserve,
        request=request,
        state=layout.state_bytes() if layout else 0,
        max_num_seqs=seqs,
        fits=fits,
        layout=layout,
    )


def _slots_words(layout: KvLayout) -> str:
    """Where a request's state slots come from, by the deployed base's rule (the layout's slots against
    its verified tokens): ``one per verified token (15) and one more``."""
    more = layout.state_slots - layout.verified_tokens
    if more == 0:
        return f"one per verified token ({layout.verified_tokens})"
    extra = "one more" if more == 1 else f"{more} more"
    return f"one per verified token ({layout.verified_tokens}) and {extra}"


def fit_verdict(fit: Fit, lower: bool, max_model_len: int, hostname: str = "the node") -> dict[str, Any]:
    """What service_swap does with a fit: ``{"refuse": str, "note": str, "max_num_seqs": int}``.

    All max_num_seqs requests fit: no note. Fewer but at least one, with ``lower``: max_num_seqs
    lowered to the most that fit, and a note saying so. Otherwise a refusal with every part and the
    settings to change.
    """
    parts = (
        f"per GPU {_gib(fit.budget)} for vLLM (memory x gpu_memory_utilization) holds the target's weights "
        f"{_gib(fit.weights_target)}, the drafter's {_gib(fit.weights_drafter)}, the profile run's peak "
        f"{_gib(fit.profile)}, the reserve {_gib(fit.reserve)} (service_swap_fit_reserve_mib), leaving "
        f"{_gib(max(fit.kv_available, 0))} for the KV cache"
    )
    if fit.layout is None:
        # No base: only whether anything is left for the KV cache is known (memory_fit says why).
        if fit.fits >= 1:
            return {"refuse": "", "note": "", "max_num_seqs": fit.max_num_seqs}
        return {
            "refuse": (
                f"the weights and the profile run leave no memory for the KV cache on {hostname}, so vLLM would "
                "refuse to start. Fix: raise the tensor parallel size or shared_settings_gpu_memory_utilization, or "
                f"lower service_swap_max_num_batched_tokens. How it adds up: {parts}"
            ),
            "note": "",
            "max_num_seqs": fit.max_num_seqs,
        }
    parts += f"; one request of max_model_len={max_model_len} needs {_gib(fit.request)}"
    if fit.state:
        parts += (
            f", {_gib(fit.state)} of it recurrent state ({fit.layout.state_slots} slots of "
            f"{fit.layout.state_slot_bytes / MIB:.1f} MiB in each of {fit.layout.state_layers} layers: "
            f"{_slots_words(fit.layout)})"
        )
    needed = fit.max_num_seqs * fit.request
    if fit.fits >= fit.max_num_seqs:
        return {"refuse": "", "note": "", "max_num_seqs": fit.max_num_seqs}
    if fit.fits >= 1 and lower:
        return {
            "refuse": "",
            "note": (
                f"service_swap_max_num_seqs lowered from {fit.max_num_seqs} to {fit.fits} on {hostname}, the most "
                f"requests of max_model_len that fit ({parts})"
            ),
            "max_num_seqs": fit.fits,
        }
    if fit.fits >= 1:
        change = (
            f"set service_swap_max_num_seqs to {fit.fits} or less (or service_swap_fit_lower_max_num_seqs: true to "
            "let the role lower it), lower service_swap_max_model_len, or raise the tensor parallel size"
        )
    else:
        change = (
            "not even one request fits: lower service_swap_max_model_len or service_swap_max_num_batched_tokens, "
            "lower the DDTree budget, raise shared_settings_gpu_memory_utilization or the tensor parallel size"
        )
    # The headline and the fix first: roles/tune records a refused candidate's first 300 characters.
    return {
        "refuse": (
            f"{fit.max_num_seqs} requests of max_model_len={max_model_len} (service_swap_max_num_seqs) need "
            f"{_gib(needed)} of KV cache per GPU and {fit.fits} fit on {hostname}. Fix: {change}. How it adds up: "
            f"{parts}"
        ),
        "note": "",
        "max_num_seqs": fit.max_num_seqs,
    }
