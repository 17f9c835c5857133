"""DDTree's tree attention in two parts (ddtree/common/ddtree_attention.py), on the CPU.

The prefix part is FlashAttention's on a GPU; here a float32 reference computes it (output and
log-sum-exp, in FlashAttention's layout), and the tree kernel runs in Triton's interpreter. The
merged result must be the attention of each node over the whole prefix and its own ancestors (the
tree bias), for trees of several shapes, requests of different lengths in one batch, grouped
query heads, head sizes that are not powers of two, a request without a prefix, one bias for all
requests and none (causal).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch

from ddtree import HOME

MODULE_PATH = HOME / "common/ddtree_attention.py"

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs the kernel in Triton's interpreter (CPU)",
    ),
    pytest.mark.usefixtures("interpreter_scalar_index"),  # ddtree/tests/conftest.py
]


@pytest.fixture(scope="module")
def attn() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddtree_attention", MODULE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ancestor_bias(parents: list[int], size: int) -> torch.Tensor:
    """[size, size] float32: 0 where key j is query i or one of its ancestors, else -inf."""
    bias = torch.full((size, size), float("-inf"))
    for i in range(len(parents)):
        j = i
        while j >= 0:
            bias[i, j] = 0.0
            j = parents[j]
    return bias


def attention(q, k, v, mask, scale):
    """float32 attention of q [t, H, D] over k, v [n, Hkv, D] with mask [t, n]; (out, lse [H, t])."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = torch.einsum("thd,nhd->htn", q.float(), k) * scale + mask
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v)
    return out, lse


def run_case(attn, *, parents_per_req, prefix_lens, heads, kv_heads, head, dtype, bias_kind, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [len(p) for p in parents_per_req]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(qsl[-1])
    scale = head**-0.5
    q = torch.randn(total, heads, head, generator=g).to(dtype)
    k_new = torch.randn(total, kv_heads, head, generator=g).to(dtype)
    v_new = torch.randn(total, kv_heads, head, generator=g).to(dtype)
    size = max(lens)
    if bias_kind == "per_request":
        bias = torch.stack([ancestor_bias(p, size) for p in parents_per_req])
    elif bias_kind == "shared":
        bias = ancestor_bias(parents_per_req[0], size)
    else:
        bias = None
    out = torch.zeros(total, heads, head, dtype=dtype)
    lse = torch.empty(heads, total)
    want = torch.empty(total, heads, head)
    for r, n_prefix in enumerate(prefix_lens):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        n = lens[r]
        kp = torch.randn(n_prefix, kv_heads, head, generator=g).to(dtype)
        vp = torch.randn(n_prefix, kv_heads, head, generator=g).to(dtype)
        if n_prefix:
            o_p, lse_p = attention(q[rows], kp, vp, torch.zeros(n, n_prefix), scale)
            out[rows] = o_p.to(dtype)
            lse[:, rows] = lse_p
        else:
            lse[:, rows] = float("inf")  # FlashAttention's mark of a row without keys
        causal = torch.triu(torch.full((n, n), float("-inf")), 1)
        tree = torch.zeros(n, n) if bias is None else bias[r, :n, :n] if bias.dim() == 3 else bias[:n, :n]
        tree_mask = causal + tree
        mask = torch.cat([torch.zeros(n, n_prefix), tree_mask], 1)
        want[rows], _ = attention(q[rows], torch.cat([kp, k_new[rows]]), torch.cat([vp, v_new[rows]]), mask, scale)
    attn.tree_suffix_merge(q, k_new, v_new, out, lse, bias, qsl, len(lens), size, scale)
    return out.float(), want


TREES = {
    "fan": [-1, 0, 0, 0, 0, 0],
    "chain": [-1, 0, 1, 2, 3],
    "branchy": [-1, 0, 0, 1, 2, 4, 1, 6, 3],
}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 2e-2)])
def test_tree_part_merged_with_the_prefix_is_attention_over_prefix_and_ancestors(attn, dtype, tol):
    # Three requests of different lengths in one batch, the second with no cached prefix.
    got, want = run_case(
        attn,
        parents_per_req=[TREES["branchy"], TREES["fan"], TREES["chain"]],
        prefix_lens=[7, 0, 20],
        heads=6,
        kv_heads=2,
        head=24,
        dtype=dtype,
        bias_kind="per_request",
        seed=1,
    )
    assert (got - want).abs().max() < tol


def test_more_nodes_than_one_key_tile_and_a_single_kv_head(attn):
    # 20 nodes: the kernel's loop over this step's keys takes two tiles of 16.
    parents = [-1] + [max(0, i - 2) for i in range(1, 20)]
    got, want = run_case(
        attn,
        parents_per_req=[parents, parents[:3]],
        prefix_lens=[5, 33],
        heads=4,
        kv_heads=1,
        head=16,
        dtype=torch.float32,
        bias_kind="per_request",
        seed=2,
    )
    assert (got - want).abs().max() < 2e-5


@pytest.mark.parametrize("bias_kind", ["shared", "none"])
def test_one_bias_for_every_request_or_none_at_all(attn, bias_kind):
    # "none" is a causal step (a chain, or the target alone with one token per request).
    parents = TREES["chain"] if bias_kind == "none" else TREES["branchy"]
    got, want = run_case(
        attn,
        parents_per_req=[parents, parents],
        prefix_lens=[3, 11],
        heads=2,
        kv_heads=2,
        head=32,
        dtype=torch.float32,
        bias_kind=bias_kind,
        seed=3,
    )
    assert (got - want).abs().max() < 2e-5


def test_one_token_per_request_is_plain_decoding(attn):
    got, want = run_case(
        attn,
        parents_per_req=[[-1], [-1], [-1]],
        prefix_lens=[1, 9, 40],
        heads=8,
        kv_heads=2,
        head=16,
        dtype=torch.float32,
        bias_kind="none",
        seed=4,
    )
    assert (got - want).abs().max() < 2e-5


def test_bad_shapes_are_refused_with_the_reason(attn):
    q = torch.zeros(2, 3, 16)
    kv = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 KV heads"):
        attn.tree_suffix_merge(q, kv, kv, q.clone(), torch.zeros(3, 2), None, torch.tensor([0, 2]), 1, 2, 1.0)
    q = torch.zeros(2, 2, 16)
    bias = torch.zeros(1, 4, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous rows"):
        attn.tree_suffix_merge(q, kv, kv, q.clone(), torch.zeros(2, 2), bias, torch.tensor([0, 2]), 1, 2, 1.0)
