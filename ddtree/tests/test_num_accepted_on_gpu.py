"""Under async scheduling a hybrid target's next step is prepared without waiting for the GPU.

vLLM 0.20.1 copies each step's accepted counts (the recurrent layers' state slot per request) to the
host, and the next step's ``_prepare_inputs`` waits for that copy before it reorders them: the host
cannot prepare step N+1 while step N runs, so the GPU idles for the whole preparation on every
speculative step of a Gated DeltaNet hybrid (the release's own TODO says so). The change set's
runner carries the counts on the GPU instead (``_ddtree_num_accepted_on_gpu``). Its method and
``_prepare_inputs`` are taken from the real wheel as the change set leaves it; the counts it gives
are the ones the release's host path computes, written out here literally.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch

from ddtree.tests import release_files

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
CLS = "GPUModelRunner"


@pytest.fixture(scope="module")
def patched_source() -> str:
    return release_files.patched([RUNNER])[RUNNER].decode()


@pytest.fixture(scope="module")
def carry(patched_source):
    return release_files.method(patched_source, CLS, "_ddtree_num_accepted_on_gpu", {"torch": torch})


class Buffer:
    """vLLM's CpuGpuBuffer as far as the method uses it (the "GPU" side is a CPU tensor here)."""

    def __init__(self, values, dtype):
        self.gpu = torch.tensor(values, dtype=dtype)
        self.np = self.gpu.numpy().copy()
        self.copies = 0

    def copy_to_gpu(self, n=None):
        self.copies += 1
        n = len(self.np) if n is None else n
        self.gpu[:n] = torch.from_numpy(self.np[:n])


def a_runner(last_counts, prev_positions, *, async_scheduling=True, mode="none"):
    """``last_counts``: the previous step's accepted counts, in its request order (max 6 requests);
    ``prev_positions``: this step's requests' rows in the previous step (-1: new to the batch)."""
    counts = last_counts + [7] * (6 - len(last_counts))  # 7: rows no request holds
    prev = prev_positions + [0] * (6 - len(prev_positions))
    return SimpleNamespace(
        use_async_scheduling=async_scheduling,
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        num_accepted_tokens=Buffer(counts, torch.int32),
        prev_positions=Buffer(prev, torch.int64),
    )


def test_counts_follow_their_requests_into_the_new_order(carry):
    # Last step: three requests accepted 3, 1 and 5 tokens. This step: the third moved to row 0,
    # a new request took row 1, the first moved to row 2.
    runner = a_runner([3, 1, 5], [2, -1, 0])
    assert carry(runner, 3, True) is True
    assert runner.num_accepted_tokens.gpu.tolist() == [5, 1, 3, 1, 1, 1]


def test_a_request_that_stays_keeps_its_count(carry):
    runner = a_runner([2, 16, 4, 1], [0, 1, 2, 3])
    assert carry(runner, 4, True) is True
    assert runner.num_accepted_tokens.gpu.tolist() == [2, 16, 4, 1, 1, 1]
    assert runner.prev_positions.copies == 1  # the mapping went to the GPU once


@pytest.mark.parametrize(
    ("async_scheduling", "had_prev_step", "mode"),
    [(False, True, "none"), (True, False, "none"), (True, True, "align")],
)
def test_the_release_path_runs_where_the_host_needs_the_counts(carry, async_scheduling, had_prev_step, mode):
    runner = a_runner([3, 1, 5], [2, -1, 0], async_scheduling=async_scheduling, mode=mode)
    assert carry(runner, 3, had_prev_step) is False
    assert runner.num_accepted_tokens.gpu.tolist() == [3, 1, 5, 7, 7, 7]  # untouched
    assert runner.prev_positions.copies == 0


def test_prepare_inputs_waits_for_the_host_copy_only_without_it(patched_source):
    """In ``_prepare_inputs`` the wait on the host copy is guarded by the GPU carry."""
    tree = ast.parse(patched_source)
    prepare = next(
        item
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == CLS
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name == "_prepare_inputs"
    )
    waits = []
    for node in ast.walk(prepare):
        if isinstance(node, ast.If):
            for stmt in node.body:
                if "num_accepted_tokens_event.synchronize()" in ast.unparse(stmt):
                    waits.append(ast.unparse(node.test))
    assert waits == ["self.num_accepted_tokens_event is not None and (not carried)"]
    (carry,) = [
        ast.unparse(node.value)
        for node in ast.walk(prepare)
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["carried"]
    ]
    assert carry == (
        "self.num_accepted_tokens_event is not None and "
        "self._ddtree_num_accepted_on_gpu(num_reqs, bool(prev_req_id_to_index))"
    )
    # The release's fill with 1 stays for runners without the event only: an `else` there would
    # overwrite the carried counts every step.
    (guarded,) = [node for node in ast.walk(prepare) if isinstance(node, ast.If) and ast.unparse(node.test) == waits[0]]
    (fallback,) = guarded.orelse
    assert isinstance(fallback, ast.If)
    assert ast.unparse(fallback.test) == "self.num_accepted_tokens_event is None"
    # The carry put prev_positions on the GPU already: the async spec-decode update copies it only
    # where the carry did not run.
    copies = [
        (node, stmt)
        for node in ast.walk(prepare)
        if isinstance(node, ast.If)
        for stmt in node.body
        if ast.unparse(stmt) == "self.prev_positions.copy_to_gpu(num_reqs)"
    ]
    assert [ast.unparse(node.test) for node, _ in copies] == ["not carried"]
