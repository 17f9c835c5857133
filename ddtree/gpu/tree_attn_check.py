#!/usr/bin/env python3
"""The DDTree verification kernel against a float32 reference, and its cost, at real shapes (GPU).

Runs vLLM 0.20.1's Triton unified attention as the change set patches it (PYTHONPATH holds the
patched tree) on a paged KV cache with one random tree per sequence (each node attends to the
whole context, its ancestors and itself), in the variants the TREE_ATTN backend can launch:

  2d      the release's kernel as TREE_ATTN called it (one program walks all keys, 16 query rows)
  3d-16   keys split into 16 segments, reduced after (what DDTree decodes now use), 16 rows
  3d-32, 3d-64   the same with 32 / 64 query rows per program (fewer re-reads of the keys)

Every variant must match the reference (bf16 inputs, float32 math); its time per call is the mean
of CUDA-event timings. Shapes: the attention layers of Qwen3-8B (32 query / 8 KV heads, head 128)
and Qwen3.6-27B (24 / 4, head 256).

    PYTHONPATH=/path/to/patched/site-packages python3 -m ddtree.gpu.tree_attn_check --out result.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

SHAPES = {"8b": (32, 8, 128), "27b": (24, 4, 256)}
BLOCK = 16
SEGMENTS = 16
VARIANTS = {"2d": (False, None), "3d-16": (True, None), "3d-32": (True, 32), "3d-64": (True, 64)}


def random_tree_allowed(q: int, gen: torch.Generator) -> torch.Tensor:
    """[q, q] bool: row i may attend to column j (j is i or one of its ancestors); row 0 is the root."""
    allowed = torch.eye(q, dtype=torch.bool)
    for i in range(1, q):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        allowed[i] |= allowed[parent]
    return allowed


def make_case(shape: str, batch: int, ctx: int, q: int, seed: int = 0) -> dict:
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    seq = ctx + q
    blocks_per_seq = math.ceil(seq / BLOCK)
    num_blocks = batch * blocks_per_seq + 3
    dev = "cuda"
    key_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=gen).to(dev, torch.bfloat16)
    value_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=gen).to(dev, torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_table = perm.view(batch, blocks_per_seq).to(dev, torch.int32)
    query = torch.randn(batch * q, hq, d, generator=gen).to(dev, torch.bfloat16)
    allowed = torch.stack([random_tree_allowed(q, gen) for _ in range(batch)])
    bias = torch.zeros(batch, q, q).masked_fill_(~allowed, float("-inf")).to(dev)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_table": block_table,
        "bias": bias,
        "allowed": allowed.to(dev),
        "cu_q": torch.arange(0, (batch + 1) * q, q, dtype=torch.int32, device=dev),
        "seq_lens": torch.full((batch,), seq, dtype=torch.int32, device=dev),
        "batch": batch,
        "ctx": ctx,
        "q": q,
        "heads": (hq, hkv, d),
    }


def reference(c: dict) -> torch.Tensor:
    hq, hkv, d = c["heads"]
    q, ctx = c["q"], c["ctx"]
    out = torch.empty(c["batch"] * q, hq, d, device="cuda", dtype=torch.float32)
    for b in range(c["batch"]):
        slots = c["block_table"][b].long()
        k = c["key_cache"][slots].reshape(-1, hkv, d)[: ctx + q].float()
        v = c["value_cache"][slots].reshape(-1, hkv, d)[: ctx + q].float()
        qb = c["query"][b * q : (b + 1) * q].float()
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, k) / math.sqrt(d)
        mask = torch.ones(q, ctx + q, dtype=torch.bool, device="cuda")
        mask[:, ctx:] = c["allowed"][b]
        s = s.masked_fill(~mask, float("-inf"))
        out[b * q : (b + 1) * q] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


def launch(c: dict, split: bool, block_m: int | None):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    hq, hkv, d = c["heads"]
    tokens = c["query"].shape[0]
    out = torch.empty_like(c["query"])
    padded = 1 << (d - 1).bit_length()
    extra = {}
    if split:
        extra = {
            "seq_threshold_3D": c["batch"],
            "num_par_softmax_segments": SEGMENTS,
            "softmax_segm_output": torch.empty(tokens, hq, SEGMENTS, padded, device="cuda"),
            "softmax_segm_max": torch.empty(tokens, hq, SEGMENTS, device="cuda"),
            "softmax_segm_expsum": torch.empty(tokens, hq, SEGMENTS, device="cuda"),
            "split_kv_multi_token": True,
        }
    scale = torch.ones(c["batch"], hkv, device="cuda")

    def run():
        unified_attention(
            q=c["query"],
            k=c["key_cache"],
            v=c["value_cache"],
            out=out,
            cu_seqlens_q=c["cu_q"],
            max_seqlen_q=c["q"],
            seqused_k=c["seq_lens"],
            max_seqlen_k=c["ctx"] + c["q"],
            softmax_scale=1.0 / math.sqrt(d),
            causal=True,
            window_size=(-1, -1),
            block_table=c["block_table"],
            softcap=0,
            q_descale=None,
            k_descale=scale,
            v_descale=scale,
            qq_bias=c["bias"],
            block_m=block_m,
            **extra,
        )
        return out

    return run


def time_ms(run, iters: int = 30) -> float:
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tolerance", type=float, default=2e-2)
    args = parser.parse_args()
    rows = []
    failures = 0
    for shape in SHAPES:
        for batch in (1, 8):
            for ctx in (512, 8192):
                for q in (17, 65):
                    c = make_case(shape, batch, ctx, q)
                    ref = reference(c)
                    row = {"shape": shape, "batch": batch, "ctx": ctx, "q": q}
                    for name, (split, block_m) in VARIANTS.items():
                        run = launch(c, split, block_m)
                        err = (run().float() - ref).abs().max().item()
                        row[f"{name}_max_err"] = round(err, 5)
                        row[f"{name}_ms"] = round(time_ms(run), 4)
                        if not err <= args.tolerance:
                            failures += 1
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"hardware": torch.cuda.get_device_name(), "tolerance": args.tolerance, "rows": rows}, f, indent=1)
    print(f"{failures} variant(s) outside tolerance {args.tolerance}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
