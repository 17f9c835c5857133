#!/usr/bin/env python3
"""Where a decode step's time goes: a summary of a vLLM torch-profiler trace (Chrome trace JSON).

A step is the span from one ``gpu_model_runner: forward`` scope to the next (vLLM opens the scope
when ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``); the first (the prefill) and the last (open-ended)
are left out. Per step: the wall time, the time the GPU is busy (the union of kernel, memcpy and
memset intervals), the idle time and, for each idle gap, the host scope the engine was inside when
it opened (the innermost one), the CUDA runtime calls (launches, graph replays, synchronisations)
and the heaviest kernels and host ops. ``python3 -m ddtree.bench.step_cost run --profile`` writes one
summary per case; this also reads a trace directly:

    python3 -m ddtree.bench.step_profile /tmp/prof/<worker>.pt.trace.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

STEP_SCOPE = "gpu_model_runner: forward"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
MIN_GAP_US = 5.0  # shorter idle gaps are launch jitter, not a place to look


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return events


def _spans(events: list[dict[str, Any]], cats: set[str]) -> list[tuple[float, float, dict[str, Any]]]:
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in cats and "ts" in e and "dur" in e:
            ts = float(e["ts"])
            out.append((ts, ts + float(e["dur"]), e))
    out.sort(key=lambda s: s[0])
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _innermost(scopes: list[tuple[float, float, dict[str, Any]]], t: float) -> str:
    """The shortest host scope open at time t."""
    best = None
    for a, b, e in scopes:
        if a > t:
            break
        if b > t and (best is None or b - a < best[1] - best[0]):
            best = (a, b, e)
    return best[2]["name"] if best else "(outside every scope)"


def summarize(events: list[dict[str, Any]], top: int = 40) -> dict[str, Any]:
    """Per-step averages of one profiled decode run (see the module docstring)."""
    scopes = _spans(events, {"user_annotation"})
    starts = [a for a, _b, e in scopes if e.get("name") == STEP_SCOPE]
    if len(starts) < 3:
        raise ValueError(
            f"the trace holds {len(starts)} '{STEP_SCOPE}' scopes, at least 3 are needed "
            "(profile a decode of several steps with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1)"
        )
    lo, hi = starts[1], starts[-1]
    steps = len(starts) - 2
    gpu = _spans(events, GPU_CATS)
    busy = _union([(a, b) for a, b, _e in gpu])
    busy_in = _clip(busy, lo, hi)
    busy_us = sum(b - a for a, b in busy_in)
    idle_by_scope: Counter[str] = Counter()
    edges = [lo] + [x for ab in busy_in for x in ab] + [hi]
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        if b - a >= MIN_GAP_US:
            idle_by_scope[_innermost(scopes, a)] += b - a
    runtime: dict[str, list[float]] = {}
    for a, b, e in _spans(events, {"cuda_runtime", "cuda_driver"}):
        if lo <= a < hi:
            runtime.setdefault(e.get("name", "?"), []).append(b - a)
    kernels: Counter[str] = Counter()
    launches = 0
    for a, b, e in gpu:
        if lo <= a < hi:
            kernels[str(e.get("name", "?"))[:100]] += b - a
            launches += 1
    host_ops: Counter[str] = Counter()
    for a, b, e in _spans(events, {"cpu_op"}):
        if lo <= a < hi:
            host_ops[str(e.get("name", "?"))[:100]] += b - a
    scope_time: Counter[str] = Counter()
    for a, b, e in scopes:
        if lo <= a < hi:
            scope_time[e["name"]] += min(b, hi) - a
    wall = hi - lo

    def per_step(counter: Counter[str]) -> dict[str, float]:
        return {k: round(v / steps / 1000, 4) for k, v in counter.most_common(top)}

    return {
        "steps": steps,
        "ms_per_step": round(wall / steps / 1000, 4),
        "gpu_busy_ms_per_step": round(busy_us / steps / 1000, 4),
        "gpu_idle_ms_per_step": round((wall - busy_us) / steps / 1000, 4),
        "gpu_idle_ms_per_step_by_host_scope": per_step(idle_by_scope),
        "host_scope_ms_per_step": per_step(scope_time),
        "cuda_runtime_per_step": {
            k: {"calls": round(len(v) / steps, 2), "ms": round(sum(v) / steps / 1000, 4)}
            for k, v in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:top]
        },
        "gpu_ops_per_step": round(launches / steps, 2),
        "kernel_ms_per_step": per_step(kernels),
        "host_op_ms_per_step": per_step(host_ops),
    }


def newest_trace(folder: Path) -> Path:
    traces = sorted(folder.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no *.pt.trace.json[.gz] in {folder}: did the profiled run stop cleanly?")
    return traces[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a trace file, or a folder: its newest trace")
    a = ap.parse_args()
    path = newest_trace(a.trace) if a.trace.is_dir() else a.trace
    try:
        print(json.dumps(summarize(load_trace(path)), indent=1))
    except (OSError, ValueError) as e:
        print(f"step_profile: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
