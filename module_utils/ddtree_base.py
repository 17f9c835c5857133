"""A vLLM base's rules, read from its descriptor (ddtree/vllm-<release>/base.json) and validated.

A base is one vLLM release with the DDTree engine's change set for it. Its descriptor states as data
what the Ansible side computes with: which recurrent layers get branch-local tree state (and at
which convolution width), how many batched-token slots the scheduler reserves per sequence for
drafting, the tokens a request's verification batch takes in a CUDA graph (with the most graphs
worth capturing, the size grid a capture cap is cut down to, and the smallest cap the release
starts with), and how the release lays out the KV cache (block multiple, state slots per request,
convolution columns, layer groups).
plugins/filter/ddtree_method.py, swap_gates.py and memory_fit.py read the rules here (the arithmetic
with them is theirs and module_utils/memory_fit.py's); ddtree/bases.py lists and loads the same
descriptors for the engine's own code. Adding a base is adding its folder: nothing here names a
release.

Standard library only: it reads files on the controller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

DESCRIPTOR = "base.json"
FORMAT = 1
# A vLLM release number as a base folder names it; a local label (+cu130) is the same base.
_RELEASE_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
# Descriptors are small: a bigger file is not one.
MAX_DESCRIPTOR_BYTES = 1 << 20
# Bounds no real base comes near; they keep arithmetic on a descriptor's numbers small.
MAX_OFFSET = 64
MAX_CONV_WIDTH = 64
MAX_GRAPH_SIZES = 65536
MAX_BLOCK_MULTIPLE = 4096
MAX_GROUP_MERGE_RATIO = 16
# The most sizes listed before a capture grid's steps, and the largest size or step they name.
MAX_GRID_SIZES = 64
MAX_GRID_SIZE = 1 << 24
# The repository's DDTree engine (one vllm-<release>/ folder per base), beside module_utils/: what the
# controller-side filters read when they are given no other home.
ENGINE_HOME = Path(__file__).resolve().parents[1] / "ddtree"


class BaseError(ValueError):
    """A base is missing or its descriptor is not one; the message names the file and what to do."""


class NoBaseError(BaseError):
    """The engine has no base for the release asked for."""


@dataclass(frozen=True)
class BaseRules:
    """What one base's descriptor says the Ansible side computes with."""

    release: str
    # Recurrent layer kinds (config.json layer_types) that get branch-local tree state, and the
    # convolution width that state covers.
    tree_layers: tuple[str, ...]
    conv_width: int
    # Scheduler: verified_tokens + draft_slots_plus batched-token slots reserved per sequence.
    draft_slots_plus: int
    # CUDA graphs: verified_tokens + graph_tokens_plus tokens per request, at most max_graph_sizes sizes.
    graph_tokens_plus: int
    max_graph_sizes: int
    # A max_cudagraph_capture_size other than 0 must hold this many requests' graph tokens (0: any size)
    # once cut down to the largest size of the grid at or under it: the grid is capture_grid_sizes, then
    # from each step's first size on, every step's-th size up to the next step's first.
    capture_min_requests: int
    capture_grid_sizes: tuple[int, ...]
    capture_grid_steps: tuple[tuple[int, int], ...]
    # KV cache: attention blocks are multiples of kv_block_multiple tokens; a request holds
    # verified_tokens + kv_state_slots_plus recurrent state slots per Gated DeltaNet group; the
    # convolution window holds conv width + verified_tokens + kv_conv_columns_plus columns; layer kinds
    # whose counts are within kv_group_merge_ratio of each other share the largest kind's group size.
    kv_block_multiple: int
    kv_state_slots_plus: int
    kv_conv_columns_plus: int
    kv_group_merge_ratio: float

    def draft_slots(self, verified_tokens: int) -> int:
        """Batched-token slots the scheduler reserves per sequence for drafting."""
        return verified_tokens + self.draft_slots_plus

    def graph_tokens(self, verified_tokens: int) -> int:
        """Tokens one request takes in a uniform verification batch."""
        return verified_tokens + self.graph_tokens_plus

    def capture_tokens(self, verified_tokens: int) -> int:
        """The graph tokens a max_cudagraph_capture_size other than 0 must hold once cut to the grid (0: none)."""
        return self.capture_min_requests * self.graph_tokens(verified_tokens)

    def min_capture_size(self, verified_tokens: int) -> int:
        """The smallest max_cudagraph_capture_size other than 0 the release starts with (0: any): the
        smallest grid size that holds capture_tokens."""
        need = self.capture_tokens(verified_tokens)
        return self.grid_at_or_above(need) if need else 0

    def _grid_spans(self) -> list[tuple[int, int, int | None]]:
        """Each step as (first size, step, first size of the next step or None)."""
        firsts = [first for first, _ in self.capture_grid_steps[1:]]
        return [
            (first, every, end) for (first, every), end in zip(self.capture_grid_steps, [*firsts, None], strict=True)
        ]

    def grid_at_or_under(self, size: int) -> int:
        """The largest grid size at or under ``size``, what the release cuts a cap of ``size`` down to (0: none)."""
        found = [s for s in self.capture_grid_sizes if s <= size]
        for first, every, end in self._grid_spans():
            top = size if end is None else min(size, end - 1)
            if top >= first:
                found.append(first + (top - first) // every * every)
        return max(found, default=0)

    def grid_at_or_above(self, size: int) -> int:
        """The smallest grid size at or above ``size`` (the last step has no end, so there is one)."""
        found = [s for s in self.capture_grid_sizes if s >= size]
        for first, every, end in self._grid_spans():
            point = first + max(-(-(size - first) // every), 0) * every
            if end is None or point < end:
                found.append(point)
        return min(found)

    def grid_words(self) -> str:
        """The grid in words: ``1, 2, 4, then every 8 from 8 and every 16 from 256``."""
        steps = " and ".join(f"every {every} from {first}" for first, every in self.capture_grid_steps)
        sizes = ", ".join(str(s) for s in self.capture_grid_sizes)
        return f"{sizes}, then {steps}" if sizes else steps

    def state_slots(self, verified_tokens: int) -> int:
        """Recurrent state slots one request holds in each Gated DeltaNet layer group."""
        return verified_tokens + self.kv_state_slots_plus

    def conv_columns(self, conv_width: int, verified_tokens: int) -> int:
        """Columns of one Gated DeltaNet layer's convolution window in a state slot."""
        return conv_width + verified_tokens + self.kv_conv_columns_plus

    def group_size(self, layer_counts: list[int]) -> int:
        """Layers per KV cache group, from each layer kind's count: the smallest, or the largest where
        that is under kv_group_merge_ratio times the smallest (less padding than more groups)."""
        smallest, largest = min(layer_counts), max(layer_counts)
        return largest if largest < smallest * self.kv_group_merge_ratio else smallest


def release_of(version: str) -> str:
    """The base a vLLM version runs on: ``0.20.1+cu130`` -> ``0.20.1``."""
    return str(version).split("+", 1)[0].strip()


def releases(home: str | Path) -> list[str]:
    """Every release with a descriptor under ``home`` (vllm-<release>/base.json), oldest first."""
    found = []
    for path in Path(home).glob(f"vllm-*/{DESCRIPTOR}"):
        release = path.parent.name.removeprefix("vllm-")
        if _RELEASE_RE.match(release):
            found.append(release)
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def descriptor_path(home: str | Path, release: str) -> Path:
    return Path(home) / f"vllm-{release_of(release)}" / DESCRIPTOR


def load(home: str | Path, release: str) -> dict[str, Any]:
    """The descriptor of ``release`` under ``home`` as JSON; BaseError naming the known bases when there is
    none, or the file when it is not a JSON object."""
    path = descriptor_path(home, release)
    if not path.is_file():
        known = ", ".join(releases(home)) or "none"
        raise NoBaseError(
            f"the DDTree engine has no base for vLLM {release_of(release)} ({path} does not exist; "
            f"bases: {known}); pick a release it has a base for, or add that base (ddtree/README.md)"
        )
    if path.stat().st_size > MAX_DESCRIPTOR_BYTES:
        raise BaseError(f"{path} is larger than {MAX_DESCRIPTOR_BYTES} bytes, so it is no base descriptor")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BaseError(f"{path} is not valid JSON ({exc}); fix the descriptor") from None
    if not isinstance(data, dict):
        raise BaseError(f"{path} holds {type(data).__name__}, not a JSON object; fix the descriptor")
    return data


def sole_release(home: str | Path) -> str:
    """The one base under ``home``; BaseError when there are none or several (then the caller must name one)."""
    found = releases(home)
    if len(found) != 1:
        raise BaseError(
            f"the DDTree engine in {home} has {len(found)} bases ({', '.join(found) or 'none'}): name the vLLM "
            "release (shared_settings_vllm_version) whose rules apply"
        )
    return found[0]


def _field(data: Mapping[str, Any], path: str, keys: str) -> Any:
    node: Any = data
    for key in keys.split("."):
        if not isinstance(node, Mapping) or key not in node:
            raise BaseError(f"{path} has no {keys}; add it (see ddtree/vllm-0.20.1/base.json for the layout)")
        node = node[key]
    return node


def _whole(data: Mapping[str, Any], path: str, keys: str, low: int, high: int) -> int:
    value = _field(data, path, keys)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BaseError(f"{path}: {keys} is {value!r}; it must be a whole number from {low} to {high}")
    return value


def _ratio(data: Mapping[str, Any], path: str, keys: str, low: float, high: float) -> float:
    value = _field(data, path, keys)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BaseError(f"{path}: {keys} is {value!r}; it must be a number from {low} to {high}")
    return float(value)


def _grid(data: Mapping[str, Any], path: str) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """cudagraphs.capture_size.grid: ascending sizes, then steps ({from, every}) whose first sizes ascend
    above them; the last step has no end, as vLLM's grid has none."""
    keys = "cudagraphs.capture_size.grid"
    sizes = _field(data, path, f"{keys}.sizes")
    steps = _field(data, path, f"{keys}.steps")

    def whole(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= MAX_GRID_SIZE

    if (
        not isinstance(sizes, list)
        or len(sizes) > MAX_GRID_SIZES
        or not all(whole(s) for s in sizes)
        or any(a >= b for a, b in pairwise(sizes))
    ):
        raise BaseError(
            f"{path}: {keys}.sizes is {sizes!r}; it must be a list of at most {MAX_GRID_SIZES} ascending whole "
            f"numbers from 1 to {MAX_GRID_SIZE}"
        )
    if (
        not isinstance(steps, list)
        or not 1 <= len(steps) <= MAX_GRID_SIZES
        or not all(isinstance(x, Mapping) and set(x) == {"from", "every"} for x in steps)
        or not all(whole(x["from"]) and whole(x["every"]) for x in steps)
    ):
        raise BaseError(
            f'{path}: {keys}.steps is {steps!r}; it must be a list of 1 to {MAX_GRID_SIZES} steps {{"from": first '
            f'size, "every": step}}, whole numbers from 1 to {MAX_GRID_SIZE}'
        )
    pairs = tuple((x["from"], x["every"]) for x in steps)
    firsts = [first for first, _ in pairs]
    if any(a >= b for a, b in pairwise(firsts)) or (sizes and firsts[0] <= sizes[-1]):
        raise BaseError(
            f"{path}: {keys}.steps start at {firsts}; each must start above the sizes and the step before it"
        )
    return tuple(sizes), pairs


def rules(data: Mapping[str, Any], path: str = DESCRIPTOR) -> BaseRules:
    """The rules of one descriptor, every field checked; BaseError names the file and the field."""
    if _field(data, path, "format") != FORMAT:
        raise BaseError(f"{path}: format is {data.get('format')!r}; this project reads format {FORMAT}")
    release = _field(data, path, "release")
    if not isinstance(release, str) or not _RELEASE_RE.match(release):
        raise BaseError(f"{path}: release is {release!r}; it must be a vLLM release number such as 0.20.1")
    layers = _field(data, path, "tree_state.layers")
    if not isinstance(layers, list) or not all(isinstance(k, str) and k for k in layers):
        raise BaseError(
            f"{path}: tree_state.layers is {layers!r}; it must be a list of layer kinds (config.json layer_types)"
        )
    min_requests = _whole(data, path, "cudagraphs.capture_size.min_requests", 0, MAX_OFFSET)
    grid_sizes, grid_steps = _grid(data, path)
    return BaseRules(
        release=release,
        tree_layers=tuple(layers),
        conv_width=_whole(data, path, "tree_state.conv_width", 1, MAX_CONV_WIDTH),
        draft_slots_plus=_whole(
            data, path, "scheduler.draft_slots_per_sequence.verified_tokens_plus", -MAX_OFFSET, MAX_OFFSET
        ),
        graph_tokens_plus=_whole(data, path, "cudagraphs.tokens_per_request.verified_tokens_plus", 1, MAX_OFFSET),
        max_graph_sizes=_whole(data, path, "cudagraphs.max_sizes", 1, MAX_GRAPH_SIZES),
        capture_min_requests=min_requests,
        capture_grid_sizes=grid_sizes,
        capture_grid_steps=grid_steps,
        kv_block_multiple=_whole(data, path, "kv_layout.block_tokens_multiple", 1, MAX_BLOCK_MULTIPLE),
        kv_state_slots_plus=_whole(data, path, "kv_layout.state_slots_per_request.verified_tokens_plus", 0, MAX_OFFSET),
        kv_conv_columns_plus=_whole(
            data, path, "kv_layout.conv_columns.width_plus_verified_tokens_plus", -MAX_OFFSET, MAX_OFFSET
        ),
        kv_group_merge_ratio=_ratio(data, path, "kv_layout.group_merge_ratio", 1, MAX_GROUP_MERGE_RATIO),
    )


def rules_for(home: str | Path | None, version: str | None) -> BaseRules | None:
    """Which base's rules apply to the deployed vLLM ``version``: its own base's, or None where the engine has
    no descriptor for that release. None is the answer, never another base: a rule the project knows only
    from a descriptor holds only for that release, so its checks are not run on another (the caller says
    so). Without a version, the sole base's (BaseError when there are none or several). A descriptor that
    exists but is not one is a BaseError, as in load_rules."""
    home = ENGINE_HOME if home in (None, "") else home
    if version in (None, ""):
        return load_rules(home)
    try:
        return load_rules(home, version)
    except NoBaseError:
        return None


def load_rules(home: str | Path | None = None, release: str | None = None) -> BaseRules:
    """The rules of ``release``'s base under ``home`` (ENGINE_HOME when None; the sole base when
    ``release`` is None)."""
    home = ENGINE_HOME if home in (None, "") else home
    release = release_of(release) if release not in (None, "") else sole_release(home)
    rules_ = rules(load(home, release), str(descriptor_path(home, release)))
    if rules_.release != release:
        raise BaseError(
            f"{descriptor_path(home, release)} says release {rules_.release}, not {release}; fix the descriptor"
        )
    return rules_
