"""DDTree on Gated DeltaNet hybrids: the change set's tree-aware GDN kernels, on the CPU.

The kernels are vLLM 0.20.1's own Triton kernels (the recurrent gated delta rule update and the
causal convolution update of the spec-decode path) with the change set applied, run in Triton's
interpreter. Each tree node must continue its parent's state, so the reference runs every node's
ancestor path as a plain chain, token by token, in float32. A chain given as a tree, and no tree at
all, must give the stock kernels' results bit for bit. The commit (``compact``) is checked by
running the stock chain kernel on the next step from what the tree step left behind.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from ddtree.tests import release_files
from ddtree.tests.vllm_modules import (
    GDN_KERNELS,
    TREE_PARENTS,
    committed_tree_step,
    load_ddtree_runtime,
    load_gdn_kernels,
)

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs the kernels in Triton's interpreter (CPU)",
    ),
    pytest.mark.usefixtures("interpreter_scalar_index"),  # ddtree/tests/conftest.py
]

H, HV, K, V = 1, 2, 16, 16  # key heads, value heads, key and value head dims
WIDTH = 4  # Qwen3.5/3.6's convolution
DIM = 24  # convolution channels


@pytest.fixture(scope="module", autouse=True)
def no_vllm_left_behind():
    """The stand-in vllm modules the kernels and the runtime load go when this module's tests end
    (other tests check that vLLM itself was never imported)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    paths = list(GDN_KERNELS.values())
    return {
        "stock": load_gdn_kernels(release_files.pristine(paths), tmp_path_factory.mktemp("stock")),
        "patched": load_gdn_kernels(release_files.patched(paths), tmp_path_factory.mktemp("patched")),
    }


def ancestors(parents: list[int], i: int) -> list[int]:
    """Rows from the root to row i (inclusive)."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


# ---------------------------------------------------------------------------
# recurrent state
def recurrent_inputs(rows: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    t = sum(rows)
    return dict(
        A_log=torch.randn(HV, generator=g) * 0.5,
        dt_bias=torch.randn(HV, generator=g) * 0.5,
        a=torch.randn(t, HV, generator=g),
        b=torch.randn(t, HV, generator=g),
        q=torch.randn(1, t, H, K, generator=g),
        k=torch.randn(1, t, H, K, generator=g),
        v=torch.randn(1, t, HV, V, generator=g),
    ), torch.randn(len(rows), HV, V, K, generator=g) * 0.1


def reference_step(h, q, k, v, a, b, A_log, dt_bias):
    """One token of the gated delta rule (vLLM's kernel, written out): h [HV, V, K]."""
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    q = F.normalize(q, dim=-1, eps=1e-6) * K**-0.5
    k = F.normalize(k, dim=-1, eps=1e-6)
    q, k = q.repeat_interleave(HV // H, 0), k.repeat_interleave(HV // H, 0)
    h = h * torch.exp(g)[:, None, None]
    v = (v - (h * k[:, None, :]).sum(-1)) * beta[:, None]
    h = h + v[:, :, None] * k[:, None, :]
    return h, (h * q[:, None, :]).sum(-1)


def run_recurrent(mod, inputs, h0, rows, parents, num_accepted):
    """The spec-decode call of vLLM 0.20.1's GDN layer: one state slot per row of each request."""
    n, width = len(rows), max(rows)
    slots = 1 + n * width
    state = torch.zeros(slots, HV, V, K)
    indices = torch.arange(1, slots).view(n, width).to(torch.int32)
    for r in range(n):
        state[indices[r, num_accepted[r] - 1]] = h0[r]
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    kw = {} if parents is None else {"parent_rows": torch.tensor(parents, dtype=torch.int32)}
    out, _ = mod.fused_sigmoid_gating_delta_rule_update(
        **inputs,
        initial_state=state,
        inplace_final_state=True,
        cu_seqlens=cu,
        ssm_state_indices=indices,
        num_accepted_tokens=torch.tensor(num_accepted, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        **kw,
    )
    return out.squeeze(0), state, indices, cu


TREES = {
    "chain": [-1, 0, 1, 2, 3],
    "siblings_first": [-1, 0, 0, 0, 1, 2, 4],  # parents not adjacent
    "star": [-1, 0, 0, 0, 0],
    "deep_branch": [-1, 0, 1, 1, 3, 2, 5, 4],
}


@pytest.mark.parametrize("tree", sorted(TREES))
def test_each_node_continues_its_parents_recurrent_state(kernels, tree):
    parents = TREES[tree]
    rows = [len(parents), len(parents)]
    flat = parents + parents
    inputs, h0 = recurrent_inputs(rows, seed=3)
    out, state, indices, cu = run_recurrent(kernels["patched"]["fused_sigmoid_gating"], inputs, h0, rows, flat, [2, 1])
    for r in range(2):
        start = int(cu[r])
        for i in range(rows[r]):
            h = h0[r]
            for j in ancestors(parents, i):
                t = start + j
                h, o = reference_step(
                    h,
                    inputs["q"][0, t],
                    inputs["k"][0, t],
                    inputs["v"][0, t],
                    inputs["a"][t],
                    inputs["b"][t],
                    inputs["A_log"],
                    inputs["dt_bias"],
                )
            torch.testing.assert_close(out[start + i], o, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(state[indices[r, i]], h, rtol=1e-4, atol=1e-5)


def test_a_chain_is_bit_identical_to_the_stock_kernel(kernels):
    rows = [5, 3]
    chain = [-1, 0, 1, 2, 3, -1, 0, 1]
    inputs, h0 = recurrent_inputs(rows, seed=5)
    stock = run_recurrent(kernels["stock"]["fused_sigmoid_gating"], inputs, h0, rows, None, [1, 3])
    patched = kernels["patched"]["fused_sigmoid_gating"]
    for parents in (None, chain):
        got = run_recurrent(patched, inputs, h0, rows, parents, [1, 3])
        assert torch.equal(got[0], stock[0])
        assert torch.equal(got[1], stock[1])


def test_a_tree_needs_per_row_state_slots(kernels):
    mod = kernels["patched"]["fused_sigmoid_gating"]
    inputs, _ = recurrent_inputs([3], seed=1)
    with pytest.raises(ValueError, match="per-token state slots"):
        mod.fused_sigmoid_gating_delta_rule_update(
            **inputs,
            initial_state=torch.zeros(4, HV, V, K),
            cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
            ssm_state_indices=torch.tensor([1], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
            parent_rows=torch.tensor([-1, 0, 0], dtype=torch.int32),
        )


# ---------------------------------------------------------------------------
# convolution window
def conv_inputs(rows: list[int], budget: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = sum(rows)
    lines = len(rows) + 1
    state = torch.randn(lines, DIM, WIDTH - 1 + budget, generator=g)
    return (
        torch.randn(t, DIM, generator=g),
        state,
        torch.randn(DIM, WIDTH, generator=g),
        torch.randn(DIM, generator=g),
    )


def run_conv(mod, x, state, weight, bias, rows, parents, num_accepted):
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    kw = {} if parents is None else {"parent_rows": torch.tensor(parents, dtype=torch.int32)}
    out = mod.causal_conv1d_update(
        x.clone(),
        state,
        weight,
        bias,
        "silu",
        conv_state_indices=torch.arange(1, len(rows) + 1, dtype=torch.int32),
        num_accepted_tokens=torch.tensor(num_accepted, dtype=torch.int32),
        query_start_loc=cu,
        max_query_len=max(rows),
        **kw,
    )
    return out, cu


def reference_conv(history, xs, weight, bias):
    """silu of the width-4 convolution over [3 history columns, xs...], the last output."""
    cols = torch.cat([history, torch.stack(xs, 1)], 1)[:, -WIDTH:]
    return F.silu((cols * weight).sum(1) + bias)


@pytest.mark.parametrize("tree", sorted(TREES))
def test_each_node_convolves_over_its_ancestors(kernels, tree):
    parents = TREES[tree]
    rows = [len(parents), len(parents)]
    x, state, weight, bias = conv_inputs(rows, budget=len(parents) - 1, seed=7)
    before = state.clone()
    accepted = [1, 3]
    out, cu = run_conv(kernels["patched"]["causal_conv1d"], x, state, weight, bias, rows, parents + parents, accepted)
    for r in range(2):
        off = accepted[r] - 1
        history = before[r + 1, :, off : off + WIDTH - 1]
        start = int(cu[r])
        for i in range(rows[r]):
            xs = [x[start + j] for j in ancestors(parents, i)]
            torch.testing.assert_close(out[start + i], reference_conv(history, xs, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_chain_convolution_is_bit_identical_to_the_stock_kernel(kernels):
    rows = [5, 3]
    x, state, weight, bias = conv_inputs(rows, budget=4, seed=9)
    s0 = state.clone()
    stock, _ = run_conv(kernels["stock"]["causal_conv1d"], x, s0, weight, bias, rows, None, [2, 1])
    for parents in (None, [-1, 0, 1, 2, 3, -1, 0, 1]):
        s = state.clone()
        got, _ = run_conv(kernels["patched"]["causal_conv1d"], x, s, weight, bias, rows, parents, [2, 1])
        assert torch.equal(got, stock)
        assert torch.equal(s, s0)


def test_a_tree_convolution_needs_width_four(kernels):
    x, state, weight, bias = conv_inputs([3], budget=2, seed=1)
    with pytest.raises(ValueError, match="width 4"):
        run_conv(kernels["patched"]["causal_conv1d"], x, state, weight[:, :3].contiguous(), bias, [3], [-1, 0, 0], [1])


# ---------------------------------------------------------------------------
# the commit: the next step resumes from the accepted path
def test_the_next_step_resumes_from_the_last_accepted_node(kernels):
    """A tree step, the walk, the commit, then the stock kernels on one more token, on both paths a
    next step can take (spec decoding, and no drafts at all): the reference over the path alone."""
    ddtree = load_ddtree_runtime()
    parents = list(TREE_PARENTS)  # rows; nodes are rows 1..5 (node n = row n + 1)
    n = len(parents) - 1
    rows = [n + 1]
    x, conv_state, weight, bias = conv_inputs(rows, budget=n, seed=11)
    conv_before = conv_state.clone()
    run_conv(kernels["patched"]["causal_conv1d"], x, conv_state, weight, bias, rows, parents, [1])
    inputs, h0 = recurrent_inputs(rows, seed=12)
    _out, ssm_state, indices, _cu = run_recurrent(
        kernels["patched"]["fused_sigmoid_gating"], inputs, h0, rows, parents, [1]
    )

    # The walk accepted nodes 1, 3, 4 (rows 2, 4, 5): a path off the first rows.
    runtime = ddtree.DDTreeRuntime(budget=n, depth=3, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    runtime._step = committed_tree_step(ddtree)
    # The request's conv line is its first state slot in vLLM; here the two tensors were made
    # apart, so each gets a group of its own with the request's slots (conv line 1).
    conv_slots = torch.zeros_like(indices)
    conv_slots[0, 0] = 1
    runtime.compact(
        [],
        [],
        torch.zeros(n + 1, dtype=torch.int64),
        recurrent=[
            ddtree.RecurrentGroup(conv_states=[conv_state], ssm_states=[], state_slots=conv_slots, width=WIDTH),
            ddtree.RecurrentGroup(conv_states=[], ssm_states=[ssm_state], state_slots=indices, width=WIDTH),
        ],
    )
    counts = torch.tensor([4], dtype=torch.int32)  # what the runner counted: 3 accepted + bonus
    runtime.resume_recurrent_state(counts)
    assert counts.tolist() == [1]  # resume from the first slot

    path = [0, 2, 4, 5]
    assert ancestors(parents, 5) == path
    history = conv_before[1, :, 0 : WIDTH - 1]
    x2, _s, _w, _b = conv_inputs([1], budget=n, seed=13)
    want = reference_conv(history, [x[j] for j in path] + [x2[0]], weight, bias)
    stock_conv = kernels["stock"]["causal_conv1d"]
    # Next step with drafts (the spec path, accepted-token count 1) ...
    out_spec, _ = run_conv(stock_conv, x2[:1], conv_state.clone(), weight, bias, [1], None, counts.tolist())
    torch.testing.assert_close(out_spec[0], want, rtol=1e-5, atol=1e-5)
    # ... and without any (vLLM's non-spec decode reads the first window entries of the line).
    out_plain = stock_conv.causal_conv1d_update(
        x2[:1].clone(),
        conv_state.clone(),
        weight,
        bias,
        "silu",
        conv_state_indices=torch.tensor([1], dtype=torch.int32),
    )
    torch.testing.assert_close(out_plain[0], want, rtol=1e-5, atol=1e-5)
    # Both read the first slot's recurrent state: the state after the accepted path.
    h = h0[0]
    for j in path:
        h, _o = reference_step(
            h,
            inputs["q"][0, j],
            inputs["k"][0, j],
            inputs["v"][0, j],
            inputs["a"][j],
            inputs["b"][j],
            inputs["A_log"],
            inputs["dt_bias"],
        )
    torch.testing.assert_close(ssm_state[indices[0, 0]], h, rtol=1e-4, atol=1e-5)


def test_requests_without_drafts_keep_their_state():
    ddtree = load_ddtree_runtime()
    runtime = ddtree.DDTreeRuntime(budget=3, depth=3, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    conv = torch.randn(3, DIM, WIDTH - 1 + 3)
    ssm = torch.randn(9, HV, V, K)
    conv0, ssm0 = conv.clone(), ssm.clone()
    runtime._step = ddtree._StepTrees(
        num_reqs=2,
        has_drafts=torch.tensor([False, False]),
        has_tree=torch.tensor([False, False]),
        num_drafts=torch.tensor([0, 0]),
        query_start=torch.tensor([0, 4]),
        parent=torch.full((2, 3), -1),
        depth=torch.ones(2, 3, dtype=torch.int64),
        ancestor_mask=torch.ones(2, 4, 4, dtype=torch.bool),
        seq_positions=torch.zeros(8, dtype=torch.int64),
        accepted_nodes=torch.full((2, 3), -1),
        num_accepted=torch.tensor([0, 0]),
    )
    runtime.compact(
        [],
        [],
        torch.zeros(8, dtype=torch.int64),
        recurrent=[
            ddtree.RecurrentGroup(
                conv_states=[conv], ssm_states=[], state_slots=torch.tensor([[1, 0, 0, 0], [2, 0, 0, 0]]), width=WIDTH
            ),
            ddtree.RecurrentGroup(
                conv_states=[], ssm_states=[ssm], state_slots=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), width=WIDTH
            ),
        ],
    )
    counts = torch.tensor([1, 0], dtype=torch.int32)
    runtime.resume_recurrent_state(counts)
    assert counts.tolist() == [1, 0]
    assert torch.equal(conv, conv0)
    assert torch.equal(ssm, ssm0)
