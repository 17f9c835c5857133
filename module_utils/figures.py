"""Numbers from outside (an engine's answer, a record on the node, a model's config.json) checked where they are read.

A figure that is not finite and positive (a tokens/s of Infinity from a completion_tokens of 8e306,
a NaN, a 0.0 from a stream that generated nothing) is refused with a sentence, never stored or
reported as a number (issue 43, classes 1 and 3); a count is a whole number in a range before any
arithmetic is done with it, so an integer of 400 digits is "not a count", not a crash in float().
A field of a node's file (config.json, a weight index) is validated for type, finiteness, sign and
range before it is used, and the refusal names the file and the field (class 6).

Standard library only (runs on managed nodes and in controller plugins).
"""

from __future__ import annotations

import math
from typing import Any

# No completion, and no sum of a run's completions, holds more tokens than this: far beyond any
# model's context, far below where a float loses whole numbers (2**53).
MAX_TOKENS = 10**12


class FigureError(ValueError):
    """A number read from outside is not what it must be; the message names it and says why."""


def _shown(value: Any) -> str:
    """``value`` as a message shows it, without converting a huge integer to text in full."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        # Counted where str() can (up to 4300 digits), else estimated from the bit length.
        if value.bit_length() <= 14000:
            digits = len(str(abs(value)))
            return f"{'-' if value < 0 else ''}an integer of {digits} digits"
        return f"{'-' if value < 0 else ''}an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (True is an int to Python, not a figure to anyone)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive_figure(value: Any) -> float | None:
    """``value`` as a float when it is a finite number above zero, else None (the caller says why)."""
    if not is_number(value):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) and number > 0 else None


def figure_problem(value: Any, what: str) -> str | None:
    """One sentence when ``value`` is not a finite figure above zero, None when it is."""
    if positive_figure(value) is not None:
        return None
    if value is None:
        return f"{what} is missing"
    if not is_number(value):
        return f"{what} is {_shown(value)}, not a number"
    return f"{what} is {_shown(value)}, not a finite figure above zero"


def require_positive(value: Any, what: str) -> float:
    """``value`` as a finite float above zero, or FigureError naming ``what``."""
    number = positive_figure(value)
    if number is None:
        raise FigureError(figure_problem(value, what) or what)
    return number


def token_count(value: Any, what: str, limit: int = MAX_TOKENS) -> int:
    """A count of tokens the server reports: a whole number from 0 to ``limit``, else FigureError.

    A JSON number such as 5.0 counts (it is whole); 1e308, an integer of 400 digits, -1, 2.5 or "12"
    do not. Nothing is converted to float before the range check, so nothing overflows.
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and 0 <= value <= limit:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise FigureError(f"{what} is {_shown(value)}, not a count of tokens (a whole number from 0 to {limit})")
    return value


def whole_field(value: Any, where: str, low: int, high: int) -> int:
    """A field of a node's file that must be a whole number from ``low`` to ``high``, else FigureError.

    ``where`` names the file and the field ("/opt/m/config.json: text_config.linear_num_key_heads").
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FigureError(f"{where} is {_shown(value)}, not a whole number")
    if not low <= value <= high:
        raise FigureError(f"{where} is {_shown(value)}, outside {low} to {high}")
    return value


def finite_field(value: Any, where: str, low: float, high: float) -> float:
    """A field of a node's file that must be a finite number from ``low`` to ``high``, else FigureError."""
    if not is_number(value):
        raise FigureError(f"{where} is {_shown(value)}, not a number")
    try:
        number = float(value)
    except OverflowError:
        raise FigureError(f"{where} is {_shown(value)}, outside {low:g} to {high:g}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise FigureError(f"{where} is {_shown(value)}, outside {low:g} to {high:g}")
    return number
