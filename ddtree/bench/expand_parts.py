#!/usr/bin/env python3
"""Where the DDTree expansion kernel's time goes, part by part (NVIDIA GPU with Triton).

The expansion (``_expand`` in ddtree/common/ddtree_kernels.py) lists one depth
per loop iteration. Each variant below is a copy of the kernels' source in which one part of that
loop runs twice: the second copy's input is perturbed by a zero read from memory at run time, so
the compiler cannot fold it away, and its result is dropped through a select on a condition that
never holds. The trees stay the same (the script checks), so a variant's time minus the
baseline's is what that part costs over the depths the build runs. Timed as the CUDA-graph
replay of the whole build (vocabulary ranking included) on peaked logits (standard deviation 8),
the shape where trees go deep.

Usage:
    python3 -m ddtree.bench.expand_parts --out /tmp/ddtree_expand_parts.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree.bench.tree_bench import COMMON, capture_graph, load_module, time_events
from ddtree.bench.tree_bench import dt as tree_module

# The loop's parts, as they appear in the kernel source, and what running each twice adds.
MERGE = "            best = tl.bitonic_merge(tl.maximum(best, listed), descending=True)\n"
RANK = "            _top_into(tl.where(real, _key(score, p), NO_KEY), wanted, scratch, SEL, N2, FEW)\n"
TAU = "            tau = _score_at(best, N - 1)\n"
SCORES = "            score = prev + step\n"
TWICE = {
    "merge into the running order": (
        MERGE,
        MERGE + "            best_x = tl.bitonic_merge(tl.maximum(best ^ dmy, listed), descending=True)\n"
        "            best = tl.where(dmy == 7, best_x, best)\n",
    ),
    "rank the selected keys": (
        RANK,
        "            _top_into(tl.where(real, _key(score, p), NO_KEY) ^ dmy, wanted, scratch, SEL, N2, FEW)\n" + RANK,
    ),
    "running N-th score": (TAU, TAU + "            tau = tl.where(dmy == 7, _score_at(best ^ dmy, N - 2), tau)\n"),
    "candidates' scores": (
        SCORES,
        SCORES + "            code_x = tl.load(codes + d * P2 + p + dmy).to(tl.int64)\n"
        "            prev_x = tl.load(level_score + (b * D + d - 1) * N2 + code_x // K, mask=code_x >= 0, other=0.0)\n"
        "            step_x = tl.load(logp + (b * D + d) * K + code_x % K, mask=code_x >= 0, other=0.0)\n"
        "            score = tl.where(dmy == 7, prev_x + step_x, score)\n",
    ),
}


def _replace(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise SystemExit(f"the kernel source changed: {old.strip()[:60]!r} is not there once; update this script")
    return source.replace(old, new)


def _with_runtime_zero(source: str) -> str:
    """The kernels' source with ``dmy``, a zero read from memory, inside ``_expand``."""
    source = _replace(source, "    scratch,\n    D: tl.constexpr,", "    scratch,\n    dmy_ptr,\n    D: tl.constexpr,")
    source = _replace(
        source,
        "    b = tl.program_id(0).to(tl.int64)\n    scratch += b * (SEL + N2)",
        "    b = tl.program_id(0).to(tl.int64)\n    dmy = tl.load(dmy_ptr)\n    scratch += b * (SEL + N2)",
    )
    return _replace(
        source,
        "        scratch,\n        D=num_depths,",
        "        scratch,\n        torch.zeros(1, dtype=torch.int64, device=device),\n        D=num_depths,",
    )


def variant_sources(source: str) -> dict[str, str]:
    """The baseline (the kernels' source with the runtime zero) and one variant per part in TWICE."""
    base = _with_runtime_zero(source)
    return {"baseline": base} | {f"{part} x2": _replace(base, old, new) for part, (old, new) in TWICE.items()}


def _graph_us(step: Callable[[], object], iters: int) -> float:
    """Median microseconds of replaying ``step`` captured in a CUDA graph."""
    graph = capture_graph(step, warmup=3)
    return statistics.median(time_events(graph.replay, iters, warmup=0)) * 1000


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="write the results as JSON to this path")
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--depth", type=int, default=15, help="draft positions D = block size - 1")
    parser.add_argument("--settings", default="1x16,1x64,1x256,4x256", help="batch x budget, comma-separated")
    parser.add_argument("--scale", type=float, default=8.0, help="std of the random logits")
    parser.add_argument("--iters", type=int, default=80)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU: the variants differ only in their kernels' GPU time")

    sources = variant_sources((COMMON / "ddtree_kernels.py").read_text())
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {}
        for i, (name, source) in enumerate(sources.items()):
            path = Path(tmp) / f"ddtree_kernels_variant{i}.py"
            path.write_text(source)
            variants[name] = load_module(f"ddtree_kernels_variant{i}", path)
        for setting in args.settings.split(","):
            batch, budget = (int(x) for x in setting.split("x"))
            gen = torch.Generator(device="cuda").manual_seed(1000 * batch + budget)
            logits = torch.randn(batch, args.depth, args.vocab, generator=gen, device="cuda") * args.scale
            plan = tree_module._expand_plan(args.depth, args.vocab, budget, logits.device)
            expected = tree_module.build_trees(logits, budget)
            times: dict[str, float] = {}
            for name, module in variants.items():
                tokens, _, parent, *_ = module.build(logits, budget, plan)
                if not (torch.equal(tokens, expected.tokens) and torch.equal(parent, expected.parent)):
                    raise SystemExit(f"{name} built other trees than the kernels at batch {batch}, budget {budget}")
                times[name] = round(_graph_us(functools.partial(module.build, logits, budget, plan), args.iters), 1)
            depths = int(expected.depth.max().item())
            results[f"batch {batch} budget {budget}"] = {"depths": depths, "graph_us": times}
            added = ", ".join(f"{k[:-3]} +{v - times['baseline']:.1f}" for k, v in times.items() if k != "baseline")
            print(f"batch {batch} budget {budget}: {depths} depths, build {times['baseline']} us; {added}")
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
