"""service_swap's checks in words (plugins/filter/swap_gates.py), expectations written out."""

from __future__ import annotations

from pathlib import Path

from swap_gates import (
    service_swap_acceptance_problem,
    service_swap_budget_problem,
    service_swap_capture_size_problem,
    service_swap_device_problem,
    service_swap_draft_slots_problem,
    service_swap_gpus_busy_problem,
    service_swap_missing_paths,
    service_swap_no_previous_unit,
    service_swap_previous_exec_problem,
    service_swap_previous_plan,
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
    # come from the base's rule, ddtree_draft_slots: verified tokens - 1 per sequence).
    assert service_swap_draft_slots_problem(1024, 1024 * 14, 8192, "dflash") == (
        'vLLM would refuse to start ("max_num_scheduled_tokens ... does not allow any tokens to be scheduled"): it'
        " reserves 14 batched-token slots per sequence for dflash drafting, so service_swap_max_num_seqs (1024) x 14"
        " = 14336 must stay below service_swap_max_num_batched_tokens (8192). Raise service_swap_max_num_batched_tokens"
        " above 14336, or lower service_swap_max_num_seqs, num_speculative_tokens or the DDTree budget."
    )
    assert service_swap_draft_slots_problem(32, 32 * 14, 16384, "dflash") == ""
    assert service_swap_draft_slots_problem(32, 32 * 512, 16384, "ddtree") != ""  # 16384: not below


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
        assert service_swap_capture_size_problem(fine, 8) == "", fine
    assert service_swap_capture_size_problem(8, "15") == (
        "service_swap_max_cudagraph_capture_size is 8: vLLM 0.20.1 cuts it down to the largest size of its grid (1, 2,"
        " 4, then every 8 from 8 and every 16 from 256) at or under it and captures CUDA graphs of at most 8 tokens,"
        " less than the 16 tokens one request verifies per step, so it would refuse to start. Use auto (one graph per"
        " batch), 0 (vLLM's default) or at least 16, the smallest grid size that holds 16 tokens."
    )
    assert service_swap_capture_size_problem(8, "15", "0.20.1+cu130") == service_swap_capture_size_problem(8, "15")


def test_a_capture_size_off_the_grid_is_refused_with_the_size_vllm_would_capture() -> None:
    """9 tokens hold budget 8's request, but vLLM 0.20.1 cuts 9 down to 8 first; 15 at budget 14 to 8 too."""
    assert service_swap_capture_size_problem(9, 8) == (
        "service_swap_max_cudagraph_capture_size is 9: vLLM 0.20.1 cuts it down to the largest size of its grid (1, 2,"
        " 4, then every 8 from 8 and every 16 from 256) at or under it and captures CUDA graphs of at most 8 tokens,"
        " less than the 9 tokens one request verifies per step, so it would refuse to start. Use auto (one graph per"
        " batch), 0 (vLLM's default) or at least 16, the smallest grid size that holds 9 tokens."
    )
    assert "captures CUDA graphs of at most 8 tokens, less than the 15 tokens" in service_swap_capture_size_problem(
        15, 14
    )
    # Past 256 the grid steps by 16: budget 255's 256 tokens fit 256 to 271, budget 256's 257 need 272.
    assert service_swap_capture_size_problem(271, 255) == ""
    assert "at most 256 tokens, less than the 257 tokens" in service_swap_capture_size_problem(271, 256)
    assert service_swap_capture_size_problem(272, 256) == ""


def test_a_second_base_s_descriptor_sets_the_smallest_capture_size(tmp_path: Path, synthetic_base) -> None:
    """The synthetic base takes two extra graph tokens per request and at least two requests' worth on a grid of
    2 then every 10 from 10: at 15 verified tokens that is 2 x 17 = 34 tokens, held by 40, where 0.20.1 takes 16;
    nothing in the filter names either."""
    home = synthetic_base(tmp_path)
    for fine in ("auto", 0, 40, 49):
        assert service_swap_capture_size_problem(fine, 15, "9.9.9", home) == "", fine
    assert service_swap_capture_size_problem(39, 15, "9.9.9", home) == (
        "service_swap_max_cudagraph_capture_size is 39: vLLM 9.9.9 cuts it down to the largest size of its grid (2,"
        " then every 10 from 10) at or under it and captures CUDA graphs of at most 30 tokens, less than the 34 tokens"
        " 2 requests verify per step, so it would refuse to start. Use auto (one graph per batch), 0 (vLLM's default)"
        " or at least 40, the smallest grid size that holds 34 tokens."
    )
    assert "at most 2 tokens, less than the 34 tokens" in service_swap_capture_size_problem(9, 15, "9.9.9", home)


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
