"""service_swap's checks in words (plugins/filter/swap_gates.py), expectations written out."""

from __future__ import annotations

from pathlib import Path

import pytest
from swap_gates import (
    service_swap_acceptance_problem,
    service_swap_budget_problem,
    service_swap_capture_size_problem,
    service_swap_ddtree_base_problem,
    service_swap_device_problem,
    service_swap_draft_slots_problem,
    service_swap_gpus_busy_problem,
    service_swap_missing_paths,
    service_swap_no_previous_unit,
    service_swap_previous_exec_problem,
    service_swap_previous_plan,
    service_swap_skipped_checks,
)

EXE = {"path": "/opt/vllm/0.20.1/bin/vllm", "executable": True, "what": "vllm executable: run vllm_install"}
TARGET = {"path": "/opt/models/t/config.json", "what": "target model: set shared_settings_target_dir"}


def test_missing_paths_name_what_each_is_and_an_executable_must_execute() -> None:
    results = [
        {"item": EXE, "stat": {"exists": True, "executable": False}},
        {"item": TARGET, "stat": {"exists": False}},
    ]
    assert service_swap_missing_paths(results) == [
        "/opt/vllm/0.20.1/bin/vllm (vllm executable: run vllm_install)",
        "/opt/models/t/config.json (target model: set shared_settings_target_dir)",
    ]
    results = [
        {"item": EXE, "stat": {"exists": True, "executable": True}},
        {"item": TARGET, "stat": {"exists": True, "executable": False}},
    ]
    assert service_swap_missing_paths(results) == []


def test_device_problems() -> None:
    assert service_swap_device_problem([], [], "n1", "vllm") == (
        "No /dev/nvidia* device nodes on n1: the GPUs are not passed into the container (run gpu_check)."
    )
    assert service_swap_device_problem([{"path": "/dev/nvidia0"}], ["/dev/nvidia0", "/dev/nvidiactl"], "n1", "llm") == (
        "GPU device nodes /dev/nvidia0, /dev/nvidiactl are root-group and not world read-write, so the llm user cannot"
        " open them: give them a dedicated group (e.g. a udev rule or the container mount) or mode 0666."
    )
    assert service_swap_device_problem([{"path": "/dev/nvidia0"}], [], "n1", "vllm") == ""


def test_acceptance_gate_says_why() -> None:
    low = {"mean_acceptance_length": 1.25, "spec_decode": {"present": True, "accepted_tokens": 12, "drafts": 48}}
    assert service_swap_acceptance_problem(low, 2.0, 3) == (
        "mean acceptance length 1.25 over 3 requests is under the floor service_swap_min_acceptance_length 2.0"
        " (1 + 12 accepted / 48 drafts): the drafter runs but its drafts are rejected (wrong drafter config,"
        " target_layer_ids, or an unpatched vLLM layer offset)"
    )
    none = {"mean_acceptance_length": None, "spec_decode": {"present": False}}
    assert service_swap_acceptance_problem(none, 2.0, 3) == (
        "vLLM reports no spec-decode drafts on /metrics: speculative decoding is not running"
    )


def test_busy_gpus_say_what_holds_them() -> None:
    facts = {
        "nvidia_smi": {"ok": True},
        "gpus": [{"index": 0, "memory_used_mib": 70000}, {"index": 1, "memory_used_mib": 3}],
        "holders": {"compute_apps": [{"process_name": "python3"}], "local": [{"unit": "sglang.service"}, {"pid": 7}]},
    }
    assert service_swap_gpus_busy_problem(facts, 1024, 300) == (
        "The GPUs were not free 300s after SGLang stopped: MiB used per GPU 0: 70000, 1: 3 (must be under 1024);"
        " compute apps: python3; local holders: sglang.service. Stop what holds them (nvidia-smi, fuser -v"
        " /dev/nvidia*) and re-run."
    )
    facts["holders"] = {}
    assert "compute apps: none listed; local holders: none." in service_swap_gpus_busy_problem(facts, 1024, 300)


def test_unreadable_gpus_say_why() -> None:
    facts = {"nvidia_smi": {"ok": False}, "problems": ["Driver/library version mismatch", "NVML 580.95"]}
    assert service_swap_gpus_busy_problem(facts, 1024, 300) == (
        "Cannot read the GPUs to see whether they are free: Driver/library version mismatch NVML 580.95"
    )
    assert service_swap_gpus_busy_problem({"msg": "no nvidia-smi"}, 1024, 300) == (
        "Cannot read the GPUs to see whether they are free: no nvidia-smi"
    )


def test_draft_slots_vllm_would_refuse() -> None:
    # vLLM 0.20.1's serve defaults on a 70 GB GPU with a 15-token chain: 1024 x 14 > 8192 (the slots
    # come from the base's rule: verified tokens - 1 per sequence).
    assert service_swap_draft_slots_problem(1024, 15, 8192, "dflash", "0.20.1") == (
        'vLLM would refuse to start ("max_num_scheduled_tokens ... does not allow any tokens to be scheduled"): it'
        " reserves 14 batched-token slots per sequence for dflash drafting, so service_swap_max_num_seqs (1024) x 14"
        " = 14336 must stay below service_swap_max_num_batched_tokens (8192). Raise service_swap_max_num_batched_tokens"
        " above 14336, or lower service_swap_max_num_seqs, num_speculative_tokens or the DDTree budget."
    )
    assert service_swap_draft_slots_problem(1024, 15, 8192, "dflash") == service_swap_draft_slots_problem(
        1024, 15, 8192, "dflash", "0.20.1+cu130"
    )
    assert service_swap_draft_slots_problem(32, 15, 16384, "dflash", "0.20.1") == ""
    assert service_swap_draft_slots_problem(32, 513, 16384, "ddtree", "0.20.1") != ""  # 32 x 512 = 16384: not below
    assert service_swap_draft_slots_problem(32, 512, 16384, "ddtree", "0.20.1") == ""


def test_draft_slots_are_the_base_s_per_sequence_rule(tmp_path: Path, synthetic_base) -> None:
    # 0.20.1: the verified tokens less one per sequence; inventory values arrive as text too.
    assert "(32) x 63 = 2016 must stay below" in service_swap_draft_slots_problem(32, 64, 2016, "ddtree", "0.20.1")
    assert service_swap_draft_slots_problem(32, 64, 2017, "ddtree", "0.20.1") == ""
    assert "(8) x 14 = 112 must stay below" in service_swap_draft_slots_problem("8", "15", "112", "dflash", "0.20.1")
    assert service_swap_draft_slots_problem("8", "15", "113", "dflash", "0.20.1") == ""
    assert service_swap_draft_slots_problem(4, 1, 1, "ddtree", "0.20.1") == ""  # no slots at all
    # The synthetic base reserves as many as it verifies: 64 per sequence at budget 64.
    home = synthetic_base(tmp_path)
    assert "(32) x 64 = 2048 must stay below" in service_swap_draft_slots_problem(32, 64, 2048, "ddtree", "9.9.9", home)
    assert service_swap_draft_slots_problem(32, 64, 2049, "ddtree", "9.9.9", home) == ""


def two_bases(tmp_path: Path, synthetic_base) -> Path:
    """An engine home with two bases (9.9.9 and 9.10.0, neither 0.20.1's rules) and none for 0.22.0."""
    synthetic_base(tmp_path, "9.9.9")
    return synthetic_base(tmp_path, "9.10.0")


def test_a_release_without_a_base_gets_no_other_base_s_draft_slot_or_capture_rule(
    tmp_path: Path, synthetic_base
) -> None:
    """0.22.0 has no base here: limits each base would refuse pass (vLLM checks them at start); a base's own
    release keeps its rule (the synthetic base reserves as many slots as verified tokens)."""
    home = two_bases(tmp_path, synthetic_base)
    assert service_swap_draft_slots_problem(1024, 15, 8192, "dflash", "0.22.0", home) == ""
    assert "reserves 15 batched-token slots per sequence" in service_swap_draft_slots_problem(
        1024, 15, 8192, "dflash", "9.10.0", home
    )
    assert service_swap_draft_slots_problem(1024, 15, 8192, "dflash", "0.22.0") == ""  # the repository's one base
    assert service_swap_capture_size_problem(8, 15, 16384, "0.22.0", home) == ""
    assert service_swap_capture_size_problem(8, 15, 16384, "0.22.0") == ""
    assert "vLLM 9.9.9 cuts it down" in service_swap_capture_size_problem(8, 15, 16384, "9.9.9", home)


def test_the_checks_a_release_without_a_base_skips_are_named_with_why(tmp_path: Path, synthetic_base) -> None:
    home = two_bases(tmp_path, synthetic_base)
    why = (
        "vLLM 0.22.0 has no base descriptor in ddtree/: its scheduler/CUDA-graph/KV rules are not known here; vLLM"
        " checks them at start, and the health gate rolls back if it refuses"
    )
    skipped = service_swap_skipped_checks("0.22.0+cu130", home)
    assert [(s["check"], s["why"]) for s in skipped] == [
        ("draft_slots", why),
        ("capture_size", why),
        ("memory_fit_kv_cache", why),
    ]
    # With auto and 0 too: vLLM lowers its own default to max_num_batched_tokens, which the check compares.
    assert skipped[1]["what"] == (
        "service_swap_max_cudagraph_capture_size and service_swap_max_num_batched_tokens against the CUDA graph sizes"
        " the release captures (its size grid, lowered to max_num_batched_tokens)"
    )
    assert skipped[2]["what"] == (
        "how many requests of service_swap_max_model_len the KV cache holds (its layout); the weights and the profile"
        " run's peak are still checked against the GPU's memory"
    )
    assert service_swap_skipped_checks("9.10.0", home) == []
    assert service_swap_skipped_checks("0.20.1") == []
    # A descriptor that is there but broken is no "no base": the checks themselves refuse, naming it.
    (home / "vllm-0.22.0").mkdir()
    (home / "vllm-0.22.0" / "base.json").write_text("{")
    assert service_swap_skipped_checks("0.22.0", home) == []


def test_ddtree_on_a_release_without_a_base_is_refused(tmp_path: Path, synthetic_base) -> None:
    home = two_bases(tmp_path, synthetic_base)
    assert service_swap_ddtree_base_problem("ddtree", "0.22.0", home) == (
        "service_swap_spec_method is ddtree, but this project's DDTree change set has no base for vLLM 0.22.0 (no"
        " ddtree/vllm-0.22.0/base.json; bases: 9.9.9, 9.10.0), so ddtree_patch cannot patch it and vLLM there"
        " verifies no trees. Use dflash on this release, or set shared_settings_vllm_version to a release with a"
        " base."
    )
    assert service_swap_ddtree_base_problem("dflash", "0.22.0", home) == ""
    assert service_swap_ddtree_base_problem("ddtree", "9.9.9", home) == ""
    assert service_swap_ddtree_base_problem("ddtree", "0.20.1+cu130") == ""


def test_a_ddtree_budget_below_the_depth_is_named_by_where_it_came_from() -> None:
    assert service_swap_budget_problem(None, None, 7) == ""
    assert service_swap_budget_problem("", "", 7) == ""
    assert service_swap_budget_problem(7, 7, 7) == ""
    assert service_swap_budget_problem(4, 4, 7) == (
        "shared_settings_ddtree_budget is 4, below shared_settings_num_speculative_tokens (7): a DDTree budget is at"
        " least the tree's depth; raise it or leave it empty."
    )
    assert service_swap_budget_problem(4, 16, "7").startswith(
        "The DDTree budget roles/tune chose or is measuring is 4, below shared_settings_num_speculative_tokens (7)"
    )
    # Not a number: Jinja's | int made it 0, below any depth.
    assert service_swap_budget_problem("many", "many", 7).startswith("shared_settings_ddtree_budget is many, below")


def test_a_capture_size_under_one_requests_tokens_is_refused() -> None:
    for fine in ("auto", 0, "0", 16, 17):
        assert service_swap_capture_size_problem(fine, 8, 16384) == "", fine
    assert service_swap_capture_size_problem(8, "15", 16384) == (
        "service_swap_max_cudagraph_capture_size is 8: vLLM 0.20.1 cuts it down to the largest size of its grid (1, 2,"
        " 4, then every 8 from 8 and every 16 from 256) at or under it and captures CUDA graphs of at most 8 tokens,"
        " less than the 16 tokens one request verifies per step, so it would refuse to start. Use auto (one graph per"
        " batch), 0 (vLLM's default) or at least 16, the smallest grid size that holds 16 tokens."
    )
    assert service_swap_capture_size_problem(8, "15", 16384, "0.20.1+cu130") == service_swap_capture_size_problem(
        8, "15", 16384
    )


def test_a_capture_size_off_the_grid_is_refused_with_the_size_vllm_would_capture() -> None:
    """9 tokens hold budget 8's request, but vLLM 0.20.1 cuts 9 down to 8 first; 15 at budget 14 to 8 too."""
    assert service_swap_capture_size_problem(9, 8, 16384) == (
        "service_swap_max_cudagraph_capture_size is 9: vLLM 0.20.1 cuts it down to the largest size of its grid (1, 2,"
        " 4, then every 8 from 8 and every 16 from 256) at or under it and captures CUDA graphs of at most 8 tokens,"
        " less than the 9 tokens one request verifies per step, so it would refuse to start. Use auto (one graph per"
        " batch), 0 (vLLM's default) or at least 16, the smallest grid size that holds 9 tokens."
    )
    assert "captures CUDA graphs of at most 8 tokens, less than the 15 tokens" in service_swap_capture_size_problem(
        15, 14, 16384
    )
    # Past 256 the grid steps by 16: budget 255's 256 tokens fit 256 to 271, budget 256's 257 need 272.
    assert service_swap_capture_size_problem(271, 255, 16384) == ""
    assert "at most 256 tokens, less than the 257 tokens" in service_swap_capture_size_problem(271, 256, 16384)
    assert service_swap_capture_size_problem(272, 256, 16384) == ""


def test_a_capture_size_lowered_to_the_batched_tokens_is_refused_only_where_a_request_no_longer_fits() -> None:
    """vLLM 0.20.1 lowers the cap (or its default) to max_num_batched_tokens and captures that size itself."""
    # Harmless: 300 tokens still hold 65 (graphs of 65 to 260); 15 and 9 are captured as they are, off the grid.
    for fine in ((520, 64, 300), (15, 14, 15), (9, 8, 9), ("auto", 15, 16), (0, 15, 16), ("auto", 64, 65)):
        assert service_swap_capture_size_problem(*fine) == "", fine
    assert service_swap_capture_size_problem(100, 14, 14) == (
        "service_swap_max_num_batched_tokens is 14: vLLM 0.20.1 lowers the largest CUDA graph it captures to"
        " max_num_batched_tokens (from service_swap_max_cudagraph_capture_size 100) and captures CUDA graphs of at"
        " most 14 tokens, less than the 15 tokens one request verifies per step, so it would refuse to start. Raise"
        " service_swap_max_num_batched_tokens to at least 15."
    )
    for size in ("auto", 0, "0"):
        assert service_swap_capture_size_problem(size, 15, "15") == (
            "service_swap_max_num_batched_tokens is 15: vLLM 0.20.1 lowers the largest CUDA graph it captures to"
            " max_num_batched_tokens (from its default, as service_swap_max_cudagraph_capture_size is"
            f" {size}) and captures CUDA graphs of at most 15 tokens, less than the 16 tokens one request verifies"
            " per step, so it would refuse to start. Raise service_swap_max_num_batched_tokens to at least 16."
        )
    # Both short: each setting to change is named, whichever one vLLM applies first.
    assert service_swap_capture_size_problem(8, 15, 8).endswith(
        "at most 8 tokens, less than the 16 tokens one request verifies per step, so it would refuse to start. Use"
        " auto (one graph per batch), 0 (vLLM's default) or at least 16, the smallest grid size that holds 16 tokens."
        " Raise service_swap_max_num_batched_tokens to at least 16."
    )
    assert service_swap_capture_size_problem(9, 15, 12) == (
        "service_swap_max_cudagraph_capture_size is 9: vLLM 0.20.1 cuts it down to the largest size of its grid (1, 2,"
        " 4, then every 8 from 8 and every 16 from 256) at or under it and captures CUDA graphs of at most 8 tokens,"
        " less than the 16 tokens one request verifies per step, so it would refuse to start. Use auto (one graph per"
        " batch), 0 (vLLM's default) or at least 16, the smallest grid size that holds 16 tokens. Raise"
        " service_swap_max_num_batched_tokens to at least 16."
    )


@pytest.mark.parametrize(
    ("tokens", "shown"),
    [
        (0, "0"),
        (-16384, "-16384"),
        ("-1", "-1"),
        ("many", "many"),
        (True, "True"),
        (1.5, "1.5"),
        (None, "None"),
        ("", ""),
        ("9" * 5000, "99999999999999999999... (5000 characters)"),
    ],
)
def test_batched_tokens_that_are_no_whole_number_of_at_least_one_are_refused_with_a_sentence(tokens, shown) -> None:
    for size in ("auto", 0, 16):
        assert service_swap_capture_size_problem(size, 15, tokens) == (
            f"service_swap_max_num_batched_tokens is {shown}; it must be a whole number of tokens, at least 16."
        )


def test_huge_values_and_capture_sizes_that_are_no_number_are_left_to_their_own_rules() -> None:
    assert service_swap_capture_size_problem(16, 15, 10**30) == ""
    assert service_swap_capture_size_problem(10**30, 15, 16384) == ""  # lowered to 16384, which holds 16
    assert service_swap_capture_size_problem(str(10**30), 15, "16384") == ""
    assert "at most 8 tokens" in service_swap_capture_size_problem(8, 15, 10**30)
    # The preflight's own rule says "it must be auto or a number of tokens" for these.
    for size in ("-16", "x", 16.0, True, None, "\u00b2"):
        assert service_swap_capture_size_problem(size, 15, 8) == "", size
    assert service_swap_capture_size_problem("9" * 5000, 15, 16384) == (
        "service_swap_max_cudagraph_capture_size has 5000 digits; use auto, 0 or a number of tokens."
    )


def test_a_second_base_s_descriptor_sets_the_smallest_capture_size(tmp_path: Path, synthetic_base) -> None:
    """The synthetic base takes two extra graph tokens per request and at least two requests' worth on a grid of
    2 then every 10 from 10: at 15 verified tokens that is 2 x 17 = 34 tokens, held by 40, where 0.20.1 takes 16;
    nothing in the filter names either."""
    home = synthetic_base(tmp_path)
    for fine in ("auto", 0, 40, 49):
        assert service_swap_capture_size_problem(fine, 15, 16384, "9.9.9", home) == "", fine
    assert service_swap_capture_size_problem(39, 15, 16384, "9.9.9", home) == (
        "service_swap_max_cudagraph_capture_size is 39: vLLM 9.9.9 cuts it down to the largest size of its grid (2,"
        " then every 10 from 10) at or under it and captures CUDA graphs of at most 30 tokens, less than the 34 tokens"
        " 2 requests verify per step, so it would refuse to start. Use auto (one graph per batch), 0 (vLLM's default)"
        " or at least 40, the smallest grid size that holds 34 tokens."
    )
    assert "at most 2 tokens, less than the 34 tokens" in service_swap_capture_size_problem(9, 15, 16384, "9.9.9", home)
    # Lowered to the batched tokens: 33 tokens do not hold its two requests' 34, whatever the cap.
    assert service_swap_capture_size_problem(40, 15, 34, "9.9.9", home) == ""
    for size in (40, "auto", 0):
        assert service_swap_capture_size_problem(size, 15, 33, "9.9.9", home).endswith(
            "at most 33 tokens, less than the 34 tokens 2 requests verify per step, so it would refuse to start. Raise"
            " service_swap_max_num_batched_tokens to at least 34."
        )


def test_previous_vllm_refusals_say_what_is_missing_and_what_to_do() -> None:
    path = "/etc/vllm/vllm-qwen.previous.service"
    assert service_swap_no_previous_unit(path, "node1") == (
        "No previous vLLM unit on node1 (/etc/vllm/vllm-qwen.previous.service is missing): service_swap keeps the unit"
        " a changed one replaced only after the new unit passed its gates while the old one served healthily, so there"
        " is no earlier vLLM this node served from. Nothing was changed. Go back to SGLang instead with"
        " -e rollback_to=sglang."
    )
    assert service_swap_previous_exec_problem(path, "/opt/vllm/0.20.1/bin/vllm", "node1") == (
        "The previous vLLM unit /etc/vllm/vllm-qwen.previous.service runs /opt/vllm/0.20.1/bin/vllm, which is not an"
        " executable on node1 (vllm_install keeps vllm_install_keep_venvs venvs and removes older ones). Nothing was"
        " changed. Go back to SGLang with -e rollback_to=sglang, or reinstall that vLLM version with vllm_install."
    )
    assert service_swap_previous_exec_problem(path, "", "node1").startswith(
        "The previous vLLM unit /etc/vllm/vllm-qwen.previous.service runs no ExecStart, which"
    )


def test_previous_vllm_check_mode_says_what_it_would_do() -> None:
    args = ("/etc/vllm/p.service", "/etc/systemd/system/vllm.service", "/opt/vllm/0.20.1/bin/vllm", "vllm.service")
    assert service_swap_previous_plan(True, *args) == (
        "Would put /etc/vllm/p.service in place as /etc/systemd/system/vllm.service (runs /opt/vllm/0.20.1/bin/vllm),"
        " restart vllm.service and gate it on /health, a completion and the acceptance length; on failure put SGLang"
        " back."
    )
    assert (
        service_swap_previous_plan(False, *args) == "vllm.service already serves from the previous unit; nothing to do."
    )
