"""Under DDTree a short prompt is attended as the target alone attends it.

TREE_ATTN splits a step's requests into decodes (tree verification: FlashAttention over the cached
prefix, then the step's own tokens through the tree kernel) and prefills (causal FlashAttention) by
query length alone: a prompt no longer than a tree step (budget + 1 tokens, 33 at budget 32) counted
as a decode. Its attention is then exact but rounded by the tree kernel, not as the target alone
rounds it, and on the trained pure-attention pair the sampled test's 24-token prefix drew its first
token from a visibly other distribution (a 2.6% token at the top-p cut never drawn in 2,000), where
the chain and the target alone agreed. The change set's builder counts every request still in its
prompt as a prefill (vLLM's own ``is_prefilling`` flags). The split is the wheel's own function,
run on stand-in metadata; the call is read from the patched builder.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch

from ddtree.tests import release_files

TREE_ATTN = "vllm/v1/attention/backends/tree_attn.py"
UTILS = "vllm/v1/attention/backends/utils.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"


@pytest.fixture(scope="module")
def split():
    source = release_files.pristine([UTILS])[UTILS].decode()
    return release_files.function(
        source, "split_decodes_and_prefills", {"torch": torch, "CommonAttentionMetadata": object}
    )


@pytest.fixture(scope="module")
def build_calls() -> dict[str, dict[str, str]]:
    """The keywords of TreeAttentionMetadataBuilder.build's split call, pristine and patched."""
    out = {}
    for name, files in (("pristine", release_files.pristine), ("patched", release_files.patched)):
        tree = ast.parse(files([TREE_ATTN])[TREE_ATTN].decode())
        builder = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("MetadataBuilder"))
        build = next(n for n in builder.body if isinstance(n, ast.FunctionDef) and n.name == "build")
        (call,) = [
            c
            for c in ast.walk(build)
            if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "split_decodes_and_prefills"
        ]
        out[name] = {kw.arg: ast.unparse(kw.value) for kw in call.keywords}
    return out


def metadata(query_lens: list[int], prefilling: list[bool] | None, tokens: int | None = None):
    """A step's attention metadata as the split reads it (requests ordered as the builder's
    reorder leaves them: decodes first, prompts last; a CUDA graph's padding rows last, with no
    tokens of their own, ``tokens`` the padded count)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return SimpleNamespace(
        max_query_len=max(query_lens),
        num_reqs=len(query_lens),
        num_actual_tokens=tokens or starts[-1],
        query_start_loc_cpu=torch.tensor(starts),
        is_prefilling=None if prefilling is None else torch.tensor(prefilling),
    )


def as_builder(split, call: dict[str, str], cad, threshold: int = 33):
    """The split as the builder calls it (its keyword expressions, evaluated on ``cad``)."""
    extra = {
        k: eval(v, {}, {"common_attn_metadata": cad})  # the wheel's own expression
        for k, v in call.items()
        if k not in ("decode_threshold",)
    }
    return split(cad, decode_threshold=threshold, **extra)


def test_the_release_verifies_a_short_prompt_as_a_tree(split, build_calls):
    # One tree step of 33 tokens and a fresh 24-token prompt: the release calls both decodes.
    cad = metadata([33, 24], [False, True])
    assert as_builder(split, build_calls["pristine"], cad) == (2, 0, 57, 0)


@pytest.mark.parametrize(
    ("query_lens", "prefilling", "expected"),
    [
        ([33, 24], [False, True], (1, 1, 33, 24)),  # the short prompt is a prefill
        ([33, 33, 5], [False, False, True], (2, 1, 66, 5)),  # a short prompt chunk too
        ([33, 1, 40], [False, False, True], (2, 1, 34, 40)),  # a one-token decode stays a decode
        ([33, 33], [False, False], (2, 0, 66, 0)),  # tree steps alone: all decodes
    ],
)
def test_a_request_in_its_prompt_is_a_prefill(split, build_calls, query_lens, prefilling, expected):
    assert as_builder(split, build_calls["patched"], metadata(query_lens, prefilling)) == expected


def test_a_padded_graph_batch_stays_all_decodes(split, build_calls):
    """Three tree steps padded to a graph of four requests: the padding row has no tokens, and the
    runner never flags it as a prompt, so the split is the release's. A stale flag there (the input
    batch keeps a departed request's values) would make it a prefill and shrink the decode part the
    graph was captured with."""
    cad = metadata([33, 33, 33, 0], [False, False, False, False], tokens=132)
    assert as_builder(split, build_calls["patched"], cad) == as_builder(split, build_calls["pristine"], cad)
    assert as_builder(split, build_calls["patched"], cad) == (4, 0, 132, 0)
    stale = metadata([33, 33, 33, 0], [False, False, False, True], tokens=132)
    assert as_builder(split, build_calls["patched"], stale) == (3, 1, 99, 33)


def test_padding_rows_are_never_flagged_as_prompts():
    """The runner clears the flags past the batch's real requests right where it computes them."""
    source = release_files.patched([RUNNER])[RUNNER].decode()
    fn = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef) and n.name == "_build_attention_metadata"
    )
    lines = [ast.unparse(stmt) for stmt in fn.body]
    computed = lines.index("is_prefilling = num_computed_tokens_cpu < num_prompt_tokens_cpu")
    assert lines[computed + 1] == "is_prefilling[num_reqs:] = False"
