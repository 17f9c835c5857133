#!/usr/bin/env python3
"""Header inspection time: our standard-library parser vs safetensors.safe_open, flat in file size.

Builds sparse checkpoints (real headers, data a hole: full size, almost no disk) in a temporary
directory: a 1 MB file, a 3.46 GB file with the Qwen3.6-27B-DFlash drafter's tensors, and a
~57 GB 12-shard checkpoint shaped like a 27B target plus its index. For each it lists every
tensor's name and shape, once with ``module_utils.safetensors_header.inspect_path`` (which
also validates every header and the index) and once with ``safetensors.safe_open`` (the
baseline: open each shard the index names, read keys and each slice's shape), interleaved,
and prints the median and the minimum of the repeats and the ratios ours / baseline.

The verdict uses the paired ratio: each repeat times both sides back to back, so the ratio of the
two within a repeat cancels the machine's slower stretches (a shared VM's load comes and goes);
the script prints the median of those ratios with a 95% confidence interval (distribution-free:
order statistics of the binomial), and the goal "no slower than safe_open" holds for a case when
the interval's upper end is at most 1.

Run from the repository root:  python3 benchmarks/safetensors_inspect.py [--repeats 1001] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Why sys.path: this is a script run by its path, without the repository root on sys.path (so no
# ddtree.repo), and module_utils/ and tests/unit/ are no packages; their folders go first so that
# safetensors_header and the tests' checkpoint writer (safetensors_files) import by their names.
sys.path.insert(0, str(REPO / "module_utils"))
sys.path.insert(0, str(REPO / "tests" / "unit"))

from safetensors import safe_open  # noqa: E402
from safetensors_files import QWEN36_27B_DFLASH, write_sharded, write_sparse  # noqa: E402
from safetensors_header import inspect_path  # noqa: E402


def target_shapes() -> dict[str, tuple[int, ...]]:
    """A 27B-class target: 248320 x 5120 embeddings and head, 64 layers of attention + 17408 MLP."""
    h, inter, vocab = 5120, 17408, 248320
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
        "model.norm.weight": (h,),
    }
    for i in range(64):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (12288, h),
            p + "self_attn.k_proj.weight": (1024, h),
            p + "self_attn.v_proj.weight": (1024, h),
            p + "self_attn.o_proj.weight": (h, 12288),
            p + "self_attn.q_norm.weight": (256,),
            p + "self_attn.k_norm.weight": (256,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def ours(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: t.shape for name, t in inspect_path(str(path)).tensors.items()}


def baseline(path: Path) -> dict[str, tuple[int, ...]]:
    if path.is_dir():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = sorted({path / f for f in index["weight_map"].values()})
    else:
        files = [path]
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = tuple(st.get_slice(k).get_shape())
    return out


def measure(path: Path, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per listing of ours and of the baseline, interleaved so machine noise hits both alike.

    Which of the two runs first alternates from one repeat to the next, so neither always runs
    right after the other (whose work leaves the CPU caches colder for the next).
    """
    samples: dict[Callable[[Path], object], list[float]] = {ours: [], baseline: []}
    clock = time.perf_counter
    for i in range(repeats):
        first, second = (ours, baseline) if i % 2 else (baseline, ours)
        t0 = clock()
        first(path)
        t1 = clock()
        second(path)
        t2 = clock()
        samples[first].append(t1 - t0)
        samples[second].append(t2 - t1)
    return samples[ours], samples[baseline]


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median and a distribution-free 95% confidence interval for it.

    Order statistics: [x_(r), x_(n+1-r)] (1-based) holds the true median with probability
    P(r <= Binomial(n, 1/2) <= n-r), whatever the distribution; r is the largest rank with
    P(Binomial(n, 1/2) <= r-1) <= 2.5%, computed exactly in integers.
    """
    xs = sorted(values)
    n = len(xs)
    total = 2**n
    tail = 0  # P(Binomial <= r-1) * 2**n for the current r
    r = 0
    while (tail + math.comb(n, r)) * 40 <= total:
        tail += math.comb(n, r)
        r += 1
    # The interval is x_(r) .. x_(n+1-r), 1-based; below 6 values no rank qualifies (r = 0) and
    # the whole range is returned, which then holds the median with less than 95%.
    lo = max(r - 1, 0)
    return statistics.median(xs), xs[lo], xs[n - 1 - lo]


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir())
    return path.stat().st_size


def disk_of(path: Path) -> int:
    files = list(path.iterdir()) if path.is_dir() else [path]
    return sum(f.stat().st_blocks * 512 for f in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1001)
    ap.add_argument("--dir", default=None, help="where to build the sparse files (default: a temp dir)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        cases = [
            ("1 MB file", write_sparse(root / "small.safetensors", {"w": (512, 1024)})),
            ("drafter 3.46 GB file", write_sparse(root / "drafter.safetensors", QWEN36_27B_DFLASH)),
            ("target 12 shards", write_sharded(root / "target", target_shapes(), shards=12)),
        ]
        print(f"python {sys.version.split()[0]}, {a.repeats} repeats, wall time per full listing (median / min)")
        print(f"{'case':22} {'size GB':>7} {'on disk MB':>10} {'tensors':>7}", end="")
        print(f" {'ours ms':>13} {'safe_open ms':>13} {'ratio median':>12} {'ratio min':>9}", end="")
        print(f" {'paired ratio [95% CI]':>23} {'no slower':>9}")
        verdicts = []
        for label, path in cases:
            assert ours(path) == baseline(path), f"{label}: listings differ"
            mine, base = measure(path, a.repeats)
            m_med, m_min = statistics.median(mine), min(mine)
            b_med, b_min = statistics.median(base), min(base)
            print(
                f"{label:22} {size_of(path) / 1e9:7.2f} {disk_of(path) / 1e6:10.2f} {len(ours(path)):7d}"
                f" {m_med * 1e3:6.3f}/{m_min * 1e3:6.3f} {b_med * 1e3:6.3f}/{b_min * 1e3:6.3f}"
                f" {m_med / b_med:12.2f} {m_min / b_min:9.2f}",
                end="",
            )
            mid, lo, hi = median_interval([m / b for m, b in zip(mine, base, strict=True)])
            verdicts.append(hi <= 1.0)
            print(f"      {mid:5.3f} [{lo:5.3f}, {hi:5.3f}] {'yes' if hi <= 1.0 else 'NO':>9}")
        print(
            f"goal no slower than safe_open (paired ratio's 95% interval <= 1): {'met' if all(verdicts) else 'NOT met'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
