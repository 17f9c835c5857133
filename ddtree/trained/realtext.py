"""Whether a greedy output is real text: identity on a two-token loop proves nothing.

An output of 128 tokens is real text when it holds at least 24 distinct tokens and no stretch of
``LOOP_SPAN`` consecutive tokens repeats with a period of 4 or less (``21 59 21 59 ...`` has period
2). Shorter outputs need proportionally fewer distinct tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_DISTINCT_PER_128 = 24
MAX_LOOP_PERIOD = 4
LOOP_SPAN = 32


def shortest_loop(tokens: Sequence[int], span: int = LOOP_SPAN, max_period: int = MAX_LOOP_PERIOD) -> int | None:
    """The smallest period p <= max_period of any ``span`` consecutive tokens, else None."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        run = 0  # consecutive i with tokens[i] == tokens[i - p]
        for i in range(p, n):
            run = run + 1 if tokens[i] == tokens[i - p] else 0
            if run + p >= span:
                return p
    return None


def degenerate(tokens: Sequence[int]) -> str | None:
    """None for real text, else why not (in words)."""
    if not tokens:
        return "no tokens"
    need = -(-MIN_DISTINCT_PER_128 * len(tokens) // 128)
    distinct = len(set(tokens))
    if distinct < need:
        return f"{distinct} distinct tokens in {len(tokens)} (at least {need} needed)"
    period = shortest_loop(tokens)
    if period is not None:
        return f"loops with period {period} over {LOOP_SPAN} tokens"
    return None
