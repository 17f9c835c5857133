"""Triton kernels for one DDTree step: the tree build and the walk in five kernel launches.

``ddtree_tree.build_trees`` / ``walk_trees`` define the result (see that module's docstring for
the order of nodes and the tie rules); on CUDA they call the kernels here, which compute the same
trees with a handful of launches instead of about a hundred small torch operators. On a GPU the
launches, not the arithmetic, were the cost of a step.

How ties stay exact: every comparison is made on one int64 key, the float32 value's bits mapped
to an order-preserving signed integer in the high half and ``2**32 - 1 - index`` in the low half,
so that sorting keys in descending order sorts by value descending, then by index ascending:
the order of a stable descending sort, which the torch code uses.

Kernels, in launch order:

1. ``_chunk_top_keys``: per (row, chunk of the vocabulary) the top ``K2`` keys of (logit, token
   id), and the chunk's max and sum of exponentials for the row's logsumexp;
2. ``_merge_top_keys`` (only when one row has too many chunk keys for one program): merges
   groups of chunks' keys;
3. ``_rank_rows``: per row the top ``k`` token ids in rank order and their log-probabilities
   (logit minus the row's logsumexp, float32);
4. ``_expand``: per request the best-first tree: per depth the kept prefixes (stable top of the
   candidate (parent, rank) pairs), then the global order over all depths; writes tokens,
   depths, parents, scores and position offsets;
5. ``_ancestors``: the ancestor-or-self mask over ``[root] + nodes``.

The walk is one kernel, ``_walk``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Keys one program ranks at once; more keys per row are merged over several launches.
_MERGE_KEYS = 4096
# Vocabulary elements per program of the first kernel.
CHUNK = 2048


@triton.jit
def _key(value, index):
    """int64 key ordering (float32 value desc, int64 index asc) under a descending sort."""
    value = value + 0.0  # -0.0 -> +0.0: equal values must give equal keys
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (tl.full((), 4294967295, tl.int64) - index)


@triton.jit
def _key_index(key):
    high = key >> 32
    return tl.full((), 4294967295, tl.int64) - (key - (high << 32))


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _chunk_top_keys(logits, vocab, n_chunks, keys, stats, CHUNK: tl.constexpr, K2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    valid = ids < vocab
    x = tl.load(logits + row * vocab + ids, mask=valid, other=float("-inf")).to(tl.float32)
    key = tl.where(valid, _key(x, ids), -9223372036854775808)
    slot = (row * n_chunks + chunk) * K2 + tl.arange(0, K2)
    tl.store(keys + slot, tl.topk(key, K2))
    top = tl.max(x, 0)
    total = tl.sum(tl.where(valid, tl.exp(x - top), 0.0), 0)
    total = tl.where(top == float("-inf"), 0.0, total)
    tl.store(stats + (row * n_chunks + chunk) * 2, top)
    tl.store(stats + (row * n_chunks + chunk) * 2 + 1, total)


@triton.jit
def _merge_top_keys(keys_in, n_in, keys_out, n_out, GROUP: tl.constexpr, K2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    j = tl.arange(0, GROUP * K2)
    src = group * GROUP + j // K2
    key = tl.load(keys_in + (row * n_in + src) * K2 + j % K2, mask=src < n_in, other=-9223372036854775808)
    tl.store(keys_out + (row * n_out + group) * K2 + tl.arange(0, K2), tl.topk(key, K2))


@triton.jit
def _rank_rows(
    keys,
    n_in,
    stats,
    n_chunks,
    logits,
    vocab,
    ids_out,
    logp_out,
    k,
    GROUP: tl.constexpr,
    K2: tl.constexpr,
    CHUNKS2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, GROUP * K2)
    key = tl.load(keys + (row * n_in + j // K2) * K2 + j % K2, mask=j // K2 < n_in, other=-9223372036854775808)
    top = tl.topk(key, K2)
    ids = _key_index(top)
    c = tl.arange(0, CHUNKS2)
    chunk_max = tl.load(stats + (row * n_chunks + c) * 2, mask=c < n_chunks, other=float("-inf"))
    chunk_sum = tl.load(stats + (row * n_chunks + c) * 2 + 1, mask=c < n_chunks, other=0.0)
    top_max = tl.max(chunk_max, 0)
    scaled = tl.where(chunk_max == float("-inf"), 0.0, chunk_sum * tl.exp(chunk_max - top_max))
    lse = top_max + tl.log(tl.sum(scaled, 0))
    slot = tl.arange(0, K2)
    keep = slot < k
    tl.store(ids_out + row * k + slot, ids, mask=keep)
    tl.store(logp_out + row * k + slot, _key_value(top) - lse, mask=keep)


@triton.jit
def _expand(
    ids,
    logp,
    codes,
    sizes,
    level_score,
    level_pos,
    node_of_entry,
    tokens_out,
    depth_out,
    parent_out,
    score_out,
    offsets_out,
    D: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    N2: tl.constexpr,
    P2: tl.constexpr,
    E2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N2)
    # Depth 1 keeps its top K tokens, in rank order.
    first = tl.load(logp + b * D * K + j, mask=j < K, other=float("-inf"))
    tl.store(level_score + b * D * N2 + j, first)
    tl.store(level_pos + b * D * N2 + j, j.to(tl.int32))
    p = tl.arange(0, P2)
    for d in range(1, D):
        tl.debug_barrier()  # the previous depth's stores are read below
        code = tl.load(codes + d * P2 + p).to(tl.int64)
        valid = code >= 0
        parent_pos = code // K
        rank = code % K
        prev = tl.load(level_score + (b * D + d - 1) * N2 + parent_pos, mask=valid, other=0.0)
        step = tl.load(logp + (b * D + d) * K + rank, mask=valid, other=0.0)
        key = tl.where(valid, _key(prev + step, p), -9223372036854775808)
        top = tl.topk(key, N2)
        tl.store(level_score + (b * D + d) * N2 + j, _key_value(top))
        tl.store(level_pos + (b * D + d) * N2 + j, _key_index(top).to(tl.int32))
    tl.debug_barrier()
    # Global order: the depths' lists concatenated depth by depth; ties by that index.
    e = tl.arange(0, E2)
    e_depth = e // N2
    size = tl.load(sizes + e_depth, mask=e_depth < D, other=0)
    kept = (e_depth < D) & (e % N2 < size)
    score = tl.load(level_score + b * D * N2 + e, mask=kept, other=0.0)
    top = tl.topk(tl.where(kept, _key(score, e.to(tl.int64)), -9223372036854775808), N2)
    n = j
    live = n < N
    entry = _key_index(top)
    depth = entry // N2
    pos = tl.load(level_pos + b * D * N2 + entry, mask=live, other=0).to(tl.int64)
    code = tl.where(depth == 0, pos, tl.load(codes + depth * P2 + pos, mask=live & (depth > 0), other=0))
    rank = code % K
    token = tl.load(ids + (b * D + depth) * K + rank, mask=live, other=0)
    tl.store(node_of_entry + b * D * N2 + entry, n.to(tl.int32), mask=live)
    tl.debug_barrier()
    parent_entry = (depth - 1) * N2 + code // K
    parent = tl.load(node_of_entry + b * D * N2 + parent_entry, mask=live & (depth > 0), other=-1)
    parent = tl.where(depth == 0, -1, parent.to(tl.int64))
    tl.store(tokens_out + b * N + n, token, mask=live)
    tl.store(depth_out + b * N + n, depth + 1, mask=live)
    tl.store(parent_out + b * N + n, parent, mask=live)
    tl.store(score_out + b * N + n, _key_value(top), mask=live)
    tl.store(offsets_out + b * (N + 1) + 1 + n, depth + 1, mask=live)
    tl.store(offsets_out + b * (N + 1), 0)


@triton.jit
def _ancestors(parent, mask_out, D: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr, N1P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, N1P).to(tl.int64)
    live = rows < N + 1
    node = rows - 1  # -1: the root's row
    seen = cols[None, :] == rows[:, None]
    for _ in range(D):
        up = node >= 0
        node = tl.where(up, tl.load(parent + b * N + node, mask=live & up, other=-1), -1)
        seen = seen | (cols[None, :] == (node + 1)[:, None])
    out = mask_out + b * (N + 1) * (N + 1) + rows[:, None] * (N + 1) + cols[None, :]
    tl.store(out, seen, mask=live[:, None] & (cols[None, :] < N + 1))


@triton.jit
def _walk(
    tokens,
    parent,
    depth,
    targets,
    mismatch,
    accepted_out,
    count_out,
    bonus_out,
    D: tl.constexpr,
    N: tl.constexpr,
    N2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, N2).to(tl.int64)
    live = n < N
    token = tl.load(tokens + b * N + n, mask=live, other=0)
    up = tl.load(parent + b * N + n, mask=live, other=-1)
    chosen = tl.load(targets + b * (N + 1) + up + 1, mask=live, other=0)
    wrong = live & (token != chosen.to(tl.int64))
    tl.store(mismatch + b * N + n, wrong.to(tl.int8), mask=live)
    tl.debug_barrier()
    ok = live & (wrong == 0)
    for _ in range(D - 1):
        has = up >= 0
        bad = tl.load(mismatch + b * N + up, mask=live & has, other=0)
        ok = ok & ((bad == 0) | ~has)
        up = tl.where(has, tl.load(parent + b * N + up, mask=live & has, other=-1), -1)
    level = tl.load(depth + b * N + n, mask=live, other=0)
    for t in range(D):
        tl.store(accepted_out + b * D + t, tl.max(tl.where(ok & (level == t + 1), n, -1), 0))
    tl.store(count_out + b, tl.sum(ok.to(tl.int64), 0))
    last = tl.max(tl.where(ok, n + 1, 0), 0)
    tl.store(bonus_out + b, tl.load(targets + b * (N + 1) + last))


def _pow2(n: int) -> int:
    """The next power of two, at least 2 (Triton's top-k needs a power of two above 1)."""
    return 1 << max(1, math.ceil(math.log2(max(n, 1))))


@dataclass(frozen=True)
class ExpandPlan:
    """Sizes and the candidate table of one (depth, vocab, budget), on the device."""

    k: int
    codes: torch.Tensor  # [D, P2] int32: per depth the candidate (parent position * k + rank), -1 pad
    sizes: torch.Tensor  # [D] int32: prefixes kept per depth
    p2: int


def expand_plan(num_depths: int, k: int, budget: int, pair_codes, device: torch.device) -> ExpandPlan:
    """Candidate tables: the pairs that can reach each depth's top ``budget`` (``pair_codes``)."""
    sizes, tables = [k], [list(range(k))]
    for _ in range(1, num_depths):
        n_prev = sizes[-1]
        tables.append(pair_codes(n_prev, k, budget))
        sizes.append(min(budget, n_prev * k))
    p2 = _pow2(max(max(len(t) for t in tables), budget))
    codes = torch.full((num_depths, p2), -1, dtype=torch.int32)
    for d, table in enumerate(tables):
        codes[d, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return ExpandPlan(k=k, codes=codes.to(device), sizes=torch.tensor(sizes, dtype=torch.int32).to(device), p2=p2)


def ranked_logprobs(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` token ids per row of ``[R, V]`` by (logit desc, id asc), and their float32 log-probs."""
    rows = rows.contiguous()
    num_rows, vocab = rows.shape
    k2 = _pow2(k)
    chunk = max(CHUNK, k2)
    n_chunks = triton.cdiv(vocab, chunk)
    device = rows.device
    keys = torch.empty(num_rows, n_chunks, k2, dtype=torch.int64, device=device)
    stats = torch.empty(num_rows, n_chunks, 2, dtype=torch.float32, device=device)
    _chunk_top_keys[(num_rows, n_chunks)](rows, vocab, n_chunks, keys, stats, CHUNK=chunk, K2=k2)
    group = max(_MERGE_KEYS, 2 * k2) // k2
    n_in = n_chunks
    while n_in > group:
        n_out = triton.cdiv(n_in, group)
        merged = torch.empty(num_rows, n_out, k2, dtype=torch.int64, device=device)
        _merge_top_keys[(num_rows, n_out)](keys, n_in, merged, n_out, GROUP=group, K2=k2)
        keys, n_in = merged, n_out
    ids = torch.empty(num_rows, k, dtype=torch.int64, device=device)
    logp = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    _rank_rows[(num_rows,)](
        keys, n_in, stats, n_chunks, rows, vocab, ids, logp, k, GROUP=_pow2(n_in), K2=k2, CHUNKS2=_pow2(n_chunks)
    )
    return ids, logp


def build(draft_logits: torch.Tensor, budget: int, plan: ExpandPlan) -> tuple[torch.Tensor, ...]:
    """Tokens, depth, parent, scores, ancestor mask and position offsets of the batch's trees."""
    batch, num_depths, vocab = draft_logits.shape
    k = plan.k
    ids, logp = ranked_logprobs(draft_logits.reshape(batch * num_depths, vocab), k)
    device = draft_logits.device
    n2 = _pow2(budget)
    e2 = _pow2(num_depths * n2)

    def empty(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    level_score = empty(batch, num_depths, n2, dtype=torch.float32)
    level_pos = empty(batch, num_depths, n2, dtype=torch.int32)
    node_of_entry = empty(batch, num_depths * n2, dtype=torch.int32)
    tokens, depth, parent = empty(batch, budget), empty(batch, budget), empty(batch, budget)
    scores = empty(batch, budget, dtype=torch.float32)
    offsets = empty(batch, budget + 1)
    _expand[(batch,)](
        ids,
        logp,
        plan.codes,
        plan.sizes,
        level_score,
        level_pos,
        node_of_entry,
        tokens,
        depth,
        parent,
        scores,
        offsets,
        D=num_depths,
        K=k,
        N=budget,
        N2=n2,
        P2=plan.p2,
        E2=e2,
        num_warps=8 if plan.p2 >= 1024 else 4,
    )
    mask = empty(batch, budget + 1, budget + 1, dtype=torch.bool)
    rows = 16
    _ancestors[(batch, triton.cdiv(budget + 1, rows))](
        parent, mask, D=num_depths, N=budget, ROWS=rows, N1P=_pow2(budget + 1)
    )
    return tokens, depth, parent, scores, mask, offsets


def walk(
    tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, num_depths: int, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted node per depth (-1 past the end), number accepted, bonus token, per request."""
    batch, budget = tokens.shape
    device = tokens.device
    targets = targets.contiguous()
    mismatch = torch.empty(batch, budget, dtype=torch.int8, device=device)
    accepted = torch.empty(batch, num_depths, dtype=torch.int64, device=device)
    count = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=targets.dtype, device=device)
    _walk[(batch,)](
        tokens, parent, depth, targets, mismatch, accepted, count, bonus, D=num_depths, N=budget, N2=_pow2(budget)
    )
    return accepted, count, bonus
