#!/usr/bin/env python3
"""The verification step's per-layer parts at the real models' shapes: where DDTree's extra time goes.

step_cost.py measures whole steps; this script times the layers' parts that differ between the
chain and DDTree, each as vLLM 0.20.1 with this project's change set calls it, replayed from CUDA
graphs (as a step runs them), over several layers' worth of distinct caches so that nothing is
served from L2 that a real step would read from memory:

- attention (every attention layer, 36 of Qwen3-8B's, 16 of Qwen3.6-27B's), per request ``q``
  query tokens over ``context`` cached ones:
  ``fa_causal``: the chain's verification, FlashAttention 3 causal (as FLASH_ATTN runs it under
  full CUDA graphs: AOT schedule, up to 32 splits);
  ``triton_tree``: TREE_ATTN's Triton unified attention with the per-request tree bias (the
  change set's path where FlashAttention 3 is not available);
  ``flash_tree``: FlashAttention 3 over the cached prefix plus the tree kernel
  (ddtree_attention.py), the change set's path on Hopper.
  Before timing, triton_tree and flash_tree are checked against a float32 reference.
- Gated DeltaNet (48 of Qwen3.6-27B's layers): the recurrent update (``gdn_chain``: the chain's
  spec-decode kernel, ``gdn_tree``: the same kernel following each node's parent) and the
  convolution (``conv_chain``, ``conv_tree``), with random trees of the given size.

    python3 -m ddtree.bench.verify_parts --out /tmp/parts.json     # needs a GPU and vLLM + the change set

Prints ms per layer call and, per (shape, batch, context), the sum over the model's layers:
what a step spends in these parts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

import torch

from ddtree.bench.tree_bench import capture_graph

# Shapes: (query heads, KV heads, head size, KV block size, attention layers, GDN layers).
# Qwen3.6-27B's KV block is vLLM's for the hybrid (attention pages as large as a GDN state).
SHAPES = {
    "8b": dict(heads=32, kv_heads=8, head=128, block=16, attn_layers=36, gdn_layers=0),
    "27b": dict(heads=24, kv_heads=4, head=256, block=400, attn_layers=16, gdn_layers=48),
}
# Qwen3.6-27B's Gated DeltaNet: key heads, value heads, key/value head size, conv width.
GDN = dict(key_heads=16, value_heads=48, head=128, width=4)
LAYERS = 4  # distinct caches per timed graph
REPLAYS = 20


def random_parents(batch: int, q: int, gen: torch.Generator, shape: str) -> torch.Tensor:
    """Parent row of each row (-1 for the root): 'chain', 'fan' (every node a child of the root)
    or 'random' (each node under a random earlier node)."""
    rows = []
    for _ in range(batch):
        if shape == "chain":
            p = [i - 1 for i in range(q)]
        elif shape == "fan":
            p = [-1] + [0] * (q - 1)
        else:
            p = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q)]
        rows.append(p)
    return torch.tensor(rows, dtype=torch.int32)


def ancestor_bias(parents: torch.Tensor) -> torch.Tensor:
    """[batch, q, q] float32: 0 where key j is an ancestor of (or is) query i, else -inf."""
    batch, q = parents.shape
    allowed = torch.zeros(batch, q, q, dtype=torch.bool)
    for b in range(batch):
        for i in range(q):
            j = i
            while j >= 0:
                allowed[b, i, j] = True
                j = int(parents[b, j])
    return torch.zeros(batch, q, q).masked_fill_(~allowed, float("-inf"))


def time_graph(fn, replays: int = REPLAYS) -> float:
    """ms per call of fn, replayed from one CUDA graph that calls it LAYERS times."""
    graph = capture_graph(fn, warmup=2)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays / LAYERS)
    return round(statistics.median(times), 4)


class AttentionCase:
    def __init__(self, shape: str, batch: int, context: int, q: int, dtype: torch.dtype, gen: torch.Generator):
        s = SHAPES[shape]
        self.heads, self.kv_heads, self.head, self.block = s["heads"], s["kv_heads"], s["head"], s["block"]
        self.batch, self.context, self.q = batch, context, q
        dev = "cuda"
        per_seq = math.ceil((context + q) / self.block)
        blocks = batch * per_seq + 1
        self.caches = [
            torch.randn(2, blocks, self.block, self.kv_heads, self.head, device=dev, dtype=dtype) for _ in range(LAYERS)
        ]
        self.block_table = (torch.randperm(blocks - 1, generator=gen)[: batch * per_seq] + 1).view(batch, per_seq)
        self.block_table = self.block_table.to(dev, torch.int32)
        self.seq_lens = torch.full((batch,), context + q, dtype=torch.int32, device=dev)
        self.qsl = (torch.arange(batch + 1, dtype=torch.int32) * q).to(dev)
        self.query = torch.randn(batch * q, self.heads, self.head, device=dev, dtype=dtype)
        self.parents = random_parents(batch, q, gen, "random")
        self.bias = ancestor_bias(self.parents).to(dev)
        self.scale = self.head**-0.5
        self.out = torch.empty_like(self.query)
        # This step's keys and values as the layer passes them: the cache's last q positions.
        pos = torch.arange(context, context + q, device=dev)
        blk = self.block_table.long().gather(1, (pos // self.block)[None, :].expand(batch, q))
        self.new_kv = [
            tuple(c[i][blk, pos % self.block].reshape(batch * q, self.kv_heads, self.head) for i in (0, 1))
            for c in self.caches
        ]
        self.prefix_lens = self.seq_lens - q
        rows = batch * q
        segs = 16
        padded = 1 << (self.head - 1).bit_length()
        self.segm = (
            segs,
            torch.empty(rows, self.heads, segs, padded, dtype=torch.float32, device=dev),
            torch.empty(rows, self.heads, segs, dtype=torch.float32, device=dev),
            torch.empty(rows, self.heads, segs, dtype=torch.float32, device=dev),
        )

    def reference(self, layer: int) -> torch.Tensor:
        """float32 attention of every query over its prefix and its tree ancestors."""
        k_cache, v_cache = self.caches[layer][0].float(), self.caches[layer][1].float()
        out = torch.empty(self.batch * self.q, self.heads, self.head, device="cuda")
        group = self.heads // self.kv_heads
        n = self.context + self.q
        for b in range(self.batch):
            pos = torch.arange(n, device="cuda")
            blk = self.block_table[b].long()[pos // self.block]
            k = k_cache[blk, pos % self.block].repeat_interleave(group, 1)  # [n, H, D]
            v = v_cache[blk, pos % self.block].repeat_interleave(group, 1)
            qb = self.query[b * self.q : (b + 1) * self.q].float()
            s = torch.einsum("thd,nhd->htn", qb, k) * self.scale
            mask = torch.zeros(self.q, n, device="cuda")
            mask[:, self.context :] = self.bias[b]
            p = torch.softmax(s + mask, -1)
            out[b * self.q : (b + 1) * self.q] = torch.einsum("htn,nhd->thd", p, v)
        return out

    def triton_tree(self, layer: int) -> None:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        k_cache, v_cache = self.caches[layer][0], self.caches[layer][1]
        one = torch.ones((self.batch, self.kv_heads), dtype=torch.float32, device="cuda")
        use_segm = self.batch * self.q <= 256
        unified_attention(
            q=self.query,
            k=k_cache,
            v=v_cache,
            out=self.out,
            cu_seqlens_q=self.qsl,
            max_seqlen_q=self.q,
            seqused_k=self.seq_lens,
            max_seqlen_k=self.context + self.q,
            softmax_scale=self.scale,
            causal=True,
            alibi_slopes=None,
            qq_bias=self.bias if self.q > 1 else None,
            window_size=(-1, -1),
            block_table=self.block_table,
            softcap=0,
            q_descale=None,
            k_descale=one,
            v_descale=one,
            seq_threshold_3D=self.batch if use_segm else None,
            num_par_softmax_segments=self.segm[0] if use_segm else None,
            softmax_segm_output=self.segm[1] if use_segm else None,
            softmax_segm_max=self.segm[2] if use_segm else None,
            softmax_segm_expsum=self.segm[3] if use_segm else None,
            split_kv_multi_token=True,
            block_m=64 if self.q > 1 else None,
        )

    def _schedule(self, seqlens: torch.Tensor, causal: bool):
        from vllm.vllm_flash_attn import get_scheduler_metadata

        return get_scheduler_metadata(
            batch_size=self.batch,
            max_seqlen_q=self.q,
            max_seqlen_k=self.context + self.q,
            num_heads_q=self.heads,
            num_heads_kv=self.kv_heads,
            headdim=self.head,
            cache_seqlens=seqlens,
            qkv_dtype=self.query.dtype,
            cu_seqlens_q=self.qsl,
            page_size=self.block,
            causal=causal,
            num_splits=32,
        )

    def _flash(self, layer: int, schedule, causal: bool):
        """FlashAttention 3 as FLASH_ATTN runs it under full CUDA graphs: causal over every key (the
        chain), or non-causal over the cached prefix with its log-sum-exp (the tree's first part)."""
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        c = self.caches[layer]
        return flash_attn_varlen_func(
            q=self.query,
            k=c[0],
            v=c[1],
            out=self.out,
            cu_seqlens_q=self.qsl,
            max_seqlen_q=self.q,
            seqused_k=self.seq_lens if causal else self.prefix_lens,
            max_seqlen_k=self.context + self.q,
            softmax_scale=self.scale,
            causal=causal,
            block_table=self.block_table,
            return_softmax_lse=not causal,
            scheduler_metadata=schedule,
            num_splits=32,
            fa_version=3,
        )

    def fa_causal(self, layer: int, schedule) -> None:
        self._flash(layer, schedule, causal=True)

    def flash_tree(self, layer: int, schedule) -> None:
        from vllm.v1.spec_decode.ddtree_attention import tree_suffix_merge

        _, lse = self._flash(layer, schedule, causal=False)
        k_new, v_new = self.new_kv[layer]
        tree_suffix_merge(self.query, k_new, v_new, self.out, lse, self.bias, self.qsl, self.batch, self.q, self.scale)

    def run(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        ref = self.reference(0)
        for name, call in (
            ("triton_tree", lambda: self.triton_tree(0)),
            ("flash_tree", lambda: self.flash_tree(0, None)),
        ):
            self.out.zero_()
            call()
            row[f"{name}_max_err"] = round(float((self.out.float() - ref).abs().max()), 5)
        causal_schedule = self._schedule(self.seq_lens, True)
        prefix_schedule = self._schedule(self.prefix_lens, False)
        row["fa_causal"] = time_graph(lambda: [self.fa_causal(i, causal_schedule) for i in range(LAYERS)])
        row["triton_tree"] = time_graph(lambda: [self.triton_tree(i) for i in range(LAYERS)])
        row["flash_tree"] = time_graph(lambda: [self.flash_tree(i, prefix_schedule) for i in range(LAYERS)])
        return row


class GdnCase:
    def __init__(self, batch: int, q: int, dtype: torch.dtype, gen: torch.Generator, tree: str):
        dev = "cuda"
        h, hv, d = GDN["key_heads"], GDN["value_heads"], GDN["head"]
        n = batch * q
        self.batch, self.q = batch, q
        slots = 1 + n
        rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
        self.ssm = [rand(slots, hv, d, d).mul_(0.05) for _ in range(LAYERS)]
        self.qk = [rand(1, n, h, d) for _ in range(2)]
        self.v = rand(1, n, hv, d)
        self.A_log = torch.randn(hv, device=dev)
        self.a = rand(n, hv)
        self.b = rand(n, hv)
        self.dt_bias = rand(hv)
        self.cu = (torch.arange(batch + 1, dtype=torch.int32) * q).to(dev)
        self.indices = torch.arange(1, 1 + n, dtype=torch.int32, device=dev).view(batch, q)
        self.accepted = torch.ones(batch, dtype=torch.int32, device=dev)
        self.parents = random_parents(batch, q, gen, tree).view(-1).to(dev)
        dim = 2 * h * d + hv * d
        state_len = GDN["width"] - 1 + (q - 1)
        self.x = rand(n, dim)
        self.conv = [rand(slots, state_len, dim).transpose(1, 2) for _ in range(LAYERS)]
        self.weight = rand(dim, GDN["width"])

    def recurrent(self, layer: int, tree: bool) -> None:
        from vllm.model_executor.layers.fla.ops.fused_sigmoid_gating import fused_sigmoid_gating_delta_rule_update

        fused_sigmoid_gating_delta_rule_update(
            A_log=self.A_log,
            a=self.a,
            b=self.b,
            dt_bias=self.dt_bias,
            q=self.qk[0],
            k=self.qk[1],
            v=self.v,
            initial_state=self.ssm[layer],
            inplace_final_state=True,
            cu_seqlens=self.cu,
            ssm_state_indices=self.indices,
            num_accepted_tokens=self.accepted,
            use_qk_l2norm_in_kernel=True,
            parent_rows=self.parents if tree else None,
        )

    def convolution(self, layer: int, tree: bool) -> None:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

        causal_conv1d_update(
            self.x,
            self.conv[layer],
            self.weight,
            None,
            "silu",
            conv_state_indices=self.indices[:, 0],
            num_accepted_tokens=self.accepted,
            query_start_loc=self.cu,
            max_query_len=self.q,
            parent_rows=self.parents if tree else None,
        )

    def run(self) -> dict[str, Any]:
        return {
            "gdn_chain": time_graph(lambda: [self.recurrent(i, False) for i in range(LAYERS)]),
            "gdn_tree": time_graph(lambda: [self.recurrent(i, True) for i in range(LAYERS)]),
            "conv_chain": time_graph(lambda: [self.convolution(i, False) for i in range(LAYERS)]),
            "conv_tree": time_graph(lambda: [self.convolution(i, True) for i in range(LAYERS)]),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8b,27b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--queries", default="16,33", help="tokens per request: 16 = chain 15 or DDTree 15, 33 = DDTree 32")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)  # the trees
    rows = []
    for shape in a.shapes.split(","):
        s = SHAPES[shape]
        for q in map(int, a.queries.split(",")):
            for batch in map(int, a.batches.split(",")):
                gdn: dict[str, Any] = {}
                if s["gdn_layers"]:
                    gdn = {
                        f"{k}_{t}": v
                        for t in ("fan", "random")
                        for k, v in GdnCase(batch, q, dtype, gen, t).run().items()
                    }
                for context in map(int, a.contexts.split(",")):
                    row = dict(shape=shape, batch=batch, context=context, q=q, dtype=a.dtype)
                    row.update(AttentionCase(shape, batch, context, q, dtype, gen).run())
                    row.update(gdn)
                    row["step_attn_ms"] = {
                        m: round(row[m] * s["attn_layers"], 3) for m in ("fa_causal", "triton_tree", "flash_tree")
                    }
                    if gdn:
                        row["step_gdn_ms"] = {
                            "chain": round((gdn["gdn_chain_fan"] + gdn["conv_chain_fan"]) * s["gdn_layers"], 3),
                            "tree_fan": round((gdn["gdn_tree_fan"] + gdn["conv_tree_fan"]) * s["gdn_layers"], 3),
                            "tree_random": round(
                                (gdn["gdn_tree_random"] + gdn["conv_tree_random"]) * s["gdn_layers"], 3
                            ),
                        }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
