"""Gated DeltaNet verification without per-token states: verify reads the committed state once, commit replays.

vLLM 0.20.1's speculative path (``fused_sigmoid_gating_delta_rule_update`` with ``num_accepted_tokens``)
stores the recurrent state after EVERY verified token in its own cache slot (``ssm_state_indices[n, t]``),
because any of them may become the committed one; the next step reads slot ``num_accepted - 1``. At
Qwen3.6-27B's shape (48 value heads of 128 x 128) that is one 48 x 128 x 128 state (3 MiB in float32,
1.5 MiB in bfloat16) per token, per request and per GDN layer: the kernel's time is those writes.

Here the two halves are split:

- ``gdn_verify``: per (value head, V tile) program, the request's committed state is read once and kept in
  registers; the chain's tokens are run through it in order, writing only each token's output. For a tree
  (``parent_rows``: each row's parent row, -1 for row 0), a row whose parent is the previous row continues
  the running state; any other row restarts from the committed state (kept in registers too) and first
  replays its parent's ancestor path (``tree_paths``, computed once per step for every layer). No state
  is written.
- ``gdn_commit``: once the accepted tokens are known, the committed state is advanced by them only (the
  first ``num_accepted`` rows of a chain, or the rows ``accepted_rows`` names for a tree): read once,
  written once, in place.

Per token the arithmetic is the stock kernel's, statement for statement and in its order (float32 state,
the same gates, L2 norms, ``BV = 32`` tiles of ``BK = K``, 4 warps), so that a chain's outputs and its
committed state can be bit-identical to 0.20.1's. Where that could break:

- the compiler: the same statements in another kernel may be scheduled or contracted differently (FMA
  contraction of ``h * exp(g)`` into the following products, reductions' tree shape from the layout). The
  bodies are written to produce the same Triton IR per token; only a GPU run can prove the SASS agrees;
- tiles: ``BV`` or ``num_warps`` other than stock's change the reductions' order over K; keep them equal;
- the state's dtype: stock continues a chain from the float32 registers and rounds only what it stores, as
  here; but the change set's tree kernel reloads a branching node's parent state from its (possibly
  bfloat16) slot, while the replay here recomputes it in float32: with a bfloat16 cache the tree's outputs
  then differ from the change set's (and agree with a chain run along each node's path instead);
- replayed ancestors recompute the same values from the same inputs, so a tree node's output is
  bit-identical to a chain's along its path (tested in the interpreter).

Slots: ``state_indices[n]`` is request n's committed state; an index <= 0 (vLLM 0.20.1's NULL_BLOCK_ID 0,
or PAD_SLOT_ID -1) is a padded request: nothing is read or written for it, as stock skips it.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

# Stock's tiles (fused_sigmoid_gating_delta_rule_update): BK = next_power_of_2(K), BV = min(that of V, 32).
MAX_BV = 32
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _gates(A_log, a, b, dt_bias, beta, threshold, t, i_hv, HV: tl.constexpr):
    """The token's decay g and write strength beta, as stock computes them (float32)."""
    b_b = tl.load(b + t * HV + i_hv).to(tl.float32)
    # If the model is loaded in fp16, without the .float() here, A might be -inf
    x = tl.load(a + t * HV + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
    softplus_x = tl.where(beta * x <= threshold, (1 / beta) * tl.log(1 + tl.exp(beta * x)), x)
    b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus_x
    b_beta = tl.sigmoid(b_b.to(tl.float32))
    return b_g, b_beta


@triton.jit
def _advance(
    b_h,
    A_log,
    a,
    b,
    dt_bias,
    k,
    v,
    beta,
    threshold,
    t,
    i_h,
    i_hv,
    o_k,
    o_v,
    mask_k,
    mask_v,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    """The state after token ``t`` (a global token index) from the state before it: stock's update."""
    b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
    b_g, b_beta = _gates(A_log, a, b, dt_bias, beta, threshold, t, i_hv, HV)
    if USE_QK_L2NORM:
        b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[None, :], 1)
    b_v *= b_beta
    b_h += b_v[:, None] * b_k[None, :]
    return b_h


@triton.jit
def _verify_kernel(
    A_log,
    a,
    b,
    dt_bias,
    beta,
    threshold,
    q,
    k,
    v,
    o,
    state,
    cu_seqlens,
    state_indices,
    parent_rows,
    paths,
    depths,
    scale,
    stride_state: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    MAX_PATH: tl.constexpr,
    IS_TREE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    state_idx = tl.load(state_indices + i_n).to(tl.int64)
    if eos - bos == 0 or state_idx <= 0:
        return

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]

    p_h0 = state + state_idx * stride_state + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h0 = tl.zeros([BV, BK], dtype=tl.float32)
    b_h0 += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
    b_h = b_h0

    for t in range(bos, eos):
        if IS_TREE:
            # A row whose parent is not the previous row restarts from the committed state and
            # replays its parent's path (root first); the running state is the previous row's.
            i_p = tl.load(parent_rows + t).to(tl.int64)
            if t > bos and i_p != t - bos - 1:
                b_h = b_h0
                p_path = paths + (bos + i_p) * MAX_PATH
                for d in range(0, tl.load(depths + bos + i_p) + 1):
                    r = tl.load(p_path + d).to(tl.int64)
                    b_h = _advance(
                        b_h, A_log, a, b, dt_bias, k, v, beta, threshold, r, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                        H, HV, K, V, USE_QK_L2NORM,
                    )  # fmt: skip
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q) + 1e-6))
        b_q = b_q * scale
        b_h = _advance(
            b_h, A_log, a, b, dt_bias, k, v, beta, threshold, t, i_h, i_hv, o_k, o_v, mask_k, mask_v,
            H, HV, K, V, USE_QK_L2NORM,
        )  # fmt: skip
        b_o = tl.sum(b_h * b_q[None, :], 1)
        p_o = o + (t * HV + i_hv) * V + o_v
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)


@triton.jit
def _commit_kernel(
    A_log,
    a,
    b,
    dt_bias,
    beta,
    threshold,
    k,
    v,
    state,
    cu_seqlens,
    state_indices,
    num_accepted,
    accepted_rows,
    stride_state: tl.constexpr,
    stride_rows: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_TREE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    accepted = tl.load(num_accepted + i_n).to(tl.int64)
    state_idx = tl.load(state_indices + i_n).to(tl.int64)
    if accepted <= 0 or state_idx <= 0:
        return

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]

    p_h = state + state_idx * stride_state + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h = tl.zeros([BV, BK], dtype=tl.float32)
    b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    for j in range(0, accepted):
        if IS_TREE:  # noqa: SIM108 - one branch per constexpr, as the other kernels write it
            t = bos + tl.load(accepted_rows + i_n * stride_rows + j).to(tl.int64)
        else:
            t = bos + j
        b_h = _advance(
            b_h, A_log, a, b, dt_bias, k, v, beta, threshold, t, i_h, i_hv, o_k, o_v, mask_k, mask_v,
            H, HV, K, V, USE_QK_L2NORM,
        )  # fmt: skip
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)


def check_parents(parent_rows: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Refuse a parent array the kernels cannot follow (reads it on the host: not under a CUDA graph).

    Row 0 of each request is its root (parent -1); every other row's parent is an earlier row of the
    same request, which also rules out cycles and bounds a path by the request's length.
    """
    parents = parent_rows.to("cpu", torch.int64)
    cu = cu_seqlens.to("cpu", torch.int64).tolist()
    if parents.shape != (cu[-1],):
        raise ValueError(f"parent_rows has shape {tuple(parents.shape)}; it needs one entry per token ({cu[-1]})")
    for n, (bos, eos) in enumerate(itertools.pairwise(cu)):
        for row, parent in enumerate(parents[bos:eos].tolist()):
            if (row == 0 and parent != -1) or (row > 0 and not 0 <= parent < row):
                wanted = "-1 (the root)" if row == 0 else f"an earlier row, 0 to {row - 1}"
                raise ValueError(
                    f"request {n}, row {row}: parent {parent}; it must be {wanted}. "
                    "Number each request's tree so that parents come before their children."
                )


def tree_paths(parent_rows: torch.Tensor, cu_seqlens: torch.Tensor, max_path: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ancestor path, computed once per step for every layer (no host sync).

    Returns ``paths`` ``[T, max_path]`` int32: the global token index of the token's ancestor at depth d
    (the root at 0, the token itself at its depth; -1 past it), and ``depths`` ``[T]`` int32.
    ``max_path`` must be at least the longest request's length (a path is never longer, given parents
    that ``check_parents`` accepts).
    """
    dev = parent_rows.device
    total = parent_rows.shape[0]
    idx = torch.arange(total, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), idx, right=True)
    bos = cu_seqlens.to(torch.int64)[seq]
    parents = parent_rows.to(torch.int64)
    up = torch.where(parents >= 0, bos + parents, torch.full_like(parents, -1))
    chain = [idx]
    for _ in range(max_path - 1):
        prev = chain[-1]
        chain.append(torch.where(prev >= 0, up[prev.clamp(min=0)], prev))
    upward = torch.stack(chain, 1)  # [T, max_path]: self, parent, grandparent, ...
    depths = (upward >= 0).sum(1) - 1
    d = torch.arange(max_path, device=dev, dtype=torch.int64)[None, :]
    back = (depths[:, None] - d).clamp(min=0)
    paths = torch.where(d <= depths[:, None], upward.gather(1, back), torch.full_like(upward, -1))
    return paths.to(torch.int32).contiguous(), depths.to(torch.int32)


def _shapes(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    _, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), MAX_BV)
    if BK != K or HV % H:
        raise ValueError(f"key head size {K} must be a power of two and value heads {HV} a multiple of key heads {H}")
    return H, HV, K, V, BV


def gdn_verify(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    parent_rows: torch.Tensor | None = None,
    paths: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    beta: float = 1.0,
    threshold: float = 20.0,
    use_qk_l2norm_in_kernel: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every verified token's output; ``state`` is read, never written.

    Tensors as stock's varlen spec path takes them: ``q``, ``k`` ``[1, T, H, K]``, ``v`` ``[1, T, HV, V]``,
    ``a``, ``b`` ``[T, HV]``, ``state`` ``[slots, HV, V, K]``, ``cu_seqlens`` ``[N + 1]``, and
    ``state_indices`` ``[N]`` (each request's committed slot). A tree passes ``parent_rows`` ``[T]`` and
    ``paths = tree_paths(...)``. Returns ``o`` ``[1, T, HV, V]`` in ``q``'s dtype (a padded request's
    rows are left as they were).
    """
    H, HV, K, V, BV = _shapes(k, v)
    N = cu_seqlens.shape[0] - 1
    if (parent_rows is None) != (paths is None):
        raise ValueError("a tree needs both parent_rows and paths (tree_paths(parent_rows, ...))")
    if scale is None:
        scale = K**-0.5
    if out is None:
        out = q.new_empty(1, q.shape[1], HV, V)
    path, depth = paths if paths is not None else (None, None)
    grid = (triton.cdiv(V, BV), N * HV)
    _verify_kernel[grid](
        A_log, a.contiguous(), b.contiguous(), dt_bias, beta, threshold,
        q.contiguous(), k.contiguous(), v.contiguous(), out, state, cu_seqlens, state_indices,
        parent_rows, path, depth, scale,
        stride_state=state.stride(0), H=H, HV=HV, K=K, V=V, BK=K, BV=BV,
        MAX_PATH=path.shape[1] if path is not None else 1,
        IS_TREE=parent_rows is not None, USE_QK_L2NORM=use_qk_l2norm_in_kernel,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def gdn_commit(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    accepted_rows: torch.Tensor | None = None,
    beta: float = 1.0,
    threshold: float = 20.0,
    use_qk_l2norm_in_kernel: bool = True,
) -> None:
    """Advance each request's committed state, in place, by its accepted tokens only.

    A chain applies its first ``num_accepted[n]`` rows (0 leaves the state as it is); a tree applies
    ``accepted_rows[n, :num_accepted[n]]`` (rows within the request, root first: the accepted path).
    ``k``, ``v``, ``a``, ``b`` and ``cu_seqlens`` are the verified step's.
    """
    H, HV, K, V, BV = _shapes(k, v)
    N = cu_seqlens.shape[0] - 1
    grid = (triton.cdiv(V, BV), N * HV)
    _commit_kernel[grid](
        A_log, a.contiguous(), b.contiguous(), dt_bias, beta, threshold,
        k.contiguous(), v.contiguous(), state, cu_seqlens, state_indices, num_accepted, accepted_rows,
        stride_state=state.stride(0),
        stride_rows=accepted_rows.stride(0) if accepted_rows is not None else 0,
        H=H, HV=HV, K=K, V=V, BK=K, BV=BV,
        IS_TREE=accepted_rows is not None, USE_QK_L2NORM=use_qk_l2norm_in_kernel,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
