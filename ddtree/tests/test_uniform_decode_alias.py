"""A prompt shaped like a verification step is not replayed through the FULL decode graph.

vLLM 0.20.1 calls a batch a uniform decode from its shape alone: one request of exactly
1 + num_speculative_tokens new tokens, or several such. A fresh prompt of that length (16 tokens for
the chain of 15, budget + 1 for DDTree) matches, and is replayed through the FULL CUDA graph captured
for verification. Attention computes the same there; Gated DeltaNet does not (its builder refreshes
the graph's state indices only for decode batches), and the trained hybrid pair's first 16-token
prompt came out as garbage under full CUDA graphs, for the chain and DDTree 15 alike. The change
set's runner asks ``_ddtree_uniform_decode`` first. Its methods are taken from the real wheel's
gpu_model_runner.py, pristine and as the change set leaves it, and run on stand-in runners.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.tests import release_files

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
CLS = "GPUModelRunner"


@pytest.fixture(scope="module")
def sources() -> tuple[str, str]:
    return (
        release_files.pristine([RUNNER])[RUNNER].decode(),
        release_files.patched([RUNNER])[RUNNER].decode(),
    )


@pytest.fixture(scope="module")
def is_uniform(sources):
    return release_files.method(sources[0], CLS, "_is_uniform_decode", {})


@pytest.fixture(scope="module")
def guard(sources):
    return release_files.method(sources[1], CLS, "_ddtree_uniform_decode", {"SpecDecodeMetadata": object})


def a_runner(draft_tokens: list[int], spec: bool = True):
    """``num_decode_draft_tokens``: per request the drafts it verifies past its prompt, -1 for a
    request in its prompt (as ``_prepare_inputs`` fills it)."""
    buf = np.full(8, -1, dtype=np.int32)
    buf[: len(draft_tokens)] = draft_tokens
    return SimpleNamespace(
        speculative_config=object() if spec else None,
        num_decode_draft_tokens=SimpleNamespace(np=buf),
    )


def decide(is_uniform, guard, runner, spec_meta, scheduled: list[int], query_len: int = 16) -> bool:
    """What the patched runner's dispatch sees: ``_is_uniform_decode`` with the guard's answer."""
    return is_uniform(
        max_num_scheduled_tokens=max(scheduled),
        uniform_decode_query_len=query_len,
        num_tokens=sum(scheduled),
        num_reqs=len(scheduled),
        force_uniform_decode=guard(runner, spec_meta, len(scheduled)),
    )


def test_the_release_takes_a_16_token_prompt_for_a_verification_step(is_uniform):
    # The bug the change set fixes, in the release's own code: shape only.
    assert is_uniform(max_num_scheduled_tokens=16, uniform_decode_query_len=16, num_tokens=16, num_reqs=1) is True


@pytest.mark.parametrize(
    ("draft_tokens", "spec_meta", "scheduled"),
    [
        ([-1], None, [16]),  # a fresh 16-token prompt alone: no request has drafts
        ([-1, -1], None, [16, 16]),  # two of them
        ([15, -1], object(), [16, 16]),  # a decode beside a 16-token prompt (or prompt chunk)
        ([-1, 15, 15], object(), [16, 16, 16]),
    ],
)
def test_a_prompt_shaped_like_a_step_is_not_a_uniform_decode(is_uniform, guard, draft_tokens, spec_meta, scheduled):
    assert decide(is_uniform, guard, a_runner(draft_tokens), spec_meta, scheduled) is False


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_verification_steps_stay_uniform_decodes(is_uniform, guard, batch):
    # Every request verifies 15 drafts past its prompt: the FULL graph serves it, as released.
    assert decide(is_uniform, guard, a_runner([15] * batch), object(), [16] * batch) is True


def test_a_request_with_no_drafts_left_past_its_prompt_is_still_a_decode(is_uniform, guard):
    # 0 drafts (all rolled back, e.g. by a grammar) past the prompt: the shape decides, as released.
    assert guard(a_runner([0, 15]), object(), 2) is None
    assert decide(is_uniform, guard, a_runner([0, 15]), object(), [1, 16]) is False  # shapes differ


def test_ddtree_budget_steps_stay_uniform_decodes(is_uniform, guard):
    # DDTree 64 verifies 65 tokens a request (num_speculative_tokens is the budget there).
    assert decide(is_uniform, guard, a_runner([64, 64]), object(), [65, 65], query_len=65) is True
    assert decide(is_uniform, guard, a_runner([-1]), None, [65], query_len=65) is False


def test_without_speculative_decoding_the_shape_decides_as_released(is_uniform, guard):
    runner = a_runner([-1], spec=False)
    assert guard(runner, None, 1) is None
    assert decide(is_uniform, guard, runner, None, [1], query_len=1) is True


def test_the_step_dispatch_asks_the_guard(sources):
    """``execute_model``'s one call that decides the step's graph passes the guard's answer; the
    capture path keeps forcing its own."""
    pristine, patched = sources
    calls = {}
    for name, source in (("pristine", pristine), ("patched", patched)):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name == "execute_model":
                found = [
                    call
                    for call in ast.walk(node)
                    if isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "_determine_batch_execution_and_padding"
                ]
                assert len(found) == 1, f"{name}: one dispatch decision in execute_model"
                calls[name] = {kw.arg: ast.unparse(kw.value) for kw in found[0].keywords}
    assert "force_uniform_decode" not in calls["pristine"]
    assert calls["patched"]["force_uniform_decode"] == "self._ddtree_uniform_decode(spec_decode_metadata, num_reqs)"
