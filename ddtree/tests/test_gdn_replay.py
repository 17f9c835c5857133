"""Gated DeltaNet verification by replay (ddtree/common/gdn_replay.py), on the CPU.

The kernels run in Triton's interpreter against a plain float32 PyTorch reference of the gated delta
rule (vLLM 0.20.1's fused_sigmoid_gating kernel, written out), for chains and for trees (each node's
reference is the chain along its ancestor path), with the committed state after the accepted tokens.
Against vLLM 0.20.1's own kernel (the real wheel's source, run in the same interpreter): a chain's
outputs and committed state are bit for bit stock's (the outputs; the state stock stores in the slot of
the last accepted token), and a tree's outputs bit for bit the change set's tree kernel's on a float32
cache. Small shapes: the interpreter is slow.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from ddtree import HOME
from ddtree.tests import release_files
from ddtree.tests.vllm_modules import GDN_KERNELS, load_gdn_kernels

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs the kernels in Triton's interpreter (CPU)",
    ),
    pytest.mark.usefixtures("interpreter_scalar_index"),  # ddtree/tests/conftest.py
]

H, HV, K, V = 2, 4, 16, 64  # two V tiles of 32 (stock's BV), two value heads per key head
MAX_DEPTH = 16


@pytest.fixture(scope="module")
def gr() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gdn_replay", HOME / "common/gdn_replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """vLLM 0.20.1's recurrent kernel, stock and with the change set's tree support."""
    before = set(sys.modules)
    out = {
        "stock": load_gdn_kernels(release_files.pristine(list(GDN_KERNELS.values())), tmp_path_factory.mktemp("s")),
        "patched": load_gdn_kernels(release_files.patched(list(GDN_KERNELS.values())), tmp_path_factory.mktemp("p")),
    }
    yield {k: v["fused_sigmoid_gating"] for k, v in out.items()}
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]


# ---------------------------------------------------------------------------
# the reference
def reference_step(h, q, k, v, a, b, A_log, dt_bias):
    """One token of the gated delta rule as vLLM's kernel computes it, in float32: h [HV, V, K]."""
    x = a + dt_bias
    g = -torch.exp(A_log) * torch.where(x <= 20.0, torch.log(1 + torch.exp(x)), x)
    beta = torch.sigmoid(b)
    q = F.normalize(q, dim=-1, eps=1e-6) * K**-0.5
    k = F.normalize(k, dim=-1, eps=1e-6)
    q, k = q.repeat_interleave(HV // H, 0), k.repeat_interleave(HV // H, 0)
    h = h * torch.exp(g)[:, None, None]
    v = (v - (h * k[:, None, :]).sum(-1)) * beta[:, None]
    h = h + v[:, :, None] * k[:, None, :]
    return h, (h * q[:, None, :]).sum(-1)


def reference_path(inputs, h, tokens):
    """The state after the given global tokens and the last one's output."""
    o = None
    for t in tokens:
        h, o = reference_step(
            h,
            inputs["q"][0, t].float(),
            inputs["k"][0, t].float(),
            inputs["v"][0, t].float(),
            inputs["a"][t].float(),
            inputs["b"][t].float(),
            inputs["A_log"],
            inputs["dt_bias"],
        )
    return h, o


def ancestors(parents: list[int], i: int) -> list[int]:
    """Rows from the root to row i (inclusive)."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


# ---------------------------------------------------------------------------
# cases
def make_inputs(rows: list[int], seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = sum(rows)
    inputs = dict(
        A_log=torch.randn(HV, generator=g) * 0.5,
        dt_bias=torch.randn(HV, generator=g) * 0.5,
        a=torch.randn(t, HV, generator=g).to(dtype),
        b=torch.randn(t, HV, generator=g).to(dtype),
        q=torch.randn(1, t, H, K, generator=g).to(dtype),
        k=torch.randn(1, t, H, K, generator=g).to(dtype),
        v=torch.randn(1, t, HV, V, generator=g).to(dtype),
    )
    h0 = torch.randn(len(rows), HV, V, K, generator=g) * 0.1
    return inputs, h0


def cu_of(rows: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)


def random_tree(size: int, rng: random.Random, max_depth: int = MAX_DEPTH) -> list[int]:
    """Parent rows of a tree of ``size`` rows (row 0 the root), parents first, depth <= max_depth."""
    parents, depth = [-1], [0]
    for _ in range(1, size):
        p = rng.choice([i for i in range(len(parents)) if depth[i] < max_depth])
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def pool(h0: torch.Tensor, slots: list[int], dtype=torch.float32) -> torch.Tensor:
    """A state cache of 1 + 2 * len(h0) slots, noise everywhere, request n's state in slots[n]."""
    g = torch.Generator().manual_seed(99)
    state = torch.randn(1 + 2 * len(h0), HV, V, K, generator=g).to(dtype)
    for n, s in enumerate(slots):
        if s > 0:
            state[s] = h0[n].to(dtype)
    return state


def verify(gr, inputs, state, rows, slots, parents=None):
    cu = cu_of(rows)
    kw = {}
    if parents is not None:
        pr = torch.tensor(parents, dtype=torch.int32)
        gr.check_parents(pr, cu)
        kw = dict(parent_rows=pr, paths=gr.tree_paths(pr, cu, max(rows)))
    out = torch.full((1, sum(rows), HV, V), float("nan"), dtype=inputs["q"].dtype)
    gr.gdn_verify(
        **inputs, state=state, cu_seqlens=cu, state_indices=torch.tensor(slots, dtype=torch.int32), out=out, **kw
    )
    return out[0]


def commit(gr, inputs, state, rows, slots, accepted, accepted_rows=None):
    inputs = {k: v for k, v in inputs.items() if k != "q"}
    kw = {}
    if accepted_rows is not None:
        width = max(len(r) for r in accepted_rows) or 1
        table = torch.full((len(rows), width), -7, dtype=torch.int32)
        for n, r in enumerate(accepted_rows):
            table[n, : len(r)] = torch.tensor(r, dtype=torch.int32)
        kw = dict(accepted_rows=table)
    gr.gdn_commit(
        **inputs,
        state=state,
        cu_seqlens=cu_of(rows),
        state_indices=torch.tensor(slots, dtype=torch.int32),
        num_accepted=torch.tensor(accepted, dtype=torch.int32),
        **kw,
    )


# ---------------------------------------------------------------------------
# chains
def test_a_chain_verifies_every_token_and_commits_only_the_accepted_ones(gr):
    # Three requests of different lengths: nothing accepted, some, all of them.
    rows, accepted = [5, 16, 3], [0, 7, 3]
    slots = [3, 1, 6]
    inputs, h0 = make_inputs(rows, seed=1)
    state = pool(h0, slots)
    before = state.clone()
    out = verify(gr, inputs, state, rows, slots)
    assert torch.equal(state, before), "verification must not write any state"
    cu = cu_of(rows).tolist()
    for n, (bos, eos) in enumerate(itertools.pairwise(cu)):
        h = h0[n]
        for t in range(bos, eos):
            h, o = reference_path(inputs, h, [t])
            torch.testing.assert_close(out[t], o, rtol=1e-4, atol=1e-5)

    commit(gr, inputs, state, rows, slots, accepted)
    for n, (bos, count) in enumerate(zip(cu, accepted, strict=False)):
        want, _ = reference_path(inputs, h0[n], range(bos, bos + count))
        torch.testing.assert_close(state[slots[n]], want, rtol=1e-4, atol=1e-5)
    assert torch.equal(state[slots[0]], before[slots[0]]), "nothing accepted leaves the state as it was"
    others = [s for s in range(state.shape[0]) if s not in slots]
    assert torch.equal(state[others], before[others]), "a slot of no request was written"


@pytest.mark.parametrize("pad", [-1, 0])
def test_a_padded_request_is_neither_read_nor_written(gr, pad):
    rows, slots, accepted = [4, 4, 2], [2, pad, 5], [4, 4, 1]
    inputs, h0 = make_inputs(rows, seed=2)
    state = pool(h0, slots)
    before = state.clone()
    out = verify(gr, inputs, state, rows, slots)
    assert out[4:8].isnan().all(), "the padded request's outputs stay as they were"
    assert not out[:4].isnan().any() and not out[8:].isnan().any()
    commit(gr, inputs, state, rows, slots, accepted)
    changed = sorted({int(s) for s in (state != before).nonzero()[:, 0].tolist()})
    assert changed == [2, 5]


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_a_chain_is_bit_identical_to_vllm_0_20_1(gr, release, cache):
    """Outputs as stock's spec-decode kernel gives them; the committed state as stock stores it in the
    slot of the last accepted token (the one the next step reads), bit for bit."""
    rows, accepted = [6, 3, 1], [4, 3, 1]
    inputs, h0 = make_inputs(rows, seed=4, dtype=torch.bfloat16)
    n, width = len(rows), max(rows)
    stock_state = torch.zeros(1 + n * width, HV, V, K, dtype=cache)
    indices = torch.arange(1, 1 + n * width, dtype=torch.int32).view(n, width)
    for r in range(n):
        stock_state[indices[r, 0]] = h0[r].to(cache)
    stock_out, _ = release["stock"].fused_sigmoid_gating_delta_rule_update(
        **inputs,
        initial_state=stock_state,
        inplace_final_state=True,
        cu_seqlens=cu_of(rows),
        ssm_state_indices=indices,
        num_accepted_tokens=torch.ones(n, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
    )
    slots = [2, 5, 1]
    state = pool(h0, slots, cache)
    out = verify(gr, inputs, state, rows, slots)
    assert torch.equal(out, stock_out[0])
    commit(gr, inputs, state, rows, slots, accepted)
    for r in range(n):
        assert torch.equal(state[slots[r]], stock_state[indices[r, accepted[r] - 1]])


# ---------------------------------------------------------------------------
# trees
TREES = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0],
    "siblings_first": [-1, 0, 0, 0, 1, 2, 4],
    "deep_branch": [-1, 0, 1, 1, 3, 2, 5, 4],
}


def tree_case(budgets: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tree(budget + 1, rng) for budget in budgets]


@pytest.mark.parametrize(
    "trees",
    [
        pytest.param([TREES[t] for t in sorted(TREES)], id="hand"),
        pytest.param(tree_case([15, 32], seed=7), id="random15_32"),
        pytest.param(tree_case([64], seed=8), id="random64"),
        # Depth 16: a chain, then a sibling of its deepest node (replays 16 ancestors), beside a tree.
        pytest.param([[-1, *range(16), 15], random_tree(33, random.Random(3))], id="depth16_and_tree"),
    ],
)
def test_a_tree_node_gets_the_output_of_the_chain_along_its_path(gr, trees):
    rows = [len(p) for p in trees]
    inputs, h0 = make_inputs(rows, seed=len(rows) + rows[0])
    slots = [2 * n + 1 for n in range(len(rows))]
    state = pool(h0, slots)
    before = state.clone()
    out = verify(gr, inputs, state, rows, slots, [p for t in trees for p in t])
    assert torch.equal(state, before)
    cu = cu_of(rows).tolist()
    for n, parents in enumerate(trees):
        for i in range(len(parents)):
            _, o = reference_path(inputs, h0[n], [cu[n] + j for j in ancestors(parents, i)])
            torch.testing.assert_close(out[cu[n] + i], o, rtol=1e-4, atol=2e-5)

    # Commit each request's path to its deepest last row (a leaf), or nothing, or the root only.
    paths = [ancestors(trees[0], len(trees[0]) - 1)] + [[0] if n % 2 else [] for n in range(1, len(trees))]
    commit(gr, inputs, state, rows, slots, [len(p) for p in paths], accepted_rows=paths)
    for n, path in enumerate(paths):
        want, _ = reference_path(inputs, h0[n], [cu[n] + j for j in path])
        torch.testing.assert_close(state[slots[n]], want, rtol=1e-4, atol=2e-5)


def test_a_tree_is_bit_identical_to_chains_along_its_paths(gr):
    """Replaying a branch recomputes exactly what a chain computes: a node's output and an accepted
    path's committed state are bit for bit those of the chain made of the node's ancestors."""
    parents = random_tree(33, random.Random(11))
    inputs, h0 = make_inputs([33], seed=12)
    state = pool(h0, [1])
    out = verify(gr, inputs, state, [33], [1], parents)
    for leaf in (32, 20, 5):
        path = ancestors(parents, leaf)
        chain = {k: (v[:, path] if k in "qkv" else v[path] if k in "ab" else v) for k, v in inputs.items()}
        chain_state = pool(h0, [1])
        chain_out = verify(gr, chain, chain_state, [len(path)], [1])
        assert torch.equal(out[path], chain_out)
        tree_state = pool(h0, [1])
        commit(gr, inputs, tree_state, [33], [1], [len(path)], accepted_rows=[path])
        commit(gr, chain, chain_state, [len(path)], [1], [len(path)])
        assert torch.equal(tree_state[1], chain_state[1])


def test_a_tree_is_bit_identical_to_the_change_set_on_a_float32_cache(gr, release):
    trees = tree_case([15, 32], seed=21)
    rows = [len(t) for t in trees]
    flat = [p for t in trees for p in t]
    inputs, h0 = make_inputs(rows, seed=22, dtype=torch.bfloat16)
    n, width = len(rows), max(rows)
    cs_state = torch.zeros(1 + n * width, HV, V, K)
    indices = torch.arange(1, 1 + n * width, dtype=torch.int32).view(n, width)
    for r in range(n):
        cs_state[indices[r, 0]] = h0[r]
    cs_out, _ = release["patched"].fused_sigmoid_gating_delta_rule_update(
        **inputs,
        initial_state=cs_state,
        inplace_final_state=True,
        cu_seqlens=cu_of(rows),
        ssm_state_indices=indices,
        num_accepted_tokens=torch.ones(n, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        parent_rows=torch.tensor(flat, dtype=torch.int32),
    )
    state = pool(h0, [1, 2])
    assert torch.equal(verify(gr, inputs, state, rows, [1, 2], flat), cs_out[0])
    leaves = [len(t) - 1 for t in trees]
    paths = [ancestors(t, leaf) for t, leaf in zip(trees, leaves, strict=True)]
    commit(gr, inputs, state, rows, [1, 2], [len(p) for p in paths], accepted_rows=paths)
    for r in range(n):
        assert torch.equal(state[1 + r], cs_state[indices[r, leaves[r]]])


# ---------------------------------------------------------------------------
# the tree's metadata
def test_tree_paths_lists_each_rows_ancestors_root_first(gr):
    parents = torch.tensor([-1, 0, 0, 1, 3, -1, 0, 0], dtype=torch.int32)  # two requests: 5 and 3 rows
    paths, depths = gr.tree_paths(parents, torch.tensor([0, 5, 8], dtype=torch.int32), 5)
    assert depths.tolist() == [0, 1, 1, 2, 3, 0, 1, 1]
    assert paths.tolist() == [
        [0, -1, -1, -1, -1],
        [0, 1, -1, -1, -1],
        [0, 2, -1, -1, -1],
        [0, 1, 3, -1, -1],
        [0, 1, 3, 4, -1],
        [5, -1, -1, -1, -1],
        [5, 6, -1, -1, -1],
        [5, 7, -1, -1, -1],
    ]


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([0, 0, 1], "request 0, row 0: parent 0; it must be -1 \\(the root\\)"),
        ([-1, 0, 2], "request 0, row 2: parent 2; it must be an earlier row, 0 to 1"),
        ([-1, 3, 1], "request 0, row 1: parent 3; it must be an earlier row, 0 to 0"),
        ([-1, 0, 1, -1, -1], "request 1, row 1: parent -1"),
    ],
)
def test_a_parent_array_the_kernel_cannot_follow_is_refused(gr, parents, message):
    rows = [3] if len(parents) == 3 else [3, 2]
    with pytest.raises(ValueError, match=message):
        gr.check_parents(torch.tensor(parents, dtype=torch.int32), cu_of(rows))


def test_one_parent_per_token(gr):
    with pytest.raises(ValueError, match="one entry per token \\(4\\)"):
        gr.check_parents(torch.tensor([-1, 0, 1], dtype=torch.int32), cu_of([4]))


def test_a_tree_without_its_paths_is_refused(gr):
    inputs, h0 = make_inputs([3], seed=1)
    with pytest.raises(ValueError, match="a tree needs both parent_rows and paths"):
        gr.gdn_verify(
            **inputs,
            state=pool(h0, [1]),
            cu_seqlens=cu_of([3]),
            state_indices=torch.tensor([1], dtype=torch.int32),
            parent_rows=torch.tensor([-1, 0, 0], dtype=torch.int32),
        )
