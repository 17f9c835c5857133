"""ddtree/gpu/memory_profile_check.py's verdict, which the GPU proof of the memory profile rests on."""

from __future__ import annotations

import pytest

GIB = 1 << 30


@pytest.fixture(scope="module")
def check():
    """The check's verdict, importable on the CPU."""
    from ddtree.gpu import memory_profile_check

    return memory_profile_check


def case(profile: float, step: float, kept: float = 0.0, tokens: int = 24) -> dict:
    return {
        "profile_peak_bytes": int(profile * GIB),
        "step_peak_bytes": int(step * GIB),
        "kept_by_profile_bytes": int(kept * GIB),
        "tokens": [tokens] * 16,
    }


def test_what_the_profile_keeps_counts_on_the_steps_side(check):
    # The step alone fits the profile, but the buffer the profile kept is held during the step too.
    summary = check.summarise("8b", {"ddtree64": case(profile=1.0, step=0.9, kept=0.2)})
    assert summary["profile_covers_the_tree_step"] is False
    assert summary["margin_gib"] == pytest.approx(-0.1, abs=0.001)
    summary = check.summarise("8b", {"ddtree64": case(profile=1.0, step=0.7, kept=0.2)})
    assert summary["profile_covers_the_tree_step"] is True


def test_the_chains_profile_is_compared_only_where_the_chain_ran(check):
    rows = {"chain": case(profile=0.3, step=0.6), "ddtree64": case(profile=1.0, step=0.7, kept=0.1)}
    summary = check.summarise("8b", rows)
    assert summary["step_needs_more_than_the_chains_profile"] is True
    assert summary["chain_profile_peak_gib"] == pytest.approx(0.3, abs=0.001)
    summary = check.summarise("27b", {"ddtree64": rows["ddtree64"]})
    assert "step_needs_more_than_the_chains_profile" not in summary and summary["profile_covers_the_tree_step"]


def test_no_verdict_without_a_finished_tree_case_or_with_short_outputs(check):
    summary = check.summarise("8b", {"chain": case(0.3, 0.6), "ddtree64": {"error": "exit 1: see log"}})
    assert "profile_covers_the_tree_step" not in summary
    summary = check.summarise("8b", {"ddtree64": case(profile=1.0, step=0.5, tokens=23)})
    assert summary["all_tokens"] is False


def measured(**kw) -> dict:
    out = {
        "profile_peak_bytes": 4 * GIB,
        "non_torch_bytes": GIB // 2,
        "cudagraph_estimate_bytes": GIB // 2,
        "requested_bytes": 70 * GIB,
        "request_bytes": 5 * GIB,
        "max_concurrency": 2,
    }
    out.update(kw)
    return out


def predicted(**kw) -> dict:
    out = {
        "budget_bytes": 70 * GIB,
        "profile_bytes": 4 * GIB,
        "reserve_bytes": 2 * GIB,
        "request_bytes": 5 * GIB,
        "fits": 2,
    }
    out.update(kw)
    return out


def test_the_fit_proof_holds_when_every_part_agrees(check):
    assert all(check.fit_checks(measured(), predicted()).values())


def test_the_fit_proof_fails_each_check_on_its_own(check):
    """Each verdict can fail: a request of another size, a profile estimate too low, a reserve that does not
    cover what vLLM holds besides (with nvidia-smi's extra share), a fit that admits more than vLLM."""
    assert not check.fit_checks(measured(), predicted(request_bytes=5 * GIB + 1))["request_bytes_equal"]
    low = check.fit_checks(measured(), predicted(profile_bytes=int(3.5 * GIB)))
    assert not low["profile_within_tolerance_or_above"]
    assert check.fit_checks(measured(), predicted(profile_bytes=int(3.7 * GIB)))["profile_within_tolerance_or_above"]
    short = check.fit_checks(measured(), predicted(budget_bytes=71 * GIB + 1))
    assert not short["reserve_covers_what_vllm_holds_besides"]
    assert not check.fit_checks(measured(), predicted(fits=3))["fit_admits_no_more_than_vllm"]


def test_the_fit_proof_runs_at_the_role_defaults(check):
    defaults = check.role_defaults()
    assert set(defaults) == {name for names in check.FIT_DEFAULTS.values() for name in names}
    assert all(isinstance(v, (int, float)) for v in defaults.values())
