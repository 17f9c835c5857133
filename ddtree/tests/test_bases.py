"""Each vLLM base's descriptor (ddtree/vllm-<release>/base.json) against what it describes.

The descriptor is what the roles read (ddtree_patch: the manifest digest it consumes; vllm_install:
what the change set fixes); these tests keep it true to the manifest beside it, to the release
knowledge base's fix names, and to the rules the Ansible side still computes in code (the scheduler's
draft slots and the CUDA-graph sizes in plugins/filter/ddtree_method.py), so a base whose rules differ
fails here until that code learns them.
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
    # vllm_release_check's own default, used only where no role passes patch_fixes, agrees where it
    # names the release (vllm_install passes the descriptor's, so a new base needs no entry there).
    if release in releases.PROJECT_PATCHES:
        assert releases.patch_fixes_for(release, enabled=True) == frozenset(fixes)


@pytest.mark.parametrize("release", RELEASES)
def test_the_scheduler_and_graph_rules_are_the_ones_service_swap_renders(release: str) -> None:
    method = repo.repo_file("plugins/filter/ddtree_method.py")
    base = bases.load(release)
    assert base["scheduler"]["draft_slots_per_sequence"] == "verified_tokens - 1"
    assert method.draft_slots(4, 16) == 4 * 15
    assert base["cudagraphs"]["tokens_per_request"] == "verified_tokens + 1"
    assert method.ddtree_cudagraph_sizes(3, 16, 8192) == [17, 34, 51]
    assert base["cudagraphs"]["max_sizes"] == method.MAX_GRAPH_SIZES
    assert base["tree_state"]["layers"] == [method.GDN]
    assert base["tree_state"]["conv_width"] == method.GDN_CONV_WIDTH


def test_the_gpu_proof_probes_the_refusals_the_base_lists() -> None:
    from ddtree.gpu import pair_proof

    assert bases.load(pair_proof.PROOF_BASE)["refuses"]["probes"] == pair_proof.REFUSAL_PROBES
    assert set(pair_proof.REFUSAL_PROBES) == {"logprobs", "repetition_penalty", "min_tokens", "seed_sampled"}


def test_an_unknown_release_is_named_with_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"no vLLM base 0\.26\.0 in .* \(there are: 0\.20\.1\)"):
        bases.load("0.26.0")
