"""tests/gpu/ddtree_gpu.py's judgements, which the GPU runs' summaries rest on, on the CPU."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ddtree_gpu(gpu_script):
    """The GPU driver's judgements, importable on the CPU."""
    return gpu_script("ddtree_gpu")


REFUSED = "DDTree tree verification (speculative method 'ddtree') cannot honour logprobs ..."


def test_ddtree_must_refuse_every_probe_and_the_others_serve_them(ddtree_gpu):
    probes = list(ddtree_gpu.REFUSAL_PROBES)
    assert ddtree_gpu.refusals_as_expected(True, dict.fromkeys(probes, REFUSED))["as_expected"]
    assert ddtree_gpu.refusals_as_expected(False, dict.fromkeys(probes, "served"))["as_expected"]
    one_served = {**dict.fromkeys(probes, REFUSED), probes[0]: "served"}
    assert not ddtree_gpu.refusals_as_expected(True, one_served)["as_expected"]
    assert not ddtree_gpu.refusals_as_expected(False, one_served)["as_expected"]
    assert not ddtree_gpu.refusals_as_expected(True, {probes[0]: REFUSED})["as_expected"]  # a probe missing


def test_identity_covers_the_allowed_token_run_when_both_sides_have_it(ddtree_gpu):
    ref = {"batch1": [[1, 2]], "batch4": [[1, 2]], "allowed_batch4": [[3, 3]]}
    same = ddtree_gpu.compare(ref, dict(ref))
    assert set(same) == {"batch1", "batch4", "allowed_batch4"}
    assert all(v["identical"] for v in same.values())
    other = ddtree_gpu.compare(ref, {**ref, "allowed_batch4": [[3, 4]]})
    assert other["allowed_batch4"] == {"identical": False, "first_divergence": [1]}
    assert set(ddtree_gpu.compare({"batch1": [], "batch4": []}, ref)) == {"batch1", "batch4"}
