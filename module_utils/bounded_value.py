"""Values from the inventory measured with bounded work before any text is built from them (issue 43, class 5).

YAML aliases let ten lines describe a list of 9**9 elements (each level nine references to the one
before: a few dozen objects, a billion elements once walked). ``repr`` or ``json.dumps`` of such a
value walks every element, so a check that shows "what the inventory gives" hung for minutes before
it could cut the text. Here a walk stops as soon as it has seen ``max_elements`` elements or gone
``max_depth`` levels deep, and ``bounded_repr`` writes at most ``limit`` characters, whatever the value.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# No setting of any role holds more than this many elements (lists, their items, mappings' keys and values).
MAX_ELEMENTS = 10_000
MAX_DEPTH = 32


@dataclass(frozen=True)
class Size:
    """What a bounded walk saw: elements counted (at most the bound + 1) and whether it stopped early."""

    elements: int
    depth: int
    too_large: bool
    too_deep: bool

    @property
    def refused(self) -> bool:
        return self.too_large or self.too_deep


def _children(value: Any) -> list[Any] | None:
    if isinstance(value, str | bytes):
        return None
    if isinstance(value, Mapping):
        items: list[Any] = []
        for k, v in value.items():
            items.extend((k, v))
            if len(items) > MAX_ELEMENTS:  # a mapping's own width is bounded too
                break
        return items
    if isinstance(value, list | tuple | set | frozenset):
        return list(value) if len(value) <= MAX_ELEMENTS else list(value)[: MAX_ELEMENTS + 1]
    return None


def measure(value: Any, max_elements: int = MAX_ELEMENTS, max_depth: int = MAX_DEPTH) -> Size:
    """Count ``value``'s elements and depth, stopping past ``max_elements`` or ``max_depth``.

    Shared references are counted each time they are reached (that is what an alias bomb expands
    into), so the work is bounded by ``max_elements``, not by the value.
    """
    count = 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > max_depth:
            return Size(count, deepest, False, True)
        children = _children(item)
        if children is None:
            continue
        count += len(children)
        if count > max_elements:
            return Size(count, deepest, True, False)
        stack.extend((child, depth + 1) for child in children)
    return Size(count, deepest, False, False)


def _scalar(value: Any, room: int) -> str:
    if isinstance(value, str):
        return repr(str(value[: max(room, 0) + 1]))
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 200:  # repr of an int past 4300 digits raises; long ones say what they are
            return "<int too long to show>"
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value))
    text = f"<{type(value).__name__}>"
    return text


def bounded_repr(value: Any, limit: int) -> str:
    """A repr-like text of ``value`` of at most ``limit`` characters (then ending in "..."), built piece by
    piece: no more of the value is visited than the text can show."""
    out: list[str] = []
    size = 0
    # A stack of pieces still to write: a value, or a literal string (brackets and separators).
    stack: list[tuple[bool, Any]] = [(False, value)]
    while stack and size <= limit:
        literal, item = stack.pop()
        if literal:
            piece = item
        elif isinstance(item, Mapping):
            pieces: list[tuple[bool, Any]] = [(True, "{")]
            for i, (k, v) in enumerate(item.items()):
                if i:
                    pieces.append((True, ", "))
                pieces.extend(((False, k), (True, ": "), (False, v)))
                if len(pieces) > limit:
                    break
            pieces.append((True, "}"))
            stack.extend(reversed(pieces))
            continue
        elif isinstance(item, list | tuple):
            pieces = [(True, "[")]
            for i, v in enumerate(item):
                if i:
                    pieces.append((True, ", "))
                pieces.append((False, v))
                if len(pieces) > limit:
                    break
            pieces.append((True, "]"))
            stack.extend(reversed(pieces))
            continue
        else:
            piece = _scalar(item, limit - size)
        out.append(piece)
        size += len(piece)
    text = "".join(out)
    if stack or len(text) > limit:
        return text[: max(limit - 3, 0)] + "..."
    return text
