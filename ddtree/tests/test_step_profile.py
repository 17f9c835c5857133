"""ddtree/bench/step_profile.py: per-step figures from a Chrome trace, on a hand-made trace."""

from __future__ import annotations

import gzip
import json

import pytest

from ddtree.bench import step_profile


def x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


FORWARD = "gpu_model_runner: forward"
# Four forward scopes: steps [1000, 2000) and [2000, 3000) are whole (the first is the prefill).
TRACE = [
    *(x("user_annotation", FORWARD, t, 50) for t in (0, 1000, 2000, 3000)),
    x("user_annotation", "gpu_model_runner: bookkeep", 1700, 290),
    x("kernel", "gemm", 1100, 400),
    x("kernel", "attn", 1400, 300),  # overlaps the gemm: busy 1100-1700
    x("kernel", "gemm", 2000, 800),
    x("kernel", "gemm", 500, 100),  # the prefill step: not counted
    x("cuda_runtime", "cudaGraphLaunch", 1010, 20),
    x("cuda_runtime", "cudaGraphLaunch", 2010, 20),
    x("cuda_runtime", "cudaStreamSynchronize", 1710, 250),
    x("cpu_op", "aten::copy_", 1720, 10),
    {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1200},  # not a span
]


def test_a_step_is_split_into_busy_and_idle_time_by_host_scope():
    s = step_profile.summarize(TRACE)
    assert s["steps"] == 2
    assert s["ms_per_step"] == 1.0
    assert s["gpu_busy_ms_per_step"] == 0.7  # (600 + 800) us over two steps
    assert s["gpu_idle_ms_per_step"] == 0.3
    assert s["gpu_idle_ms_per_step_by_host_scope"] == {
        "gpu_model_runner: bookkeep": 0.15,
        "(outside every scope)": 0.1,
        FORWARD: 0.05,
    }
    assert s["cuda_runtime_per_step"]["cudaGraphLaunch"] == {"calls": 1.0, "ms": 0.02}
    assert s["cuda_runtime_per_step"]["cudaStreamSynchronize"] == {"calls": 0.5, "ms": 0.125}
    assert s["kernel_ms_per_step"] == {"gemm": 0.6, "attn": 0.15}
    assert s["gpu_ops_per_step"] == 1.5  # three kernels in the two whole steps
    assert s["host_op_ms_per_step"] == {"aten::copy_": 0.005}


def test_too_few_steps_is_an_error_that_says_what_to_profile():
    with pytest.raises(ValueError, match=r"2 'gpu_model_runner: forward' scopes.*VLLM_CUSTOM_SCOPES_FOR_PROFILING"):
        step_profile.summarize(TRACE[:2])


def test_traces_are_read_gzipped_and_the_newest_of_a_folder_is_taken(tmp_path):
    old = tmp_path / "w.1.pt.trace.json"
    old.write_text(json.dumps({"traceEvents": []}))
    new = tmp_path / "w.2.pt.trace.json.gz"
    with gzip.open(new, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    assert step_profile.newest_trace(tmp_path) == new
    assert step_profile.summarize(step_profile.load_trace(new))["steps"] == 2
    with pytest.raises(FileNotFoundError, match=r"no \*\.pt\.trace\.json"):
        step_profile.newest_trace(tmp_path / "missing")


def test_a_file_that_is_not_a_trace_is_named(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match=r"t\.json: not a Chrome trace"):
        step_profile.load_trace(bad)
