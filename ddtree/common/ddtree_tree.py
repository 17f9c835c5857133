"""DDTree draft trees, built and walked in batch on the device that holds the draft logits.

DDTree (arXiv 2604.12989) turns one DFlash pass into a tree of draft tokens: from the drafter's
per-position logits ``[D, V]`` it keeps the ``budget`` most probable prefixes under the factorised
draft distribution (one log-softmax per depth), verifies all of them in one target pass with
ancestor-only attention, and accepts by walking the target's own choices from the root.

The reference implementation builds the tree with a best-first heap on the host. This module
computes the same tree with a fixed number of tensor operations per depth (no host round-trip,
no Python loop over nodes; the loops below run over depths, at most ``D``, and only launch
kernels), for a whole batch at once, on CUDA or CPU. It depends on torch only.

Order of nodes (the tie-break rule)
-----------------------------------
Each depth ``d`` ranks its tokens by draft logit, larger first, and equal logits by token id,
smaller first. A prefix's score is the float32 sum of its tokens' log-probabilities
(``torch.log_softmax`` of the depth's logits in float32), accumulated from the root:
``score(child) = score(parent) + logprob``. Node ``A`` comes before node ``B`` when, in this order
of precedence:

1. ``score(A) > score(B)``;
2. ``depth(A) < depth(B)`` (shallower first: a token of probability 1 scores exactly as its
   parent, and still comes after it);
3. ``A``'s parent comes before ``B``'s parent (by this same rule; nodes of depth 1 share the root);
4. ``A``'s token ranks before ``B``'s token at that depth (same parent).

Every node comes after its parent and after its better-ranked siblings, so a best-first heap keyed
by this order pops nodes exactly in this order: the tree is the first ``budget`` prefixes of it,
prefix-closed, numbered in that order (parents before children). The reference repository's heap
breaks score ties by the tuple of ranks instead and adds scores in double precision: it builds the
same tree except where two prefixes' scores tie or differ by about one float32 rounding.

``-inf`` logits are fine (such tokens have probability 0 and come last). A request whose logits
hold a NaN or a ``+inf``, or a depth with no finite logit (a drafter overflowing in fp16, a corrupt
drafter file), has them replaced by zeros in place, on the device and without a host sync: its tree
is then the uniform one (token ids in order), whose every token is in the vocabulary, and the
target's verification keeps the step lossless (it accepts what it would have sampled anyway). Left
as they were, such logits made the tree hold ids outside the vocabulary and nodes whose depth
disagrees with their parent's, which vLLM's input batch cannot take: the engine would stop.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

__all__ = ["DDTree", "GraphedTrees", "TreeWalk", "build_trees", "ranked_logprobs", "walk_trees"]


@functools.cache
def _kernels() -> ModuleType | None:
    """``ddtree_kernels`` beside this file (Triton kernels of the same build and walk), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    if __package__:  # inside vLLM: vllm.v1.spec_decode.ddtree_kernels
        return importlib.import_module(f"{__package__}.ddtree_kernels")
    # Loaded from its file (tests, benchmarks).
    spec = importlib.util.spec_from_file_location("ddtree_kernels", Path(__file__).with_name("ddtree_kernels.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _use_kernels(tensor: torch.Tensor, kernels: bool | None) -> ModuleType | None:
    """The kernels module when asked for (``True``), or by default on CUDA where Triton is installed."""
    if kernels is False or (kernels is None and tensor.device.type != "cuda"):
        return None
    module = _kernels()
    if module is None and kernels:
        raise RuntimeError("kernels=True needs Triton (pip install triton), which is not installed")
    return module


@dataclass(frozen=True)
class DDTree:
    """A batch of ``B`` draft trees of ``N`` nodes each, all tensors on the logits' device.

    Nodes are numbered ``0..N-1`` in the order of the module docstring (parents before children).
    The verification layout is ``[root] + nodes``: node ``i`` sits at position ``i + 1`` there,
    the root (the last accepted token) at position 0.

    Attributes:
        tokens: ``[B, N]`` int64, each node's draft token.
        depth: ``[B, N]`` int64, ``1..num_depths``.
        parent: ``[B, N]`` int64, the parent's node index, ``-1`` for the root.
        scores: ``[B, N]`` float32, cumulative draft log-probability of the node's prefix.
        ancestor_mask: ``[B, N+1, N+1]`` bool over ``[root] + nodes``: ``True`` where the row may
            attend to the column (the root, the row's ancestors and itself).
        position_offsets: ``[B, N+1]`` int64 over ``[root] + nodes``: the depth, 0 for the root
            (add the root's position to get each entry's position).
        num_depths: ``D``, the number of draft positions the tree was built from.
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    scores: torch.Tensor
    ancestor_mask: torch.Tensor
    position_offsets: torch.Tensor
    num_depths: int

    @property
    def budget(self) -> int:
        """Number of nodes per tree (the root not counted)."""
        return int(self.tokens.shape[1])


class TreeWalk(NamedTuple):
    """Outcome of walking a batch of verified trees.

    Attributes:
        accepted_nodes: ``[B, D]`` int64, the accepted node indices by depth (``accepted_nodes[b,
            k]`` is the accepted node of depth ``k + 1``), ``-1`` past the accepted length.
        num_accepted: ``[B]`` int64, number of accepted draft nodes (0..D).
        bonus_tokens: ``[B]``, the target's token after the last accepted node (or the root).
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    bonus_tokens: torch.Tensor


# Index tables depend only on shapes; they are built once per shape and device and reused, so a
# step makes no host-to-device copy and, after one warmup call, can be captured in a CUDA graph.
_TABLES: dict[tuple[object, ...], torch.Tensor] = {}


def _table(key: tuple[object, ...], make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    full_key = (*key, str(device))
    table = _TABLES.get(full_key)
    if table is None:
        table = make().to(device)
        _TABLES[full_key] = table
    return table


def _pair_codes(n_prev: int, k: int, keep: int) -> list[int]:
    """Flat indices ``i * k + r`` of the (parent position, rank) pairs that can reach a depth's top ``keep``.

    Pair ``(i, r)`` is preceded by the ``(i + 1) * (r + 1) - 1`` pairs ``(i' <= i, r' <= r)``, each
    scoring at least as much and winning ties, so it is out of the top ``keep`` when
    ``(i + 1) * (r + 1) > keep``. Listed in ascending flat order, which is the tie order.
    """
    return [i * k + r for i in range(n_prev) for r in range(min(k, keep // (i + 1)))]


# Candidate lists up to this size are sorted whole: on CUDA one sort kernel handles them, which is
# cheaper than the extra launch that would prune them first.
_SORT_WHOLE_MAX = 4096


def _level_sizes(num_depths: int, k: int, budget: int) -> list[int]:
    """Prefixes kept per depth: the top ``budget`` of each depth, or all of them where fewer."""
    sizes = [k]
    for _ in range(1, num_depths):
        sizes.append(min(budget, sizes[-1] * k))
    return sizes


@dataclass(frozen=True)
class _Plan:
    """Everything about a build that depends only on (depth, vocab, budget): sizes and index tables.

    Entries are the kept prefixes of all depths, concatenated depth by depth; each entry is reached
    from the sorted candidate list of its depth at position ``order``, and ``order + table_offset``
    (the entry's depth's offset) indexes the candidate tables ``token_column`` and ``parent_entry``.
    """

    k: int  # tokens ranked per depth
    sizes: tuple[int, ...]  # prefixes kept per depth
    # Per depth d >= 1 (0-based) whose candidates are pruned: the kept pair codes, on the device.
    pairs: tuple[torch.Tensor | None, ...]
    # Per candidate of every depth: index of its token in top_ids viewed as [B, D * k], and
    # 1 + the entry index of its parent (0 = the root).
    token_column: torch.Tensor
    parent_entry: torch.Tensor
    # Per entry: depth (1-based), table offset of its depth.
    entry_info: torch.Tensor
    slots: torch.Tensor  # arange(budget)


_PLANS: dict[tuple[int, int, int, str], _Plan] = {}


def _plan(num_depths: int, vocab: int, budget: int, device: torch.device) -> _Plan:
    key = (num_depths, vocab, budget, str(device))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    k = min(budget, vocab)
    sizes = _level_sizes(num_depths, k, budget)
    tables, pruned = [list(range(k))], [False]
    for n_prev in sizes[:-1]:
        prune = n_prev * k > max(budget, _SORT_WHOLE_MAX)
        tables.append(_pair_codes(n_prev, k, budget) if prune else list(range(n_prev * k)))
        pruned.append(prune)
    token_column: list[int] = []
    parent_entry: list[int] = []
    info: list[list[int]] = []
    entry_start, table_start, prev_start = 0, 0, -1
    for d, (size, table) in enumerate(zip(sizes, tables, strict=True)):
        token_column.extend(d * k + code % k for code in table)
        parent_entry.extend(0 if d == 0 else prev_start + 1 + code // k for code in table)
        info.extend([d + 1, table_start] for _ in range(size))
        prev_start, entry_start = entry_start, entry_start + size
        table_start += len(table)

    def on_device(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    plan = _Plan(
        k=k,
        sizes=tuple(sizes),
        pairs=tuple(on_device(t) if p else None for t, p in zip(tables, pruned, strict=True)),
        token_column=on_device(token_column),
        parent_entry=on_device(parent_entry),
        entry_info=on_device(info),
        slots=torch.arange(budget, device=device),
    )
    _PLANS[key] = plan
    return plan


@functools.cache
def _expand_plan(num_depths: int, vocab: int, budget: int, device: torch.device) -> object:
    """The kernels' per-depth sizes and candidate tables (always pruned: one program ranks them)."""
    k = min(budget, vocab)
    sizes = _level_sizes(num_depths, k, budget)
    tables = [list(range(k)), *(_pair_codes(n_prev, k, budget) for n_prev in sizes[:-1])]
    return _kernels().expand_plan(k, sizes, tables, budget, device)


def _ranked_top_tokens(logits: torch.Tensor, k: int, slots: torch.Tensor) -> torch.Tensor:
    """Ids ``[R, k]`` of the top ``k`` tokens of each row of ``[R, V]``, by (logit desc, token id asc).

    ``torch.topk`` does not specify which of several equal values it returns, so ties are settled
    here: the tokens tied with the k-th value are replaced by the smallest tied ids, then the k
    entries are put in (value desc, id asc) order.
    """
    vocab = logits.shape[-1]
    values, ids = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    if k < vocab:
        device = logits.device
        threshold = values[:, k - 1 :]
        reversed_ids = _table(
            ("reversed_ids", vocab), lambda: torch.arange(vocab - 1, -1, -1, dtype=torch.int32), device
        )
        tie_key = torch.where(logits == threshold, reversed_ids, -1)
        tied_ids = torch.topk(tie_key, k, dim=-1, largest=True, sorted=True).indices
        above = (values > threshold).sum(dim=-1, keepdim=True)
        from_ties = tied_ids.gather(1, (slots - above).clamp_(min=0))
        ids = torch.where(slots < above, ids, from_ties)
    ids, perm = ids.sort(dim=-1)
    values = values.gather(-1, perm)
    perm = values.sort(dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, perm)


def ranked_logprobs(rows: torch.Tensor, k: int, *, kernels: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` token ids of each row of ``[R, V]`` in rank order, and their float32 log-probabilities.

    What :func:`build_trees` builds from (with the same ``kernels`` choice): the tree is the best-first
    tree over exactly these numbers.
    """
    fused = _use_kernels(rows, kernels)
    if fused is not None:
        return fused.ranked_logprobs(rows, k)
    slots = _table(("slots", k), lambda: torch.arange(k), rows.device)
    top_ids = _ranked_top_tokens(rows, k, slots)
    return top_ids, torch.log_softmax(rows, dim=-1, dtype=torch.float32).gather(1, top_ids)


def _check_build_args(draft_logits: torch.Tensor, budget: int) -> tuple[int, int, int]:
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 3:
        raise ValueError(
            "draft_logits must be a tensor [batch, depth, vocab] (one row of draft logits per draft "
            f"position), got {getattr(draft_logits, 'shape', type(draft_logits))}"
        )
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int (number of tree nodes), got {budget!r}")
    batch, depth, vocab = (int(s) for s in draft_logits.shape)
    if depth < 1 or vocab < 1:
        raise ValueError(f"draft_logits needs at least one draft position and one token, got {draft_logits.shape}")
    total = 0
    for d in range(1, depth + 1):
        total += vocab**d
        if total >= budget:
            break
    if total < budget:
        raise ValueError(
            f"budget {budget} exceeds the {total} distinct prefixes of {depth} positions over a "
            f"vocabulary of {vocab}: lower the budget"
        )
    return batch, depth, vocab


def uniform_where_not_finite_(draft_logits: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the ``[B, D, V]`` logits of every request with a NaN, a ``+inf`` or a depth
    without a finite logit (see the module docstring); the others are untouched. Returns the tensor.

    A row's max is NaN where it holds a NaN, ``+inf`` where it holds a ``+inf`` and ``-inf`` where
    nothing in it is finite, so one reduction finds all three; fixed operators, no host sync, so a
    step keeps its launch sequence and can be captured in a CUDA graph."""
    finite = torch.isfinite(draft_logits.amax(dim=-1)).all(dim=-1)  # [B]
    return draft_logits.masked_fill_(~finite[:, None, None], 0.0)


def build_trees(draft_logits: torch.Tensor, budget: int, *, kernels: bool | None = None) -> DDTree:
    """Build one DDTree per request from its drafter logits.

    Args:
        draft_logits: ``[B, D, V]`` float, the drafter's logits for draft positions ``1..D`` of each
            request (any float dtype, any device). A request's logits that are not finite are
            replaced by zeros in place (:func:`uniform_where_not_finite_`).
        budget: ``N``, the number of nodes per tree (the root not counted); at most the number of
            distinct prefixes, which any real vocabulary exceeds.
        kernels: build with the Triton kernels of ``ddtree_kernels`` (six launches) instead of torch
            operators (about a hundred). Default: on CUDA where Triton is installed. Same trees; the
            log-probabilities are the logit minus the row's logsumexp, which may differ from
            ``torch.log_softmax`` in the last bit, so trees can differ where two prefixes tie to
            within one float32 rounding.

    Returns:
        The trees (see :class:`DDTree`): for each request the ``budget`` first prefixes in the order
        of the module docstring, which is the order a best-first heap pops them.

    How: per depth, keep the top ``budget`` prefixes of that depth (extensions of the previous
    depth's kept prefixes by that depth's top-ranked tokens: a prefix of the top ``budget`` of its
    depth extends a prefix of the top ``budget`` of the previous depth), sorted stably so ties keep
    (parent position, rank) order; then one stable sort of all depths' lists, depth by depth, takes
    the global first ``budget``.
    """
    batch, num_depths, vocab = _check_build_args(draft_logits, budget)
    uniform_where_not_finite_(draft_logits)
    fused = _use_kernels(draft_logits, kernels)
    if fused is not None:
        tokens, depth, parent, scores, mask, offsets = fused.build(
            draft_logits, budget, _expand_plan(num_depths, vocab, budget, draft_logits.device)
        )
        return DDTree(tokens, depth, parent, scores, mask, offsets, num_depths)
    plan = _plan(num_depths, vocab, budget, draft_logits.device)
    k = plan.k

    rows = draft_logits.reshape(batch * num_depths, vocab)
    top_ids, top_logp = ranked_logprobs(rows, k, kernels=False)
    top_logp = top_logp.view(batch, num_depths, k)

    # Per depth, its kept prefixes in the order of the module docstring: scores, and the position
    # of each in the sorted candidate list of its depth (decoded through the plan after the loop).
    level_scores = [top_logp[:, 0, :]]
    level_orders = [plan.slots[:k].expand(batch, k)]
    for d in range(1, num_depths):
        cand = (level_scores[-1].unsqueeze(2) + top_logp[:, d, :].unsqueeze(1)).flatten(1)
        pairs = plan.pairs[d]
        if pairs is not None:
            cand = cand.index_select(1, pairs)
        ordered, order = cand.sort(dim=1, descending=True, stable=True)
        level_scores.append(ordered[:, : plan.sizes[d]])
        level_orders.append(order[:, : plan.sizes[d]])

    # Global order: the lists concatenated depth by depth, so a stable sort breaks score ties by
    # depth, then by position in the depth's list.
    sorted_scores, pick = torch.cat(level_scores, dim=1).sort(dim=1, descending=True, stable=True)
    pick = pick[:, :budget]
    info = plan.entry_info[pick]  # [B, N, 2]: depth, table offset
    candidate = torch.cat(level_orders, dim=1).gather(1, pick) + info[..., 1]
    tokens = top_ids.view(batch, num_depths * k).gather(1, plan.token_column[candidate])

    # Parent: its entry (1 + index in the concatenation, 0 = root) mapped to its node index.
    node_of_entry = torch.full((batch, 1 + sum(plan.sizes)), -1, dtype=torch.int64, device=pick.device)
    node_of_entry[:, 1:].scatter_(1, pick, plan.slots.expand(batch, budget))
    parent = node_of_entry.gather(1, plan.parent_entry[candidate])

    depth = info[..., 0]
    return DDTree(
        tokens=tokens,
        depth=depth,
        parent=parent,
        scores=sorted_scores[:, :budget],
        ancestor_mask=_ancestor_mask(parent, num_depths),
        position_offsets=torch.nn.functional.pad(depth, (1, 0)),
        num_depths=num_depths,
    )


def _ancestor_mask(parent: torch.Tensor, num_depths: int) -> torch.Tensor:
    """``[B, N+1, N+1]`` reflexive-transitive closure of the parent relation over ``[root] + nodes``.

    ``R = I + P`` (P: child to parent) counts walks that stay or climb: ``R^m[i, j] = C(m, dist(i,
    j))`` when ``j`` is an ancestor-or-self of ``i`` at distance ``dist <= m``, else 0. Squaring ``R``
    ``s = ceil(log2(D))`` times gives ``m = 2^s >= D``, enough to reach the root from depth D; the
    entries stay below ``2^m``, so only their sign is used and float32 (or TF32) rounding cannot turn a
    positive entry into 0. Beyond D = 64, ``2^m`` could overflow float32, so entries are clamped to 1.
    """
    batch, n = parent.shape
    reach = torch.zeros(batch, n + 1, n + 1, dtype=torch.float32, device=parent.device)
    reach[:, 1:, :].scatter_(2, (parent + 1).unsqueeze(2), 1.0)
    reach.diagonal(dim1=1, dim2=2).fill_(1.0)
    if num_depths <= 64:
        return torch.linalg.matrix_power(reach, 2 ** math.ceil(math.log2(num_depths))) > 0
    for _ in range(math.ceil(math.log2(num_depths))):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    return reach > 0


def walk_trees(tree: DDTree, target_tokens: torch.Tensor, *, kernels: bool | None = None) -> TreeWalk:
    """Accept the longest root path whose tokens the target chose, and take the target's bonus token.

    Args:
        tree: the batch of trees that was verified.
        target_tokens: ``[B, N+1]`` integer tensor over ``[root] + nodes``: ``target_tokens[b, i]`` is
            the token the target chose (argmax when greedy, sampled otherwise) after entry ``i``.
        kernels: walk with one Triton kernel (default on CUDA where Triton is installed), as in
            :func:`build_trees`; the result is the same.

    Returns:
        :class:`TreeWalk`. From the root, the walk follows the child whose token equals the target's
        choice at the current node (siblings carry distinct tokens, so there is at most one); the
        target's choice at the last accepted node (the root if none) is the bonus token.

    A node is accepted exactly when it and every ancestor match the target's choice at their
    parents: with torch operators one masked reduction over the ancestor mask, in the kernel a few
    pointer-jumping steps along the parents; no step per node either way.
    The accepted nodes form one root path, and a deeper node has a larger index.
    """
    batch, n = tree.tokens.shape
    if (
        not isinstance(target_tokens, torch.Tensor)
        or target_tokens.shape != (batch, n + 1)
        or target_tokens.is_floating_point()
        or target_tokens.dtype == torch.bool
    ):
        raise ValueError(
            f"target_tokens must be an integer tensor [batch, budget + 1] = [{batch}, {n + 1}] over "
            f"[root] + nodes, got {getattr(target_tokens, 'shape', type(target_tokens))} "
            f"{getattr(target_tokens, 'dtype', '')}"
        )
    if target_tokens.device != tree.tokens.device:
        raise ValueError(f"target_tokens is on {target_tokens.device}, the tree on {tree.tokens.device}")
    fused = _use_kernels(target_tokens, kernels)
    if fused is not None:
        return TreeWalk(*fused.walk(tree.tokens, tree.parent, tree.depth, tree.num_depths, target_tokens))

    mismatch = tree.tokens != target_tokens.gather(1, tree.parent + 1)
    accepted = ~(tree.ancestor_mask[:, 1:, 1:] & mismatch.unsqueeze(1)).any(dim=2)
    entry_ids = _table(("entry_ids", n), lambda: torch.arange(1, n + 1), tree.tokens.device)
    entry = torch.where(accepted, entry_ids.expand(batch, n), 0)

    # Accepted node of depth k goes to column k; everything else to column 0, dropped.
    by_depth = torch.full((batch, tree.num_depths + 1), -1, dtype=torch.int64, device=entry.device)
    by_depth.scatter_(1, torch.where(accepted, tree.depth, 0), entry - 1)
    last_entry = entry.amax(dim=1, keepdim=True)
    return TreeWalk(
        accepted_nodes=by_depth[:, 1:],
        num_accepted=accepted.sum(dim=1),
        bonus_tokens=target_tokens.gather(1, last_entry).squeeze(1),
    )


class GraphedTrees:
    """``build_trees`` and ``walk_trees`` for one fixed shape, replayed from CUDA graphs.

    An eager step launches a dozen kernels (about a hundred with ``kernels=False``), and on a GPU
    their launch cost, not their work, dominates. This captures both functions once (after a
    warmup on a side stream) and then each call is one graph replay, reading its inputs from the
    static buffers :attr:`logits` and :attr:`targets`. A producer that writes there directly (the
    drafter's output, say) saves the copy; ``build(x)`` / ``walk(t)`` copy ``x`` / ``t`` in first.
    Results are the same as the eager calls.

    The returned tree and walk live in static buffers that the next ``build``/``walk`` overwrites:
    copy what must outlive the step. ``walk`` walks the tree of the latest ``build``.
    """

    def __init__(
        self,
        batch: int,
        num_depths: int,
        vocab: int,
        budget: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cuda",
        warmup: int = 2,
        kernels: bool | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"GraphedTrees needs a CUDA device, got {device}: call build_trees/walk_trees instead")
        self.logits = torch.zeros(batch, num_depths, vocab, dtype=dtype, device=device)
        _check_build_args(self.logits, budget)
        self.targets = torch.zeros(batch, budget + 1, dtype=torch.int64, device=device)
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    walk_trees(build_trees(self.logits, budget, kernels=kernels), self.targets, kernels=kernels)
            torch.cuda.current_stream().wait_stream(side)
            self._build_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._build_graph):
                self.tree = build_trees(self.logits, budget, kernels=kernels)
            self._walk_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._walk_graph):
                self.walk_result = walk_trees(self.tree, self.targets, kernels=kernels)

    def build(self, draft_logits: torch.Tensor | None = None) -> DDTree:
        """``build_trees(draft_logits, budget)`` for logits of the captured shape (any dtype is cast);
        without an argument, of what :attr:`logits` holds."""
        if draft_logits is not None:
            if draft_logits.shape != self.logits.shape:
                raise ValueError(f"draft_logits must be {list(self.logits.shape)}, got {list(draft_logits.shape)}")
            self.logits.copy_(draft_logits)
        self._build_graph.replay()
        return self.tree

    def walk(self, target_tokens: torch.Tensor | None = None) -> TreeWalk:
        """``walk_trees(tree, target_tokens)`` on the tree of the latest ``build``; without an
        argument, with what :attr:`targets` holds."""
        if target_tokens is not None:
            if target_tokens.shape != self.targets.shape:
                raise ValueError(f"target_tokens must be {list(self.targets.shape)}, got {list(target_tokens.shape)}")
            self.targets.copy_(target_tokens)
        self._walk_graph.replay()
        return self.walk_result
