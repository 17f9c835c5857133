"""Test double for the three vLLM 0.20.1 modules the DDTree runtime imports (logger, SamplerOutput, top-k/top-p),
and for the KV-cache specs the patched runner's start-up checks read (``runner_check_modules``).

``vllm/v1/spec_decode/ddtree.py`` (added by the change set) runs inside vLLM's GPU model runner. Its
logic (positions, attention bias, tree walk, compaction) depends only on torch; these stand-ins let
the unit tests load the real file without vLLM (which needs CUDA). ``load_ddtree_runtime()`` returns
the change set's ``ddtree`` module with ``vllm.v1.spec_decode.ddtree_tree`` bound to the change
set's own ``ddtree_tree.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from ddtree import HOME

FILES = HOME


@dataclass
class SamplerOutput:
    """vllm.v1.outputs.SamplerOutput: the two fields the runtime fills."""

    sampled_token_ids: object
    logprobs_tensors: object


def apply_top_k_top_p(logits, k, p):
    """vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p, for k and p per row (or None)."""
    import torch

    out = logits.clone()
    if k is not None:
        kth = out.sort(dim=-1, descending=True).values.gather(1, (k.long() - 1).clamp(min=0).view(-1, 1))
        out = out.masked_fill(out < kth, float("-inf"))
    if p is not None:
        probs = torch.softmax(out, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > p.view(-1, 1)
        out = out.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return out


def _module(name: str, **attrs) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    sys.modules[name] = mod
    return mod


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_ddtree_runtime() -> types.ModuleType:
    for name in ("vllm", "vllm.v1", "vllm.v1.sample", "vllm.v1.sample.ops", "vllm.v1.spec_decode"):
        _module(name)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.v1.outputs", SamplerOutput=SamplerOutput)
    _module("vllm.v1.sample.ops.topk_topp_sampler", apply_top_k_top_p=apply_top_k_top_p)
    _load("vllm.v1.spec_decode.ddtree_tree", FILES / "common" / "ddtree_tree.py")
    _load("vllm.v1.spec_decode.ddtree_moves", FILES / "common" / "ddtree_moves.py")
    return _load("vllm.v1.spec_decode.ddtree", FILES / "vllm-0.20.1" / "added" / "ddtree.py")


# One request's tree of five drafts (rows: the root, then node n at row n + 1): siblings, and a
# branch off row 2. The GDN and tensor-parallel tests verify it and commit the walk's path.
TREE_PARENTS = (-1, 0, 0, 1, 2, 4)


def committed_tree_step(dd: types.ModuleType):
    """The DDTree runtime's step (module ``dd``) after verifying TREE_PARENTS and accepting nodes 1,
    3 and 4 (rows 2, 4 and 5): a path off the first rows."""
    import torch

    n = len(TREE_PARENTS) - 1
    return dd._StepTrees(
        num_reqs=1,
        has_drafts=torch.tensor([True]),
        has_tree=torch.tensor([True]),
        num_drafts=torch.tensor([n]),
        query_start=torch.tensor([0]),
        parent=torch.tensor([[p - 1 for p in TREE_PARENTS[1:]]]),
        depth=torch.tensor([[1, 1, 2, 2, 3]]),
        ancestor_mask=torch.ones(1, n + 1, n + 1, dtype=torch.bool),
        seq_positions=torch.zeros(n + 1, dtype=torch.int64),
        accepted_nodes=torch.tensor([[1, 3, 4]]),
        num_accepted=torch.tensor([3]),
    )


GDN_KERNELS = {
    "fused_sigmoid_gating": "vllm/model_executor/layers/fla/ops/fused_sigmoid_gating.py",
    "causal_conv1d": "vllm/model_executor/layers/mamba/ops/causal_conv1d.py",
}


def load_gdn_kernels(sources: dict[str, bytes], where: Path) -> dict[str, types.ModuleType]:
    """The Gated DeltaNet kernel files given (pristine or patched release sources), loaded with the
    two vLLM names they import (``vllm.triton_utils``: the real triton; the null-block constants)."""
    import triton
    import triton.language as tl

    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        _module(name)
    _module("vllm.triton_utils", tl=tl, triton=triton)
    _module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0, PAD_SLOT_ID=-1)
    out = {}
    for short, path in GDN_KERNELS.items():
        file = where / Path(path).name
        file.write_bytes(sources[path])
        out[short] = _load(f"_gdn_{where.name}_{short}", file)
    return out


# vllm.v1.kv_cache_interface's specs and vllm's Attention layer, as far as the patched runner's
# start-up checks (_get_ddtree_kv_caches, _get_ddtree_recurrent_groups) read them.
class FullAttentionSpec:
    def __init__(self, sliding_window=None):
        self.sliding_window = sliding_window


class SlidingWindowSpec:
    sliding_window = 2048


class MambaSpec:
    pass


class Attention:
    def __init__(self, name: str):
        self.kv_cache = [f"kv:{name}"]


def runner_check_modules() -> dict[str, types.ModuleType]:
    """The modules those checks import inside their bodies, by name (install them in sys.modules)."""
    made = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1")}
    made["vllm.v1.kv_cache_interface"] = types.ModuleType("vllm.v1.kv_cache_interface")
    made["vllm.v1.kv_cache_interface"].FullAttentionSpec = FullAttentionSpec
    made["vllm.v1.kv_cache_interface"].MambaSpec = MambaSpec
    abstract = made["vllm.model_executor.layers.mamba.abstract"] = types.ModuleType("abstract")
    abstract.MambaBase = object
    utils = made["vllm.model_executor.layers.mamba.mamba_utils"] = types.ModuleType("mamba_utils")
    utils.is_conv_state_dim_first = lambda: False
    made["vllm.v1.spec_decode.ddtree"] = types.ModuleType("ddtree")
    made["vllm.v1.spec_decode.ddtree"].RecurrentGroup = types.SimpleNamespace
    return made
