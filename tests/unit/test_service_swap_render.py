"""service_swap's unit template rendered by the role itself (tests/gpu/render_unit.yml), literal ExecStart lines."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest
from playbook_run import ansible_playbook, local_play, localhost_inventory
from safetensors_files import fake

REPO = Path(__file__).resolve().parents[2]
# The unit's --speculative-config line: the chain's, and DDTree's at a budget.
CHAIN_LINE = (
    ' --speculative-config \'{"method":"dflash","model":"/opt/models/drafter","num_speculative_tokens":15}\' \\'
)


def ddtree_line(budget: int) -> str:
    return (
        ' --speculative-config \'{"method":"ddtree","model":"/opt/models/drafter","num_speculative_tokens":15,'
        f'"ddtree_budget":{budget}}}\' \\'
    )


def ansible(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess:
    """ansible-playbook on localhost alone, with ``args``; reports and temporary files under ``tmp_path``."""
    return ansible_playbook(
        localhost_inventory(tmp_path),
        *args,
        ANSIBLE_INJECT_FACT_VARS="False",
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
        TMPDIR=str(tmp_path),
    )


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(
        json.dumps({"text_config": {"layer_types": ["linear_attention", "linear_attention", "full_attention"]}})
    )
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
    return {"hybrid": hybrid, "dense": dense, "drafter": tmp_path / "drafter", "tmp": tmp_path}


def unit_args(dirs: dict[str, Path], target: str) -> list[str]:
    """The vLLM executable, the target (``dirs[target]``) and the drafter a unit is rendered with."""
    return [
        "-e",
        "service_swap_vllm_executable=/opt/vllm/0.20.1/bin/vllm",
        "-e",
        f"shared_settings_target_dir={dirs[target]}",
        "-e",
        "shared_settings_drafter_dir=/opt/models/drafter",
    ]


def render_unit(dirs: dict[str, Path], target: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """tests/gpu/render_unit.yml on ``target``: the run, and the unit file it writes (if it does)."""
    dest = dirs["tmp"] / "vllm.service"
    res = ansible(
        dirs["tmp"], "tests/gpu/render_unit.yml", *unit_args(dirs, target), "-e", f"render_dest={dest}", *extra
    )
    return res, dest


def render(dirs: dict[str, Path], target: str, *extra: str) -> list[str]:
    """The unit's ExecStart lines, rendered on ``target``."""
    res, dest = render_unit(dirs, target, *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    text = dest.read_text()
    start = text.index("ExecStart=")
    end = text.index("\n", text.index("\n", start))
    while text[end - 1] == "\\":
        end = text.index("\n", end + 1)
    return text[start:end].split("\n")


def preflight(dirs: dict[str, Path], *extra: str) -> subprocess.CompletedProcess:
    """Only the role's preflight tasks, against localhost."""
    play = local_play(
        dirs["tmp"] / "preflight.yml",
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: preflight.yml}\n",
    )
    return ansible(dirs["tmp"], play, *extra)


def caller(dirs: dict[str, Path], *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """The role's main entry point run as roles/tune runs it, in a block whose rescue keeps what the caller sees:
    the run, and ``{"result": service_swap_result, "msg": the failure's message}`` (None where no rescue ran)."""
    kept = dirs["tmp"] / "result.json"
    kept.unlink(missing_ok=True)
    play = local_play(
        dirs["tmp"] / "caller.yml",
        "    - block:\n"
        "        - ansible.builtin.include_role: {name: service_swap}\n"
        "      rescue:\n"
        "        - ansible.builtin.copy:\n"
        f"            dest: {kept}\n"
        '            content: \'{{ {"result": service_swap_result, "msg": ansible_failed_result.msg} | to_json }}\'\n',
    )
    res = ansible(dirs["tmp"], play, *extra)
    return res, json.loads(kept.read_text()) if kept.exists() else None


def service_section(dirs: dict[str, Path]) -> list[str]:
    """The [Service] lines of the unit render() wrote last."""
    text = (dirs["tmp"] / "vllm.service").read_text()
    return text[text.index("[Service]") : text.index("[Install]")].splitlines()


def test_hybrid_target_dflash(dirs):
    t = dirs["hybrid"]
    assert render(dirs, "hybrid") == [
        f"ExecStart=/opt/vllm/0.20.1/bin/vllm serve {t} \\",
        " --host 0.0.0.0 \\",
        " --port 8000 \\",
        " --served-model-name Qwen3.6-27B \\",
        " --tensor-parallel-size 1 \\",
        " --max-model-len 32768 \\",
        " --gpu-memory-utilization 0.9 \\",
        " --max-num-seqs 32 \\",
        " --max-num-batched-tokens 16384 \\",
        ' --speculative-config \'{"method":"dflash","model":"/opt/models/drafter","num_speculative_tokens":15}\' \\',
        " --no-enable-prefix-caching",
    ]


def _seccomp_lines(dirs: dict[str, Path], *extra: str) -> list[str]:
    render(dirs, "dense", *extra)
    text = (dirs["tmp"] / "vllm.service").read_text()
    return [ln for ln in text.splitlines() if ln.startswith(("SystemCall", "NoNewPrivileges"))]


def test_the_unit_carries_the_syscall_filter_and_an_operator_can_widen_or_drop_it(dirs):
    assert _seccomp_lines(dirs) == [
        "NoNewPrivileges=true",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service pidfd_getfd",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
    ]
    widened = '{"service_swap_system_call_filter": ["@system-service pidfd_getfd", "~@privileged", "ptrace"]}'
    assert _seccomp_lines(dirs, "-e", widened)[2:] == [
        "SystemCallFilter=@system-service pidfd_getfd",
        "SystemCallFilter=~@privileged",
        "SystemCallFilter=ptrace",
        "SystemCallErrorNumber=EPERM",
    ]
    none = '{"service_swap_system_call_filter": [], "service_swap_system_call_error_number": ""}'
    assert _seccomp_lines(dirs, "-e", none) == ["NoNewPrivileges=true", "SystemCallArchitectures=native"]


def test_the_unit_runs_vllm_without_capabilities_or_kernel_access(dirs):
    """The hardening lines around the filter, as the template writes them (issue 23); Molecule
    checks systemd applies them, the GPU serve check that vLLM starts under the filter."""
    render(dirs, "dense")
    service = service_section(dirs)
    for line in [
        "User=vllm",
        "Group=vllm",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
        "ProtectHome=true",
        "PrivateTmp=true",
        "ProtectKernelTunables=true",
        "ProtectKernelModules=true",
        "ProtectControlGroups=true",
        "RestrictSUIDSGID=true",
        "LockPersonality=true",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectKernelLogs=true",
        "RestrictRealtime=true",
        "RestrictNamespaces=true",
        "SystemCallArchitectures=native",
    ]:
        assert line in service, line


def test_dense_target_ddtree_with_budget_and_extra_args(dirs):
    t = dirs["dense"]
    lines = render(
        dirs,
        "dense",
        "-e",
        "service_swap_spec_method=ddtree",
        "-e",
        "shared_settings_ddtree_budget=32",
        "-e",
        "service_swap_tensor_parallel_size=2",
        "-e",
        '{"service_swap_extra_args": ["--reasoning-parser", "qwen3", "--enforce-eager"]}',
    )
    assert lines == [
        f"ExecStart=/opt/vllm/0.20.1/bin/vllm serve {t} \\",
        " --host 0.0.0.0 \\",
        " --port 8000 \\",
        " --served-model-name Qwen3.6-27B \\",
        " --tensor-parallel-size 2 \\",
        " --max-model-len 32768 \\",
        " --gpu-memory-utilization 0.9 \\",
        " --max-num-seqs 32 \\",
        " --max-num-batched-tokens 16384 \\",
        ' --speculative-config \'{"method":"ddtree","model":"/opt/models/drafter","num_speculative_tokens":15,'
        '"ddtree_budget":32}\' \\',
        # every uniform batch in a graph: 1 to 32 requests of 33 tokens, within 16384 - 32 x 31
        ' --compilation-config \'{"cudagraph_capture_sizes":[' + ",".join(str(33 * k) for k in range(1, 33)) + "]}' \\",
        " --reasoning-parser qwen3 \\",
        " --enforce-eager",
    ]


def test_dflash_ignores_a_ddtree_budget_and_forced_prefix_caching(dirs):
    lines = render(
        dirs, "hybrid", "-e", "shared_settings_ddtree_budget=32", "-e", '{"service_swap_prefix_caching": true}'
    )
    assert lines[9] == CHAIN_LINE
    assert lines[10] == " --enable-prefix-caching"


def test_the_tuned_winner_comes_before_ddtree_patchs_method_and_the_shared_budget(dirs):
    # roles/tune's result (tune_result, from the node's record) is what a re-run renders.
    winner = '{"tune_result": {"winner": "ddtree-32", "method": "ddtree", "budget": 32}}'
    lines = render(
        dirs, "hybrid", "-e", winner, "-e", "ddtree_patch_method=dflash", "-e", "shared_settings_ddtree_budget=15"
    )
    assert lines[9] == ddtree_line(32)
    chain = '{"tune_result": {"winner": "dflash", "method": "dflash", "budget": null}}'
    lines = render(
        dirs, "hybrid", "-e", chain, "-e", "ddtree_patch_method=ddtree", "-e", "shared_settings_ddtree_budget=32"
    )
    assert lines[9] == CHAIN_LINE


def test_a_tuning_without_a_winner_leaves_ddtree_patchs_method_and_the_shared_budget(dirs):
    # Every candidate failed: nothing tuned serves, so a re-run renders what the inventory says.
    none_won = '{"tune_result": {"winner": null, "method": null, "budget": null}}'
    lines = render(
        dirs, "hybrid", "-e", none_won, "-e", "ddtree_patch_method=ddtree", "-e", "shared_settings_ddtree_budget=24"
    )
    assert lines[9] == ddtree_line(24)


def test_the_unit_runs_as_the_service_account_s_own_group(dirs):
    """Group= is shared_settings_service_group, the account's primary group (vllm_account creates it
    so), not a group named after the user (issue 44)."""
    render(dirs, "dense", "-e", "shared_settings_service_user=llm", "-e", "shared_settings_service_group=gpu-serve")
    service = service_section(dirs)
    assert [ln for ln in service if ln.startswith(("User=", "Group="))] == ["User=llm", "Group=gpu-serve"]


def test_a_candidate_s_method_and_budget_come_before_the_recorded_winner(dirs):
    # roles/tune starts each candidate with include_role vars while tune_result (a fact) holds the
    # winner recorded before: the candidate's own method and budget must be what is rendered.
    dest = dirs["tmp"] / "candidate.service"
    play = local_play(
        dirs["tmp"] / "candidate.yml",
        "    - ansible.builtin.set_fact:\n"
        "        tune_result: {winner: ddtree-32, method: ddtree, budget: 32}\n"
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: render.yml}\n"
        "      vars:\n"
        f"        service_swap_render_dest: {dest}\n"
        "        service_swap_spec_method: ddtree\n"
        "        service_swap_spec_budget: 48\n",
    )
    res = ansible(dirs["tmp"], play, *unit_args(dirs, "hybrid"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert (
        '--speculative-config \'{"method":"ddtree","model":"/opt/models/drafter","num_speculative_tokens":15,'
        '"ddtree_budget":48}\'' in dest.read_text()
    )


def test_systemd_specifiers_and_spaces_are_escaped(dirs):
    lines = render(dirs, "dense", "-e", '{"service_swap_served_model_name": "Qwen 100% $HOME"}')
    assert lines[3] == " --served-model-name 'Qwen 100%% $$HOME' \\"


# One broken setting per case, each named alone: tests/unit/test_preflight_rules.py.


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # vLLM 0.20.1's serve defaults on a 70 GB GPU with a 15-token chain: 1024 x 14 > 8192.
        (
            ["-e", "service_swap_max_num_seqs=1024", "-e", "service_swap_max_num_batched_tokens=8192"],
            "reserves 14 batched-token slots per sequence for dflash drafting, so service_swap_max_num_seqs (1024) x"
            " 14 = 14336 must stay below service_swap_max_num_batched_tokens (8192). Raise"
            " service_swap_max_num_batched_tokens above 14336",
        ),
        # The defaults (32 sequences, 16384 tokens) with a DDTree budget of 1024 nodes.
        (
            ["-e", "service_swap_spec_method=ddtree", "-e", "shared_settings_ddtree_budget=1024"],
            "reserves 1023 batched-token slots per sequence for ddtree drafting, so service_swap_max_num_seqs (32) x"
            " 1023 = 32736 must stay below service_swap_max_num_batched_tokens (16384).",
        ),
    ],
)
def test_preflight_refuses_scheduler_limits_vllm_would_refuse(dirs, extra, message):
    res = preflight(dirs, *extra)
    assert res.returncode == 2
    assert "vLLM would refuse to start" in res.stdout
    assert message in " ".join(res.stdout.split())


def test_preflight_names_every_missing_file_after_valid_settings(dirs):
    res = preflight(
        dirs,
        "-e",
        f"service_swap_vllm_executable={dirs['tmp']}/venv/bin/vllm",
        "-e",
        f"shared_settings_target_dir={dirs['dense']}",
        "-e",
        f"shared_settings_drafter_dir={dirs['drafter']}",
    )
    assert res.returncode == 2
    assert "Fix the inventory" not in res.stdout
    assert (
        f"Missing on localhost: {dirs['tmp']}/venv/bin/vllm (vllm executable: run vllm_install, or set "
        f"service_swap_vllm_executable); {dirs['drafter']}/config.json (drafter: run model_stage and drafter_config, or set "
        "shared_settings_drafter_dir)."
    ) in res.stdout
    assert "Nothing was changed." in res.stdout


def test_dflash_on_a_release_without_a_ddtree_base_passes_the_settings_rules(dirs):
    # The scheduler rule comes from the deployed release's base (ddtree/vllm-<release>/base.json); a
    # release the engine has no base for gets no other release's rule: its check is not run, and the
    # preflight says so, instead of failing on a filter error.
    res = preflight(
        dirs,
        "-e",
        "shared_settings_vllm_version=0.99.0",
        "-e",
        '{"service_swap_max_num_seqs": 1024, "service_swap_max_num_batched_tokens": 8192}',
        "-e",
        f"service_swap_vllm_executable={dirs['tmp']}/venv/bin/vllm",
        "-e",
        f"shared_settings_target_dir={dirs['dense']}",
        "-e",
        f"shared_settings_drafter_dir={dirs['drafter']}",
    )
    assert res.returncode == 2
    assert "Fix the inventory" not in res.stdout
    assert "no base for vLLM 0.99.0" not in res.stdout + res.stderr
    assert "NOTE: not checked: service_swap_max_num_batched_tokens against the batched-token slots" in res.stdout
    assert f"Missing on localhost: {dirs['tmp']}/venv/bin/vllm" in res.stdout


def test_ddtree_on_a_release_without_a_ddtree_base_is_refused(dirs):
    res = preflight(dirs, "-e", '{"shared_settings_vllm_version": "0.99.0", "service_swap_spec_method": "ddtree"}')
    assert res.returncode == 2
    assert (
        "service_swap_spec_method is ddtree, but this project's DDTree change set has no base for vLLM 0.99.0 (no"
        " ddtree/vllm-0.99.0/base.json; bases: 0.20.1)" in " ".join(res.stdout.split())
    ), res.stdout


def test_preflight_refuses_an_api_key_unfit_for_an_environment_file(dirs):
    res = preflight(dirs, "-e", '{"service_swap_api_key": "two words"}')
    assert res.returncode == 2
    assert "service_swap_api_key must be a string without whitespace, quotes or backslashes" in res.stdout
    assert "two words" not in res.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            '{"service_swap_served_model_name": "Qwen\\nExecStartPre=/bin/touch /tmp/pwned"}',
            "service_swap_served_model_name holds a newline at position 4",
        ),
        (
            '{"service_swap_extra_args": ["--x\\nExecStartPost=/bin/true"]}',
            "service_swap_extra_args[0] holds a newline",
        ),
        (
            '{"shared_settings_service_group": "vllm\\nExecStartPre=/bin/true"}',
            "shared_settings_service_group holds a newline",
        ),
        (
            '{"service_swap_extra_env": {"A": "1\\nExecStartPre=/bin/true"}}',
            "service_swap_extra_env['A'] holds a newline",
        ),
        (
            '{"service_swap_system_call_filter": ["@system-service\\nExecStartPre=/bin/true"]}',
            "service_swap_system_call_filter[0] holds a newline",
        ),
        (
            '{"service_swap_system_call_filter": ["@system-service", "~@privilegd"]}',
            "service_swap_system_call_filter[1] names the group '@privilegd', which systemd 252 does not have",
        ),
    ],
)
def test_a_value_that_would_inject_unit_directives_is_refused_before_rendering(dirs, extra, message):
    """Issue 23, item 7: a newline in one of these values used to inject real ExecStartPre= lines."""
    res, dest = render_unit(dirs, "dense", "-e", extra)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stdout
    assert "Nothing was written." in res.stdout
    assert not dest.exists()


def _open_api(dirs: dict[str, Path], *extra: str) -> subprocess.CompletedProcess:
    play = local_play(
        dirs["tmp"] / "open_api.yml",
        "    - ansible.builtin.include_role: {name: service_swap, tasks_from: open_api.yml}\n",
    )
    return ansible(dirs["tmp"], play, *extra)


def test_an_empty_key_on_a_network_address_is_refused_unless_allowed(dirs):
    """Issue 23, LOW: the default empty key on 0.0.0.0 served an open API."""
    res = _open_api(dirs)
    assert res.returncode == 2
    assert "service_swap_vllm_host is '0.0.0.0' but service_swap_api_key is empty" in res.stdout
    assert _open_api(dirs, "-e", '{"service_swap_allow_open_api": true}').returncode == 0
    assert _open_api(dirs, "-e", "service_swap_vllm_host=127.0.0.1").returncode == 0
    assert _open_api(dirs, "-e", "service_swap_api_key=sk-abc").returncode == 0


def sparse_weights(directory: Path, values: int) -> None:
    """A valid safetensors file of ``values`` bf16 values, sparse: the size the memory fit reads, no disk used."""
    raw = json.dumps({"w": {"dtype": "BF16", "shape": [values], "data_offsets": [0, 2 * values]}}).encode()
    raw += b" " * (-len(raw) % 8)
    with (directory / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 2 * values)


def qwen_pair(dirs) -> list[str]:
    """The stand-in Qwen3.6-27B target and its drafter with weights of their real sizes (sparse), a vLLM
    executable, and the arguments naming them."""
    target = dirs["tmp"] / "qwen36"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(fake("target_model").config()))
    sparse_weights(target, 27_800_000_000)
    venv = dirs["tmp"] / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "vllm").write_text("#!/bin/sh\n")
    (venv / "vllm").chmod(0o755)
    dirs["drafter"].mkdir()
    (dirs["drafter"] / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 5120,
                "num_hidden_layers": 5,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]},
            }
        )
    )
    sparse_weights(dirs["drafter"], 1_730_000_000)
    return [
        "-e",
        f"service_swap_vllm_executable={dirs['tmp']}/venv/bin/vllm",
        "-e",
        f"shared_settings_target_dir={target}",
        "-e",
        f"shared_settings_drafter_dir={dirs['drafter']}",
    ]


def test_preflight_refuses_a_ddtree_budget_whose_tree_state_cannot_fit(dirs):
    """Qwen3.6-27B on 2x RTX A6000: 256 state slots per Gated DeltaNet layer and request do not fit beside the
    weights (the memory fit, tests/unit/test_memory_fit.py); a budget of 15 does, for one request."""
    args = [
        *qwen_pair(dirs),
        "-e",
        '{"service_swap_spec_method": "ddtree", "shared_settings_ddtree_budget": 255, "service_swap_max_num_seqs": 1,'
        ' "service_swap_tensor_parallel_size": 2, "gpu_check_facts": {"gpus": [{"memory_total_mib": 49140},'
        ' {"memory_total_mib": 49140}]}}',
    ]
    res = preflight(dirs, *args)
    assert res.returncode == 2
    out = " ".join(res.stdout.split())
    assert "1 requests of max_model_len=32768 (service_swap_max_num_seqs) need" in out, out
    assert "(256 slots of 3.3 MiB in each of 48 layers: one per verified token (255) and one more)" in out, out
    assert "Fix: not even one request fits" in out and "Nothing was changed." in out, out
    # A budget of 15 fits: the preflight goes on to the next check (the SGLang unit).
    args[-1] = args[-1].replace('"shared_settings_ddtree_budget": 255', '"shared_settings_ddtree_budget": 15')
    res = preflight(dirs, *args)
    assert "requests of max_model_len" not in res.stdout, res.stdout
    assert "Read the SGLang unit the swap may have to restore" in res.stdout


def test_a_release_without_a_base_beside_two_bases_passes_the_preflight_and_names_what_it_skipped(dirs, synthetic_base):
    """vLLM 0.22.0 with the DFlash chain, in an engine home with two bases (9.9.9 and 9.10.0) and none for it: limits
    either base (and 0.20.1) would refuse pass (draft slots, a capture cap of 8, 1,024 requests of 32,768 tokens
    on one H200), the preflight runs through to reading the SGLang unit, and service_swap_result names the skipped
    checks."""
    synthetic_base(dirs["tmp"] / "engine", "9.9.9")
    home = synthetic_base(dirs["tmp"] / "engine", "9.10.0")
    settings = {
        "_service_swap_engine": str(home),
        "shared_settings_vllm_version": "0.22.0",
        "service_swap_max_num_seqs": 1024,
        "service_swap_max_num_batched_tokens": 8192,
        "service_swap_max_cudagraph_capture_size": 8,
        "gpu_check_facts": {"gpus": [{"memory_total_mib": 143771}]},
    }
    pair = qwen_pair(dirs)
    res, kept = caller(dirs, *pair, "-e", json.dumps(settings))
    assert res.returncode == 0 and kept, res.stdout + res.stderr
    out = " ".join(res.stdout.split())
    why = (
        "vLLM 0.22.0 has no base descriptor in ddtree/: its scheduler/CUDA-graph/KV rules are not known here; vLLM"
        " checks them at start, and the health gate rolls back if it refuses"
    )
    assert "NOTE: not checked: service_swap_max_num_batched_tokens against the batched-token slots vLLM reserves" in out
    assert f"Why: {why}." in out
    result = kept["result"]
    assert result["status"] == "refused"
    # Every check of the preflight passed: it stopped at the first task after the memory fit, reading the SGLang
    # unit (this machine runs no systemd).
    assert result["failed_task"] == "Read the SGLang unit the swap may have to restore", result
    assert [(s["check"], s["why"]) for s in result["skipped_checks"]] == [
        ("draft_slots", why),
        ("capture_size", why),
        ("memory_fit_kv_cache", why),
    ]
    # The same settings on 0.20.1, the repository's base, are refused by its rules.
    settings.update({"_service_swap_engine": str(REPO / "ddtree"), "shared_settings_vllm_version": "0.20.1"})
    res, kept = caller(dirs, *pair, "-e", json.dumps(settings))
    assert kept, res.stdout + res.stderr
    result = kept["result"]
    assert result["failed_task"] == "Check the swap's settings", result
    assert "reserves 14 batched-token slots per sequence" in result["reason"], result
    assert "skipped_checks" not in result


def test_ddtree_gets_a_graph_for_every_uniform_batch_and_an_explicit_cap_is_passed_as_given(dirs):
    def argv(*extra: str) -> str:
        return " ".join(line.rstrip("\\").strip() for line in render(dirs, *extra))

    def sizes(*tokens: int) -> str:
        return f"--compilation-config '{{\"cudagraph_capture_sizes\":[{','.join(map(str, tokens))}]}}'"

    ddtree = ("-e", "service_swap_spec_method=ddtree", "-e", "shared_settings_ddtree_budget=64")
    # 1 to 32 requests of 65 tokens, within 16384 - 32 x 63 = 14368.
    assert sizes(*range(65, 32 * 65 + 1, 65)) in argv("dense", *ddtree)
    # A scheduler that takes fewer tokens bounds it: 2300 - 32 x 63 = 284 tokens hold 4 x 65.
    assert sizes(65, 130, 195, 260) in argv("dense", *ddtree, "-e", "service_swap_max_num_batched_tokens=2300")
    # 8 requests: 520 tokens, which a cap would leave without a graph (vLLM truncates it to 512).
    assert sizes(65, 130, 195, 260, 325, 390, 455, 520) in argv("dense", *ddtree, "-e", "service_swap_max_num_seqs=8")
    assert "--compilation-config" not in argv("dense", *ddtree, "-e", "service_swap_max_cudagraph_capture_size=0")
    # 2030 - 32 x 63 = 14 tokens: no uniform batch of 65 fits, so no sizes (and no empty list).
    assert "--compilation-config" not in argv("dense", *ddtree, "-e", "service_swap_max_num_batched_tokens=2030")
    assert "--compilation-config" not in argv("hybrid")  # the chain keeps vLLM's default
    cap = "--compilation-config '{\"max_cudagraph_capture_size\":256}'"
    assert cap in argv("hybrid", "-e", "service_swap_max_cudagraph_capture_size=256")


@pytest.mark.parametrize("value", ["-5", "lots", "1.5"])
def test_preflight_refuses_a_cuda_graph_cap_that_is_not_auto_or_tokens(dirs, value):
    res = preflight(dirs, "-e", f'{{"service_swap_max_cudagraph_capture_size": {json.dumps(value)}}}')
    assert res.returncode == 2
    assert f"service_swap_max_cudagraph_capture_size is {value}; it must be auto or a number of tokens" in " ".join(
        res.stdout.split()
    )


def test_preflight_refuses_a_cuda_graph_cap_below_one_request_s_tokens(dirs):
    """vLLM 0.20.1 would refuse to start: the size of its grid a cap is cut down to must hold the tokens a request
    verifies and its root (16 for the 15-token chain)."""
    res = preflight(dirs, "-e", "service_swap_max_cudagraph_capture_size=8")
    assert res.returncode == 2
    assert (
        "service_swap_max_cudagraph_capture_size is 8: vLLM 0.20.1 cuts it down to the largest size of its grid"
    ) in " ".join(res.stdout.split())
    assert "or at least 16, the smallest grid size that holds 16 tokens" in " ".join(res.stdout.split())
    res = preflight(dirs, "-e", "service_swap_max_cudagraph_capture_size=16")
    assert "less than the" not in res.stdout
    # 15 holds a 14-token chain's request, but vLLM 0.20.1 cuts 15 down to its grid's 8 first.
    res = preflight(
        dirs, "-e", "service_swap_max_cudagraph_capture_size=15", "-e", "shared_settings_num_speculative_tokens=14"
    )
    assert res.returncode == 2
    assert "captures CUDA graphs of at most 8 tokens, less than the 15 tokens" in " ".join(res.stdout.split())


def test_preflight_refuses_batched_tokens_that_lower_the_cuda_graphs_below_one_request_s_tokens(dirs):
    """vLLM 0.20.1 lowers the largest CUDA graph it captures to max_num_batched_tokens: 15 batched tokens leave the
    15-token chain's 16 without a graph, which the draft-slot rule (1 sequence x 14 slots) lets through."""
    one_seq = ("-e", "service_swap_max_num_seqs=1")
    res = preflight(dirs, *one_seq, "-e", "service_swap_max_num_batched_tokens=15")
    out = " ".join(res.stdout.split())
    assert res.returncode == 2, out
    assert (
        "service_swap_max_num_batched_tokens is 15: vLLM 0.20.1 lowers the largest CUDA graph it captures to"
        " max_num_batched_tokens (from its default, as service_swap_max_cudagraph_capture_size is auto) and captures"
        " CUDA graphs of at most 15 tokens, less than the 16 tokens one request verifies per step, so it would refuse"
        " to start. Raise service_swap_max_num_batched_tokens to at least 16."
    ) in out
    assert "batched-token slots per sequence" not in out
    # 16 hold it: the settings pass and the preflight goes on to the files vLLM needs.
    res = preflight(dirs, *one_seq, "-e", "service_swap_max_num_batched_tokens=16")
    assert "TASK [service_swap : Check the swap's settings] ***" in res.stdout
    assert "less than the" not in res.stdout
    assert "Missing on localhost" in res.stdout, res.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            '{"service_swap_max_num_seqs": "8\\nExecStartPre=/bin/touch /tmp/pwned"}',
            "argument 'service_swap_max_num_seqs' is of type str and we were unable to convert to int",
        ),
        (
            '{"service_swap_tensor_parallel_size": "1\\nExecStartPost=/bin/true"}',
            "argument 'service_swap_tensor_parallel_size' is of type str and we were unable to convert to int",
        ),
        (
            '{"service_swap_timeout_start_sec": "1800\\nExecStartPre=/bin/true"}',
            "argument 'service_swap_timeout_start_sec' is of type str and we were unable to convert to int",
        ),
    ],
)
def test_render_unit_validates_the_role_s_argument_spec_so_a_number_cannot_inject_a_line(dirs, extra, message):
    """Issue 43, LOW: tests/gpu/render_unit.yml (tasks_from: render.yml) skipped the role's argument spec,
    so a number given as text with a newline rendered an ExecStartPre= line of its own."""
    res, dest = render_unit(dirs, "dense", "-e", extra)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stdout
    assert not dest.exists()


def test_a_refusal_is_declared_in_service_swap_result_for_the_caller(dirs):
    """The main entry point, stopped by its preflight, leaves service_swap_result (status refused,
    the task, the reason) and fails the host with one line pointing at it: roles/tune reads the result,
    never the message (issue 44)."""
    res, out = caller(dirs, "-e", "service_swap_max_num_seqs=0")
    assert res.returncode == 0 and out, res.stdout + res.stderr
    reason = "service_swap_max_num_seqs is 0; it must be at least 1. Fix the inventory; nothing was changed."
    assert out["result"] == {"status": "refused", "failed_task": "Check the swap's settings", "reason": reason}
    assert out["msg"] == (
        'service_swap refused on localhost at "Check the swap\'s settings": the reason is above, and in '
        "service_swap_result.reason."
    )


def test_a_refusal_is_printed_by_one_task_only(dirs):
    """Issue 44: main.yml's rescue repeated the refusal; now the rescue's failure points at it, and the
    result fact keeps it."""
    play = local_play(dirs["tmp"] / "main.yml", "    - ansible.builtin.include_role: {name: service_swap}\n")
    res = ansible(dirs["tmp"], play, "-e", "service_swap_spec_method=bogus")
    assert res.returncode == 2
    sentence = "service_swap_spec_method is bogus; it must be dflash or ddtree."
    tasks = [block for block in res.stdout.split("TASK [") if sentence in block.split("ROLLOUT REPORT")[0]]
    assert [block.split("]")[0] for block in tasks] == ["service_swap : Check the swap's settings"], res.stdout
    assert (
        'service_swap refused on localhost at "Check the swap\'s settings": the reason is above, and in '
        "service_swap_result.reason." in res.stdout
    )
