"""Triton kernels for one DDTree step: the tree build in six launches and the walk in one, no host sync.

``ddtree_tree.build_trees`` / ``walk_trees`` define the result (see that module's docstring for
the order of nodes and the tie rules); on CUDA they call the kernels here, which compute the same
trees with a few launches instead of about a hundred small torch operators. On a GPU the
launches, and then ranking the whole vocabulary, were the cost of a step.

How ties stay exact: every comparison is made on one int64 key, the float32 value's bits mapped
to an order-preserving signed integer in the high half and ``2**32 - 1 - index`` in the low half,
so that sorting keys in descending order sorts by value descending, then by index ascending:
the order of a stable descending sort, which the torch code uses.

Kernels, in launch order:

1. ``_chunk_stats``: per (row, chunk of the vocabulary) the max and the sum of exponentials;
2. ``_row_threshold``: per row the logsumexp and the k-th largest chunk max, a lower bound of
   the row's k-th largest logit;
3. ``_gather_candidates``: per (row, chunk) appends the keys of the logits at or above it,
   reading only the chunks whose max reaches it (about k of the row's);
4. ``_rank_rows``: per row the top k token ids in rank order and their log-probabilities (logit
   minus the row's logsumexp, float32); a row with more candidates than fit (a pathological
   distribution, such as equal logits) is ranked whole, exactly, by its program;
5. ``_expand``: per request the best-first tree: per depth the kept prefixes (stable top of the
   candidate (parent, rank) pairs), merged into the running global order of the first ``budget``
   as it goes, stopping at the first depth that cannot reach them; writes tokens, depths,
   parents, scores and position offsets. Only candidates at or above a lower bound of the
   depth's N-th best score and at or above the running N-th best overall are ranked
   (``_top_into``), so a deep, narrow tree ranks a few keys per depth;
6. ``_ancestors``: the ancestor-or-self mask over ``[root] + nodes``.

The walk is one kernel, ``_walk``: mismatches propagated down the paths by pointer jumping.

On Hopper and later GPUs every kernel is launched with programmatic dependent launch
(``_wait_for_inputs``): the next kernel's launch overlaps the previous one's work, and its
programs start by waiting for that work to finish, so the order of effects is the stream's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Largest chunk of the vocabulary whose max and sum of exponentials one program computes.
STATS_CHUNK = 2048
# Most candidates kept per row (a power of two): 8 x k rounded up, at least 256, at most this.
# Rows with more are ranked whole by the fallback. Ranking the kept ones costs with their number.
CANDIDATES = 4096
# Vocabulary elements the fallback ranks at once.
CHUNK = 2048
# The smallest int64: the key of no element, after every real key in a descending sort.
NO_KEY = tl.constexpr(-(2**63))


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
def _score_at(keys, i):
    """The score of ``keys[i]``, -inf for NO_KEY."""
    key = tl.max(tl.where(tl.arange(0, keys.shape[0]) == i, keys, NO_KEY), 0)
    return tl.where(key == NO_KEY, float("-inf"), _key_value(key))


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    """Every kernel's first step. With programmatic dependent launch (``PDL``, on Hopper and
    later) a kernel is launched while the one before it still runs, so that its launch overlaps
    that work instead of following it: its programs wait here until the kernel before has
    finished and its writes are visible (as without PDL), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _chunk_stats(logits, vocab, n_chunks, stats, count, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Per (row, chunk): max and sum of exp(x - max), for the threshold and the logsumexp."""
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    valid = ids < vocab
    x = tl.load(logits + row * vocab + ids, mask=valid, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    total = tl.sum(tl.where(valid, tl.exp(x - top), 0.0), 0)
    total = tl.where(top == float("-inf"), 0.0, total)
    tl.store(stats + (row * n_chunks + chunk) * 2, top)
    tl.store(stats + (row * n_chunks + chunk) * 2 + 1, total)
    if chunk == 0:
        tl.store(count + row, 0)  # the candidate counter of this step


@triton.jit
def _row_threshold(stats, n_chunks, threshold, lse_out, k, K2: tl.constexpr, CHUNKS2: tl.constexpr, PDL: tl.constexpr):
    """Per row: the k-th largest chunk max (k distinct elements reach it, so the row's k-th largest
    value is at least this), or -inf with fewer than k chunks; and the row's logsumexp."""
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS2)
    chunk_max = tl.load(stats + (row * n_chunks + c) * 2, mask=c < n_chunks, other=float("-inf"))
    chunk_sum = tl.load(stats + (row * n_chunks + c) * 2 + 1, mask=c < n_chunks, other=0.0)
    top_max = tl.max(chunk_max, 0)
    scaled = tl.where(chunk_max == float("-inf"), 0.0, chunk_sum * tl.exp(chunk_max - top_max))
    tl.store(lse_out + row, top_max + tl.log(tl.sum(scaled, 0)))
    best = tl.topk(chunk_max, K2)
    kth = tl.max(tl.where(tl.arange(0, K2) == k - 1, best, float("-inf")), 0)
    tl.store(threshold + row, tl.where(n_chunks >= k, kth, float("-inf")))


@triton.jit
def _gather_candidates(
    logits, vocab, stats, n_chunks, threshold, count, cand, CAP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr
):
    """Per (row, chunk): append the keys of the elements at or above the row's threshold.

    Only a chunk whose max reaches the threshold holds any, about k chunks of the row (the
    threshold is the k-th largest chunk max): the others are not read again."""
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    bar = tl.load(threshold + row)
    top = tl.load(stats + (row * n_chunks + chunk) * 2)
    if (top >= bar) | (top != top):  # (a NaN max: read the chunk, as without this test)
        ids = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
        valid = ids < vocab
        x = tl.load(logits + row * vocab + ids, mask=valid, other=float("-inf")).to(tl.float32)
        chosen = valid & (x >= bar)
        n = tl.sum(chosen.to(tl.int32), 0)
        if n > 0:
            base = tl.atomic_add(count + row, n)  # order of arrival does not matter: keys are ranked
            slot = base + tl.cumsum(chosen.to(tl.int32), 0) - 1
            tl.store(cand + row * CAP + slot, _key(x, ids), mask=chosen & (slot < CAP))


@triton.jit
def _store_ranked(top, lse, ids_out, logp_out, row, k, K2: tl.constexpr):
    slot = tl.arange(0, K2)
    keep = slot < k
    tl.store(ids_out + row * k + slot, _key_index(top), mask=keep)
    tl.store(logp_out + row * k + slot, _key_value(top) - tl.load(lse + row), mask=keep)


@triton.jit
def _rank_candidates(cand, n, lse, ids_out, logp_out, row, k, CAP: tl.constexpr, SIZE: tl.constexpr, K2: tl.constexpr):
    j = tl.arange(0, SIZE)
    key = tl.load(cand + row * CAP + j, mask=j < n, other=NO_KEY)
    _store_ranked(tl.topk(key, K2), lse, ids_out, logp_out, row, k, K2)


@triton.jit
def _rank_whole_row(logits, vocab, lse, ids_out, logp_out, row, k, CHUNK: tl.constexpr, K2: tl.constexpr):
    """The exact fallback, for a row with more candidates than fit: its top K2 over the whole row,
    chunk by chunk. A chunk is ranked only when it holds a key above the K2-th best so far, so a
    row of equal logits (the usual cause) reads its chunks and ranks one."""
    best = tl.full((K2,), NO_KEY, tl.int64)
    start = tl.zeros((), tl.int64)
    while start < vocab:
        ids = start + tl.arange(0, CHUNK).to(tl.int64)
        start += CHUNK
        valid = ids < vocab
        x = tl.load(logits + row * vocab + ids, mask=valid, other=float("-inf")).to(tl.float32)
        key = tl.where(valid, _key(x, ids), NO_KEY)
        if tl.max(key, 0) > tl.min(best, 0):
            best = tl.bitonic_merge(tl.maximum(best, tl.flip(tl.topk(key, K2), 0)), descending=True)
    _store_ranked(best, lse, ids_out, logp_out, row, k, K2)


@triton.jit
def _rank_rows(
    cand,
    count,
    logits,
    vocab,
    lse,
    ids_out,
    logp_out,
    k,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per row: the top k of its candidates (or of the whole row, when they did not fit), as ids and
    log-probs. Ranking costs with the number of keys ranked, so each case ranks only as many as it has."""
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(count + row)
    if n <= SMALL:  # the usual case: a few more than k
        _rank_candidates(cand, n, lse, ids_out, logp_out, row, k, CAP, SMALL, K2)
    elif n <= CAP:
        _rank_candidates(cand, n, lse, ids_out, logp_out, row, k, CAP, CAP, K2)
    else:
        _rank_whole_row(logits, vocab, lse, ids_out, logp_out, row, k, CHUNK, K2)


@triton.jit
def _rank_first(scratch, m, SEL: tl.constexpr, SIZE: tl.constexpr, K: tl.constexpr):
    """The top K of ``scratch[0 : m]`` (m <= SIZE), descending, into ``scratch[SEL : SEL + K]``."""
    f = tl.arange(0, SIZE)
    top = tl.topk(tl.load(scratch + f, mask=f < m, other=NO_KEY), K)
    tl.store(scratch + SEL + tl.arange(0, K), top)


@triton.jit
def _top_into(key, sel, scratch, SEL: tl.constexpr, N2: tl.constexpr, FEW: tl.constexpr):
    """Writes the top N2 of ``key`` (descending) to ``scratch[SEL : SEL + N2]``, exact in its first
    entries as long as ``sel`` holds every key among them. Ranking costs with the number of keys
    ranked: when the selected keys fit in FEW, N2 or SEL, only they are ranked (the rest of the N2
    written as NO_KEY), else all of ``key``."""
    m = tl.sum(sel.to(tl.int32), 0)
    o = tl.arange(0, N2)
    if m <= SEL:
        slot = tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(scratch + slot, key, mask=sel)
        tl.debug_barrier()
        if m <= FEW:
            tl.store(scratch + SEL + o, tl.full((N2,), NO_KEY, tl.int64), mask=o >= FEW)
            _rank_first(scratch, m, SEL, FEW, FEW)
        elif m <= N2:
            _rank_first(scratch, m, SEL, N2, N2)
        else:
            _rank_first(scratch, m, SEL, SEL, N2)
    else:
        tl.store(scratch + SEL + o, tl.topk(key, N2))
    tl.debug_barrier()


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
    scratch,
    D: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    N2: tl.constexpr,
    P2: tl.constexpr,
    SEL: tl.constexpr,
    FEW: tl.constexpr,
    PDL: tl.constexpr,
):
    _wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    scratch += b * (SEL + N2)
    j = tl.arange(0, N2)
    # Depth 1 keeps its top K tokens, in rank order.
    first = tl.load(logp + b * D * K + j, mask=j < K, other=float("-inf"))
    tl.store(level_score + b * D * N2 + j, first)
    tl.store(level_pos + b * D * N2 + j, j.to(tl.int32))
    p = tl.arange(0, P2)
    # Early stop: once the depths so far hold N prefixes scoring at least ``tau``, no prefix scoring
    # at most ``tau`` at a deeper depth can be among the first N (it comes after those N: lower
    # score, or equal score and deeper). Scores never grow along a path (log-probs are <= 0), so
    # when the best candidate of a depth is <= tau, that depth and every deeper one add no node.
    # ``best``: the keys of the N2 first prefixes listed so far in the global order (score, then
    # entry = depth * N2 + position in the depth's list), sorted, NO_KEY where fewer are listed.
    # tau is the N-th one's score, -inf (no bound) until N prefixes are listed. Once the last depth
    # is listed, the first N of ``best`` are the tree's nodes in order.
    best = tl.where(j < K, _key(first, j.to(tl.int64)), NO_KEY)
    tau = _score_at(best, N - 1)
    limit = tl.full((), 1, tl.int32)  # depths 0..limit-1 (0-based) hold the kept lists
    for d in range(1, D):
        tl.debug_barrier()  # the previous depth's stores are read below
        best_parent = tl.load(level_score + (b * D + d - 1) * N2)
        best_step = tl.load(logp + (b * D + d) * K)
        if (limit == d) & (best_parent + best_step > tau):
            code = tl.load(codes + d * P2 + p).to(tl.int64)
            valid = code >= 0
            parent_pos = code // K
            rank = code % K
            prev = tl.load(level_score + (b * D + d - 1) * N2 + parent_pos, mask=valid, other=0.0)
            step = tl.load(logp + (b * D + d) * K + rank, mask=valid, other=0.0)
            score = prev + step
            # A lower bound of the depth's N-th best score (N candidates reach it, the same float
            # sums as above): the first children of the N best parents, the N best children of the
            # best parent. Only candidates at or above it are ranked, and only those at or above
            # tau: a prefix below tau is not among the first N, nor is any prefix under it. The
            # list kept is then the depth's sorted top N cut where it falls below tau (NO_KEY
            # after, whose value is a NaN that every comparison below leaves out).
            bound = float("-inf")
            if tl.load(sizes + d - 1) >= N:
                last = tl.load(level_score + (b * D + d - 1) * N2 + N - 1)
                if last == last:  # the previous depth kept N
                    bound = last + best_step
            if K >= N:
                bound = tl.maximum(bound, best_parent + tl.load(logp + (b * D + d) * K + N - 1))
            real = valid & (score == score)
            wanted = real & (score >= bound) & (score >= tau)
            _top_into(tl.where(real, _key(score, p), NO_KEY), wanted, scratch, SEL, N2, FEW)
            # The depth's sorted list read backwards (``at``: each key's position in it), so that
            # it arrives in ascending order: flipping it in registers took log2(N2) exchanges
            # between the program's threads, every depth.
            at = N2 - 1 - j
            top = tl.load(scratch + SEL + at)
            tl.store(level_score + (b * D + d) * N2 + at, _key_value(top))
            tl.store(level_pos + (b * D + d) * N2 + at, _key_index(top).to(tl.int32))
            # The first N2 of both sorted lists: the larger of each pair (i, N2-1-i) is their top
            # N2 as a bitonic sequence, which one merge sorts. ``listed``: the depth's keys with the
            # entry number in place of the position (the low half of a key holds the index).
            entries = d * N2 + at.to(tl.int64)
            listed = tl.where(top != NO_KEY, ((top >> 32) << 32) | (4294967295 - entries), NO_KEY)
            best = tl.bitonic_merge(tl.maximum(best, listed), descending=True)
            tau = _score_at(best, N - 1)
            limit = tl.full((), 1, tl.int32) + d
    tl.debug_barrier()
    n = j
    live = n < N
    entry = _key_index(best)
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
    tl.store(score_out + b * N + n, _key_value(best), mask=live)
    tl.store(offsets_out + b * (N + 1) + 1 + n, depth + 1, mask=live)
    tl.store(offsets_out + b * (N + 1), 0)


@triton.jit
def _ancestors(parent, mask_out, N: tl.constexpr, ROWS: tl.constexpr, N1P: tl.constexpr, PDL: tl.constexpr):
    _wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, N1P).to(tl.int64)
    live = rows < N + 1
    node = rows - 1  # -1: the root's row
    seen = cols[None, :] == rows[:, None]
    while tl.max(node, 0) >= 0:  # one parent step per loop until every row has reached the root
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
    scratch,
    accepted_out,
    count_out,
    bonus_out,
    D: tl.constexpr,
    D2: tl.constexpr,
    N: tl.constexpr,
    N2: tl.constexpr,
    JUMPS: tl.constexpr,
    PDL: tl.constexpr,
):
    _wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    scratch += b * 2 * N2
    n = tl.arange(0, N2).to(tl.int64)
    live = n < N
    token = tl.load(tokens + b * N + n, mask=live, other=0)
    up = tl.load(parent + b * N + n, mask=live, other=-1)
    chosen = tl.load(targets + b * (N + 1) + up + 1, mask=live, other=0)
    bad = (live & (token != chosen.to(tl.int64))).to(tl.int64)
    t = tl.arange(0, D2)
    tl.store(accepted_out + b * D + t, tl.full((D2,), -1, tl.int64), mask=t < D)
    # A node is accepted when no node on its path from the root (itself included) mismatches.
    # Pointer jumping: after step i, ``bad`` covers the node and its 2**(i+1) - 1 nearest
    # ancestors and ``up`` is its 2**(i+1)-th ancestor (-1 past the root); paths are at most D long.
    for _ in tl.static_range(JUMPS):
        tl.store(scratch + n, bad)
        tl.store(scratch + N2 + n, up)
        tl.debug_barrier()
        above = up >= 0
        bad = bad | tl.load(scratch + up, mask=above, other=0)
        up = tl.load(scratch + N2 + up, mask=above, other=-1)
        tl.debug_barrier()  # every load of this step is done before the next one's stores
    ok = live & (bad == 0)
    level = tl.load(depth + b * N + n, mask=live, other=1)
    tl.store(accepted_out + b * D + level - 1, n, mask=ok)  # one accepted node per depth at most
    tl.store(count_out + b, tl.sum(ok.to(tl.int64), 0))
    last = tl.max(tl.where(ok, n + 1, 0), 0)
    tl.store(bonus_out + b, tl.load(targets + b * (N + 1) + last))


@functools.cache
def _pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: GPUs of compute capability 9.0 (Hopper) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _launch_options(device: torch.device) -> dict[str, bool]:
    """Every launch's options: the kernels' ``PDL`` and Triton's ``launch_pdl``, both on where the GPU has it."""
    pdl = _pdl(device)
    return {"PDL": pdl, "launch_pdl": pdl}


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


def expand_plan(k: int, sizes: list[int], tables: list[list[int]], budget: int, device: torch.device) -> ExpandPlan:
    """``_expand``'s inputs: per depth the prefixes kept and the candidate (parent position, rank) codes."""
    p2 = _pow2(max(max(len(t) for t in tables), budget))
    codes = torch.full((len(tables), p2), -1, dtype=torch.int32)
    for d, table in enumerate(tables):
        codes[d, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return ExpandPlan(k=k, codes=codes.to(device), sizes=torch.tensor(sizes, dtype=torch.int32).to(device), p2=p2)


def ranked_logprobs(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` token ids per row of ``[R, V]`` by (logit desc, id asc), and their float32 log-probs."""
    ids, logp, _ = _ranked_logprobs(rows, k)
    return ids, logp


def _ranked_logprobs(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ranked_logprobs``, and each row's number of candidates (the fallback ran where above the cap).

    Top ``k`` token ids per row of ``[R, V]`` by (logit desc, id asc), and their float32 log-probs.

    Ranking every logit is what costs: instead each row keeps only its candidates, the elements at
    or above the k-th largest of its chunks' maxima (at least k of them, since k chunk maxima reach
    that value; all ties of the row's k-th value among them), and ranks those. A row with more
    candidates than the cap (8 k, see ``CANDIDATES``: a pathological distribution, or fewer
    chunks than k) is ranked whole, chunk by chunk, by its program of the ranking kernel: the same
    result, at a cost only such rows pay (two kernels that returned at once for every other row
    cost a launch each, every step).
    """
    rows = rows.contiguous()
    num_rows, vocab = rows.shape
    device = rows.device
    k2 = _pow2(k)
    # Chunks small enough that a row has at least k of them.
    chunk = max(16, min(STATS_CHUNK, 1 << max(0, (vocab // k).bit_length() - 1)))
    n_chunks = triton.cdiv(vocab, chunk)
    stats = torch.empty(num_rows, n_chunks, 2, dtype=torch.float32, device=device)
    count = torch.empty(num_rows, dtype=torch.int32, device=device)
    threshold = torch.empty(num_rows, dtype=torch.float32, device=device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    cap = min(CANDIDATES, max(256, _pow2(8 * k2)))
    cand = torch.empty(num_rows, cap, dtype=torch.int64, device=device)
    ids = torch.empty(num_rows, k, dtype=torch.int64, device=device)
    logp = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    options = _launch_options(device)
    _chunk_stats[(num_rows, n_chunks)](rows, vocab, n_chunks, stats, count, CHUNK=chunk, **options)
    _row_threshold[(num_rows,)](stats, n_chunks, threshold, lse, k, K2=k2, CHUNKS2=max(_pow2(n_chunks), k2), **options)
    _gather_candidates[(num_rows, n_chunks)](
        rows, vocab, stats, n_chunks, threshold, count, cand, CAP=cap, CHUNK=chunk, **options
    )

    small = min(cap, max(64, 2 * k2))  # most rows have a few more than k candidates
    _rank_rows[(num_rows,)](
        cand,
        count,
        rows,
        vocab,
        lse,
        ids,
        logp,
        k,
        CAP=cap,
        SMALL=small,
        CHUNK=max(CHUNK, k2),
        K2=k2,
        **options,
    )
    return ids, logp, count


def build(draft_logits: torch.Tensor, budget: int, plan: ExpandPlan) -> tuple[torch.Tensor, ...]:
    """Tokens, depth, parent, scores, ancestor mask and position offsets of the batch's trees."""
    batch, num_depths, vocab = draft_logits.shape
    k = plan.k
    ids, logp = ranked_logprobs(draft_logits.reshape(batch * num_depths, vocab), k)
    device = draft_logits.device
    n2 = _pow2(budget)

    def empty(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    level_score = empty(batch, num_depths, n2, dtype=torch.float32)
    level_pos = empty(batch, num_depths, n2, dtype=torch.int32)
    node_of_entry = empty(batch, num_depths * n2, dtype=torch.int32)
    tokens, depth, parent = empty(batch, budget), empty(batch, budget), empty(batch, budget)
    scores = empty(batch, budget, dtype=torch.float32)
    offsets = empty(batch, budget + 1)
    sel = 2 * n2  # keys a ranking step takes when the rest are known to rank below the first n2
    scratch = empty(batch, sel + n2)
    options = _launch_options(device)
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
        scratch,
        D=num_depths,
        K=k,
        N=budget,
        N2=n2,
        P2=plan.p2,
        SEL=sel,
        FEW=min(n2, max(16, n2 // 4)),  # peaked logits: a depth often keeps a few prefixes at or above tau
        num_warps=8 if plan.p2 >= 512 else 4,  # measured on an H200 (16 was slower at every budget)
        **options,
    )
    mask = empty(batch, budget + 1, budget + 1, dtype=torch.bool)
    rows = 16
    _ancestors[(batch, triton.cdiv(budget + 1, rows))](
        parent, mask, N=budget, ROWS=rows, N1P=_pow2(budget + 1), **options
    )
    return tokens, depth, parent, scores, mask, offsets


def walk(
    tokens: torch.Tensor,
    parent: torch.Tensor,
    depth: torch.Tensor,
    num_depths: int,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted node per depth (-1 past the end), number accepted, bonus token, per request."""
    batch, budget = tokens.shape
    device = tokens.device
    targets = targets.contiguous()
    n2 = _pow2(budget)
    scratch = torch.empty(batch, 2 * n2, dtype=torch.int64, device=device)
    accepted = torch.empty(batch, num_depths, dtype=torch.int64, device=device)
    count = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=targets.dtype, device=device)
    options = _launch_options(device)
    _walk[(batch,)](
        tokens,
        parent,
        depth,
        targets,
        scratch,
        accepted,
        count,
        bonus,
        D=num_depths,
        D2=_pow2(num_depths),
        N=budget,
        N2=n2,
        JUMPS=max(1, math.ceil(math.log2(num_depths))),  # 2**JUMPS >= D: a path's length
        **options,
    )
    return accepted, count, bonus
