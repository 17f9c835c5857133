"""What the patched vLLM 0.20.1 runner checks at start-up before DDTree may compact a target's caches, and
that it tells the DDTree runtime which requests finished.

The runner's own methods, taken from the real wheel's gpu_model_runner.py as the change set leaves it
and run on stand-in runners (a GPU runner cannot be built here): a target attention layer that is not
full attention, or a hybrid target with prefix caching on, is refused with what to do, and the
refusal runs where vLLM allocates its KV caches, not at the first tree step.
"""

from __future__ import annotations

import ast
import sys
from types import SimpleNamespace

import pytest

from ddtree.tests import release_files
from ddtree.tests.vllm_modules import (  # vLLM's KV-cache specs, as stand-ins
    Attention,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    runner_check_modules,
)

RUNNER = "vllm/v1/worker/gpu_model_runner.py"


@pytest.fixture(scope="module")
def runner_source() -> str:
    return release_files.patched([RUNNER])[RUNNER].decode()


@pytest.fixture
def stub_vllm(monkeypatch):
    for name, module in runner_check_modules().items():
        monkeypatch.setitem(sys.modules, name, module)


def kv_caches_method(source: str, layers: dict[str, Attention]):
    return release_files.method(
        source,
        "GPUModelRunner",
        "_get_ddtree_kv_caches",
        {
            "torch": SimpleNamespace(Tensor=object),
            "Attention": Attention,
            "get_layers_from_vllm_config": lambda c, t: layers,
        },
    )


def runner(groups, draft_layers=(), hybrid=False, mamba_cache_mode="none"):
    return SimpleNamespace(
        _ddtree_kv_caches=None,
        _ddtree_recurrent=None,
        drafter=SimpleNamespace(_draft_attn_layer_names=set(draft_layers)),
        vllm_config=None,
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        model_config=SimpleNamespace(is_hybrid=hybrid),
        cache_config=SimpleNamespace(mamba_cache_mode=mamba_cache_mode),
    )


def group(spec, *names):
    return SimpleNamespace(kv_cache_spec=spec, layer_names=list(names))


def test_every_full_attention_group_of_the_target_is_compacted_and_the_drafters_layers_are_not(
    runner_source, stub_vllm
):
    layers = {n: Attention(n) for n in ("t.0", "t.1", "t.2", "draft.0")}
    get = kv_caches_method(runner_source, layers)
    r = runner(
        [
            group(FullAttentionSpec(), "t.0", "t.1"),
            group(MambaSpec(), "gdn.0"),
            group(FullAttentionSpec(), "t.2", "draft.0"),
        ],
        draft_layers=["draft.0"],
    )
    assert get(r) == [(0, [["kv:t.0"], ["kv:t.1"]]), (2, [["kv:t.2"]])]


@pytest.mark.parametrize(
    ("spec", "named"),
    [(SlidingWindowSpec(), "SlidingWindowSpec"), (FullAttentionSpec(sliding_window=4096), "FullAttentionSpec")],
)
def test_a_target_attention_layer_that_is_not_full_attention_is_refused_with_what_to_do(
    runner_source, stub_vllm, spec, named
):
    layers = {n: Attention(n) for n in ("t.0", "t.1")}
    get = kv_caches_method(runner_source, layers)
    r = runner([group(FullAttentionSpec(), "t.0"), group(spec, "t.1")])
    with pytest.raises(ValueError) as refused:
        get(r)
    assert str(refused.value) == (
        f"DDTree needs a target whose attention layers are all full attention (group 1 is {named}); use method 'dflash'."
    )


def test_a_hybrid_target_with_prefix_caching_is_refused_with_what_to_do(runner_source, stub_vllm):
    get = release_files.method(
        runner_source,
        "GPUModelRunner",
        "_get_ddtree_recurrent_groups",
        {"get_layers_from_vllm_config": lambda c, t: {}},
    )
    with pytest.raises(
        ValueError, match=r"prefix caching off \(--no-enable-prefix-caching\); mamba cache mode 'align'"
    ):
        get(runner([], hybrid=True, mamba_cache_mode="align"))
    assert get(runner([], hybrid=False, mamba_cache_mode="align")) is None  # nothing recurrent to keep


def test_both_checks_run_where_vllm_allocates_its_kv_caches(runner_source):
    """At start-up (initialize_kv_cache), right after the caches exist, not at the first tree step."""
    [init] = [
        f
        for c in ast.walk(ast.parse(runner_source))
        if isinstance(c, ast.ClassDef) and c.name == "GPUModelRunner"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "initialize_kv_cache"
    ]
    line = {
        n.func.attr: n.lineno
        for n in ast.walk(init)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
    }
    assert line["_get_ddtree_kv_caches"] > line["initialize_kv_cache_tensors"]
    assert line["_get_ddtree_recurrent_groups"] > line["initialize_kv_cache_tensors"]


class _FinishedHandled(Exception):
    """Raised by the stand-in runner once the finished requests are handled: the rest of
    ``_update_states`` (the persistent batch, new requests) needs a real runner."""


def update_states_until_finished_handled(
    source: str, ddtree, finished: set[str], preempted: set[str] | None = None
) -> dict:
    from collections.abc import Callable

    update_states = release_files.method(source, "GPUModelRunner", "_update_states", {"Callable": Callable})

    def stop(req_ids):
        raise _FinishedHandled

    r = SimpleNamespace(
        requests={rid: object() for rid in ("a", "b", "c")},
        num_prompt_logprobs={},
        ddtree=ddtree,
        late_interaction_runner=SimpleNamespace(on_requests_finished=stop),
    )
    with pytest.raises(_FinishedHandled):
        update_states(r, SimpleNamespace(finished_req_ids=finished, preempted_req_ids=preempted))
    return r.requests


def test_the_runner_makes_the_runtime_forget_the_trees_of_finished_requests(runner_source, dd):
    """Where vLLM drops a finished request's state, the runtime drops its tree: else it would wait
    (and be copied to the device) at every later tree build."""
    import torch

    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    rt.build(torch.randn(3, 2, 8), ["a", "b", "c"])
    requests = update_states_until_finished_handled(runner_source, rt, {"a"})
    assert list(requests) == ["b", "c"]
    assert list(rt._stored.req_index) == ["b", "c"]
    update_states_until_finished_handled(runner_source, None, {"a"})  # the chain: no runtime to tell


def test_the_runner_makes_the_runtime_forget_the_trees_of_preempted_requests(runner_source, dd):
    """A preempted request resumes through a prefill, without drafts, and gets a new tree: its old
    one would only wait (and be copied) at every tree build until then. vLLM keeps its state."""
    import torch

    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    rt.build(torch.randn(3, 2, 8), ["a", "b", "c"])
    requests = update_states_until_finished_handled(runner_source, rt, set(), {"c"})
    assert list(requests) == ["a", "b", "c"]
    assert list(rt._stored.req_index) == ["a", "b"]
    update_states_until_finished_handled(runner_source, rt, set(), None)  # vLLM sends None when none was
