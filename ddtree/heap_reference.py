"""Reference DDTree on the host: the paper's best-first heap in pure Python (test oracle, benchmark baseline).

The heap is the algorithm of arXiv 2604.12989 (reference repository liranringel/ddtree): start with
rank 0 at depth 1; each pop adds a node and pushes its next sibling (same parent, rank + 1) and its
first child (rank 0, depth + 1); stop after ``budget`` pops. Its key settles ties completely with
the order the device implementation documents: (score desc, depth asc, parent's pop index asc,
rank asc). Scores are float32 sums accumulated from the root, ``score(child) = score(parent) +
logprob``, so both sides add the same float32 numbers in the same order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


def f32(value: float) -> float:
    """Round to float32 (one rounding of an exact-in-double sum is the float32 sum)."""
    return float(np.float32(value))


def rank_tokens(logits_row: list[float]) -> list[int]:
    """Token ids by logit desc, then token id asc."""
    return sorted(range(len(logits_row)), key=lambda t: (-logits_row[t], t))


def ranked_logprobs(
    logits: list[list[float]], logp: list[list[float]], k: int
) -> tuple[list[list[float]], list[list[int]]]:
    """Per depth, the ``k`` best tokens in rank order and their log-probs (``logp[d][token]``, float32)."""
    ids = [rank_tokens(row)[:k] for row in logits]
    return [[logp[d][t] for t in row] for d, row in enumerate(ids)], ids


@dataclass
class HeapTree:
    """One request's tree, nodes in pop order."""

    tokens: list[int]
    depths: list[int]
    parents: list[int]
    scores: list[float]


def heap_tree(logp: list[list[float]], ids: list[list[int]], budget: int, *, exact: bool = True) -> HeapTree:
    """Best-first heap over ``logp[d][r]`` / ``ids[d][r]`` (depth ``d + 1``'s tokens in rank order).

    ``exact``: round every score to float32 as the device code does (the oracle). ``False`` adds in
    double precision like the reference repository (the benchmark baseline: same tree unless two
    prefixes' scores differ by about one float32 rounding).
    """
    num_depths, k = len(ids), len(ids[0])
    rnd = f32 if exact else float
    tree = HeapTree(tokens=[], depths=[], parents=[], scores=[])
    # (negated score, depth, parent node index (-1 = root), rank, score)
    heap: list[tuple[float, int, int, int, float]] = [(-logp[0][0], 1, -1, 0, logp[0][0])]
    while heap and len(tree.tokens) < budget:
        _, depth, parent, rank, score = heapq.heappop(heap)
        node = len(tree.tokens)
        tree.tokens.append(ids[depth - 1][rank])
        tree.depths.append(depth)
        tree.parents.append(parent)
        tree.scores.append(score)
        if rank + 1 < k:
            base = tree.scores[parent] if parent >= 0 else 0.0
            sibling = rnd(base + logp[depth - 1][rank + 1])
            heapq.heappush(heap, (-sibling, depth, parent, rank + 1, sibling))
        if depth < num_depths:
            child = rnd(score + logp[depth][0])
            heapq.heappush(heap, (-child, depth + 1, node, 0, child))
    return tree


def visibility(parents: list[int]) -> list[list[bool]]:
    """Ancestor-only mask over ``[root] + nodes``, row by row as the reference builds it."""
    n = len(parents) + 1
    vis = [[False] * n for _ in range(n)]
    vis[0][0] = True
    for index in range(1, n):
        parent = parents[index - 1] + 1
        vis[index][:index] = vis[parent][:index]
        vis[index][index] = True
    return vis


def visibility_np(parents: list[int]) -> np.ndarray:
    """The same mask as a numpy array, built as the reference repository builds it."""
    n = len(parents) + 1
    vis = np.zeros((n, n), dtype=np.bool_)
    vis[0, 0] = True
    for index in range(1, n):
        parent = parents[index - 1] + 1
        vis[index, :index] = vis[parent, :index]
        vis[index, index] = True
    return vis


def child_maps(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    """For each entry of ``[root] + nodes``: token -> child entry."""
    maps: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        maps[parent + 1][token] = node + 1
    return maps


def walk(maps: list[dict[int, int]], target: list[int]) -> tuple[list[int], int]:
    """The reference walk: accepted node indices (0-based, root excluded) and the bonus token."""
    accepted: list[int] = []
    entry = 0
    while target[entry] in maps[entry]:
        entry = maps[entry][target[entry]]
        accepted.append(entry - 1)
    return accepted, target[entry]
