"""Near max_model_len the patched vLLM 0.20.1 stops drafting per request under DDTree, and the chain as stock.

Taken from the real wheel's files as the change set leaves them (a GPU runner cannot be built here):
the runner's decision whether the drafter runs at all (its own statement, against the pristine
release's), and the DFlash proposer's ``set_inputs_first_pass`` with the release's own Triton input
kernel (in Triton's interpreter without a GPU) and the change set's DDTree runtime. vLLM's metadata
containers and the proposer object are stand-ins holding the fields those functions read.
"""

from __future__ import annotations

import ast
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from ddtree.tests import release_files

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
DFLASH = "vllm/v1/spec_decode/dflash.py"
UTILS = "vllm/v1/spec_decode/utils.py"


def drafter_decision(source: str):
    """The runner's ``input_fits_in_drafter = ...`` statement, compiled on its own: a function of
    the runner (``self``) and the step's attention metadata."""
    found = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["input_fits_in_drafter"]
    ]
    assert len(found) == 1, "the runner decides once whether the drafter runs"
    expr = ast.Expression(found[0].value)
    code = compile(expr, "input_fits_in_drafter", "eval")
    return lambda runner, cad: eval(code, {}, {"self": runner, "spec_decode_common_attn_metadata": cad})


@pytest.fixture(scope="module")
def decisions():
    return (
        drafter_decision(release_files.pristine([RUNNER])[RUNNER].decode()),
        drafter_decision(release_files.patched([RUNNER])[RUNNER].decode()),
    )


def a_runner(ddtree, num_spec_tokens):
    return SimpleNamespace(ddtree=ddtree, num_spec_tokens=num_spec_tokens, effective_drafter_max_model_len=100)


@pytest.mark.parametrize("max_seq_len", [80, 85, 86, 99, 100])
def test_the_chain_decides_as_stock_vllm(decisions, max_seq_len):
    stock, patched = decisions
    runner = a_runner(None, 15)
    cad = SimpleNamespace(max_seq_len=max_seq_len)
    assert patched(runner, cad) == stock(runner, cad) == (max_seq_len + 15 <= 100)
    assert patched(runner, None) is stock(runner, None) is False


@pytest.mark.parametrize("max_seq_len", [20, 80, 99])
def test_ddtree_runs_the_drafter_whatever_the_longest_request(decisions, max_seq_len):
    stock, patched = decisions
    runner = a_runner(object(), 64)  # budget 64: stock vLLM stopped every tree 64 tokens early
    cad = SimpleNamespace(max_seq_len=max_seq_len)
    assert stock(runner, cad) is (max_seq_len + 64 <= 100)  # the release: the whole batch by the budget
    assert patched(runner, cad) is True  # each request's own block is checked by the drafter
    assert patched(runner, None) is False  # no step to draft from


@pytest.fixture(scope="module")
def input_kernel():
    """The release's DFlash input kernel, its module loaded with the three vLLM names it imports."""
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": SimpleNamespace(current_platform=SimpleNamespace(simple_compile_backend="eager")),
        "vllm.triton_utils": SimpleNamespace(tl=tl, triton=triton),
        "vllm.v1.attention.backends.utils": SimpleNamespace(CommonAttentionMetadata=SimpleNamespace),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)  # type: ignore[arg-type]
    try:
        scope: dict = {"__name__": "_dflash_input_kernel"}
        exec(compile(release_files.pristine([UTILS])[UTILS], UTILS, "exec"), scope)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return scope["copy_and_expand_dflash_inputs_kernel"]


def first_pass(source: str, kernel):
    return release_files.method(
        source,
        "DFlashProposer",
        "set_inputs_first_pass",
        {
            "torch": torch,
            "triton": triton,
            "copy_and_expand_dflash_inputs_kernel": kernel,
            "CommonAttentionMetadata": SimpleNamespace,
            "override": lambda f: f,
        },
    )


def proposer(ddtree, depth=2, block_size=4, max_model_len=32):
    """The proposer's buffers as ``DFlashProposer.__init__`` makes them, for 2 requests."""
    q = 2 * (1 + depth)
    return SimpleNamespace(
        num_speculative_tokens=depth,
        device=torch.device("cpu"),
        input_ids=torch.zeros(q, dtype=torch.int32),
        _context_positions_buffer=torch.zeros(16, dtype=torch.int64),
        positions=torch.zeros(q, dtype=torch.int64),
        _context_slot_mapping_buffer=torch.zeros(16, dtype=torch.int64),
        _slot_mapping_buffer=torch.zeros(q, dtype=torch.int64),
        parallel_drafting_token_id=7,
        block_size=block_size,
        arange=torch.arange(16, dtype=torch.int32),
        token_arange_np=np.arange(16, dtype=np.int32),
        ddtree=ddtree,
        _ddtree_runner=SimpleNamespace(effective_drafter_max_model_len=max_model_len),
    )


def step_metadata():
    """Request 0 verified 3 tokens at positions 10..12, request 1 at 27..29; blocks of 4 slots, the
    requests' blocks 100.. and 200.. (max_model_len 32: 8 blocks each)."""
    return SimpleNamespace(
        batch_size=lambda: 2,
        max_query_len=3,
        query_start_loc=torch.tensor([0, 3, 6], dtype=torch.int32),
        block_table_tensor=torch.stack([torch.arange(100, 108), torch.arange(200, 208)]).to(torch.int32),
        seq_lens=torch.tensor([13, 30], dtype=torch.int32),
        seq_lens_cpu_upper_bound=None,
        num_reqs=2,
        max_seq_len=30,
    )


def run_first_pass(method, prop):
    return method(
        prop,
        target_token_ids=torch.zeros(6, dtype=torch.int32),
        next_token_ids=torch.tensor([5, 6], dtype=torch.int32),
        target_positions=torch.tensor([10, 11, 12, 27, 28, 29]),
        target_hidden_states=torch.zeros(6, 4),
        token_indices_to_sample=None,
        cad=step_metadata(),
        num_rejected_tokens_gpu=None,
    )


def slot(block: int, position: int) -> int:
    return block * 4 + position % 4


def test_a_request_whose_draft_block_passes_max_model_len_drafts_nothing_and_the_other_drafts_on(dd, input_kernel):
    method = first_pass(release_files.patched([DFLASH])[DFLASH].decode(), input_kernel)
    runtime = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    prop = proposer(runtime)
    num_query, _, cad = run_first_pass(method, prop)
    assert num_query == 6
    # Request 0's block (bonus at 13, then depth 2) is the kernel's; request 1's would end at 32,
    # past max_model_len 32: it moves to positions 0..2 of its own cache and writes no KV.
    assert prop.positions.tolist() == [13, 14, 15, 0, 1, 2]
    assert prop._slot_mapping_buffer.tolist() == [slot(103, 13), slot(103, 14), slot(103, 15), -1, -1, -1]
    assert cad.seq_lens.tolist() == [16, 3]
    assert cad.max_seq_len == 32  # 30 + 3 before: no sequence is longer than max_model_len now
    assert prop._ddtree_drafted.tolist() == [True, False]
    assert prop.input_ids.tolist() == [5, 7, 7, 6, 7, 7]  # bonus token, then mask tokens


def test_the_release_wrote_past_max_model_len_and_the_chain_still_does(dd, input_kernel):
    """What the per-request limit guards against, and that the chain (no DDTree) keeps stock's
    behaviour: the stock runner does not run its drafter on this batch at all."""
    for source in (release_files.pristine([DFLASH])[DFLASH], release_files.patched([DFLASH])[DFLASH]):
        prop = proposer(None)
        _, _, cad = run_first_pass(first_pass(source.decode(), input_kernel), prop)
        assert prop.positions.tolist() == [13, 14, 15, 30, 31, 32]
        assert prop._slot_mapping_buffer.tolist()[3:] == [slot(207, 30), slot(207, 31), slot(207, 32)]
        assert cad.seq_lens.tolist() == [16, 33]
        assert cad.max_seq_len == 33
