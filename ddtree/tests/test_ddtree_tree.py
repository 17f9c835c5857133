"""DDTree tree building and walking (ddtree/common/ddtree_tree.py), on CPU and CUDA.

Checked three ways: against brute force over every prefix of small vocabularies, against the
paper's best-first heap (ddtree/heap_reference.py) on random logits, and on hand-written
trees with literal expected tensors. The CUDA tests run only where a GPU is present.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import sys
from types import ModuleType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree import HOME
from ddtree import heap_reference as ref

MODULE_PATH = HOME / "common/ddtree_tree.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddtree_tree", MODULE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if not torch.cuda.is_available():
    # The Triton kernels run in Triton's interpreter on the CPU (slowly: the kernel tests use small
    # shapes). Triton reads this when first imported; ddtree/tests/conftest.py sets it before anything
    # imports Triton, this covers a run of this file alone without it.
    os.environ.setdefault("TRITON_INTERPRET", "1")
dt = _load()
INF = float("inf")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _logits(*rows_per_request: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows_per_request, dtype=torch.float32)


def _probs_to_logits(*requests: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(requests, dtype=torch.float64)).float()


def _random_logits(
    seed: int, batch: int, depth: int, vocab: int, *, ties: bool = False, scale: float = 3.0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, depth, vocab, generator=gen) * scale
    if ties:
        # Few distinct values: many equal logits and equal prefix scores.
        # Some tokens of probability 0 too, keeping each row's best token finite.
        logits = logits.round()
        logits[(logits < -2) & (logits < logits.amax(dim=-1, keepdim=True))] = -INF
    return logits


def _oracle(logits_b: torch.Tensor, budget: int) -> ref.HeapTree:
    """The heap reference on one request's logits [D, V] (log-softmax by torch on their device)."""
    k = min(budget, logits_b.shape[-1])
    logp = torch.log_softmax(logits_b.float(), dim=-1).cpu()
    if logits_b.shape[-1] <= 5000:
        logp_k, ids = ref.ranked_logprobs(logits_b.float().tolist(), logp.tolist(), k)
    else:  # Python sorts of whole large vocabularies are slow: a stable sort ranks the same way
        order = torch.sort(logits_b.float().cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
        logp_k, ids = logp.gather(1, order).tolist(), order.tolist()
    return ref.heap_tree(logp_k, ids, budget)


def _assert_is_heap_tree(tree, b: int, heap: ref.HeapTree) -> None:
    """Request ``b`` of ``tree`` is the heap's tree: nodes, scores, mask and positions."""
    assert tree.tokens[b].tolist() == heap.tokens
    assert tree.depth[b].tolist() == heap.depths
    assert tree.parent[b].tolist() == heap.parents
    assert tree.scores[b].tolist() == heap.scores
    assert tree.ancestor_mask[b].tolist() == ref.visibility(heap.parents)
    assert tree.position_offsets[b].tolist() == [0, *heap.depths]


def _brute_force(logits_b: torch.Tensor, budget: int) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], float]]:
    """Every prefix, ordered by the documented rule written out directly (no heap, no pruning)."""
    rows = logits_b.tolist()
    logp = torch.log_softmax(logits_b.float(), dim=-1).tolist()
    vocab = len(rows[0])
    rank = [{t: r for r, t in enumerate(ref.rank_tokens(row))} for row in rows]
    score: dict[tuple[int, ...], float] = {(): 0.0}
    position: dict[tuple[int, ...], int] = {(): 0}
    everything: list[tuple[int, ...]] = []
    for d in range(len(rows)):
        level = [(*p, t) for p in itertools.product(range(vocab), repeat=d) for t in range(vocab)]
        for p in level:
            score[p] = ref.f32(score[p[:-1]] + logp[d][p[-1]])
        level.sort(key=lambda p, d=d: (-score[p], position[p[:-1]], rank[d][p[-1]]))
        position.update((p, i) for i, p in enumerate(level))
        everything.extend(level)
    everything.sort(key=lambda p: (-score[p], len(p), position[p]))
    return everything, score


def _prefixes(tree, b: int) -> list[tuple[int, ...]]:
    tokens, parents = tree.tokens[b].tolist(), tree.parent[b].tolist()
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return out


# --- against brute force -------------------------------------------------------------------------

BRUTE_CASES = [
    # (seed, batch, depth, vocab, budget, ties)
    (1, 2, 3, 4, 10, False),
    (2, 1, 2, 5, 1, False),
    (3, 3, 4, 3, 30, False),
    (4, 2, 3, 4, 84, False),  # every prefix: 4 + 16 + 64
    (5, 2, 5, 2, 40, True),
    (6, 1, 4, 3, 12, True),
    (7, 2, 1, 6, 6, False),  # one depth, whole vocabulary
    (8, 2, 3, 5, 7, True),
    (9, 1, 6, 2, 50, False),  # budget > vocab at every depth
]


@pytest.mark.parametrize(("seed", "batch", "depth", "vocab", "budget", "ties"), BRUTE_CASES)
def test_build_matches_brute_force(seed: int, batch: int, depth: int, vocab: int, budget: int, ties: bool) -> None:
    logits = _random_logits(seed, batch, depth, vocab, ties=ties)
    tree = dt.build_trees(logits, budget)
    assert tree.tokens.shape == (batch, budget)
    for b in range(batch):
        ordered, score = _brute_force(logits[b], budget)
        got = _prefixes(tree, b)
        assert got == ordered[:budget]
        # Exactly the most probable: nothing left out scores above anything kept.
        kept = set(got)
        assert len(kept) == budget
        left_out = [score[p] for p in ordered if p not in kept]
        if left_out:
            assert min(score[p] for p in kept) >= max(left_out)
        # Prefix-closed, parents first, depths and scores consistent.
        for i, p in enumerate(got):
            assert len(p) == tree.depth[b, i].item()
            assert tree.scores[b, i].item() == score[p]
            if len(p) > 1:
                assert p[:-1] in kept
                assert got.index(p[:-1]) == tree.parent[b, i].item() < i
            else:
                assert tree.parent[b, i].item() == -1


# --- against the heap reference -----------------------------------------------------------------

HEAP_CASES = [
    # (batch, depth, vocab, budget)
    (1, 15, 1000, 16),
    (4, 15, 1000, 64),
    (2, 15, 500, 256),
    (3, 7, 50, 100),
    (2, 4, 3, 40),  # budget > vocab
    (2, 15, 5, 300),  # budget > vocab
    (4, 15, 1000, 1),  # budget 1
    (2, 6, 1000, 100),  # candidates pruned before sorting (100 * 100 > 4096)
    (1, 1, 300, 200),  # one depth
    (2, 3, 2, 14),  # every prefix
]


@pytest.mark.parametrize(("batch", "depth", "vocab", "budget"), HEAP_CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_build_matches_heap_reference(batch: int, depth: int, vocab: int, budget: int, ties: bool) -> None:
    for seed in range(6):
        logits = _random_logits(1000 * seed + budget, batch, depth, vocab, ties=ties)
        tree = dt.build_trees(logits, budget)
        for b in range(batch):
            heap = _oracle(logits[b], budget)
            _assert_is_heap_tree(tree, b, heap)


@pytest.mark.parametrize("budget", [100, 300])
def test_build_matches_heap_reference_when_one_parent_takes_the_budget(budget: int) -> None:
    # Depth 1 sure of one token, later depths nearly flat: the tree is that token and its
    # children up to rank budget - 2, the far end of the (parent, rank) candidates kept per depth.
    logits = _random_logits(7, 2, 4, 1000) * 0.003
    logits[:, 0, 17] = 30.0
    tree = dt.build_trees(logits, budget)
    assert tree.depth[:, :3].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert max(tree.depth[0].tolist()) == 2
    for b in range(2):
        heap = _oracle(logits[b], budget)
        assert tree.tokens[b].tolist() == heap.tokens
        assert tree.parent[b].tolist() == heap.parents


def test_output_dtypes_and_shapes() -> None:
    tree = dt.build_trees(_random_logits(0, 3, 15, 100), 20)
    assert tree.tokens.dtype == torch.int64 and tree.tokens.shape == (3, 20)
    assert tree.depth.dtype == torch.int64 and tree.depth.shape == (3, 20)
    assert tree.parent.dtype == torch.int64 and tree.parent.shape == (3, 20)
    assert tree.scores.dtype == torch.float32 and tree.scores.shape == (3, 20)
    assert tree.ancestor_mask.dtype == torch.bool and tree.ancestor_mask.shape == (3, 21, 21)
    assert tree.position_offsets.dtype == torch.int64 and tree.position_offsets.shape == (3, 21)
    assert tree.num_depths == 15
    assert tree.budget == 20


def test_bfloat16_logits_give_the_same_tree_as_their_float32_values() -> None:
    logits = _random_logits(3, 2, 15, 2000).bfloat16()  # bf16 has many equal logits
    a, b = dt.build_trees(logits, 64), dt.build_trees(logits.float(), 64)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parent, b.parent)
    assert torch.equal(a.scores, b.scores)


# --- hand-written trees, literal expectations ----------------------------------------------------

HAND_PROBS = [
    [0.3, 0.1, 0.6, 0.0],
    [0.1, 0.8, 0.05, 0.05],
    [0.45, 0.25, 0.2, 0.1],
]
# Prefixes by probability: (2) .6, (2,1) .48, (0) .3, (0,1) .24, (2,1,0) .216, then (2,1,1) .12.
HAND_TOKENS = [2, 1, 0, 1, 0]
HAND_DEPTH = [1, 2, 1, 2, 3]
HAND_PARENT = [-1, 0, -1, 2, 1]
HAND_MASK = [
    [1, 0, 0, 0, 0, 0],  # root
    [1, 1, 0, 0, 0, 0],  # node 0: (2)
    [1, 1, 1, 0, 0, 0],  # node 1: (2,1)
    [1, 0, 0, 1, 0, 0],  # node 2: (0)
    [1, 0, 0, 1, 1, 0],  # node 3: (0,1)
    [1, 1, 1, 0, 0, 1],  # node 4: (2,1,0)
]
HAND_POSITIONS = [0, 1, 2, 1, 2, 3]


def test_hand_written_tree_tokens_mask_and_positions() -> None:
    tree = dt.build_trees(_probs_to_logits(HAND_PROBS), 5)
    assert tree.tokens.tolist() == [HAND_TOKENS]
    assert tree.depth.tolist() == [HAND_DEPTH]
    assert tree.parent.tolist() == [HAND_PARENT]
    assert tree.ancestor_mask.int().tolist() == [HAND_MASK]
    assert tree.position_offsets.tolist() == [HAND_POSITIONS]
    expected = [math.log(p) for p in (0.6, 0.48, 0.3, 0.24, 0.216)]
    assert tree.scores[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_hand_written_trees_in_one_batch_with_a_chain() -> None:
    # Request 1: each depth sure of one token, so the tree starts with the chain 3, 0, 2.
    chain = [[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    tree = dt.build_trees(_probs_to_logits(HAND_PROBS, chain), 5)
    assert tree.tokens.tolist() == [HAND_TOKENS, [3, 0, 2, 0, 1]]
    # After the chain every other prefix has probability 0 (log -inf): depth 1 first, by token id.
    assert tree.parent.tolist() == [HAND_PARENT, [-1, 0, 1, -1, -1]]
    assert tree.depth.tolist() == [HAND_DEPTH, [1, 2, 3, 1, 1]]
    assert tree.ancestor_mask.int().tolist() == [
        HAND_MASK,
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],
            [1, 0, 0, 0, 0, 1],
        ],
    ]
    assert tree.position_offsets.tolist() == [HAND_POSITIONS, [0, 1, 2, 3, 1, 1]]
    assert tree.scores[1].tolist() == [0.0, 0.0, 0.0, -INF, -INF]


# --- ties -----------------------------------------------------------------------------------------


def test_uniform_logits_tie_break_by_depth_then_parent_then_token_id() -> None:
    tree = dt.build_trees(torch.zeros(1, 3, 3), 8)
    # Depth 1 (all -ln 3) before depth 2 (all -2 ln 3); depth 2 by parent, then token id.
    assert tree.tokens.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert tree.parent.tolist() == [[-1, -1, -1, 0, 0, 0, 1, 1]]
    assert tree.depth.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]


def test_probability_one_tokens_keep_the_tree_prefix_closed() -> None:
    # Depth 1 is sure of token 0, depth 2 of token 2: (0) and (0, 2) both score exactly 0.
    logits = _logits([[0.0, -INF, -INF], [-INF, -INF, 0.0]])
    tree = dt.build_trees(logits, 4)
    assert tree.tokens.tolist() == [[0, 2, 1, 2]]
    assert tree.parent.tolist() == [[-1, 0, -1, -1]]
    assert tree.depth.tolist() == [[1, 2, 1, 1]]
    assert tree.scores.tolist() == [[0.0, 0.0, -INF, -INF]]


def test_equal_logits_rank_by_token_id_inside_and_at_the_top_k_boundary() -> None:
    row = [0.0] * 1000
    for token in (999, 500, 7):
        row[token] = 1.0
    assert dt.build_trees(_logits([row]), 5).tokens.tolist() == [[7, 500, 999, 0, 1]]
    # The tie straddles the top-k boundary: 4 tokens above, 996 tied, budget 6.
    row = [0.0] * 1000
    for token, value in ((998, 3.0), (3, 2.0), (600, 2.0), (2, 2.0)):
        row[token] = value
    assert dt.build_trees(_logits([row]), 6).tokens.tolist() == [[998, 2, 3, 600, 0, 1]]
    assert dt.build_trees(torch.zeros(1, 1, 1000), 4).tokens.tolist() == [[0, 1, 2, 3]]


def test_ties_are_deterministic_across_calls_and_batch_layout() -> None:
    logits = _random_logits(11, 4, 15, 300, ties=True)
    first = dt.build_trees(logits, 100)
    again = dt.build_trees(logits.clone(), 100)
    flipped = dt.build_trees(logits.flip(0), 100)
    for name in ("tokens", "depth", "parent", "scores", "ancestor_mask", "position_offsets"):
        assert torch.equal(getattr(first, name), getattr(again, name))
        assert torch.equal(getattr(first, name), getattr(flipped, name).flip(0))


# --- batch independence ---------------------------------------------------------------------------


def test_each_request_depends_only_on_its_own_logits() -> None:
    logits = _random_logits(21, 4, 15, 400)
    batch = dt.build_trees(logits, 64)
    changed = logits.clone()
    changed[1:] = _random_logits(22, 3, 15, 400)
    other = dt.build_trees(changed, 64)
    for b in range(4):
        alone = dt.build_trees(logits[b : b + 1], 64)
        for name in ("tokens", "depth", "parent", "scores", "ancestor_mask", "position_offsets"):
            assert torch.equal(getattr(batch, name)[b], getattr(alone, name)[0])
    for name in ("tokens", "parent", "scores"):
        assert torch.equal(getattr(batch, name)[0], getattr(other, name)[0])


# --- walk -----------------------------------------------------------------------------------------


def test_walk_hand_written_full_depth_accept() -> None:
    tree = dt.build_trees(_probs_to_logits(HAND_PROBS), 5)
    # Entries: root, (2), (2,1), (0), (0,1), (2,1,0). Target follows 2, 1, 0, then says 3.
    walk = dt.walk_trees(tree, torch.tensor([[2, 1, 0, 1, 1, 3]]))
    assert walk.accepted_nodes.tolist() == [[0, 1, 4]]
    assert walk.num_accepted.tolist() == [3]
    assert walk.bonus_tokens.tolist() == [3]


def test_walk_hand_written_partial_and_all_reject() -> None:
    tree = dt.build_trees(_probs_to_logits(HAND_PROBS, HAND_PROBS), 5)
    target = torch.tensor(
        [
            [0, 2, 2, 1, 0, 0],  # root -> (0) -> (0,1), then 0: (0,1,0) is not in the tree
            [3, 1, 0, 1, 1, 3],  # 3 is no depth-1 token: nothing accepted, bonus 3
        ]
    )
    walk = dt.walk_trees(tree, target)
    assert walk.accepted_nodes.tolist() == [[2, 3, -1], [-1, -1, -1]]
    assert walk.num_accepted.tolist() == [2, 0]
    assert walk.bonus_tokens.tolist() == [0, 3]


def _targets_along_tree(tree, b: int, vocab: int, gen: torch.Generator, p_follow: float) -> list[int]:
    """Per entry: with probability p_follow one of its children's tokens, else a random token."""
    maps = ref.child_maps(tree.tokens[b].tolist(), tree.parent[b].tolist())
    out = []
    for children in maps:
        if children and torch.rand((), generator=gen).item() < p_follow:
            keys = sorted(children)
            out.append(keys[int(torch.randint(len(keys), (), generator=gen))])
        else:
            out.append(int(torch.randint(vocab, (), generator=gen)))
    return out


@pytest.mark.parametrize(("batch", "depth", "vocab", "budget"), [(4, 15, 50, 64), (3, 5, 3, 30), (2, 15, 1000, 16)])
@pytest.mark.parametrize("p_follow", [0.0, 0.7, 1.0])
def test_walk_matches_naive_walk(batch: int, depth: int, vocab: int, budget: int, p_follow: float) -> None:
    gen = torch.Generator().manual_seed(budget)
    for seed in range(8):
        tree = dt.build_trees(_random_logits(seed, batch, depth, vocab, ties=seed % 2 == 1), budget)
        targets = [_targets_along_tree(tree, b, vocab, gen, p_follow) for b in range(batch)]
        walk = dt.walk_trees(tree, torch.tensor(targets))
        for b in range(batch):
            maps = ref.child_maps(tree.tokens[b].tolist(), tree.parent[b].tolist())
            accepted, bonus = ref.walk(maps, targets[b])
            assert walk.accepted_nodes[b].tolist() == accepted + [-1] * (depth - len(accepted))
            assert walk.num_accepted[b].item() == len(accepted)
            assert walk.bonus_tokens[b].item() == bonus


def test_walk_accepts_the_full_depth_of_a_chain() -> None:
    # Budget 15 over 15 certain positions: the tree is the chain, the target agrees everywhere.
    logits = torch.full((1, 15, 20), -INF)
    chain = [(3 * d) % 20 for d in range(15)]
    for d, token in enumerate(chain):
        logits[0, d, token] = 0.0
    tree = dt.build_trees(logits, 15)
    assert tree.tokens.tolist() == [chain]
    walk = dt.walk_trees(tree, torch.tensor([[*chain, 19]]))
    assert walk.accepted_nodes.tolist() == [list(range(15))]
    assert walk.num_accepted.tolist() == [15]
    assert walk.bonus_tokens.tolist() == [19]


def test_walk_keeps_the_target_dtype() -> None:
    tree = dt.build_trees(_probs_to_logits(HAND_PROBS), 5)
    walk = dt.walk_trees(tree, torch.tensor([[2, 1, 0, 1, 1, 3]], dtype=torch.int32))
    assert walk.bonus_tokens.dtype == torch.int32 and walk.bonus_tokens.tolist() == [3]
    assert walk.accepted_nodes.tolist() == [[0, 1, 4]]


# --- no host round-trip -------------------------------------------------------------------------

# Operators that hand a tensor's value to the host (or need its size from the data).
HOST_SYNC_OPS = {
    "aten._local_scalar_dense.default",  # .item(), int(t), float(t), bool(t)
    "aten.is_nonzero.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
}


def _operators(step) -> list[str]:
    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record() as record:
        step()
    return record.names


@pytest.mark.parametrize("budget", [16, 256])
def test_steps_launch_a_fixed_sequence_of_operators_without_host_sync(budget: int) -> None:
    def step(seed: int, batch: int, ties: bool):
        logits = _random_logits(seed, batch, 15, 1000, ties=ties)
        tree = dt.build_trees(logits, budget)
        targets = torch.randint(0, 1000, (batch, budget + 1), generator=torch.Generator().manual_seed(seed))
        targets[:, 0] = tree.tokens[:, 0]
        return lambda: dt.walk_trees(dt.build_trees(logits, budget), targets)

    warm = step(1, 1, False)
    warm()  # shape-only index tables are built on the first call
    first = _operators(warm)
    assert not set(first) & HOST_SYNC_OPS
    # The same operators whatever the batch size and the data: no loop depends on either.
    assert _operators(step(2, 4, True)) == first
    assert _operators(step(3, 2, False)) == first


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("logits", "budget", "message"),
    [
        (torch.zeros(3, 4), 2, "must be a tensor \\[batch, depth, vocab\\]"),
        (torch.zeros(1, 3, 4, dtype=torch.int64), 2, "must be floating point"),
        (torch.zeros(1, 3, 4), 0, "budget must be a positive int"),
        (torch.zeros(1, 3, 4), True, "budget must be a positive int"),
        (torch.zeros(1, 3, 4), 2.0, "budget must be a positive int"),
        (torch.zeros(1, 0, 4), 2, "at least one draft position and one token"),
        (torch.zeros(1, 2, 3), 13, "budget 13 exceeds the 12 distinct prefixes"),
    ],
)
def test_build_rejects_bad_input(logits: torch.Tensor, budget: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dt.build_trees(logits, budget)


def test_build_accepts_the_largest_possible_budget() -> None:
    assert dt.build_trees(torch.zeros(1, 2, 3), 12).tokens.shape == (1, 12)


@pytest.mark.parametrize(
    "target",
    [
        torch.zeros(1, 5, dtype=torch.int64),
        torch.zeros(2, 6, dtype=torch.int64),
        torch.zeros(1, 6, dtype=torch.float32),
        torch.zeros(1, 6, dtype=torch.bool),
    ],
)
def test_walk_rejects_bad_targets(target: torch.Tensor) -> None:
    tree = dt.build_trees(_probs_to_logits(HAND_PROBS), 5)
    with pytest.raises(ValueError, match="target_tokens must be an integer tensor \\[batch, budget \\+ 1\\]"):
        dt.walk_trees(tree, target)


# --- drafter logits that are not finite ------------------------------------------------------------


def _assert_well_formed(tree, vocab: int) -> None:
    """Every id in the vocabulary, every parent earlier and one depth up, no two siblings alike."""
    tokens, depth, parent = tree.tokens.cpu(), tree.depth.cpu(), tree.parent.cpu()
    assert bool(((tokens >= 0) & (tokens < vocab)).all()), tokens
    for b in range(tokens.shape[0]):
        seen = set()
        for i in range(tokens.shape[1]):
            p, d = int(parent[b, i]), int(depth[b, i])
            assert (p == -1 and d == 1) or (0 <= p < i and int(depth[b, p]) == d - 1), (b, i, p, d)
            assert (p, int(tokens[b, i])) not in seen, (b, i)
            seen.add((p, int(tokens[b, i])))


def _poison(logits: torch.Tensor, request: int, kind: str) -> torch.Tensor:
    bad = logits.clone()
    if kind == "nan everywhere":
        bad[request] = float("nan")
    elif kind == "one nan":
        bad[request, 2, 3] = float("nan")
    elif kind == "+inf":
        bad[request, 0, 5] = INF
    else:  # a depth with nothing finite
        bad[request, 1] = -INF
    return bad


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON, reason="needs Triton"))]
)
@pytest.mark.parametrize("kind", ["nan everywhere", "one nan", "+inf", "a depth of -inf"])
def test_a_request_with_non_finite_logits_gets_the_uniform_tree_and_the_others_keep_theirs(
    kind: str, kernels: bool
) -> None:
    vocab, budget = 40, 24
    logits = _random_logits(31, 3, 4, vocab).to(DEVICE)
    bad = _poison(logits, 1, kind)
    tree = dt.build_trees(bad, budget, kernels=kernels)
    _assert_well_formed(tree, vocab)
    uniform = dt.build_trees(torch.zeros(1, 4, vocab, device=DEVICE), budget, kernels=kernels)
    clean = dt.build_trees(logits.clone(), budget, kernels=kernels)
    for name in ("tokens", "depth", "parent", "scores", "ancestor_mask", "position_offsets"):
        assert torch.equal(getattr(tree, name)[1], getattr(uniform, name)[0]), name
        for b in (0, 2):
            assert torch.equal(getattr(tree, name)[b], getattr(clean, name)[b]), (name, b)
    assert torch.equal(bad[1], torch.zeros_like(bad[1]))  # replaced in place, as documented
    assert torch.equal(bad[[0, 2]], logits[[0, 2]])
    walk = dt.walk_trees(tree, torch.zeros(3, budget + 1, dtype=torch.int64, device=DEVICE), kernels=kernels)
    assert bool((walk.num_accepted >= 0).all())


def test_non_finite_logits_anywhere_never_give_an_id_outside_the_vocabulary() -> None:
    # The failure this replaces: 376 of 600 such cases gave a depth or a parent that disagreed.
    gen = torch.Generator().manual_seed(5)
    specials = torch.tensor([float("nan"), INF, -INF])
    for case in range(300):
        logits = _random_logits(100 + case, 3, 5, 60)
        spots = torch.rand(logits.shape, generator=gen) < float(torch.rand((), generator=gen)) * 0.2
        values = specials[torch.randint(0, 3, logits.shape, generator=gen)]
        logits = torch.where(spots, values, logits)
        _assert_well_formed(dt.build_trees(logits, 32, kernels=False), 60)


# --- the Triton kernels (interpreted on a CPU, compiled on a GPU) -----------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_CASES = [
    # (seed, batch, depth, vocab, budget, ties, scale)
    (11, 2, 3, 7, 10, False, 3.0),
    (12, 2, 4, 3, 40, False, 3.0),  # budget > vocab: every depth keeps whole vocabularies
    (13, 2, 5, 50, 64, True, 3.0),  # equal logits and equal prefix scores
    # Peaked logits, deep trees: the deeper depths keep only their few prefixes at or above tau.
    (14, 2, 8, 60, 64, False, 8.0),
    (15, 2, 7, 30, 100, True, 6.0),
    (16, 2, 4, 5, 60, True, 3.0),
]


def _kernel_oracle(logits_b: torch.Tensor, budget: int) -> ref.HeapTree:
    """The heap over the numbers the kernels build from, after checking those numbers independently."""
    k = min(budget, logits_b.shape[-1])
    ids, logp = dt.ranked_logprobs(logits_b, k, kernels=True)
    ranked = [ref.rank_tokens(row)[:k] for row in logits_b.float().cpu().tolist()]
    assert ids.cpu().tolist() == ranked
    expected = torch.log_softmax(logits_b.float(), dim=-1).gather(1, ids)
    torch.testing.assert_close(logp, expected, rtol=0, atol=1e-5)
    return ref.heap_tree(logp.cpu().tolist(), ids.cpu().tolist(), budget)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize(("seed", "batch", "depth", "vocab", "budget", "ties", "scale"), KERNEL_CASES)
def test_kernels_build_and_walk_match_the_heap_reference(
    seed: int, batch: int, depth: int, vocab: int, budget: int, ties: bool, scale: float
) -> None:
    logits = _random_logits(seed, batch, depth, vocab, ties=ties, scale=scale).to(DEVICE)
    tree = dt.build_trees(logits, budget, kernels=True)
    ops = dt.build_trees(logits, budget, kernels=False)
    gen = torch.Generator().manual_seed(seed)
    targets = [_targets_along_tree(tree, b, vocab, gen, 0.7) for b in range(batch)]
    walk = dt.walk_trees(tree, torch.tensor(targets).to(DEVICE), kernels=True)
    for b in range(batch):
        heap = _kernel_oracle(logits[b], budget)
        _assert_is_heap_tree(tree, b, heap)
        accepted, bonus = ref.walk(ref.child_maps(heap.tokens, heap.parents), targets[b])
        assert walk.accepted_nodes[b].tolist() == accepted + [-1] * (depth - len(accepted))
        assert walk.num_accepted[b].item() == len(accepted)
        assert walk.bonus_tokens[b].item() == bonus
    for name in ("tokens", "depth", "parent", "ancestor_mask", "position_offsets"):
        assert getattr(tree, name).dtype == getattr(ops, name).dtype, name
    assert walk.accepted_nodes.dtype == torch.int64 and walk.bonus_tokens.dtype == torch.int64


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize(
    ("device", "capability", "pdl"), [("cpu", None, False), ("cuda", (8, 6), False), ("cuda", (9, 0), True)]
)
def test_kernels_overlap_launches_only_on_hopper_and_later(device: str, capability, pdl: bool, monkeypatch) -> None:
    # Programmatic dependent launch needs compute capability 9.0 (an RTX A6000 is 8.6): asking
    # for it elsewhere would fail to launch, and Triton's interpreter on a CPU has no such thing.
    kernels = dt._kernels()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device: capability)
    kernels._pdl.cache_clear()
    try:
        assert kernels._launch_options(torch.device(device)) == {"PDL": pdl, "launch_pdl": pdl}
    finally:
        kernels._pdl.cache_clear()


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("budget", [16, 64])
def test_kernels_bound_a_depth_by_the_first_children_of_close_parents(budget: int) -> None:
    # Depth 1 a gentle ramp (token t scores 1e-4 * t below token 0); depth 2 certain (one token
    # takes all the probability: its log-prob rounds to 0, so each first child ties its parent
    # and comes after it); depths 3 and 4 flat (log-prob -log(vocab): no chain goes deeper). The
    # tree is the first budget/2 parents and their first children; the last of those children
    # scores only budget/2 * 1e-4 above the depth's bound (the budget-th parent's first child),
    # so a bound set even 0.01 too high drops children that belong in the tree.
    vocab = 2 * budget
    logits = torch.zeros(2, 4, vocab)
    logits[:, 0] = -1e-4 * torch.arange(vocab)
    logits[:, 1, 7] = 30.0
    logits = logits.to(DEVICE)
    tree = dt.build_trees(logits, budget, kernels=True)
    for b in range(2):
        _assert_is_heap_tree(tree, b, _kernel_oracle(logits[b], budget))
        assert tree.depth[b].tolist().count(2) == budget // 2


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("ties", [False, True])
def test_kernels_rank_few_candidates_and_fall_back_to_ranking_whole_rows(ties: bool, monkeypatch) -> None:
    kernels = dt._kernels()
    rows = _random_logits(21, 1, 5, 300, ties=ties).reshape(5, 300).to(DEVICE)
    if ties:
        rows[1] = 1.0  # one row of equal logits: every element is a candidate
    # 160 equal maxima over the first 10 chunks of 16: more candidates than the usual ranking
    # step takes (64 for k = 10), fewer than the cap (256).
    rows[4, :160] = 50.0
    ranked = [ref.rank_tokens(row)[:10] for row in rows.cpu().tolist()]
    ids, logp, count = kernels._ranked_logprobs(rows, 10)
    assert ids.cpu().tolist() == ranked
    assert (count >= 10).all()
    # Ordinary rows keep a few candidates, far under the whole row: the filter is what ran.
    assert count[0].item() < 64 and count[2].item() < 64 and count[3].item() < 64
    assert count[4].item() == 160
    if ties:
        assert count[1].item() == 300
    monkeypatch.setattr(kernels, "CANDIDATES", 8)  # fewer than k: every row overflows, the fallback ranks it
    ids_fb, logp_fb, count_fb = kernels._ranked_logprobs(rows, 10)
    assert (count_fb > 8).all()
    assert ids_fb.cpu().tolist() == ranked
    assert torch.equal(logp_fb, logp)
    # The fallback reads a row in chunks; 19 of 16 here (the last one past the row's end).
    monkeypatch.setattr(kernels, "CHUNK", 16)
    ids_fb, logp_fb, _ = kernels._ranked_logprobs(rows, 10)
    assert ids_fb.cpu().tolist() == ranked
    assert torch.equal(logp_fb, logp)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_walk_a_hand_written_tree() -> None:
    # Root -> 5 -> 7, root -> 6: the target picks 5 at the root and 7 after it, bonus 9.
    tree = dt.DDTree(
        tokens=torch.tensor([[5, 6, 7]], device=DEVICE),
        depth=torch.tensor([[1, 1, 2]], device=DEVICE),
        parent=torch.tensor([[-1, -1, 0]], device=DEVICE),
        scores=torch.zeros(1, 3, device=DEVICE),
        ancestor_mask=torch.tensor(
            [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool, device=DEVICE
        ),
        position_offsets=torch.tensor([[0, 1, 1, 2]], device=DEVICE),
        num_depths=2,
    )
    cases = [([5, 7, 1, 9], [0, 2], 2, 9), ([6, 2, 3, 4], [1, -1], 1, 3), ([8, 7, 1, 9], [-1, -1], 0, 8)]
    for target, nodes, count, bonus in cases:
        walk = dt.walk_trees(tree, torch.tensor([target]).to(DEVICE), kernels=True)
        assert walk.accepted_nodes.tolist() == [nodes]
        assert walk.num_accepted.tolist() == [count]
        assert walk.bonus_tokens.tolist() == [bonus]


# --- same result on a GPU (runs where CUDA is present) --------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON, reason="needs Triton"))]
)
@pytest.mark.parametrize("ties", [False, True])
def test_cuda_matches_heap_reference(ties: bool, kernels: bool) -> None:
    logits = _random_logits(5, 4, 15, 248320, ties=ties).cuda()
    oracle = _kernel_oracle if kernels else _oracle  # each over the log-probs its build used
    for budget in (1, 16, 64, 256):
        tree = dt.build_trees(logits, budget, kernels=kernels)
        assert tree.tokens.is_cuda and tree.ancestor_mask.is_cuda
        for b in range(4):
            heap = oracle(logits[b], budget)
            _assert_is_heap_tree(tree, b, heap)
        gen = torch.Generator().manual_seed(budget)
        targets = [_targets_along_tree(tree, b, 248320, gen, 0.8) for b in range(4)]
        walk = dt.walk_trees(tree, torch.tensor(targets).cuda(), kernels=kernels)
        for b in range(4):
            maps = ref.child_maps(tree.tokens[b].tolist(), tree.parent[b].tolist())
            accepted, bonus = ref.walk(maps, targets[b])
            assert walk.accepted_nodes[b].tolist() == accepted + [-1] * (15 - len(accepted))
            assert walk.bonus_tokens[b].item() == bonus


def test_graphed_trees_refuse_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="GraphedTrees needs a CUDA device, got cpu"):
        dt.GraphedTrees(1, 15, 100, 16, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_graphed_trees_match_eager_calls() -> None:
    graphed = dt.GraphedTrees(4, 15, 248320, 64)  # the kernels, where Triton is installed
    for seed in range(3):
        logits = _random_logits(seed, 4, 15, 248320, ties=seed == 2).cuda()
        eager = dt.build_trees(logits, 64)
        tree = graphed.build(logits)
        for name in ("tokens", "depth", "parent", "scores", "ancestor_mask", "position_offsets"):
            assert torch.equal(getattr(tree, name), getattr(eager, name)), name
        gen = torch.Generator().manual_seed(seed)
        targets = torch.tensor([_targets_along_tree(eager, b, 248320, gen, 0.8) for b in range(4)]).cuda()
        for got, want in zip(graphed.walk(targets), dt.walk_trees(eager, targets), strict=True):
            assert torch.equal(got, want)
