"""service_swap's memory fit (module_utils/memory_fit.py): vLLM 0.20.1's own arithmetic, held to vLLM's figures.

The KV cache layout is checked against what vLLM printed on a GPU ("2.29 GiB KV cache is needed" for the
step benchmark's 27B chain at max_model_len 8,580, FACTS.md section 8), the profile estimate against the
memory profiles of record (ddtree/results/memory_profile_*_h200.json), and the verdict's sentences literally.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ansible.module_utils.ddtree_base import load_rules
from ansible.module_utils.memory_fit import (
    GIB,
    MIB,
    fit_verdict,
    kv_layout,
    memory_fit,
    profile_bytes,
    recurrent_state_bytes,
)
from memory_fit import service_swap_memory_fit
from safetensors_files import fake
from swap_outcome import tune_candidate_reason

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "ddtree" / "results"
# vLLM 0.20.1's rules as its base's descriptor gives them (ddtree/vllm-0.20.1/base.json): what the figures
# below were measured with.
BASE = load_rules(release="0.20.1")


def qwen36(**text_overrides) -> dict:
    """Qwen3.6-27B's config.json as tests/fakes/target_model.py writes it, text fields overridden."""
    config = copy.deepcopy(fake("target_model").config())
    config["text_config"].update(text_overrides)
    return config


def drafter27(**overrides) -> dict:
    """Qwen3.6-27B-DFlash's config.json as drafter_config writes it (FACTS.md section 2)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 2048,
        "vocab_size": 248320,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    }
    config.update(overrides)
    return config


def qwen3_8b() -> dict:
    return {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }


def drafter8b() -> dict:
    return {
        "hidden_size": 4096,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]},
    }


# --- the KV cache, as vLLM lays it out ------------------------------------------------------------------


def test_the_27b_chain_needs_what_vllm_said_on_the_h100() -> None:
    """vLLM 0.20.1 on an H100, step_cost's 27B chain (15 tokens), max_model_len 8,580: "2.29 GiB KV cache is
    needed". The fake target's config gives no mamba_ssm_dtype, so the state is bf16: a slot of 48 x 128 x 128
    x 2 + 10240 x (3 + 15) x 2 bytes, in pages of 480 tokens x 4,096 bytes; 4 + 1 + 10 groups of 5 layers."""
    layout = kv_layout(qwen36(), drafter27(), 15, 8580, base=BASE)
    assert layout.state_slot_bytes == 48 * 128 * 128 * 2 + 10240 * 18 * 2 == 1_941_504
    assert (layout.block_tokens, layout.page_bytes, layout.group_size) == (480, 1_966_080, 5)
    assert layout.groups == {"target": (4, 18), "drafter": (1, 18), "linear_attention": (10, 16)}
    assert layout.request_bytes() == 5 * 1_966_080 * 250 == 2_457_600_000
    assert f"{layout.request_bytes() / GIB:.2f}" == "2.29"


def test_the_real_checkpoint_keeps_its_recurrent_state_in_float32() -> None:
    """Qwen3.5/3.6 checkpoints name mamba_ssm_dtype; vLLM keeps the recurrent state in it: about 147 MiB per
    slot over the 48 layers without drafts, split over the tensor-parallel GPUs."""
    real = qwen36(mamba_ssm_dtype="float32")
    assert 48 * recurrent_state_bytes(real, base=BASE) == 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)
    assert round(48 * recurrent_state_bytes(real, base=BASE) / MIB, 1) == 146.8
    assert recurrent_state_bytes(real, spec_tokens=15, tp=2, base=BASE) == 24 * 128 * 128 * 4 + 5120 * 18 * 2


def test_ddtree_keeps_a_state_slot_per_node_and_the_root() -> None:
    chain = kv_layout(qwen36(), drafter27(), 15, 32768, base=BASE)
    tree = kv_layout(qwen36(), drafter27(), 63, 32768, base=BASE)
    assert chain.state_slots == 16 and tree.state_slots == 64
    assert tree.groups["linear_attention"] == (10, 64)
    assert tree.state_bytes() == 5 * tree.page_bytes * 10 * 64


def test_a_pure_attention_pair_of_one_spec_is_one_group() -> None:
    """Qwen3-8B and its drafter share one KV spec (8 heads of 128): 41 layers in one group of 16-token blocks."""
    layout = kv_layout(qwen3_8b(), drafter8b(), 15, 8580, base=BASE)
    assert (layout.block_tokens, layout.page_bytes, layout.group_size) == (16, 65536, 41)
    assert layout.groups == {"target": (1, 537)} and layout.state_bytes() == 0
    assert layout.request_bytes() == 41 * 65536 * 537


def test_a_second_base_s_descriptor_lays_the_cache_out_with_no_code_change(tmp_path: Path, synthetic_base) -> None:
    """The synthetic base (tests/unit/conftest.py): 64-token block multiples, one state slot per verified token
    without the root, width + verified tokens convolution columns, layer kinds merged up to 16x. The 27B chain
    at 15 tokens: a slot of 48 x 128 x 128 x 2 + 10240 x (4 + 15) x 2 bytes, in pages of 512 tokens x 4,096
    bytes; the 16 attention, 5 drafter and 48 Gated DeltaNet layers in one group of 48."""
    base = load_rules(synthetic_base(tmp_path), "9.9.9")
    layout = kv_layout(qwen36(), drafter27(), 15, 8580, base=base)
    assert layout.state_slot_bytes == 48 * 128 * 128 * 2 + 10240 * 19 * 2 == 1_961_984
    assert (layout.block_tokens, layout.page_bytes, layout.group_size) == (512, 2_097_152, 48)
    assert layout.groups == {"target": (1, 17), "drafter": (1, 17), "linear_attention": (1, 15)}
    assert layout.state_slots == 15
    assert layout.request_bytes() == 48 * 2_097_152 * 49 == 4_932_501_504


# --- the profile run's peak, against the recorded profiles ----------------------------------------------


@pytest.mark.parametrize(
    ("record", "case", "shape", "dtype", "low", "high"),
    [
        # bfloat16: within 2% of what vLLM measured.
        ("memory_profile_27b_h200.json", "ddtree64", "27b", "bfloat16", 0.98, 1.02),
        ("memory_profile_8b_h200.json", "ddtree64", "8b", "bfloat16", 0.98, 1.02),
        ("memory_profile_8b_h200.json", "chain", "8b", "bfloat16", 0.98, 1.02),
        # float16: at most 10% above (the float32 captured states are counted in full; the dummy forward had
        # already held part of them), never below.
        ("memory_profile_27b_float16_h200.json", "ddtree64", "27b", "float16", 1.0, 1.10),
    ],
)
def test_the_profile_estimate_is_within_tolerance_of_vllms_profile(record, case, shape, dtype, low, high) -> None:
    data = json.loads((RESULTS / record).read_text())
    measured = data["cases"][case]["profile_peak_bytes"]
    text = qwen36()["text_config"] if shape == "27b" else qwen3_8b()
    budget = data["budget"] if case == "ddtree64" else 15
    estimate = profile_bytes(
        text["hidden_size"], text["intermediate_size"], text["vocab_size"], 5, dtype,
        2048, data["batch"], budget, 15, case == "ddtree64",
    )  # fmt: skip
    assert low <= estimate / measured <= high, (estimate, measured)


# --- the fit and what the role says ---------------------------------------------------------------------


def fit(gpu_mib=143771, tp=1, seqs=32, model_len=32768, spec=15, ddtree=False, reserve=2048, real=True):
    return memory_fit(
        qwen36(mamba_ssm_dtype="float32") if real else qwen36(),
        drafter27(),
        target_weights=55_600_000_000,
        drafter_weights=3_460_000_000,
        gpu_memory_mib=gpu_mib,
        gpu_memory_utilization=0.9,
        tensor_parallel_size=tp,
        max_model_len=model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=16384,
        spec_tokens=spec,
        depth=15,
        ddtree=ddtree,
        reserve_mib=reserve,
        base=BASE,
    )


def test_the_role_defaults_on_one_h200_fit_fewer_than_32_requests() -> None:
    """143,771 MiB x 0.9 = 126.4 GiB: weights 51.8 + 3.2, profile 3.7, reserve 2.0 leave 65.6 GiB. The float32
    state slot (3,145,728 + 10,240 x 18 x 2 bytes) makes the block 864 tokens (54 x 16) and the page 3,538,944
    bytes; a request of 32,768 tokens holds 5 x (4 x 38 + 38 + 10 x 16) = 1,750 pages, 5.77 GiB: 11 fit."""
    result = fit()
    assert result.layout.state_slot_bytes == 3_514_368
    assert (result.layout.block_tokens, result.layout.page_bytes) == (864, 3_538_944)
    assert result.request == 1750 * 3_538_944
    assert round(result.kv_available / GIB, 1) == 65.6
    assert result.fits == 11


def test_two_h200s_at_tensor_parallel_2_fit_32_requests() -> None:
    result = fit(tp=2)
    assert result.fits >= 32
    assert fit_verdict(result, lower=False, max_model_len=32768) == {"refuse": "", "note": "", "max_num_seqs": 32}


def test_a_misfit_refuses_with_every_part_and_the_setting_to_change() -> None:
    verdict = fit_verdict(fit(), lower=False, max_model_len=32768, hostname="qwen-ct101")
    assert verdict["max_num_seqs"] == 32 and verdict["note"] == ""
    assert verdict["refuse"] == (
        "32 requests of max_model_len=32768 (service_swap_max_num_seqs) need 184.57 GiB of KV cache per GPU and 11 "
        "fit on qwen-ct101. Fix: set service_swap_max_num_seqs to 11 or less (or service_swap_fit_lower_max_num_seqs: "
        "true to let the role lower it), lower service_swap_max_model_len, or raise the tensor parallel size. How it "
        "adds up: per GPU 126.36 GiB for vLLM (memory x gpu_memory_utilization) holds the target's weights "
        "51.78 GiB, the drafter's 3.22 GiB, the profile run's peak 3.71 GiB, the reserve 2.00 GiB "
        "(service_swap_fit_reserve_mib), leaving 65.64 GiB for the KV cache; one request of max_model_len=32768 needs "
        "5.77 GiB, 2.64 GiB of it recurrent state (16 slots of 3.4 MiB in each of 48 layers: one per verified token "
        "(15) and one more)"
    )
    # roles/tune records a refused candidate's reason cut to 300 characters: the count and the fix are in it.
    reason = tune_candidate_reason({"status": "refused", "reason": verdict["refuse"] + ". Nothing was changed."}, {})
    assert reason.startswith("32 requests of max_model_len=32768 (service_swap_max_num_seqs) need 184.57 GiB")
    assert "11 fit on qwen-ct101. Fix: set service_swap_max_num_seqs to 11 or less" in reason


def test_the_operator_switch_lowers_max_num_seqs_to_what_fits() -> None:
    verdict = fit_verdict(fit(), lower=True, max_model_len=32768, hostname="qwen-ct101")
    assert verdict["refuse"] == "" and verdict["max_num_seqs"] == 11
    assert verdict["note"].startswith(
        "service_swap_max_num_seqs lowered from 32 to 11 on qwen-ct101, the most requests of max_model_len that fit "
        "(per GPU 126.36 GiB for vLLM"
    )


def test_not_even_one_request_is_refused_even_with_the_switch() -> None:
    """An H100 (81,559 MiB) at max_model_len 1,048,576: one request needs more than is left."""
    result = fit(gpu_mib=81559, model_len=1_048_576, seqs=4)
    assert result.fits == 0
    verdict = fit_verdict(result, lower=True, max_model_len=1_048_576)
    assert verdict["refuse"].startswith("4 requests of max_model_len=1048576 (service_swap_max_num_seqs) need")
    assert (
        "Fix: not even one request fits: lower service_swap_max_model_len or service_swap_max_num_batched_tokens, "
        "lower the DDTree budget, raise shared_settings_gpu_memory_utilization or the tensor parallel size. How it "
        "adds up: per GPU"
    ) in verdict["refuse"]


def test_an_h100_at_the_role_defaults_fits_one_request() -> None:
    """81,559 MiB x 0.9 = 71.7 GiB: 55.0 GiB of weights, 3.7 of profile and 2.0 of reserve leave 11.0 GiB, one
    request of 5.77 GiB."""
    result = fit(gpu_mib=81559)
    assert round(result.kv_available / GIB, 1) == 11.0
    assert result.fits == 1


# --- the filter the role calls: inputs from the node and the inventory are refused by name -----------------


SETTINGS = {
    "gpus": [{"memory_total_mib": 143771}, {"memory_total_mib": 143771}],
    "gpu_memory_utilization": 0.9,
    "tensor_parallel_size": 2,
    "max_model_len": 32768,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 16384,
    "verify_tokens": 15,
    "depth": 15,
    "method": "ddtree",
    "reserve_mib": 2048,
    "lower": False,
}


def run_filter(target=None, drafter=None, vllm_version=None, engine_home=None, **settings) -> dict:
    return service_swap_memory_fit(
        qwen36(mamba_ssm_dtype="float32") if target is None else target,
        drafter27() if drafter is None else drafter,
        55_600_000_000,
        3_460_000_000,
        {**SETTINGS, **settings},
        "qwen-ct101",
        "/m/config.json",
        "/d/config.json",
        vllm_version,
        engine_home,
    )


def test_the_filter_passes_a_fitting_node_and_reports_its_parts() -> None:
    result = run_filter()
    assert (result["refuse"], result["note"], result["max_num_seqs"]) == ("", "", 32)
    assert result["parts_gib"]["weights_target"] == pytest.approx(25.89, abs=0.01)
    assert result["fits"] >= 32


def test_the_filter_takes_the_smallest_gpu_and_lowers_on_request() -> None:
    gpus = [{"memory_total_mib": 143771}, {"memory_total_mib": 81559}]
    assert run_filter(gpus=gpus)["refuse"].startswith("32 requests of max_model_len=32768")
    lowered = run_filter(gpus=gpus, lower=True)
    assert lowered["refuse"] == "" and 1 <= lowered["max_num_seqs"] < 32


def test_the_filter_lays_the_cache_out_by_the_deployed_release_s_base(tmp_path: Path, synthetic_base) -> None:
    """At tensor parallel 2, 32,768 tokens and 15 verified: 0.20.1 gives 864-token pages of 1.6875 MiB in
    groups of 5 (4 x 38 + 38 + 10 x 16 pages), the synthetic base 896-token pages of 1.75 MiB in one group of
    48 (37 + 37 + 15 pages)."""
    assert run_filter(vllm_version="0.20.1")["parts_gib"] == run_filter()["parts_gib"]
    parts = run_filter()["parts_gib"]
    assert (parts["request"], parts["recurrent_state"]) == (2.884, 1.318)
    parts = run_filter(vllm_version="9.9.9", engine_home=synthetic_base(tmp_path))["parts_gib"]
    assert (parts["request"], parts["recurrent_state"]) == (7.301, 1.23)


def test_a_second_base_s_refusal_counts_the_state_slots_by_its_own_rule(tmp_path: Path, synthetic_base) -> None:
    """The synthetic base keeps one state slot per verified token and none for the root: on one H200 its refusal
    says 15 slots for 15 verified tokens, where 0.20.1's says 16 (one more). A slot there is 48 x 128 x 128 x 4
    + 10,240 x (4 + 15) x 2 bytes = 3.4 MiB."""
    one_h200 = {"gpus": [{"memory_total_mib": 143771}], "tensor_parallel_size": 1}
    refuse = run_filter(vllm_version="9.9.9", engine_home=synthetic_base(tmp_path), **one_h200)["refuse"]
    assert refuse.endswith("(15 slots of 3.4 MiB in each of 48 layers: one per verified token (15))"), refuse
    refuse = run_filter(vllm_version="0.20.1", **one_h200)["refuse"]
    assert refuse.endswith("(16 slots of 3.4 MiB in each of 48 layers: one per verified token (15) and one more)")


def test_a_release_without_a_base_gets_the_fit_of_weights_and_profile_only(tmp_path: Path, synthetic_base) -> None:
    """0.22.0 has no base beside 9.9.9 and 9.10.0: the KV layout is neither's, so no request is counted (one H200
    that 0.20.1's layout refuses for 32 requests passes), but weights and the profile run that leave nothing for
    the KV cache are refused: 55.6 GB of target weights on one 48 GB GPU."""
    synthetic_base(tmp_path, "9.9.9")
    home = synthetic_base(tmp_path, "9.10.0")
    one_h200 = {"gpus": [{"memory_total_mib": 143771}], "tensor_parallel_size": 1, "method": "dflash"}
    assert run_filter(vllm_version="0.20.1", **one_h200)["refuse"].startswith("32 requests of max_model_len=32768")
    result = run_filter(vllm_version="0.22.0", engine_home=home, **one_h200)
    assert (result["refuse"], result["note"], result["max_num_seqs"]) == ("", "", 32)
    assert (result["parts_gib"]["request"], result["parts_gib"]["recurrent_state"]) == (None, None)
    assert result["parts_gib"]["weights_target"] == pytest.approx(51.78, abs=0.01)
    assert run_filter(vllm_version="0.22.0", engine_home=home, lower=True, **one_h200)["max_num_seqs"] == 32
    small = {**one_h200, "gpus": [{"memory_total_mib": 49140}]}
    refuse = run_filter(vllm_version="0.22.0", engine_home=home, **small)["refuse"]
    assert refuse.startswith(
        "the weights and the profile run leave no memory for the KV cache on qwen-ct101, so vLLM would refuse to"
        " start. Fix: raise the tensor parallel size or shared_settings_gpu_memory_utilization, or lower"
        " service_swap_max_num_batched_tokens. How it adds up: per GPU 43.19 GiB for vLLM"
    ), refuse
    assert refuse.endswith("leaving 0.00 GiB for the KV cache"), refuse


def test_a_base_the_fit_cannot_read_refuses_naming_it(tmp_path: Path, synthetic_base) -> None:
    home = synthetic_base(tmp_path, kv_layout={"block_tokens_multiple": 16})
    refuse = run_filter(vllm_version="9.9.9", engine_home=home)["refuse"]
    assert refuse == (
        f"the memory fit cannot run: {home}/vllm-9.9.9/base.json has no "
        "kv_layout.state_slots_per_request.verified_tokens_plus; add it (see ddtree/vllm-0.20.1/base.json for the "
        "layout)"
    )


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"gpus": []}, "the GPU's memory_total_mib (gpu_check's facts) is None"),
        ({"gpus": [{"memory_total_mib": "lots"}]}, "the GPU's memory_total_mib (gpu_check's facts) is 'lots'"),
        ({"max_num_seqs": 0}, "service_swap_max_num_seqs is 0, outside 1 to 65536"),
        ({"max_model_len": -1}, "service_swap_max_model_len is -1, outside 1 to"),
        ({"gpu_memory_utilization": 1.5}, "shared_settings_gpu_memory_utilization is 1.5"),
        ({"reserve_mib": "much"}, "service_swap_fit_reserve_mib is 'much'"),
    ],
)
def test_a_bad_setting_refuses_naming_it(settings, why) -> None:
    result = run_filter(**settings)
    assert result["refuse"].startswith(f"the memory fit cannot run: {why}"), result["refuse"]


def test_a_missing_setting_or_drafter_config_is_named() -> None:
    result = service_swap_memory_fit(qwen36(), drafter27(), 1, 1, {"gpus": []})
    assert result["refuse"].startswith("the memory fit cannot run: no gpu_memory_utilization, tensor_parallel_size")
    assert run_filter(drafter=[1]) == {
        "refuse": "the memory fit cannot run: /d/config.json holds list, not a JSON object",
        "note": "",
        "max_num_seqs": 32,
    }
    assert (
        "/d/config.json.num_key_value_heads is 'eight', not a whole number"
        in (run_filter(drafter=drafter27(num_key_value_heads="eight"))["refuse"])
    )
    assert (
        "the drafter's weight bytes is -1" in service_swap_memory_fit(qwen36(), drafter27(), 1, -1, SETTINGS)["refuse"]
    )
