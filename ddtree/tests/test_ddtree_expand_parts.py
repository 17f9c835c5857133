"""ddtree/bench/expand_parts.py edits the kernels' source by text: these tests fail when
the kernels change under it, before anyone spends GPU time finding out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ddtree.bench import expand_parts as parts


def test_every_part_is_found_once_in_the_kernels_source() -> None:
    source = (parts.COMMON / "ddtree_kernels.py").read_text()
    variants = parts.variant_sources(source)
    assert set(variants) == {"baseline"} | {f"{part} x2" for part in parts.TWICE}
    assert len(set(variants.values())) == len(variants)  # each variant changed something
    with pytest.raises(SystemExit, match="the kernel source changed"):
        parts.variant_sources(source.replace(parts.TAU, "            tau = _score_at(best, N - 2)\n"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_each_variant_builds_the_same_trees(tmp_path: Path) -> None:
    # The variants run a part twice and drop the second result: the trees must not change (the
    # script checks this on the GPU too). Triton's interpreter on a CPU, a small peaked case.
    logits = torch.randn(1, 4, 50, generator=torch.Generator().manual_seed(3)) * 6.0
    expected = parts.tree_module.build_trees(logits, 16, kernels=True)
    plan = parts.tree_module._expand_plan(4, 50, 16, logits.device)
    sources = parts.variant_sources((parts.COMMON / "ddtree_kernels.py").read_text())
    for i, (name, source) in enumerate(sources.items()):
        path = tmp_path / f"ddtree_kernels_variant{i}.py"
        path.write_text(source)
        tokens, _, parent, *_ = parts.load_module(f"ddtree_kernels_variant{i}", path).build(logits, 16, plan)
        assert torch.equal(tokens, expected.tokens) and torch.equal(parent, expected.parent), name
