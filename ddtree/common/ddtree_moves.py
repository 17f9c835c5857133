"""DDTree's accepted path moved into place in every layer at once: one launch per kind of move.

After a tree step, ``compact`` (ddtree.py) puts the accepted path where the next step reads it:
each attention layer's KV entries of the accepted nodes onto the path's consecutive slots, and on
Gated DeltaNet hybrids each recurrent layer's state of the last accepted node into the request's
first state slot and that node's ancestors' inputs into the start of its convolution window.
Written as torch indexing, that is a few launches per layer: about 770 launches a step at
Qwen3.6-27B shapes (64 layers), and an ``index_put`` that used a fraction of the memory
bandwidth, 2 ms of GPU time a step at batch 8 (benchmarks/step_cost.py ``--profile``). Here each
kind of move is one launch over all layers: the kernels reach each layer's cache through a table
of base addresses, which works because the layers of a kind share shape, strides and dtype
(``*_table`` returns None when they do not, and the caller keeps torch indexing).

The torch code in ddtree.py is the definition; these kernels give the same bytes
(tests/unit/test_ddtree_moves.py runs both in Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Elements of one recurrent state copied by one program (the Qwen3.6-27B state is 786,432).
STATE_BLOCK = 4096
# Channels of one convolution window moved by one program.
WINDOW_BLOCK = 1024


@dataclass(frozen=True)
class LayerTable:
    """Caches of several layers that share shape, strides and dtype, reached by base address.

    ``groups[i]`` is the KV-cache group of layer ``i``: the row of the per-group inputs (state
    slots) the kernels read for it."""

    ptrs: torch.Tensor  # [L] int64
    groups: torch.Tensor  # [L] int32
    ref: torch.Tensor  # layer 0's cache: the element type, shape and strides of every layer's


def _table(caches: Sequence[tuple[int, torch.Tensor]]) -> LayerTable | None:
    if not caches:
        return None
    ref = caches[0][1]
    for _g, c in caches:
        if (c.dtype, c.shape, c.stride(), c.device) != (ref.dtype, ref.shape, ref.stride(), ref.device):
            return None
    ptrs = torch.tensor([c.data_ptr() for _g, c in caches], dtype=torch.int64)
    groups = torch.tensor([g for g, _c in caches], dtype=torch.int32)
    return LayerTable(ptrs=ptrs.to(ref.device), groups=groups.to(ref.device), ref=ref)


def kv_table(caches: Sequence[torch.Tensor]) -> LayerTable | None:
    """Attention KV caches ``[2, blocks, block_size, kv_heads, head_dim]`` (any strides)."""
    if any(c.dim() != 5 or c.shape[0] != 2 for c in caches):
        return None
    return _table([(0, c) for c in caches])


def state_table(states: Sequence[tuple[int, torch.Tensor]]) -> LayerTable | None:
    """(group, recurrent state ``[slots, ...]``) pairs whose slots are each contiguous."""
    for _g, s in states:
        if s.dim() < 2 or not s[0].is_contiguous():
            return None
    return _table(states)


def window_table(windows: Sequence[tuple[int, torch.Tensor]]) -> LayerTable | None:
    """(group, convolution state ``[lines, channels, window]``, any strides) pairs."""
    if any(w.dim() != 3 for _g, w in windows):
        return None
    return _table(windows)


# Counts that change from step to step are not specialised on (Triton compiles a variant for a
# value of 1 and one divisible by 16): a first such step while serving would stall on a compile.
@triton.jit(do_not_specialize=["moves_per_req"])
def _move_kv(
    table,
    ref,
    slot_mapping,
    src_rows,
    dst_rows,
    moves_per_req,
    block_size,
    s_kv,
    s_block,
    s_offset,
    s_head,
    s_dim,
    heads,
    head_dim,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Program (layer, request): the request's moves in depth order, K and V. In that order no
    move reads a row an earlier move wrote (move k writes row k, and reads a row >= k), and a row
    an earlier move read is overwritten by this thread, after its read."""
    layer = tl.program_id(0)
    req = tl.program_id(1)
    base = tl.load(table + layer).to(ref.dtype)
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    inside = (h < heads) & (d < head_dim)
    inner = h * s_head + d * s_dim
    for k in range(moves_per_req):
        i = req * moves_per_req + k
        src = tl.load(slot_mapping + tl.load(src_rows + i)).to(tl.int64)
        dst = tl.load(slot_mapping + tl.load(dst_rows + i)).to(tl.int64)
        if src != dst:
            at_src = (src // block_size) * s_block + (src % block_size) * s_offset + inner
            at_dst = (dst // block_size) * s_block + (dst % block_size) * s_offset + inner
            key = tl.load(base + at_src, mask=inside)
            value = tl.load(base + s_kv + at_src, mask=inside)
            tl.store(base + at_dst, key, mask=inside)
            tl.store(base + s_kv + at_dst, value, mask=inside)


def move_kv(
    table: LayerTable, slot_mapping: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor, num_reqs: int
) -> None:
    """Every layer's KV at ``slot_mapping[src_rows[i]]`` to ``slot_mapping[dst_rows[i]]``;
    ``src_rows``/``dst_rows`` ``[num_reqs * moves]``, request-major, each request's moves by depth."""
    moves = src_rows.shape[0] // max(num_reqs, 1)
    if num_reqs == 0 or moves == 0:
        return
    ref = table.ref
    _, _, block_size, heads, head_dim = ref.shape
    s = ref.stride()
    _move_kv[(table.ptrs.shape[0], num_reqs)](
        table.ptrs,
        ref,
        slot_mapping,
        src_rows.contiguous(),
        dst_rows.contiguous(),
        moves,
        block_size,
        s[0],
        s[1],
        s[2],
        s[3],
        s[4],
        heads,
        head_dim,
        HEADS=triton.next_power_of_2(heads),
        HEAD_DIM=triton.next_power_of_2(head_dim),
    )


@triton.jit(do_not_specialize=["num_reqs"])
def _copy_state(table, ref, groups, firsts, lasts, num_reqs, s_slot, numel, BLOCK: tl.constexpr):
    """Program (layer, request, block): state slot ``lasts[g, r]`` to ``firsts[g, r]``."""
    layer = tl.program_id(0)
    req = tl.program_id(1)
    block = tl.program_id(2)
    g = tl.load(groups + layer)
    first = tl.load(firsts + g * num_reqs + req).to(tl.int64)
    last = tl.load(lasts + g * num_reqs + req).to(tl.int64)
    if first != last:
        base = tl.load(table + layer).to(ref.dtype)
        o = block * BLOCK + tl.arange(0, BLOCK)
        inside = o < numel
        tl.store(base + first * s_slot + o, tl.load(base + last * s_slot + o, mask=inside), mask=inside)


def copy_states(table: LayerTable, firsts: torch.Tensor, lasts: torch.Tensor) -> None:
    """Each layer's state slot ``lasts[group, r]`` copied to ``firsts[group, r]`` (``[groups, R]``)."""
    num_reqs = firsts.shape[1]
    if num_reqs == 0:
        return
    ref = table.ref
    numel = ref[0].numel()
    grid = (table.ptrs.shape[0], num_reqs, triton.cdiv(numel, STATE_BLOCK))
    _copy_state[grid](
        table.ptrs,
        ref,
        table.groups,
        firsts.contiguous(),
        lasts.contiguous(),
        num_reqs,
        ref.stride(0),
        numel,
        STATE_BLOCK,
    )


@triton.jit(do_not_specialize=["num_reqs"])
def _gather_window(
    table,
    ref,
    groups,
    lines,
    entries,
    num_reqs,
    channels,
    s_line,
    s_channel,
    s_entry,
    KEEP: tl.constexpr,
    KEEP_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (layer, request, channel block): window entries ``entries[r, :]`` of line
    ``lines[g, r]`` to its entries ``0..KEEP-1``, all read before any is written."""
    layer = tl.program_id(0)
    req = tl.program_id(1)
    block = tl.program_id(2)
    g = tl.load(groups + layer)
    base = tl.load(table + layer).to(ref.dtype)
    line = tl.load(lines + g * num_reqs + req).to(tl.int64)
    k = tl.arange(0, KEEP_P2)
    src = tl.load(entries + req * KEEP + k, mask=k < KEEP, other=0).to(tl.int64)
    c = block * BLOCK + tl.arange(0, BLOCK)
    inside = (k[:, None] < KEEP) & (c[None, :] < channels)
    row = base + line * s_line + c[None, :] * s_channel
    values = tl.load(row + src[:, None] * s_entry, mask=inside)
    tl.debug_barrier()  # an entry read here may be one another thread of this program writes
    tl.store(row + k[:, None] * s_entry, values, mask=inside)


def gather_windows(table: LayerTable, lines: torch.Tensor, entries: torch.Tensor) -> None:
    """Each layer's convolution line ``lines[group, r]``: entries ``entries[r, k]`` moved to
    ``k = 0..keep-1`` (``entries`` ``[R, keep]``)."""
    num_reqs, keep = entries.shape
    if num_reqs == 0:
        return
    ref = table.ref
    _, channels, _ = ref.shape
    s = ref.stride()
    grid = (table.ptrs.shape[0], num_reqs, triton.cdiv(channels, WINDOW_BLOCK))
    _gather_window[grid](
        table.ptrs,
        ref,
        table.groups,
        lines.contiguous(),
        entries.contiguous(),
        num_reqs,
        channels,
        s[0],
        s[1],
        s[2],
        KEEP=keep,
        KEEP_P2=triton.next_power_of_2(keep),
        BLOCK=WINDOW_BLOCK,
    )
