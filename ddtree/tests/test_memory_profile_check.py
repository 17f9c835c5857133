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


# --- the fit's prediction, run on the CPU as the GPU run makes it ------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The 27B target's and drafter's config.json exactly as the fit proof writes them on the GPU
    (ddtree/bench/step_cost.py: tests/fakes/target_model.py's target, drafter_config's drafter)."""
    import json

    from ddtree.bench import step_cost

    target, drafter = step_cost.write_models("27b", tmp_path_factory.mktemp("fit"))
    return json.loads((target / "config.json").read_text()), json.loads((drafter / "config.json").read_text())


@pytest.fixture(scope="module")
def base():
    """vLLM 0.20.1's rules (ddtree/vllm-0.20.1/base.json), the release the proof runs on."""
    from ddtree import bases

    return bases.rules("0.20.1")


H200_MIB = 143771  # nvidia-smi's memory.total of the captured H200 (shared/fixtures/nvidia-smi)


def predict(check, pair, base, method="ddtree", defaults=None, mamba_ssm_dtype=None, weights=54 * GIB):
    target, drafter = pair
    if mamba_ssm_dtype:
        target = {**target, "text_config": {**target["text_config"], "mamba_ssm_dtype": mamba_ssm_dtype}}
    d = {**check.role_defaults(), **(defaults or {})}
    return check.fit_prediction(target, drafter, measured(weights_bytes=weights), d, method, H200_MIB, base=base)


def test_the_prediction_needs_per_request_what_vllm_printed_for_the_27b_pair(check, pair, base):
    """At max_model_len 8,580 (the step benchmark's 27B chain, 15 tokens) vLLM 0.20.1 printed "2.29 GiB KV
    cache is needed" on an H100 (tests/unit/test_memory_fit.py): pages of 480 tokens x 4,096 bytes, 5 layers a
    group, 18 blocks in 4 target and 1 drafter groups, 16 state slots in 10 Gated DeltaNet groups."""
    got = predict(check, pair, base, "dflash", {"service_swap_max_model_len": 8580})
    assert got["request_bytes"] == 5 * 1_966_080 * (4 * 18 + 18 + 10 * 16) == 2_457_600_000


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_the_prediction_at_the_role_defaults_counts_the_request_as_vllm_lays_it_out(check, pair, base, method):
    """The role defaults: max_model_len 32,768, 15 tokens verified per step (the depth, and the DDTree budget),
    32 requests. The same pages as at 8,580 tokens (the state slot sets them: 48 x 128 x 128 x 2 + 10240 x 18 x
    2 bytes in bf16), ceil(32768 / 480) = 69 blocks per attention group."""
    got = predict(check, pair, base, method)
    assert got["request_bytes"] == 5 * 1_966_080 * (4 * 69 + 69 + 10 * 16) == 4_964_352_000
    assert got["budget_bytes"] == int(H200_MIB * 2**20 * 0.9)
    assert got["reserve_bytes"] == 2048 * 2**20
    free = got["budget_bytes"] - 54 * GIB - got["profile_bytes"] - got["reserve_bytes"]
    assert got["kv_available_bytes"] == free
    assert got["fits"] == free // 4_964_352_000 == 14  # of 32: the node lowers max_num_seqs or is refused
    # The prediction is what the proof's verdicts read.
    assert set(check.fit_checks(measured(), got)) == {
        "request_bytes_equal",
        "profile_within_tolerance_or_above",
        "reserve_covers_what_vllm_holds_besides",
        "fit_admits_no_more_than_vllm",
    }


def test_a_float32_recurrent_state_grows_the_page(check, pair, base):
    """--mamba-ssm-dtype float32: a slot of 48 x 128 x 128 x 4 + 10240 x 18 x 2 = 3,514,368 bytes, so blocks of
    16 x ceil(3514368 / 65536) = 864 tokens (pages of 3,538,944 bytes), ceil(32768 / 864) = 38 blocks."""
    got = predict(check, pair, base, "ddtree", mamba_ssm_dtype="float32")
    assert got["request_bytes"] == 5 * 3_538_944 * (4 * 38 + 38 + 10 * 16) == 6_193_152_000


def test_a_larger_ddtree_budget_keeps_a_state_slot_per_node(check, pair, base):
    """Budget 63 at 8,580 tokens: 64 state slots; the slot holds 10240 x 66 conv columns, so 48 x 128 x 128 x 2
    + 10240 x 66 x 2 = 2,924,544 bytes, blocks of 16 x ceil(2924544 / 65536) = 720 tokens, 12 blocks."""
    got = predict(
        check, pair, base, "ddtree", {"shared_settings_ddtree_budget": 63, "service_swap_max_model_len": 8580}
    )
    assert got["request_bytes"] == 5 * 720 * 4096 * (4 * 12 + 12 + 10 * 64) == 10_321_920_000
    chain = predict(
        check, pair, base, "dflash", {"shared_settings_ddtree_budget": 63, "service_swap_max_model_len": 8580}
    )
    assert chain["request_bytes"] == 2_457_600_000  # the chain verifies its depth, whatever the budget


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_the_engine_starts_at_the_role_defaults(check, method):
    """vLLM's arguments for the proof are built on the CPU as on the GPU: DDTree with the CUDA graphs
    service_swap renders (32 requests of 15 + 1 tokens), the chain with vLLM's own."""
    from pathlib import Path

    args = check.fit_engine_args(check.role_defaults(), method, Path("/t"), Path("/d"))
    assert (args["model"], args["max_model_len"], args["max_num_seqs"], args["max_num_batched_tokens"]) == (
        "/t",
        32768,
        32,
        16384,
    )
    assert args["gpu_memory_utilization"] == 0.9 and args["load_format"] == "dummy"
    assert args["language_model_only"] is True
    spec = args["speculative_config"]
    if method == "ddtree":
        assert spec == {"method": "ddtree", "model": "/d", "num_speculative_tokens": 15, "ddtree_budget": 15}
        assert args["compilation_config"] == {"cudagraph_capture_sizes": [16 * k for k in range(1, 33)]}
    else:
        assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
        assert args["compilation_config"] == {}
