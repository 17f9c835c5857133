"""Acceptance from an engine's per-step output, and the two-sample test of sampled tokens."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence

MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per cell: rarer tokens are pooled


def acceptance(steps: Sequence[Sequence[int]], max_tokens: int, depth: int) -> dict:
    """Mean acceptance length and per-depth acceptance from each request's new tokens per step.

    A request's first entry is its prefill's token; every later entry is one verification step's
    accepted nodes plus its bonus token. The last step is left out (max_tokens may have cut it)."""
    lengths = [s for req in steps for s in list(req[1:])[:-1]]
    if not lengths:
        return {"steps": 0, "mean_acceptance_length": None, "accepted_at_depth": None}
    return {
        "steps": len(lengths),
        "mean_acceptance_length": round(sum(lengths) / len(lengths), 4),
        # the share of steps that accepted at least j draft tokens (j = 1 .. depth)
        "accepted_at_depth": [round(sum(n - 1 >= j for n in lengths) / len(lengths), 4) for j in range(1, depth + 1)],
        "max_tokens": max_tokens,
    }


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, stat/2)."""
    if df <= 0:
        return 1.0
    import torch

    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def table_statistic(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's chi-square homogeneity statistic of two samples' category counts and its degrees of
    freedom; categories whose expected count is under MIN_EXPECTED in either sample are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    n = na + nb
    cells: list[tuple[int, int]] = []
    pooled = [0, 0]
    for key in sorted(set(a) | set(b)):
        ca, cb = a.get(key, 0), b.get(key, 0)
        total = ca + cb
        if min(total * na / n, total * nb / n) < MIN_EXPECTED:
            pooled[0] += ca
            pooled[1] += cb
        else:
            cells.append((ca, cb))
    if sum(pooled):
        cells.append((pooled[0], pooled[1]))
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        for observed, size in ((ca, na), (cb, nb)):
            expected = total * size / n
            if expected > 0:
                stat += (observed - expected) ** 2 / expected
    return stat, max(0, len(cells) - 1)


def homogeneity(
    a: Sequence[Sequence[Sequence[int]]], b: Sequence[Sequence[Sequence[int]]], exclude: Collection[int] = ()
) -> dict:
    """Per token position, whether two samplers drew from the same distribution: a chi-square
    homogeneity test per fixed prefix, summed over the prefixes (statistics and degrees of freedom
    add) but those in ``exclude``, whose own p-values are still given. ``a[k][s]`` is sample s of
    prefix k, a list of tokens."""
    positions = min(len(s) for group in (*a, *b) for s in group)
    out = []
    by_prefix: list[list[float]] = [[] for _ in a]
    for i in range(positions):
        stat, df = 0.0, 0
        for k, (sa, sb) in enumerate(zip(a, b, strict=True)):
            st, d = table_statistic(Counter(s[i] for s in sa), Counter(s[i] for s in sb))
            if k not in exclude:
                stat, df = stat + st, df + d
            by_prefix[k].append(round(chi2_sf(st, d), 4))
        out.append({"position": i + 1, "chi2": round(stat, 2), "df": df, "p": chi2_sf(stat, df)})
    return {
        "samples": [len(g) for g in b],
        "by_position": out,
        # Each prefix's own p per position: which prefix a summed failure comes from.
        "p_by_prefix": by_prefix,
        "excluded": sorted(k for k in exclude if 0 <= k < len(a)),
        "min_p": min(x["p"] for x in out) if out else None,
        "log10_min_p": round(math.log10(max(min(x["p"] for x in out), 1e-300)), 2) if out else None,
    }


def kept_tokens(logits: Sequence[float], temperature: float, top_k: int, top_p: float) -> tuple[frozenset[int], float]:
    """The tokens vLLM's sampler may draw, and how close that set is to changing.

    vLLM keeps the top-k logits (ties at the k-th kept), then, over their renormalised probabilities
    in descending order, each token whose predecessors sum to less than top_p (it drops a token when
    its ascending cumulative sum is at most 1 - top_p). The margin is the smallest distance, in
    probability, between top_p and any such sum: under it, rounding of the logits (two attention
    backends, two batch shapes) decides whether a token is drawn at all, and a two-sample test of
    that prefix measures the rounding, not the sampler. (The margin covers the top-p cut, not the
    top-k boundary.)"""
    import torch

    x = torch.tensor(logits, dtype=torch.float64) / temperature
    if 0 < top_k < x.numel():
        x = torch.where(x >= x.topk(top_k).values[-1], x, torch.tensor(-math.inf, dtype=torch.float64))
    probs, order = x.softmax(-1).sort(descending=True)
    before = probs.cumsum(0) - probs
    live = probs > 0
    kept = frozenset(int(t) for t, b, q in zip(order, before, probs, strict=True) if q > 0 and b < top_p)
    margin = float((before[live] - top_p).abs().min()) if top_p < 1 else math.inf
    return kept | {int(order[0])}, margin


def near_tie_prefix(
    logits: Sequence[float], temperature: float, top_k: int, top_p: float, move: Callable[[float], float]
) -> dict | None:
    """Whether a prefix's first-token kept set (``kept_tokens``) is within rounding of changing: the
    first of its top-k logits that, moved up or down by ``move(logit)`` (rounding's reach at that
    logit: one step of the engine's dtype at its size, or what the target's own configurations were
    measured to move), changes the set, as {token, shift, kept}; None where no such move changes it.
    There the two-sample test of that prefix measures rounding, not the sampler."""
    if top_p >= 1 and not 0 < top_k < len(logits):
        return None  # no cut: every token is kept whatever the logits
    kept = kept_tokens(logits, temperature, top_k, top_p)[0]
    ranked = sorted(range(len(logits)), key=lambda t: -logits[t])[: top_k if top_k > 0 else len(logits)]
    for t in ranked:
        for sign in (1, -1):
            shift = sign * move(logits[t])
            moved = [*logits[:t], logits[t] + shift, *logits[t + 1 :]]
            other = kept_tokens(moved, temperature, top_k, top_p)[0]
            if other != kept:
                return {"token": t, "shift": shift, "kept": sorted(kept), "kept_moved": sorted(other)}
    return None
