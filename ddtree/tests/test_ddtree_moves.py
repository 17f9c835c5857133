"""DDTree's accepted-path moves as one launch per kind (ddtree/common/ddtree_moves.py).

``compact`` (the runtime, vllm-0.20.1/added/ddtree.py) is run twice on the same step and the same
caches: with torch indexing (the definition) and with the kernels in Triton's interpreter. The
caches must come out byte for byte the same (compiled on a GPU where there is one), for several layers and KV-cache groups, caches laid
out as vLLM lays them out (KV in a permuted physical order, recurrent states as views into pages
larger than the state, convolution windows transposed), requests whose moved nodes land on rows
another move leaves, requests without drafts or without a tree, and caches the kernels cannot
take (the runtime then keeps torch indexing for them).
"""

from __future__ import annotations

import os

import pytest
import torch

from ddtree import HOME

# On a machine with an NVIDIA GPU the same tests run the compiled kernels on it (where programs
# really run side by side), plus one cache too large for 32-bit offsets.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = [
    pytest.mark.skipif(
        DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs the kernels on a GPU, or in Triton's interpreter (TRITON_INTERPRET=1) on the CPU",
    ),
    pytest.mark.usefixtures("interpreter_scalar_index"),  # ddtree/tests/conftest.py
]

WIDTH = 4  # the Gated DeltaNet convolution's kernel width


def random_step(dd, g: torch.Generator, num_reqs: int, budget: int, *, no_drafts=(), no_tree=()):
    """Random trees (parents before children) and, per request, an accepted path to a random node.
    Request ``i`` has ``query_start`` ``i * (budget + 3)``: rows between requests stay untouched."""
    parent = torch.full((num_reqs, budget), -1, dtype=torch.int64)
    depth = torch.ones(num_reqs, budget, dtype=torch.int64)
    accepted = torch.full((num_reqs, budget), -1, dtype=torch.int64)
    for r in range(num_reqs):
        for i in range(1, budget):
            p = int(torch.randint(-1, i, (1,), generator=g))
            parent[r, i] = p
            depth[r, i] = 1 if p < 0 else depth[r, p] + 1
        # Request 0 accepts the path to its last node, which is off the first rows unless the tree is a chain.
        path, node = [], budget - 1 if r == 0 else int(torch.randint(0, budget, (1,), generator=g))
        while node >= 0:
            path.append(node)
            node = int(parent[r, node])
        accepted[r, : len(path)] = torch.tensor(path[::-1], dtype=torch.int64)
    has_drafts = torch.tensor([r not in no_drafts for r in range(num_reqs)])
    has_tree = has_drafts & torch.tensor([r not in no_tree for r in range(num_reqs)])
    accepted[~has_tree] = -1
    return dd._StepTrees(
        num_reqs=num_reqs,
        has_drafts=has_drafts.to(DEV),
        has_tree=has_tree.to(DEV),
        num_drafts=torch.where(has_drafts, budget, 0).to(DEV),
        query_start=(torch.arange(num_reqs) * (budget + 3)).to(DEV),
        parent=parent.to(DEV),
        depth=depth.to(DEV),
        ancestor_mask=torch.zeros(num_reqs, budget + 1, budget + 1, dtype=torch.bool, device=DEV),
        seq_positions=torch.zeros(num_reqs * (budget + 3), dtype=torch.int64, device=DEV),
        accepted_nodes=accepted.to(DEV),
        num_accepted=(accepted >= 0).sum(1).to(DEV),
    )


def kv_caches(g: torch.Generator, layers: int, blocks: int, block: int, heads: int, dim: int) -> list[torch.Tensor]:
    """``[2, blocks, block, heads, dim]`` caches stored heads-first (a permuted physical layout)."""
    return [
        torch.randn(2, blocks, heads, block, dim, generator=g).to(DEV, torch.bfloat16).transpose(2, 3)
        for _ in range(layers)
    ]


def recurrent_groups(dd, g: torch.Generator, num_reqs: int, budget: int, groups: int, layers: int):
    """Per group: conv windows ``[lines, channels, WIDTH - 1 + budget]`` (stored window-first, then
    transposed, as vLLM keeps them) and float32 states ``[slots, 3, 4, 5]`` as views into pages of
    one more state's worth, and a block table that gives each request its own slots."""
    slots = 2 + num_reqs * (budget + 1)
    out = []
    for _ in range(groups):
        convs = [
            torch.randn(slots, WIDTH - 1 + budget, 6, generator=g).to(DEV, torch.bfloat16).transpose(1, 2)
            for _ in range(layers)
        ]
        pages = [torch.randn(slots, 2 * 60, generator=g).to(DEV) for _ in range(layers)]
        states = [p[:, 60:].view(slots, 3, 4, 5) for p in pages]
        table = torch.randperm(slots, generator=g)[: num_reqs * (budget + 1)].view(num_reqs, budget + 1)
        out.append(
            dd.RecurrentGroup(conv_states=convs, ssm_states=states, state_slots=table.int().to(DEV), width=WIDTH)
        )
    return out


def compact_both_ways(dd, step, kv, slot_mapping, recurrent, budget: int):
    """The caches after compact() with torch indexing and after compact() with the kernels."""
    results = []
    for kernels in (False, True):
        rt = dd.DDTreeRuntime(
            budget=budget,
            depth=budget,
            device=DEV,
            max_num_reqs=step.num_reqs,
            max_num_tokens=step.seq_positions.shape[0],
            move_kernels=kernels,
        )
        caches = [c.clone() for c in kv]
        groups = [
            dd.RecurrentGroup(
                conv_states=[c.clone() for c in grp.conv_states],
                ssm_states=[s.clone() for s in grp.ssm_states],
                state_slots=grp.state_slots,
                width=grp.width,
            )
            for grp in recurrent
        ]
        rt._step = step
        rt.compact([(slot_mapping, caches)], [], step.seq_positions.clone(), recurrent=groups)
        results.append((caches, groups, rt))
    return results


def assert_same_caches(torch_way, kernel_way):
    kv_t, groups_t, _ = torch_way
    kv_k, groups_k, _ = kernel_way
    for a, b in zip(kv_t, kv_k, strict=True):
        assert torch.equal(a, b)
    for ga, gb in zip(groups_t, groups_k, strict=True):
        for a, b in zip(ga.conv_states + ga.ssm_states, gb.conv_states + gb.ssm_states, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernels_move_every_layer_as_torch_indexing_does(dd, seed):
    g = torch.Generator().manual_seed(seed)
    budget, num_reqs = 6, 4
    step = random_step(dd, g, num_reqs, budget, no_drafts=(2,), no_tree=(3,))
    rows = step.seq_positions.shape[0]
    slot_mapping = torch.randperm(4 * 8, generator=g)[:rows].to(DEV)  # a block table that is not the identity
    kv = kv_caches(g, layers=3, blocks=4, block=8, heads=2, dim=5)
    recurrent = recurrent_groups(dd, g, num_reqs, budget, groups=2, layers=2)
    torch_way, kernel_way = compact_both_ways(dd, step, kv, slot_mapping, recurrent, budget)
    assert_same_caches(torch_way, kernel_way)
    # The step moved something in every kind of cache (the test is not vacuous) ...
    assert any(not torch.equal(a, b) for a, b in zip(kv, torch_way[0], strict=True))
    moved = [
        (a, b)
        for grp, out in zip(recurrent, torch_way[1], strict=True)
        for a, b in zip(grp.conv_states + grp.ssm_states, out.conv_states + out.ssm_states, strict=True)
    ]
    assert all(not torch.equal(a, b) for a, b in moved)
    # ... and the kernels' tables were made for all three kinds.
    assert [t is not None for t in kernel_way[2]._tables.values()] == [True, True, True]


def test_moved_nodes_that_land_on_rows_other_moves_leave_are_read_first(dd):
    """Accepted nodes 1, 2, 3 (rows 2, 3, 4) move to rows 1, 2, 3: each destination but the first
    is the source of the move before it, so a move that wrote before reading would copy a copy."""
    g = torch.Generator().manual_seed(7)
    budget = 4
    step = random_step(dd, g, 1, budget)
    step.parent = torch.tensor([[-1, -1, 1, 2]], device=DEV)
    step.depth = torch.tensor([[1, 1, 2, 3]], device=DEV)
    step.accepted_nodes = torch.tensor([[1, 2, 3, -1]], device=DEV)
    step.num_accepted = torch.tensor([3], device=DEV)
    kv = [torch.arange(2 * 1 * 8, dtype=torch.float32, device=DEV).view(2, 1, 8, 1, 1)]
    torch_way, kernel_way = compact_both_ways(dd, step, kv, torch.arange(8, device=DEV), [], budget)
    assert kernel_way[0][0][0, 0, :5, 0, 0].tolist() == [0, 2, 3, 4, 4]
    assert_same_caches(torch_way, kernel_way)


def test_caches_the_kernels_cannot_take_are_moved_with_torch_indexing(dd):
    g = torch.Generator().manual_seed(3)
    budget, num_reqs = 5, 2
    step = random_step(dd, g, num_reqs, budget)
    rows = step.seq_positions.shape[0]
    # Layers of two shapes: no one table describes them.
    kv = kv_caches(g, layers=1, blocks=4, block=8, heads=2, dim=5) + kv_caches(g, 1, 4, 8, 2, 3)
    recurrent = recurrent_groups(dd, g, num_reqs, budget, groups=1, layers=2)
    recurrent[0].ssm_states[1] = recurrent[0].ssm_states[1].transpose(1, 2)  # a state that is not contiguous
    torch_way, kernel_way = compact_both_ways(dd, step, kv, torch.arange(rows, device=DEV), recurrent, budget)
    assert_same_caches(torch_way, kernel_way)
    tables = {key[0]: table for key, table in kernel_way[2]._tables.items()}
    assert tables["kv"] is None and tables["state"] is None and tables["window"] is not None


def test_the_runner_s_new_caches_get_new_tables(dd):
    """The runner forgets the tables when it allocates its caches, so none keeps the old caches
    alive or points into them."""
    g = torch.Generator().manual_seed(5)
    budget = 4
    step = random_step(dd, g, 2, budget)
    rows = step.seq_positions.shape[0]
    *_, (_caches, _groups, rt) = compact_both_ways(
        dd, step, kv_caches(g, 2, 4, 8, 2, 5), torch.arange(rows, device=DEV), [], budget
    )
    assert len(rt._tables) == 1
    rt.forget_tables()
    assert rt._tables == {}
    fresh = kv_caches(g, 2, 4, 8, 2, 5)
    rt._step = step
    rt.compact([(torch.arange(rows, device=DEV), fresh)], [], step.seq_positions.clone(), recurrent=[])
    [table] = rt._tables.values()
    assert table.ref.data_ptr() == fresh[0].data_ptr()


def test_the_runner_forgets_the_tables_where_it_allocates_its_caches():
    diff = (HOME / "vllm-0.20.1/patches/vllm__v1__worker__gpu_model_runner.py.diff").read_text()
    allocate = diff.index("initialize_kv_cache_tensors(")
    assert "+            self.ddtree.forget_tables()" in diff[allocate : allocate + 800]


@pytest.mark.skipif(DEV.type != "cuda", reason="needs a GPU with about 40 GiB free")
def test_caches_past_32_bit_offsets_are_moved_where_they_are(dd):
    """Two layers of 4.5 GB uint8 KV caches: the moved slots sit at the end, so their offsets, and
    the V half's offset from K, are past 2**31 (an H200's cache is more than 100 GiB)."""
    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("less than 40 GiB free on the GPU")
    g = torch.Generator().manual_seed(11)
    budget, num_reqs, blocks = 6, 3, 1_100_000
    step = random_step(dd, g, num_reqs, budget)
    rows = step.seq_positions.shape[0]
    kv = [torch.randint(0, 256, (2, blocks, 16, 1, 128), dtype=torch.uint8, device=DEV) for _ in range(2)]
    assert kv[0][1].data_ptr() - kv[0].data_ptr() > 2**31
    slot_mapping = blocks * 16 - 1 - torch.arange(rows, device=DEV)
    torch_way, kernel_way = compact_both_ways(dd, step, kv, slot_mapping, [], budget)
    assert_same_caches(torch_way, kernel_way)
    assert not torch.equal(kv[1], torch_way[0][1])
    assert [t is not None for t in kernel_way[2]._tables.values()] == [True]
