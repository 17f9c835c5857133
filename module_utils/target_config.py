"""The target model's config.json fields that arithmetic reads, validated first (issue 43, class 6).

service_swap's memory fit (module_utils/memory_fit.py) multiplies the target's Gated DeltaNet and
attention sizes. Those numbers come from files on the node: "sixteen" gave a raw "invalid literal
for int()", Infinity or null a raw filter exception. Each field is checked here for type, finiteness, sign
and range, and a refusal names the file and the field and says what to do.

Standard library and ansible.module_utils only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible.module_utils.figures import FigureError, finite_field, whole_field

GDN = "linear_attention"
GDN_CONV_WIDTH = 4
# Far beyond any published model (Qwen3.6-27B: 16 key and 48 value heads of 128, width 4, 64 layers),
# small enough that no product of them overflows or takes long.
MAX_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_CONV_WIDTH = 64
MAX_LAYERS = 4096

GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


class TargetConfigError(ValueError):
    """A field of the target's files is not what the arithmetic needs; the message names file and field."""


@dataclass(frozen=True)
class GdnShape:
    """What one recurrent state slot of the target's Gated DeltaNet layers is made of."""

    layers: int
    key_heads: int = 0
    value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    conv_width: int = GDN_CONV_WIDTH


def _fix(path: str) -> str:
    return f"fix or replace {path} (the model's own config.json), or set shared_settings_target_dir to a complete model"


def text_config(config: Any, path: str = "config.json") -> tuple[Mapping[str, Any], str]:
    """The mapping holding the text model's settings (``text_config`` for Qwen3.5/3.6, else the top) and its
    name in messages; TargetConfigError when the file is not a JSON object or text_config is not one."""
    if not isinstance(config, Mapping):
        raise TargetConfigError(f"{path} holds {type(config).__name__}, not a JSON object; {_fix(path)}")
    text = config.get("text_config")
    if text is None:
        return config, path
    if not isinstance(text, Mapping):
        raise TargetConfigError(f"{path}: text_config is {type(text).__name__}, not a JSON object; {_fix(path)}")
    return text, f"{path}: text_config"


def layer_kinds(config: Any, path: str = "config.json") -> list[str]:
    """The kind of every layer (``layer_types``, or ``layers_block_type``); [] when the file lists none."""
    text, where = text_config(config, path)
    for name in ("layer_types", "layers_block_type"):
        kinds = text.get(name)
        if kinds is None or kinds == []:
            continue
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise TargetConfigError(f"{where}.{name} is not a list of layer kinds (strings); {_fix(path)}")
        if len(kinds) > MAX_LAYERS:
            raise TargetConfigError(f"{where}.{name} lists {len(kinds)} layers, more than {MAX_LAYERS}; {_fix(path)}")
        return list(kinds)
    return []


def gdn_shape(config: Any, path: str = "config.json") -> GdnShape:
    """The Gated DeltaNet sizes of the target, each a whole number in range; GdnShape(0) without such layers."""
    text, where = text_config(config, path)
    layers = sum(1 for k in layer_kinds(config, path) if k == GDN)
    if not layers:
        return GdnShape(0)
    try:
        values = [
            whole_field(text.get(name), f"{where}.{name}", 1, MAX_HEADS if "heads" in name else MAX_HEAD_DIM)
            for name in GDN_FIELDS
        ]
        width = text.get("linear_conv_kernel_dim", GDN_CONV_WIDTH)
        width = whole_field(width, f"{where}.linear_conv_kernel_dim", 1, MAX_CONV_WIDTH)
    except FigureError as exc:
        raise TargetConfigError(f"{exc}; {_fix(path)}") from None
    return GdnShape(layers, *values, conv_width=width)


def memory_fraction(value: Any, where: str) -> float:
    """A share of GPU memory, above 0 and at most 1."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise TargetConfigError(f"{where} is {value[:40]!r}, not a number") from None
    try:
        number = finite_field(value, where, 0.0, 1.0)
    except FigureError as exc:
        raise TargetConfigError(str(exc)) from None
    if number <= 0:
        raise TargetConfigError(f"{where} is {number}, not a share of memory above 0")
    return number


def setting(value: Any, where: str, low: int, high: int) -> int:
    """A whole-number setting (a budget, a GPU's MiB) in range; TargetConfigError naming it otherwise.

    Strings of digits are what templating may hand over for an int (the inventory's own types are
    checked on entry); anything else is refused."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value.strip()) <= 18:
        value = int(value.strip())
    try:
        return whole_field(value, where, low, high)
    except FigureError as exc:
        raise TargetConfigError(str(exc)) from None
