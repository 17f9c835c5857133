"""Build a DFlash drafter's config.json from its tensor shapes and its target model.

A DFlash drafter checkpoint (z-lab layout, no ``model.`` prefix) holds ``fc.weight
[H, n*H]`` (n = number of tapped target layers), ``hidden_norm.weight [H]``,
``norm.weight [H]`` and per draft layer a Qwen3 decoder block. Everything about
its architecture except the attention layer pattern (sliding or full) and the
block size can be read off those shapes. The rest comes from the target:
vocabulary, rope settings, layer count (nested under ``text_config`` for
Qwen3.5/3.6) and the tokenizer, whose first unused id is the mask token.

Pure functions, standard library only. Every refusal raises
:class:`DFlashConfigError` with a message that says what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ansible.module_utils.safe_io import UnsafeFileError, read_json

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}

_TOKEN_ID = re.compile(r"[0-9]{1,12}")
_LAYER_RE = re.compile(r"^layers\.([0-9]+)\.(.+)$")
_TOP_LEVEL = ("fc.weight", "hidden_norm.weight", "norm.weight")
_OPTIONAL_TOP = ("embed_tokens.weight", "lm_head.weight")
_PER_LAYER = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_OPTIONAL_BIAS = "self_attn.o_proj.bias"


class DFlashConfigError(ValueError):
    """The drafter, the target or the given settings cannot produce a correct config."""


@dataclass(frozen=True)
class DrafterShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    attention_bias: bool
    dtype: str
    num_tapped_layers: int
    parameters: int


@dataclass(frozen=True)
class TargetInfo:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float | int
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    hidden_act: str
    model_type: str | None
    nested_text_config: bool


@dataclass(frozen=True)
class Published:
    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_tapped_layers: int
    num_target_layers: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None


# The published drafters whose layer pattern is known (FACTS: values of the published configs).
PUBLISHED: tuple[Published, ...] = (
    Published("Qwen3-8B-DFlash-b16", 4096, 5, 12288, 32, 8, 128, 5, 36, 151936, (FULL,) * 5, None),
    Published("Qwen3.6-27B-DFlash", 5120, 5, 17408, 32, 8, 128, 5, 64, 248320, (SLIDING,) * 4 + (FULL,), 2048),
    Published("Qwen3.5-27B-DFlash", 5120, 5, 17408, 32, 8, 128, 5, 64, 248320, (FULL,) * 5, None),
)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def infer_drafter(tensors: Mapping[str, tuple[str, Sequence[int]]], target_vocab: int | None = None) -> DrafterShape:
    """Infer the drafter architecture from ``{name: (dtype, shape)}``."""
    shapes = {name: tuple(shape) for name, (_, shape) in tensors.items()}
    missing = [n for n in _TOP_LEVEL if n not in shapes]
    if missing:
        hint = ""
        if any(n.startswith("model.") for n in shapes):
            hint = " (its tensor names start with 'model.': not the DFlash checkpoint layout)"
        raise DFlashConfigError(
            f"the drafter lacks {', '.join(missing)}{hint}: these are not DFlash drafter weights;"
            " stage the drafter's safetensors file"
        )
    for n in ("norm.weight", "hidden_norm.weight"):
        if len(shapes[n]) != 1:
            raise DFlashConfigError(f"drafter tensor {n} has shape {list(shapes[n])}, expected [hidden_size]")
    hidden = shapes["norm.weight"][0]
    if shapes["hidden_norm.weight"] != (hidden,):
        raise DFlashConfigError(
            "drafter tensors have inconsistent shapes: hidden_norm.weight"
            f" {list(shapes['hidden_norm.weight'])} but norm.weight [{hidden}]"
        )
    fc = shapes["fc.weight"]
    if len(fc) != 2 or fc[0] != hidden:
        raise DFlashConfigError(f"drafter fc.weight has shape {list(fc)}, expected [{hidden}, n*{hidden}]")
    if hidden == 0 or fc[1] == 0 or fc[1] % hidden:
        raise DFlashConfigError(
            f"drafter fc.weight is {list(fc)}: its width {fc[1]} is not a multiple of the hidden size"
            f" {hidden}, so it cannot be a concatenation of tapped target layers; the file is not a"
            " DFlash drafter for a target of this hidden size"
        )
    taps = fc[1] // hidden

    layers: dict[int, dict[str, tuple[int, ...]]] = {}
    unknown: list[str] = []
    for name, shape in shapes.items():
        m = _LAYER_RE.match(name)
        if m:
            digits = m.group(1)
            # A layer index can be at most the tensor count: every layer has tensors of its own.
            if len(digits) > len(str(len(shapes))) or int(digits) >= len(shapes):
                shown = digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"
                raise DFlashConfigError(
                    f"drafter tensor layers.{shown}.{m.group(2)[:100]} names layer {shown} but the file has only"
                    f" {len(shapes)} tensors, so it cannot have that many layers; the file is not DFlash drafter weights"
                )
            layers.setdefault(int(digits), {})[m.group(2)] = shape
        elif name not in _TOP_LEVEL and name not in _OPTIONAL_TOP:
            unknown.append(name)
    if not layers:
        raise DFlashConfigError("the drafter has no layers.<i>.* tensors: these are not DFlash drafter weights")
    count = max(layers) + 1
    absent = [i for i in range(count) if i not in layers]
    if absent:
        raise DFlashConfigError(
            f"drafter tensors missing: layers {absent} absent while layer {count - 1} exists; the file is incomplete"
        )
    first = layers[0]
    for key in (
        "self_attn.q_norm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "mlp.gate_proj.weight",
    ):
        if key not in first:
            raise DFlashConfigError(f"drafter tensor missing: layers.0.{key}")
    if len(first["self_attn.q_norm.weight"]) != 1 or first["self_attn.q_norm.weight"][0] == 0:
        raise DFlashConfigError(
            f"drafter layers.0.self_attn.q_norm.weight has shape {list(first['self_attn.q_norm.weight'])},"
            " expected [head_dim]"
        )
    head_dim = first["self_attn.q_norm.weight"][0]
    q_rows = first["self_attn.q_proj.weight"][0] if first["self_attn.q_proj.weight"] else 0
    k_rows = first["self_attn.k_proj.weight"][0] if first["self_attn.k_proj.weight"] else 0
    inter = first["mlp.gate_proj.weight"][0] if first["mlp.gate_proj.weight"] else 0
    if q_rows % head_dim or k_rows % head_dim or not q_rows or not k_rows:
        raise DFlashConfigError(
            f"drafter layers.0 q_proj rows {q_rows} / k_proj rows {k_rows} are not multiples of head_dim"
            f" {head_dim} (from q_norm): inconsistent attention shapes"
        )
    heads, kv = q_rows // head_dim, k_rows // head_dim
    if heads % kv:
        raise DFlashConfigError(f"drafter has {heads} query heads but {kv} KV heads: heads must be a multiple")
    with_bias = "self_attn.q_proj.bias" in first
    expected = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv * head_dim, hidden),
        "self_attn.v_proj.weight": (kv * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    bias_expected = {
        "self_attn.q_proj.bias": (heads * head_dim,),
        "self_attn.k_proj.bias": (kv * head_dim,),
        "self_attn.v_proj.bias": (kv * head_dim,),
    }
    for i in range(count):
        have = layers[i]
        want = dict(expected)
        if with_bias:
            want.update(bias_expected)
        lacking = [k for k in want if k not in have]
        if lacking:
            raise DFlashConfigError(
                f"drafter tensors missing: layers.{i}.{lacking[0]}"
                + (f" and {len(lacking) - 1} more" if len(lacking) > 1 else "")
                + ("" if with_bias or not set(_BIASES) & set(have) else " (attention biases differ between layers)")
            )
        for k, shape in want.items():
            if have[k] != shape:
                raise DFlashConfigError(
                    f"drafter tensors have inconsistent shapes: layers.{i}.{k} is {list(have[k])},"
                    f" expected {list(shape)} (from hidden {hidden}, {heads} heads, {kv} KV heads,"
                    f" head_dim {head_dim}, intermediate {inter})"
                )
        for k in have:
            if k in want:
                continue
            if k == _OPTIONAL_BIAS and with_bias and have[k] == (hidden,):
                continue
            if k in _BIASES and not with_bias:
                raise DFlashConfigError(
                    f"drafter layers.{i}.{k} exists but layers.0 has no attention biases: inconsistent tensors"
                )
            unknown.append(f"layers.{i}.{k}")
    if unknown:
        unknown.sort()
        raise DFlashConfigError(
            f"the drafter has {len(unknown)} tensor(s) the DFlash layout does not have"
            f" (first: {unknown[0]!r}); this is not a DFlash drafter of the known layout"
        )
    for n in _OPTIONAL_TOP:
        if n in shapes:
            shape = shapes[n]
            if len(shape) != 2 or shape[1] != hidden or (target_vocab is not None and shape[0] != target_vocab):
                raise DFlashConfigError(f"drafter {n} is {list(shape)}, expected [{target_vocab or 'vocab'}, {hidden}]")
    dtype = tensors["fc.weight"][0]
    if dtype not in TORCH_DTYPES:
        raise DFlashConfigError(f"drafter weights are {dtype}; only {', '.join(TORCH_DTYPES)} drafters are supported")
    return DrafterShape(
        hidden_size=hidden,
        num_hidden_layers=count,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        attention_bias=with_bias,
        dtype=dtype,
        num_tapped_layers=taps,
        parameters=sum(_numel(s) for s in shapes.values()),
    )


# A target's config.json is a few KiB; a tokenizer.json is tens of MiB at most.
MAX_TARGET_JSON_BYTES = 256 * 1024 * 1024


def _read_json(path: str, what: str) -> Any:
    try:
        return read_json(path, MAX_TARGET_JSON_BYTES, f"{what} {path}")
    except FileNotFoundError:
        raise DFlashConfigError(f"{what} {path} does not exist") from None
    except UnsafeFileError as exc:
        raise DFlashConfigError(str(exc)) from None
    except OSError as exc:
        raise DFlashConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def _finite(v: Any) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def read_target(target_dir: str) -> TargetInfo:
    """Read the settings the drafter shares with its target from the target's config.json."""
    path = os.path.join(target_dir, "config.json")
    cfg = _read_json(path, "target config")
    if not isinstance(cfg, dict):
        raise DFlashConfigError(f"target config {path} is not a JSON object")
    text = cfg.get("text_config")
    nested = isinstance(text, dict)
    if not nested:
        text = {}

    def get(key: str) -> Any:
        return text.get(key, cfg.get(key))

    values: dict[str, Any] = {}
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"):
        v = get(key)
        if not _pos_int(v):
            raise DFlashConfigError(
                f"target config {path} has no usable {key} (got {v!r}, looked in text_config and at the"
                " top level); point target at the target model's directory"
            )
        values[key] = v
    rope_params = get("rope_parameters")
    rope_params = rope_params if isinstance(rope_params, dict) else {}
    rope_theta = get("rope_theta")
    if rope_theta is None:
        rope_theta = rope_params.get("rope_theta")
    if not isinstance(rope_theta, int | float) or isinstance(rope_theta, bool) or rope_theta <= 0:
        raise DFlashConfigError(f"target config {path} has no rope_theta (nor rope_parameters.rope_theta)")
    if not _finite(rope_theta):
        raise DFlashConfigError(f"target config {path} has rope_theta {rope_theta!r}; it must be a finite number")
    rope_scaling = get("rope_scaling")
    if not isinstance(rope_scaling, dict):
        rope_scaling = None
        kind = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_params and kind != "default":
            # Multimodal position sections and partial rotary belong to the target's own attention.
            drop = {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
            rope_scaling = {k: v for k, v in rope_params.items() if k not in drop}
    eps = get("rms_norm_eps")
    if eps is None:
        eps = 1e-6
    if not isinstance(eps, int | float) or isinstance(eps, bool) or eps <= 0 or not _finite(eps):
        raise DFlashConfigError(f"target config {path} has an invalid rms_norm_eps {eps!r}; it must be a finite number")
    act = get("hidden_act") or "silu"
    model_type = cfg.get("model_type")
    return TargetInfo(
        hidden_size=values["hidden_size"],
        num_hidden_layers=values["num_hidden_layers"],
        vocab_size=values["vocab_size"],
        max_position_embeddings=values["max_position_embeddings"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=eps,
        hidden_act=str(act),
        model_type=model_type if isinstance(model_type, str) else None,
        nested_text_config=nested,
    )


def _ids_from_vocab(vocab: Any, where: str) -> list[int]:
    if isinstance(vocab, dict):
        ids = list(vocab.values())
    elif isinstance(vocab, list):
        return [len(vocab) - 1] if vocab else []
    else:
        raise DFlashConfigError(f"{where}: vocabulary is neither a map nor a list")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DFlashConfigError(f"{where}: vocabulary ids must be non-negative integers")
    return ids


def find_mask_token_id(target_dir: str) -> tuple[int, str]:
    """The first id past every token the target tokenizer knows, and where it was read.

    Sources: tokenizer.json (model.vocab + added_tokens), else vocab.json together with
    tokenizer_config.json's added_tokens_decoder or added_tokens.json; all present ones count.
    """
    ids: list[int] = []
    used: list[str] = []
    base_vocab = False
    tj = os.path.join(target_dir, "tokenizer.json")
    if os.path.isfile(tj):
        obj = _read_json(tj, "target tokenizer")
        model = obj.get("model") if isinstance(obj, dict) else None
        if not isinstance(model, dict) or "vocab" not in model:
            raise DFlashConfigError(f"target tokenizer {tj} has no model.vocab")
        ids += _ids_from_vocab(model["vocab"], tj)
        added_tokens = obj.get("added_tokens")
        if added_tokens is None:
            added_tokens = []
        if not isinstance(added_tokens, list):
            raise DFlashConfigError(
                f"target tokenizer {tj}: added_tokens is {type(added_tokens).__name__}, not a list of tokens;"
                " the file is not a tokenizer.json"
            )
        for tok in added_tokens:
            tid = tok.get("id") if isinstance(tok, dict) else None
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise DFlashConfigError(
                    f"target tokenizer {tj}: added_tokens entry without a valid id: {repr(tok)[:120]}"
                )
            ids.append(tid)
        used.append("tokenizer.json")
        base_vocab = True
    vj = os.path.join(target_dir, "vocab.json")
    if os.path.isfile(vj):
        ids += _ids_from_vocab(_read_json(vj, "target vocabulary"), vj)
        used.append("vocab.json")
        base_vocab = True
    added = False
    tc = os.path.join(target_dir, "tokenizer_config.json")
    if os.path.isfile(tc):
        obj = _read_json(tc, "target tokenizer config")
        dec = obj.get("added_tokens_decoder") if isinstance(obj, dict) else None
        if isinstance(dec, dict):
            for key in dec:
                # ASCII digits only (str.isdigit accepts '²' and other scripts' digits), and an id's length.
                if not _TOKEN_ID.fullmatch(str(key)):
                    raise DFlashConfigError(f"{tc}: added_tokens_decoder key {str(key)[:40]!r} is not a token id")
                ids.append(int(key))
            used.append("tokenizer_config.json")
            added = True
    aj = os.path.join(target_dir, "added_tokens.json")
    if os.path.isfile(aj):
        ids += _ids_from_vocab(_read_json(aj, "target added tokens"), aj)
        used.append("added_tokens.json")
        added = True
    if not base_vocab or not ("tokenizer.json" in used or added) or not ids:
        raise DFlashConfigError(
            f"cannot find the mask token id: {target_dir} has no tokenizer.json (nor vocab.json with"
            " tokenizer_config.json or added_tokens.json); stage the target's tokenizer files or set"
            " mask_token_id"
        )
    return max(ids) + 1, " + ".join(used)


def target_layer_ids_rule(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default tapped layers: the reference's expression, Python rounding included."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    n, k = num_target_layers, num_draft_layers
    return [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]


def match_published(shape: DrafterShape, target: TargetInfo) -> list[Published]:
    return [
        p
        for p in PUBLISHED
        if (
            p.hidden_size,
            p.num_hidden_layers,
            p.intermediate_size,
            p.num_attention_heads,
            p.num_key_value_heads,
            p.head_dim,
            p.num_tapped_layers,
            p.num_target_layers,
            p.vocab_size,
        )
        == (
            shape.hidden_size,
            shape.num_hidden_layers,
            shape.intermediate_size,
            shape.num_attention_heads,
            shape.num_key_value_heads,
            shape.head_dim,
            shape.num_tapped_layers,
            target.num_hidden_layers,
            target.vocab_size,
        )
    ]


def _describe(p: Published) -> str:
    if SLIDING in p.layer_types:
        return f"{p.name}: layer_types {list(p.layer_types)}, sliding_window {p.sliding_window}"
    return f"{p.name}: all {len(p.layer_types)} layers full_attention"


def build_config(
    shape: DrafterShape,
    target: TargetInfo,
    *,
    block_size: int = 16,
    mask_token_id: int | None = None,
    mask_source: str = "given",
    target_layer_ids: Sequence[int] | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (config, report). ``mask_token_id`` must already be resolved (given or from the tokenizer)."""
    assumptions: list[str] = []
    if not _pos_int(block_size) or block_size < 2:
        raise DFlashConfigError(f"block_size must be an integer >= 2 (got {block_size!r})")
    if shape.hidden_size != target.hidden_size:
        raise DFlashConfigError(
            f"the drafter's hidden size {shape.hidden_size} differs from the target's {target.hidden_size}:"
            " this drafter was trained for another target model; stage the drafter made for this target"
        )
    n = target.num_hidden_layers
    if target_layer_ids is None:
        if shape.num_tapped_layers != shape.num_hidden_layers:
            raise DFlashConfigError(
                f"fc.weight taps {shape.num_tapped_layers} target layers but the drafter has"
                f" {shape.num_hidden_layers} draft layers, so DFlash's default rule does not apply;"
                f" set target_layer_ids to the {shape.num_tapped_layers} target layers the drafter"
                " was trained on"
            )
        ids = target_layer_ids_rule(n, shape.num_hidden_layers)
        ids_source = f"DFlash default rule for {n} target layers and {shape.num_hidden_layers} draft layers"
    else:
        ids = list(target_layer_ids)
        ids_source = "given"
        if len(ids) != shape.num_tapped_layers:
            raise DFlashConfigError(
                f"target_layer_ids has {len(ids)} entries but fc.weight taps {shape.num_tapped_layers}"
                " target layers; give exactly one id per tapped layer"
            )
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0 or i >= n]
    if bad:
        raise DFlashConfigError(
            f"target layer id(s) {bad} outside the target, which has layers 0..{n - 1}"
            f" (target_layer_ids {ids}, {ids_source})"
        )
    if mask_token_id is None or isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int):
        raise DFlashConfigError("no way to find the mask token id: set mask_token_id")
    if mask_token_id < 0 or mask_token_id >= target.vocab_size:
        raise DFlashConfigError(
            f"mask token id {mask_token_id} ({mask_source}) is not below the target's vocab_size"
            f" {target.vocab_size}: the drafter's mask embedding would not exist; check the target"
            " tokenizer and config belong together, or set mask_token_id"
        )
    matches = match_published(shape, target)
    published = None
    if layer_types is not None:
        layer_types = list(layer_types)
        if len(layer_types) != shape.num_hidden_layers:
            raise DFlashConfigError(
                f"layer_types has {len(layer_types)} entries but the drafter has {shape.num_hidden_layers} layers"
            )
        wrong = sorted({t for t in layer_types if t not in LAYER_TYPES})
        if wrong:
            raise DFlashConfigError(f"layer_types may only hold {FULL!r} and {SLIDING!r}, not {wrong}")
        sliding = SLIDING in layer_types
        if sliding and sliding_window is None:
            raise DFlashConfigError("layer_types has sliding_attention layers: set sliding_window too")
        if not sliding and sliding_window is not None:
            raise DFlashConfigError(
                "sliding_window is set but no layer in layer_types is sliding_attention; drop one or the other"
            )
        for p in matches:
            if tuple(layer_types) == p.layer_types and sliding_window == p.sliding_window:
                published = p.name
    else:
        if sliding_window is not None:
            raise DFlashConfigError("sliding_window needs layer_types saying which layers slide")
        patterns = {(p.layer_types, p.sliding_window) for p in matches}
        if len(patterns) > 1:
            raise DFlashConfigError(
                "the drafter's shapes match several published drafters that differ in their attention"
                " layer pattern, which shapes cannot tell: "
                + "; ".join(_describe(p) for p in matches)
                + ". Set layer_types (and sliding_window) to the pattern of the drafter you staged"
            )
        if matches:
            published = matches[0].name
            if SLIDING in matches[0].layer_types:
                layer_types = list(matches[0].layer_types)
                sliding_window = matches[0].sliding_window
                assumptions.append(
                    f"layer pattern of {_describe(matches[0])} (the only published drafter with these shapes)"
                )
            else:
                assumptions.append(
                    f"all layers full attention, as {matches[0].name} (the only published drafter with these shapes)"
                )
        else:
            assumptions.append("all layers full attention (layer_types not given; shapes cannot tell)")
    if sliding_window is not None and (not _pos_int(sliding_window)):
        raise DFlashConfigError(f"sliding_window must be a positive integer (got {sliding_window!r})")

    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": shape.attention_bias,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
        "head_dim": shape.head_dim,
        "hidden_act": target.hidden_act,
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": target.max_position_embeddings,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "num_target_layers": n,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_scaling": target.rope_scaling,
        "rope_theta": target.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": TORCH_DTYPES[shape.dtype],
        "use_cache": True,
        "vocab_size": target.vocab_size,
    }
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
        config["use_sliding_window"] = SLIDING in layer_types
        if sliding_window is not None:
            config["sliding_window"] = sliding_window
    report = {
        "drafter": asdict(shape),
        "target": {
            "hidden_size": target.hidden_size,
            "num_hidden_layers": n,
            "vocab_size": target.vocab_size,
            "model_type": target.model_type,
            "text_config": target.nested_text_config,
        },
        "target_layer_ids": ids,
        "target_layer_ids_source": ids_source,
        "mask_token_id": mask_token_id,
        "mask_token_id_source": mask_source,
        "published_match": published,
        "assumptions": assumptions,
    }
    return config, report


def render(config: Mapping[str, Any]) -> str:
    """Deterministic, strict JSON text: sorted keys, two-space indent, trailing newline, no NaN/Infinity."""
    try:
        return json.dumps(config, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError:
        raise DFlashConfigError(
            "the config would hold a number that is not finite (NaN or Infinity, for example from the target's"
            " rope_scaling); fix the target's config.json"
        ) from None


def generate(
    tensors: Mapping[str, tuple[str, Sequence[int]]],
    target_dir: str,
    *,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Everything the module does short of writing: (rendered text, config, report)."""
    target = read_target(target_dir)
    shape = infer_drafter(tensors, target.vocab_size)
    if mask_token_id is None:
        mask_token_id, source = find_mask_token_id(target_dir)
        source = f"first id past the target tokenizer's tokens ({source})"
    else:
        source = "given"
    config, report = build_config(
        shape,
        target,
        block_size=block_size,
        mask_token_id=mask_token_id,
        mask_source=source,
        target_layer_ids=target_layer_ids,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    return render(config), config, report
