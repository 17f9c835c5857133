"""Every rule of the vLLM release knowledge base, with literal expectations."""

from __future__ import annotations

import pytest
from ansible.module_utils.vllm_releases import (
    Detected,
    Request,
    compare_with_row,
    detect_features,
    detect_prompt_as_decode,
    evaluate,
    find_release,
    metadata_torch_pin,
    notes,
    parse_version,
    refusals,
    requirements_for,
    warnings,
)

ALL_FIXES = frozenset({"aux_layer_offset", "sliding_drafter", "ddtree", "hybrid_tree", "prompt_as_decode"})


def codes(req: Request) -> list[tuple[str, str]]:
    return [(f.level, f.code) for f in evaluate(req)]


def req(version: str, method: str = "dflash", **kw: object) -> Request:
    # The DDTree engine's bases as vllm_install passes them today (ddtree/vllm-0.20.1/).
    base: dict[str, object] = {"hybrid_target": False, "sliding_drafter": False, "patch_releases": ("0.20.1",)}
    base.update(kw)
    return Request(version=version, method=method, **base)  # type: ignore[arg-type]


# --- the table -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "torch", "dflash", "aux", "sliding", "tree"),
    [
        ("0.19.1", "2.10.0", False, None, "none", True),
        ("0.20.0", "2.11.0", True, False, "silent_full", True),
        ("0.20.1", "2.11.0", True, False, "silent_full", True),
        ("0.21.0", "2.11.0", True, False, "silent_full", False),
        ("0.22.0", "2.11.0", True, True, "silent_full", False),
        ("0.24.3", "2.11.0", True, True, "silent_full", False),
        ("0.25.0", "2.11.0", True, True, "refuses", False),
        ("0.26.1", "2.11.0", True, True, "v2_runner", False),
        ("0.27.0", "2.13.0", True, True, "v2_runner", False),
        ("0.28.0", "2.13.0", True, True, "v2_runner", False),
        ("0.30.0", "2.13.0", True, True, "v2_runner", False),
        ("0.33.0", "2.14.0", True, True, "v2_runner", False),
    ],
)
def test_table_rows(version: str, torch: str, dflash: bool, aux: bool | None, sliding: str, tree: bool) -> None:
    row = find_release(version)
    assert row is not None
    assert (row.torch, row.dflash, row.aux_offset_fixed, row.sliding, row.tree_attention) == (
        torch,
        dflash,
        aux,
        sliding,
        tree,
    )


@pytest.mark.parametrize("version", ["0.18.2", "0.34.0", "1.0.0"])
def test_versions_outside_the_table_have_no_row(version: str) -> None:
    assert find_release(version) is None


@pytest.mark.parametrize(
    ("text", "parsed"), [("0.20.1", (0, 20, 1)), (" 0.22.0 ", (0, 22, 0)), ("0.20.1+cu130", (0, 20, 1))]
)
def test_parse_version(text: str, parsed: tuple[int, int, int]) -> None:
    assert parse_version(text) == parsed


@pytest.mark.parametrize("text", ["0.20", "0.20.1rc1", "0.20.1.post1", "0.21.0.dev3", "latest", ""])
def test_parse_version_rejects_non_releases(text: str) -> None:
    with pytest.raises(ValueError, match="pin an exact vLLM release"):
        parse_version(text)


def test_the_offered_change_sets_are_the_engines_bases() -> None:
    # A second base is offered where the first is, with nothing in this module naming either.
    two = evaluate(req("0.25.0", sliding_drafter=True, patch_releases=("0.20.1", "0.24.0")))
    assert two[0].message.endswith("pick 0.26.0 or later, or 0.20.1 or 0.24.0 with ddtree_patch")
    ddtree = evaluate(req("0.22.0", method="ddtree", patch_releases=("0.20.1", "0.24.0")))
    assert ddtree[0].message.endswith(
        "covers 0.20.1 or 0.24.0 only; pick 0.20.1 or 0.24.0 (with ddtree_patch), or ask for method dflash"
    )
    # Without a base, no change set is offered.
    none = evaluate(req("0.20.1", method="ddtree", patch_releases=()))
    assert none[0].message == (
        "DDTree is in no vLLM release and this project's ddtree_patch has a change set for no release only, "
        "not for 0.20.1; ask for method dflash"
    )
    assert none[1].message.endswith("(fixed upstream in 0.22.0, vllm-project/vllm#40727); pick 0.22.0 or later")
    unknown = evaluate(req("0.99.0", patch_releases=()))[0].message
    assert "pick a known release (0.30.0 or later for the DFlash chain) or read" in unknown


# --- the rules -------------------------------------------------------------------------------


def test_bad_method_is_refused() -> None:
    findings = evaluate(req("0.20.1", method="eagle3"))
    assert [f.as_dict() for f in findings] == [
        {
            "level": "refuse",
            "code": "unknown-method",
            "message": "speculative method 'eagle3' is not one this project deploys; use one of dflash, ddtree",
        }
    ]


def test_bad_version_is_refused() -> None:
    assert codes(req("0.20.1rc1")) == [("refuse", "bad-version")]


def test_unknown_release_is_refused_with_the_fix() -> None:
    (finding,) = evaluate(req("0.40.0"))
    assert finding.level == "refuse"
    assert finding.code == "unknown-release"
    assert finding.message == (
        "vLLM 0.40.0 is not in this project's release knowledge base (it knows 0.19.0 to before "
        "0.34.0), so nothing is known about its DFlash support; pick a known release (0.20.1 with "
        "ddtree_patch for DDTree, 0.30.0 or later for the DFlash chain) or read that release's wheel "
        "and add a row to module_utils/vllm_releases.py"
    )


def test_unknown_release_only_warns_when_allowed() -> None:
    assert codes(req("0.40.0", allow_unknown=True)) == [("warn", "unknown-release")]


def test_release_without_dflash_is_refused() -> None:
    (finding,) = evaluate(req("0.19.1"))
    assert (finding.level, finding.code) == ("refuse", "no-dflash")
    assert finding.message == (
        "vLLM 0.19.1 has no DFlash (it arrived in 0.20.0), so neither the DFlash chain nor DDTree can "
        "run; pick 0.20.1 with ddtree_patch, or 0.30.0 or later for the chain"
    )


def test_ddtree_without_tree_attention_and_without_patch_is_refused() -> None:
    findings = evaluate(req("0.22.0", method="ddtree"))
    assert findings[0].as_dict() == {
        "level": "refuse",
        "code": "ddtree-unavailable",
        "message": "DDTree is in no vLLM release, 0.22.0 has no tree attention to build it on (removed "
        "in 0.21.0, vllm-project/vllm#42121), and this project's ddtree_patch covers 0.20.1 only; "
        "pick 0.20.1 (with ddtree_patch), or ask for method dflash",
    }


def test_ddtree_on_a_tree_release_without_a_change_set_is_refused() -> None:
    findings = evaluate(req("0.20.0", method="ddtree"))
    assert findings[0].message == (
        "DDTree is in no vLLM release and this project's ddtree_patch has a change set for 0.20.1 "
        "only, not for 0.20.0; pick 0.20.1 (with ddtree_patch), or ask for method dflash"
    )


def test_ddtree_on_0201_with_the_patch_switched_off_is_refused() -> None:
    findings = evaluate(req("0.20.1", method="ddtree"))
    assert findings[0].as_dict() == {
        "level": "refuse",
        "code": "ddtree-unavailable",
        "message": "DDTree is in no vLLM release and ddtree_patch, which adds it to 0.20.1, is switched "
        "off; enable ddtree_patch, or ask for method dflash",
    }


def test_ddtree_on_0201_with_the_patch_is_allowed() -> None:
    assert refusals(evaluate(req("0.20.1", method="ddtree", patch_fixes=ALL_FIXES))) == []


def test_aux_offset_bug_is_refused_without_the_patch() -> None:
    assert codes(req("0.20.1")) == [("refuse", "aux-layer-offset"), ("note", "fa3-aot-cuda-graphs")]
    finding = evaluate(req("0.20.1"))[0]
    assert finding.message == (
        "vLLM 0.20.1 feeds the DFlash drafter one target layer too early, which silently lowers "
        "acceptance (fixed upstream in 0.22.0, vllm-project/vllm#40727); pick 0.22.0 or later, or "
        "0.20.1 with ddtree_patch, which fixes it"
    )


def test_aux_offset_bug_is_a_note_with_the_patch() -> None:
    assert codes(req("0.20.1", patch_fixes=ALL_FIXES)) == [
        ("note", "aux-layer-offset-patched"),
        ("note", "fa3-aot-cuda-graphs"),
    ]


def test_aux_offset_bug_in_0210_has_no_patch() -> None:
    assert ("refuse", "aux-layer-offset") in codes(req("0.21.0", patch_fixes=frozenset()))


def test_aux_offset_fixed_from_0220() -> None:
    assert codes(req("0.22.0")) == [("note", "fa3-aot-cuda-graphs")]


def test_sliding_drafter_silently_full_is_refused() -> None:
    findings = evaluate(req("0.22.0", sliding_drafter=True))
    assert findings[0].as_dict() == {
        "level": "refuse",
        "code": "sliding-drafter-silent-full",
        "message": "vLLM 0.22.0 silently runs this drafter's sliding-window layers as full non-causal "
        "attention, which collapses acceptance without an error (vllm-project/vllm#40898); pick 0.20.1 "
        "with ddtree_patch (which runs them causal over their window), 0.26.0 or later (DFlash chain only), "
        "or a drafter whose layers are all full attention",
    }


def test_sliding_drafter_on_0201_with_the_patch_is_a_note() -> None:
    assert ("note", "sliding-drafter-patched") in codes(req("0.20.1", sliding_drafter=True, patch_fixes=ALL_FIXES))
    assert refusals(evaluate(req("0.20.1", sliding_drafter=True, patch_fixes=ALL_FIXES))) == []


def test_sliding_drafter_patch_without_sliding_fix_is_refused() -> None:
    fixes = frozenset({"aux_layer_offset", "ddtree"})
    assert ("refuse", "sliding-drafter-silent-full") in codes(req("0.20.1", sliding_drafter=True, patch_fixes=fixes))


def test_sliding_drafter_refused_by_0250_is_refused_before_install() -> None:
    assert codes(req("0.25.0", sliding_drafter=True)) == [
        ("refuse", "sliding-drafter-refused"),
        ("note", "fa3-aot-cuda-graphs"),
    ]


def test_sliding_drafter_on_the_v2_runner_is_a_warning() -> None:
    assert codes(req("0.30.0", sliding_drafter=True)) == [("warn", "sliding-drafter-v2-runner")]


def test_full_attention_drafter_is_fine_where_sliding_layers_are_not() -> None:
    assert refusals(evaluate(req("0.25.0"))) == []


def test_gdn_spec_token_cap_from_0280() -> None:
    found = codes(req("0.28.0", hybrid_target=True, num_speculative_tokens=15))
    assert found[0] == ("refuse", "gdn-spec-tokens")
    assert ("refuse", "gdn-spec-tokens") not in codes(req("0.28.0", hybrid_target=True, num_speculative_tokens=7))
    assert ("refuse", "gdn-spec-tokens") not in codes(req("0.28.0", num_speculative_tokens=15))
    assert ("refuse", "gdn-spec-tokens") not in codes(req("0.26.0", hybrid_target=True, num_speculative_tokens=15))


def test_ddtree_on_hybrid_target_runs_trees_with_the_patch() -> None:
    found = codes(req("0.20.1", method="ddtree", hybrid_target=True, patch_fixes=ALL_FIXES))
    assert ("warn", "ddtree-hybrid-target") not in found
    assert refusals(evaluate(req("0.20.1", method="ddtree", hybrid_target=True, patch_fixes=ALL_FIXES))) == []


def test_ddtree_on_hybrid_target_warns_it_runs_the_chain_without_the_hybrid_fix() -> None:
    fixes = ALL_FIXES - {"hybrid_tree"}
    found = codes(req("0.20.1", method="ddtree", hybrid_target=True, patch_fixes=fixes))
    assert ("warn", "ddtree-hybrid-target") in found


def test_hybrid_target_warns_about_prefix_caching() -> None:
    assert ("note", "gdn-prefix-caching") in codes(req("0.30.0", hybrid_target=True))
    assert ("note", "gdn-prefix-caching") not in codes(req("0.30.0"))


def test_every_release_with_dflash_has_the_prompt_as_decode_bug() -> None:
    # Read in every wheel from 0.20.0 to 0.33.0 (docs/vllm_install.md); no release fixes it yet.
    for version in ("0.20.1", "0.21.0", "0.24.0", "0.25.0", "0.26.0", "0.29.0", "0.30.0", "0.33.0"):
        row = find_release(version)
        assert row is not None and "prompt_as_decode" in row.bugs, version
    row = find_release("0.19.1")
    assert row is not None and "prompt_as_decode" not in row.bugs


def test_a_step_shaped_prompt_on_a_hybrid_target_warns_with_the_fix() -> None:
    findings = evaluate(req("0.30.0", hybrid_target=True, num_speculative_tokens=15))
    (finding,) = [f for f in findings if f.code == "prompt-as-decode"]
    assert finding.as_dict() == {
        "level": "warn",
        "code": "prompt-as-decode",
        "message": "vLLM 0.30.0 takes a prompt (or prompt chunk) of exactly 16 tokens (num_speculative_tokens + 1) "
        "for a verification step and replays it through the FULL CUDA graph captured for verification, where "
        "this hybrid target's Gated DeltaNet layers lose that request's recurrent state: its output is garbage, "
        "without an error (vllm-project/vllm#49918, no fix released); pick 0.20.1 with ddtree_patch, which fixes "
        'it, or serve without full CUDA graphs (service_swap_extra_args: ["--compilation-config.cudagraph_mode", '
        '"PIECEWISE"])',
    }


def test_a_step_shaped_prompt_warns_on_0201_with_the_patch_off() -> None:
    assert ("warn", "prompt-as-decode") in codes(req("0.20.1", hybrid_target=True))
    # Without a base to offer, only the CUDA-graph setting is left; unknown length stays a formula.
    (finding,) = [f for f in evaluate(req("0.22.0", hybrid_target=True, patch_releases=())) if f.level == "warn"]
    assert finding.message.startswith(
        "vLLM 0.22.0 takes a prompt (or prompt chunk) of exactly num_speculative_tokens + 1 tokens for"
    )
    assert finding.message.endswith(
        "(vllm-project/vllm#49918, no fix released); serve without full CUDA graphs (service_swap_extra_args: "
        '["--compilation-config.cudagraph_mode", "PIECEWISE"])'
    )


def test_a_step_shaped_prompt_under_ddtree_is_budget_plus_one_tokens() -> None:
    fixes = ALL_FIXES - {"prompt_as_decode"}
    findings = evaluate(
        req("0.20.1", method="ddtree", hybrid_target=True, patch_fixes=fixes, num_speculative_tokens=15)
    )
    (finding,) = warnings(findings)
    assert finding.code == "prompt-as-decode"
    assert (
        "a prompt (or prompt chunk) of exactly the DDTree budget + 1 tokens for a verification step" in finding.message
    )


def test_a_step_shaped_prompt_is_a_note_where_the_change_set_fixes_it() -> None:
    findings = evaluate(req("0.20.1", hybrid_target=True, patch_fixes=ALL_FIXES, num_speculative_tokens=15))
    assert warnings(findings) == []
    (finding,) = [f for f in findings if f.code.startswith("prompt-as-decode")]
    assert finding.as_dict() == {
        "level": "note",
        "code": "prompt-as-decode-patched",
        "message": "vLLM 0.20.1 replays a prompt exactly as long as one verification step through the FULL CUDA "
        "graph captured for verification, which loses a Gated DeltaNet hybrid target's recurrent state for that "
        "request (vllm-project/vllm#49918); ddtree_patch fixes it here, so ddtree_patch must run before the "
        "service starts",
    }


def test_a_step_shaped_prompt_is_no_finding_on_a_dense_target() -> None:
    # Attention computes the same in the FULL graph: pure-attention targets are unaffected.
    for version in ("0.20.1", "0.22.0", "0.30.0"):
        assert [c for c in codes(req(version, num_speculative_tokens=15)) if "prompt-as-decode" in c[1]] == []
    assert warnings(evaluate(req("0.30.0", num_speculative_tokens=7))) == []


def test_concurrency_collapse_warning_on_0210() -> None:
    assert ("warn", "concurrency-collapse") in codes(req("0.21.0"))
    assert ("warn", "concurrency-collapse") not in codes(req("0.22.0"))


def test_the_projects_deployment_passes_without_a_warning() -> None:
    findings = evaluate(
        req(
            "0.20.1",
            method="ddtree",
            hybrid_target=True,
            sliding_drafter=True,
            patch_fixes=ALL_FIXES,
            num_speculative_tokens=15,
        )
    )
    assert refusals(findings) == []
    assert warnings(findings) == []
    # what the change set and the roles handle is a note, not a warning on every run
    assert [f.code for f in notes(findings)] == [
        "aux-layer-offset-patched",
        "sliding-drafter-patched",
        "gdn-prefix-caching",
        "prompt-as-decode-patched",
        "fa3-aot-cuda-graphs",
    ]


def test_several_refusals_are_all_reported() -> None:
    found = codes(req("0.21.0", method="ddtree", sliding_drafter=True))
    assert [c for lvl, c in found if lvl == "refuse"] == [
        "ddtree-unavailable",
        "aux-layer-offset",
        "sliding-drafter-silent-full",
    ]


# --- reading files back ----------------------------------------------------------------------


def test_requirements_for_each_method() -> None:
    assert requirements_for("dflash") == (
        ("vllm/v1/spec_decode/dflash.py", "class DFlashProposer"),
        ("vllm/model_executor/models/qwen3_dflash.py", "class DFlashQwen3ForCausalLM"),
        ("vllm/model_executor/models/registry.py", '"DFlashDraftModel"'),
    )
    assert requirements_for("ddtree")[-1] == (
        "vllm/v1/attention/backends/tree_attn.py",
        "class TreeAttentionBackend",
    )


METADATA = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1\nRequires-Dist: torch==2.11.0\n"


def _tree(files: dict[str, str]):
    return lambda rel: files.get(rel)


DFLASH_FILES = {
    "vllm/v1/spec_decode/dflash.py": "class DFlashProposer(Base):\n",
    "vllm/model_executor/models/qwen3_dflash.py": "class DFlashQwen3ForCausalLM(X):\n",
    "vllm/model_executor/models/registry.py": '    "DFlashDraftModel": ("qwen3_dflash", "X"),\n',
}


def test_detect_nothing_in_an_empty_tree() -> None:
    assert detect_features(_tree({}), None) == Detected(None, None, False, None, "none", False)


def test_detect_the_0201_shape() -> None:
    files = dict(DFLASH_FILES)
    files["vllm/v1/attention/backends/tree_attn.py"] = "class TreeAttentionBackend(A):\n"
    files["vllm/v1/worker/gpu_model_runner.py"] = 'layer_ids = dflash_config.get("target_layer_ids")\n'
    assert detect_features(_tree(files), METADATA) == Detected("0.20.1", "2.11.0", True, False, "silent_full", True)


def test_detect_the_aux_fix_and_sliding_refusal() -> None:
    files = dict(DFLASH_FILES)
    files["vllm/v1/worker/gpu_model_runner.py"] = (
        'layer_ids = [\n    i + 1 for i in (dflash_config.get("target_layer_ids") or [])\n]\n'
    )
    files["vllm/model_executor/models/qwen3_dflash.py"] += (
        "layer_types = x\nraise NotImplementedError('DFlash does not yet support mixed sliding/full attention')\n"
    )
    found = detect_features(_tree(files), None)
    assert (found.aux_offset_fixed, found.sliding) == (True, "refuses")


def test_detect_v2_runner_and_unknown_sliding() -> None:
    files = dict(DFLASH_FILES)
    files["vllm/model_executor/models/qwen3_dflash.py"] += "layer_types = x\n"
    assert detect_features(_tree(files), None).sliding == "unknown"
    files["vllm/config/vllm.py"] = "if self._dflash_needs_multi_kv_group():\n"
    assert detect_features(_tree(files), None).sliding == "v2_runner"


def test_a_missing_symbol_means_no_dflash() -> None:
    files = dict(DFLASH_FILES)
    files["vllm/v1/spec_decode/dflash.py"] = "# emptied\n"
    assert detect_features(_tree(files), None).dflash is False


# The shape of 0.20.1's files (gpu_model_runner.py, gdn_attn.py), cut down to what the detector reads.
RUNNER_0201 = """
class GPUModelRunner:
    @staticmethod
    def _is_uniform_decode(max_num_scheduled_tokens, uniform_decode_query_len, num_tokens, num_reqs,
                           force_uniform_decode=None):
        return (
            (max_num_scheduled_tokens == uniform_decode_query_len)
            and (num_tokens == max_num_scheduled_tokens * num_reqs)
        ) if force_uniform_decode is None else force_uniform_decode

    def execute_model(self, scheduler_output):
        self._determine_batch_execution_and_padding(
            num_tokens=num_tokens_unpadded,
            num_reqs=num_reqs,
            max_num_scheduled_tokens=max_num_scheduled_tokens,
        )
"""
GDN_0201 = """
        if (
            self.use_full_cuda_graph
            and num_prefills == 0
            and num_decodes == 0
            and num_spec_decodes <= self.decode_cudagraph_max_bs
        ):
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor)
"""
PROMPT_FILES = {"vllm/v1/worker/gpu_model_runner.py": RUNNER_0201, "vllm/v1/attention/backends/gdn_attn.py": GDN_0201}


def test_detect_the_prompt_as_decode_bug() -> None:
    assert detect_prompt_as_decode(_tree(PROMPT_FILES)) is True


def test_a_dispatch_that_decides_itself_shows_no_prompt_as_decode_bug() -> None:
    # What the change set (and the upstream fix PRs) do: execute_model passes its own answer.
    files = dict(PROMPT_FILES)
    files["vllm/v1/worker/gpu_model_runner.py"] = RUNNER_0201.replace(
        "            max_num_scheduled_tokens=max_num_scheduled_tokens,\n",
        "            max_num_scheduled_tokens=max_num_scheduled_tokens,\n"
        "            force_uniform_decode=self._ddtree_uniform_decode(spec_decode_metadata, num_reqs),\n",
    )
    assert detect_prompt_as_decode(_tree(files)) is False


def test_a_gdn_builder_that_refreshes_every_batch_shows_no_prompt_as_decode_bug() -> None:
    files = dict(PROMPT_FILES)
    files["vllm/v1/attention/backends/gdn_attn.py"] = GDN_0201.replace("            and num_decodes == 0\n", "")
    assert detect_prompt_as_decode(_tree(files)) is False


def test_prompt_as_decode_needs_the_runner_and_the_builder() -> None:
    assert detect_prompt_as_decode(_tree({})) is None
    assert detect_prompt_as_decode(_tree({"vllm/v1/worker/gpu_model_runner.py": RUNNER_0201})) is None


def test_torch_pin_with_marker() -> None:
    assert metadata_torch_pin('Requires-Dist: torch==2.13.0; platform_system == "Linux"\n') == "2.13.0"
    assert metadata_torch_pin("Requires-Dist: torchaudio==2.11.0\n") is None


def test_compare_with_row_names_each_disagreement() -> None:
    row = find_release("0.20.1")
    assert row is not None
    detected = Detected("0.20.1", "2.13.0", True, True, "silent_full", True)
    assert compare_with_row(detected, row) == [
        "torch: knowledge base says '2.11.0', files say '2.13.0'",
        "aux_offset_fixed: knowledge base says False, files say True",
    ]
