"""Tree verification attention in two parts: FlashAttention over the cached prefix, one kernel for the tree.

A verification step's queries are each request's tree nodes. Every node may see the whole cached
prefix (the tokens before this step) and, of this step's own tokens, only its ancestors and itself
(the per-request bias: 0 allowed, -inf masked). So the attention splits into

1. the prefix part: FlashAttention, non-causal, over each request's prefix keys (``seqused_k`` =
   sequence length minus this step's tokens), returning its log-sum-exp. This is the part that
   grows with the context, and FlashAttention reads the prefix once per KV head at memory speed,
   with full CUDA graphs;
2. the tree part (``tree_suffix_merge``, one Triton launch): per (request, KV head, query token)
   the attention over this step's own keys under the bias, merged with the prefix part by
   log-sum-exp weights, written in place over the prefix part's output.

The Triton unified attention kernel that TREE_ATTN uses otherwise does both in one pass but, at
the real models' head sizes, re-reads the prefix per block of query rows and runs far from memory
speed; the prefix is what long contexts pay for.

The merge is the standard one (as vLLM's ``merge_attn_states``): with ``lse_p``, ``o_p`` the
prefix part's and ``lse_s``, ``o_s`` the tree part's, ``o = (o_p e^(lse_p - m) + o_s e^(lse_s - m))
/ (e^(lse_p - m) + e^(lse_s - m))``, ``m = max(lse_p, lse_s)``. A request without prefix keys
(FlashAttention reports +inf for a row without keys) takes the tree part alone. Every node sees
itself, so the tree part is never empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys of this step per inner iteration: trees of up to 16 nodes (budget 15) in one.
_KEY_TILE = 16


@triton.jit
def _tree_suffix_merge(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    bias_ptr,
    qsl_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_lse_h,
    stride_lse_t,
    stride_b_seq,
    stride_b_row,
    scale,
    G: tl.constexpr,  # query heads per KV head
    GP: tl.constexpr,  # G padded for tl.dot (at least 16)
    D: tl.constexpr,
    DP: tl.constexpr,
    KT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.program_id(2)  # the query's row within its request's tokens
    start = tl.load(qsl_ptr + req)
    n = tl.load(qsl_ptr + req + 1) - start
    if row >= n:
        return
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    g_ok = g < G
    d_ok = d < D
    heads = kvh * G + g
    q = tl.load(
        q_ptr + t * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    # Keys 0..row of this request's step tokens (causal), then the tree's bias row.
    for j0 in range(0, row + 1, KT):
        j = j0 + tl.arange(0, KT)
        j_ok = j <= row
        k = tl.load(
            k_ptr + (start + j)[:, None] * stride_k_t + kvh * stride_k_h + d[None, :],
            mask=j_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * scale
        if HAS_BIAS:
            b = tl.load(bias_ptr + req * stride_b_seq + row * stride_b_row + j, mask=j_ok, other=float("-inf"))
            s = s + b[None, :]
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + (start + j)[:, None] * stride_v_t + kvh * stride_v_h + d[None, :],
            mask=j_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    lse_s = m_i + tl.log(l_i)
    lse_p = tl.load(lse_ptr + heads * stride_lse_h + t * stride_lse_t, mask=g_ok, other=float("-inf"))
    lse_p = tl.where(lse_p == float("inf"), float("-inf"), lse_p)
    o_ptrs = out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + d[None, :]
    o_mask = g_ok[:, None] & d_ok[None, :]
    o_p = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    mx = tl.maximum(lse_p, lse_s)
    w_p = tl.exp(lse_p - mx)
    w_s = tl.exp(lse_s - mx)
    o = (o_p * w_p[:, None] + (acc / l_i[:, None]) * w_s[:, None]) / (w_p + w_s)[:, None]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def tree_suffix_merge(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    prefix_lse: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    scale: float,
) -> None:
    """Add the tree part to ``out``, which holds the prefix part (see the module docstring).

    q ``[T, H, D]``, k and v ``[T, H_kv, D]`` (this step's tokens, as written to the KV cache), out
    ``[T, H, D]``, prefix_lse ``[H, T]`` float32 (FlashAttention's), bias ``[num_reqs, q, q]`` (one
    tree per request), ``[q, q]`` (one for all) or None (causal), query_start_loc ``[num_reqs + 1]``.
    """
    if num_reqs == 0 or max_query_len == 0:
        return
    heads, head_size = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    has_bias = bias is not None and bias.numel() > 0
    if has_bias:
        stride_b_seq = bias.stride(0) if bias.dim() == 3 else 0
        stride_b_row = bias.stride(-2)
        if bias.stride(-1) != 1:
            raise ValueError("the tree bias needs contiguous rows")
    else:
        bias, stride_b_seq, stride_b_row = q, 0, 0  # never read
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous head dimension")
    _tree_suffix_merge[(num_reqs, kv_heads, max_query_len)](
        q,
        k,
        v,
        out,
        prefix_lse,
        bias,
        query_start_loc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        prefix_lse.stride(0),
        prefix_lse.stride(1),
        stride_b_seq,
        stride_b_row,
        scale,
        G=group,
        GP=max(16, triton.next_power_of_2(group)),
        D=head_size,
        DP=triton.next_power_of_2(head_size),
        KT=_KEY_TILE,
        HAS_BIAS=has_bias,
        num_warps=4,
    )
