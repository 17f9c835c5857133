"""Each vLLM base's descriptor (ddtree/vllm-<release>/base.json) against what it describes.

The descriptor is what the roles read (ddtree_patch: the manifest digest it consumes; vllm_install:
what the change set fixes); these tests keep it true to the manifest beside it, to the release
knowledge base's fix names, and readable as the rules the Ansible side computes with
(module_utils/ddtree_base.py, which plugins/filter/ddtree_method.py, swap_gates.py and memory_fit.py read: a
base whose rules differ needs no code there, tests/unit/test_ddtree_method.py, test_swap_gates.py and
test_memory_fit.py prove it on a synthetic base).
"""

from __future__ import annotations

import json

import pytest

from ddtree import HOME, bases, repo

RELEASES = bases.releases()


def test_every_base_folder_has_a_descriptor() -> None:
    folders = sorted(p.name.removeprefix("vllm-") for p in HOME.glob("vllm-*") if p.is_dir())
    assert folders == RELEASES
    assert "0.20.1" in RELEASES


@pytest.mark.parametrize("release", RELEASES)
def test_the_descriptor_names_the_manifest_beside_it_by_its_digest(release: str) -> None:
    base = bases.load(release)
    assert base["release"] == release
    assert bases.manifest_sha256(release) == base["changeset"]["manifest_sha256"]
    manifest = json.loads((bases.folder(release) / base["changeset"]["manifest"]).read_text())
    assert manifest["vllm_version"] == release
    assert manifest["patchset"] == base["changeset"]["patchset"]


@pytest.mark.parametrize("release", RELEASES)
def test_the_fixes_are_ones_the_release_check_knows(release: str) -> None:
    releases = repo.module_util("vllm_releases")
    fixes = bases.load(release)["fixes"]
    assert set(fixes) <= set(releases.PATCH_FIXES)


def test_what_the_0201_change_set_fixes() -> None:
    # Each one proven by the CPU tests beside it (prompt_as_decode: test_uniform_decode_alias.py).
    assert bases.load("0.20.1")["fixes"] == [
        "aux_layer_offset",
        "sliding_drafter",
        "ddtree",
        "hybrid_tree",
        "prompt_as_decode",
    ]


@pytest.mark.parametrize("release", RELEASES)
def test_the_rules_read_and_are_the_ones_service_swap_renders(release: str) -> None:
    rules = bases.rules(release)
    assert rules.release == release
    method = repo.repo_file("plugins/filter/ddtree_method.py")
    q = rules.graph_tokens(16)
    assert method.ddtree_cudagraph_sizes(3, 16, 8192, vllm_version=release) == [q, 2 * q, 3 * q]
    # The batched tokens left after 4 sequences' draft slots hold 2 requests' graphs, not 3.
    tokens = 4 * rules.draft_slots(16) + 3 * q - 1
    assert method.ddtree_cudagraph_sizes(4, 16, tokens, vllm_version=release) == [q, 2 * q]


def test_the_0_20_1_rules_are_what_vllm_0_20_1_does() -> None:
    # Written out from vLLM 0.20.1's code (VllmConfig._set_max_num_scheduled_tokens, the GDN state's
    # float32 and bf16 caches), not from the descriptor under test.
    rules = bases.rules("0.20.1")
    assert rules.tree_layers == ("linear_attention",)
    assert rules.conv_width == 4
    assert (rules.draft_slots(16), rules.graph_tokens(16), rules.max_graph_sizes) == (15, 17, 512)
    # VllmConfig._set_cudagraph_sizes cuts a cap down to its grid (1, 2, 4, every 8, every 16 from 256),
    # then CompilationConfig.adjust_cudagraph_sizes_for_spec_decode keeps no size under one request's tokens;
    # platforms/interface.py _align_hybrid_block_size, mamba_utils' conv state (width - 1 + speculative
    # tokens), kv_cache_utils' group sizes (1.5), and a slot per verified token and the root.
    assert rules.min_capture_size(16) == 24
    assert (rules.kv_block_multiple, rules.state_slots(16), rules.conv_columns(4, 16)) == (16, 17, 19)
    assert rules.kv_group_merge_ratio == 1.5


def test_the_gpu_proof_probes_the_refusals_the_base_lists() -> None:
    from ddtree.gpu import pair_proof

    assert bases.load(pair_proof.PROOF_BASE)["refuses"]["probes"] == pair_proof.REFUSAL_PROBES
    assert set(pair_proof.REFUSAL_PROBES) == {"logprobs", "repetition_penalty", "min_tokens", "seed_sampled"}


def test_an_unknown_release_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no base for vLLM 0\.26\.0 \(.* does not exist; bases: 0\.20\.1\)"):
        bases.load("0.26.0")
