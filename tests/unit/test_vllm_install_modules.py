"""The vllm_install modules run in-process, and the venv helpers on real directory trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import realfs
import vllm_release_check
import vllm_venv_info
import vllm_venvs as vllm_venvs_module
from ansible.module_utils.testing import patch_module_args
from ansible.module_utils.vllm_venvs import (
    MARKER,
    VenvEntry,
    as_user,
    find_dist_info,
    find_site_packages,
    import_check_code,
    import_check_user,
    list_venvs,
    parse_import_result,
    plan_prune,
    read_venv,
    updated_history,
)

WHEELS = Path(os.environ.get("DFLASH_LAB_WHEELS", "/var/cache/dflash-lab/wheels"))


# What vllm_install passes for the engine's one base (ddtree/vllm-0.20.1/base.json).
BASE_0201 = {
    "patch_fixes": ["aux_layer_offset", "sliding_drafter", "ddtree", "hybrid_tree", "prompt_as_decode"],
    "ddtree_bases": ["0.20.1"],
}


def run_module(module, args: dict, capsys) -> tuple[bool, dict]:
    """Run a module's main() in-process; returns (failed, result)."""
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        module.main()
    result = json.loads(capsys.readouterr().out)
    return exc.value.code != 0, result


# --- vllm_release_check -------------------------------------------------------------------------


def test_release_check_passes_the_projects_deployment_with_warnings(capsys) -> None:
    failed, result = run_module(
        vllm_release_check,
        {
            "version": "0.20.1",
            "method": "ddtree",
            "hybrid_target": True,
            "sliding_drafter": False,
            "ddtree_patch": True,
            **BASE_0201,
        },
        capsys,
    )
    assert failed is False
    assert result["changed"] is False
    assert result["refusals"] == []
    assert result["torch"] == "2.11.0"
    assert result["release"]["since"] == "0.20.0"
    assert [f["code"] for f in result["findings"]] == [
        "aux-layer-offset-patched",
        "gdn-prefix-caching",
        "prompt-as-decode-patched",
        "fa3-aot-cuda-graphs",
    ]
    assert len(result["notes_found"]) == 4
    assert result["warnings_found"] == []
    assert result.get("warnings") is None  # module.warn: nothing printed


def test_release_check_accepts_a_sliding_drafter_on_the_patched_release(capsys) -> None:
    failed, result = run_module(
        vllm_release_check,
        {"version": "0.20.1", "method": "ddtree", "sliding_drafter": True, "ddtree_patch": True, **BASE_0201},
        capsys,
    )
    assert failed is False
    assert result["refusals"] == []
    assert "sliding-drafter-patched" in [f["code"] for f in result["findings"]]


def test_release_check_refuses_a_sliding_drafter_on_the_unpatched_release(capsys) -> None:
    failed, result = run_module(
        vllm_release_check,
        {"version": "0.20.1", "method": "dflash", "sliding_drafter": True, "ddtree_patch": False},
        capsys,
    )
    assert failed is True
    assert [f["code"] for f in result["findings"] if f["level"] == "refuse"] == [
        "aux-layer-offset",
        "sliding-drafter-silent-full",
    ]


def test_release_check_fails_with_every_refusal(capsys) -> None:
    failed, result = run_module(
        vllm_release_check, {"version": "0.21.0", "method": "ddtree", "sliding_drafter": True}, capsys
    )
    assert failed is True
    assert result["msg"].startswith("vLLM 0.21.0 is refused for this deployment (3 reasons): DDTree is in no")
    assert len(result["refusals"]) == 3


def test_release_check_patch_fixes_override(capsys) -> None:
    failed, result = run_module(
        vllm_release_check,
        {
            "version": "0.20.1",
            "sliding_drafter": True,
            "ddtree_patch": True,
            "patch_fixes": ["aux_layer_offset"],
        },
        capsys,
    )
    assert failed is True
    assert [f["code"] for f in result["findings"] if f["level"] == "refuse"] == ["sliding-drafter-silent-full"]


def test_release_check_without_the_bases_fixes_refuses_what_they_fix(capsys) -> None:
    # No built-in table stands in for the descriptor: without patch_fixes nothing counts as fixed.
    failed, result = run_module(
        vllm_release_check,
        {"version": "0.20.1", "method": "ddtree", "ddtree_patch": True, "ddtree_bases": ["0.20.1"]},
        capsys,
    )
    assert failed is True
    assert [f["code"] for f in result["findings"] if f["level"] == "refuse"] == [
        "ddtree-unavailable",
        "aux-layer-offset",
    ]


def test_release_check_rejects_a_base_that_is_no_release(capsys) -> None:
    failed, result = run_module(vllm_release_check, {"version": "0.20.1", "ddtree_bases": ["next"]}, capsys)
    assert failed is True
    assert result["msg"].startswith("ddtree_bases names 'next': vLLM version 'next' is not a plain release number")


def test_release_check_rejects_unknown_patch_fixes(capsys) -> None:
    failed, result = run_module(
        vllm_release_check, {"version": "0.20.1", "ddtree_patch": True, "patch_fixes": ["magic"]}, capsys
    )
    assert failed is True
    assert result["msg"] == (
        "patch_fixes names magic, which ddtree_patch does not fix; use only aux_layer_offset, sliding_drafter, ddtree, "
        "hybrid_tree, prompt_as_decode"
    )


def test_release_check_rejects_zero_speculative_tokens(capsys) -> None:
    failed, result = run_module(vllm_release_check, {"version": "0.30.0", "num_speculative_tokens": 0}, capsys)
    assert failed is True
    assert result["msg"] == "num_speculative_tokens is 0; it must be at least 1"


def test_release_check_bad_version(capsys) -> None:
    failed, result = run_module(vllm_release_check, {"version": "latest"}, capsys)
    assert failed is True
    assert result["release"] is None
    assert "pin an exact vLLM release" in result["msg"]


# --- venv trees -----------------------------------------------------------------------------------

METADATA_0201 = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1\nRequires-Dist: torch==2.11.0\n"
DFLASH_FILES = {
    "vllm/v1/spec_decode/dflash.py": "class DFlashProposer(Base):\n",
    "vllm/model_executor/models/qwen3_dflash.py": "class DFlashQwen3ForCausalLM(X):\n",
    "vllm/model_executor/models/registry.py": '    "DFlashDraftModel": ("qwen3_dflash", "X"),\n',
}


def make_tree(venv: Path, files: dict[str, str], metadata: str | None = METADATA_0201) -> Path:
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    if metadata is not None:
        dist = site / "vllm-0.20.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(metadata)
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return site


def test_read_venv_on_a_missing_dir(tmp_path: Path) -> None:
    state = read_venv(str(tmp_path / "nope"), "dflash")
    assert state.as_dict() == {
        "venv": str(tmp_path / "nope"),
        "exists": False,
        "python": None,
        "site_packages": None,
        "version": None,
        "complete": False,
        "marker": None,
        "detected": None,
        "present": [],
        "missing": [],
    }


def test_read_venv_finds_dflash_but_not_tree_attention(tmp_path: Path) -> None:
    venv = tmp_path / "0.20.1"
    site = make_tree(venv, DFLASH_FILES)
    assert find_site_packages(str(venv)) == str(site)
    assert find_dist_info(str(site)) == str(site / "vllm-0.20.1.dist-info")
    state = read_venv(str(venv), "ddtree")
    assert state.version == "0.20.1"
    assert state.complete is False
    assert state.present == (
        "vllm/v1/spec_decode/dflash.py: class DFlashProposer",
        "vllm/model_executor/models/qwen3_dflash.py: class DFlashQwen3ForCausalLM",
        'vllm/model_executor/models/registry.py: "DFlashDraftModel"',
    )
    assert state.missing == ("vllm/v1/attention/backends/tree_attn.py (file missing)",)
    assert read_venv(str(venv), "dflash").missing == ()


def test_marker_makes_a_venv_complete_only_for_its_version(tmp_path: Path) -> None:
    venv = tmp_path / "0.20.1"
    make_tree(venv, DFLASH_FILES)
    (venv / MARKER).write_text(json.dumps({"version": "0.20.0"}))
    assert read_venv(str(venv), "dflash").complete is False
    (venv / MARKER).write_text(json.dumps({"version": "0.20.1", "installed_at": "t"}))
    assert read_venv(str(venv), "dflash").complete is True
    (venv / MARKER).write_text("{not json")
    assert read_venv(str(venv), "dflash").complete is False


def test_venv_info_module_fails_on_a_missing_class(tmp_path: Path, capsys) -> None:
    venv = tmp_path / "0.20.1"
    files = dict(DFLASH_FILES)
    files["vllm/v1/spec_decode/dflash.py"] = "# nothing here\n"
    make_tree(venv, files)
    failed, result = run_module(vllm_venv_info, {"venv": str(venv)}, capsys)
    assert failed is True
    assert result["msg"] == (
        f"vLLM 0.20.1 in {venv} lacks what dflash needs: vllm/v1/spec_decode/dflash.py: class "
        "DFlashProposer. Pick a release that has it (see docs/vllm_install.md)"
    )


def test_venv_info_module_fails_on_wrong_version_and_on_no_vllm(tmp_path: Path, capsys) -> None:
    venv = tmp_path / "v"
    make_tree(venv, DFLASH_FILES)
    failed, result = run_module(vllm_venv_info, {"venv": str(venv), "expected_version": "0.22.0"}, capsys)
    assert failed is True
    assert result["msg"] == (
        f"{venv} holds vLLM 0.20.1, not 0.22.0; remove the venv and run the vllm_install role again"
    )
    failed, result = run_module(vllm_venv_info, {"venv": str(tmp_path / "empty")}, capsys)
    assert failed is True
    assert "holds no installed vLLM" in result["msg"]
    failed, result = run_module(vllm_venv_info, {"venv": str(tmp_path / "empty"), "require": False}, capsys)
    assert failed is False
    assert (result["exists"], result["version"]) == (False, None)


def test_import_check_code_runs_and_reports_each_failure() -> None:
    # Run the generated code with this interpreter, where vLLM is not installed: every import fails.
    proc = subprocess.run(
        [sys.executable, "-c", import_check_code("ddtree")], capture_output=True, text=True, check=True
    )
    result = parse_import_result(proc.stdout)
    assert sorted(result) == [
        "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM",
        "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend",
        "vllm.v1.spec_decode.dflash.DFlashProposer",
    ]
    assert all(v.startswith("ModuleNotFoundError") for v in result.values())


def test_parse_import_result_rejects_garbage() -> None:
    assert parse_import_result('noise\n{"a.B": "ok"}\n') == {"a.B": "ok"}
    with pytest.raises(ValueError, match="printed nothing"):
        parse_import_result("  \n")
    with pytest.raises(ValueError, match="other than a JSON object"):
        parse_import_result("[1]\n")
    # Printed by a Python the service account owns: read like a hostile file (issue 23).
    with pytest.raises(ValueError, match=r"^the import check's output holds a lone surrogate \(\\ud800 escape\)"):
        parse_import_result('{"a\\ud800": "ok"}\n')
    with pytest.raises(ValueError, match=r"^the import check's output is nested 100000 levels deep"):
        parse_import_result("[" * 100000 + "]" * 100000 + "\n")


@pytest.fixture
def real_0201_venv(tmp_path: Path) -> Path:
    """A real Python venv with the real vLLM 0.20.1 package files (no dependencies) unpacked."""
    wheel = next(iter(sorted(WHEELS.glob("vllm-0.20.1-*.whl"))), None) if WHEELS.is_dir() else None
    if wheel is None:
        pytest.skip(f"vLLM 0.20.1 wheel not in {WHEELS}")
    venv = tmp_path / "0.20.1"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = find_site_packages(str(venv))
    assert site is not None
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".py") or name.startswith("vllm-0.20.1.dist-info/"):
                archive.extract(name, site)
    return venv


def test_venv_info_on_the_real_0201_files_with_import(real_0201_venv: Path, capsys) -> None:
    failed, result = run_module(
        vllm_venv_info,
        {"venv": str(real_0201_venv), "method": "ddtree", "expected_version": "0.20.1", "require": False},
        capsys,
    )
    assert failed is False
    assert result["missing"] == []
    assert result["detected"]["aux_offset_fixed"] is False
    failed, result = run_module(
        vllm_venv_info,
        {"venv": str(real_0201_venv), "method": "dflash", "verify_import": True},
        capsys,
    )
    # Installed without dependencies: the files are all there, but torch is not, so imports fail.
    assert failed is True
    assert result["msg"].startswith("vLLM is installed but these do not import: vllm.v1.spec_decode.dflash")
    assert "No module named 'torch'" in result["msg"]


def test_the_import_check_runs_as_the_venvs_owner_when_root_runs_it() -> None:
    """Issue 23: root ran <venv>/bin/python, which the service account owns (and its .pth files)."""
    assert import_check_user(0, [(0, 0), (998, 997)]) == (998, 997)  # site-packages handed over
    assert import_check_user(0, [(998, 997), (0, 0)]) == (998, 997)
    assert import_check_user(0, [(0, 0), (0, 0)]) is None  # root's own venv
    assert import_check_user(1000, [(998, 997)]) is None  # not root: nothing to drop
    argv = ["timeout", "300", "/opt/vllm/0.20.1/bin/python", "-c", "pass"]
    assert as_user(argv, None) == argv
    assert as_user(argv, (998, 997)) == ["setpriv", "--reuid=998", "--regid=997", "--clear-groups", "--", *argv]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a venv to another user")
def test_a_venv_another_user_owns_is_imported_as_that_user(capsys) -> None:
    # Not under tmp_path: pytest's root-only base directory would keep the other user out.
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        venv_as_nobody(Path(top) / "venv", capsys)


def venv_as_nobody(venv: Path, capsys) -> None:
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    # Stands in for a python the service account replaced: it reports whom it runs as.
    python.write_text('#!/bin/sh\nprintf \'{"uid": "%s", "groups": "%s"}\\n\' "$(id -u)" "$(id -G)"\n')
    python.chmod(0o755)
    os.chown(venv, 65534, 65534)
    failed, result = run_module(
        vllm_venv_info, {"venv": str(venv), "require": False, "verify_import": True, "import_timeout": 30}, capsys
    )
    assert failed is False, result.get("msg")
    assert result["imports"] == {"uid": "65534", "groups": "65534"}


# --- pruning --------------------------------------------------------------------------------------


def E(version: str, at: str = "", complete: bool = True) -> VenvEntry:
    return VenvEntry(version, f"/opt/vllm/{version}", complete, at)


def test_plan_prune_keeps_current_and_the_most_recently_used() -> None:
    entries = [E("0.19.1", "1"), E("0.20.1", "2"), E("0.22.0", "3"), E("0.30.0", "4")]
    doomed = plan_prune(entries, "0.22.0", ["0.20.1", "0.30.0"], keep=2)
    assert [e.version for e in doomed] == ["0.19.1", "0.30.0"]


def test_plan_prune_falls_back_to_install_time_then_release() -> None:
    entries = [E("0.19.1", "2026-01"), E("0.20.1", "2026-03"), E("0.22.0", "2026-02"), E("0.21.0", "")]
    entries.append(E("0.30.0", "2026-04"))
    assert [e.version for e in plan_prune(entries, "0.30.0", [], keep=2)] == ["0.19.1", "0.22.0", "0.21.0"]
    # Without install times, the newest release stays.
    entries = [E("0.19.1"), E("0.22.0"), E("0.20.1"), E("0.30.0")]
    assert [e.version for e in plan_prune(entries, "0.30.0", [], keep=2)] == ["0.19.1", "0.20.1"]


def test_plan_prune_removes_interrupted_installs_but_not_the_current_one() -> None:
    entries = [E("0.20.1", "1", complete=False), E("0.22.0", "", complete=False), E("0.21.0", "2")]
    doomed = plan_prune(entries, "0.22.0", [], keep=3)
    assert [e.version for e in doomed] == ["0.20.1"]


def test_plan_prune_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep must be at least 1"):
        plan_prune([], "0.20.1", [], keep=0)


def test_updated_history() -> None:
    assert updated_history(["0.20.1", "0.19.1"], "0.22.0", ["0.20.1", "0.22.0"]) == ["0.22.0", "0.20.1"]
    assert updated_history(["0.22.0", "0.20.1"], "0.20.1", ["0.20.1", "0.22.0"]) == ["0.20.1", "0.22.0"]


def _install(root: Path, version: str, at: str, marker: bool = True) -> Path:
    venv = root / version
    venv.mkdir(parents=True)
    if marker:
        (venv / MARKER).write_text(json.dumps({"version": version, "installed_at": at}))
    return venv


def test_vllm_venvs_module_prunes_for_real_and_in_check_mode(tmp_path: Path, capsys) -> None:
    root = tmp_path / "opt-vllm"
    wheels = tmp_path / "wheels"
    for version, at in (("0.19.1", "a"), ("0.20.1", "b"), ("0.22.0", "c")):
        _install(root, version, at)
        (wheels / version).mkdir(parents=True)
    (root / "notes").mkdir()
    (root / "current").symlink_to(root / "0.22.0")
    assert [e.version for e in list_venvs(str(root))] == ["0.19.1", "0.20.1", "0.22.0"]
    args = {
        "root": str(root),
        "current": "0.22.0",
        "history": ["0.20.1"],
        "keep": 2,
        "wheelhouse_root": str(wheels),
    }
    failed, result = run_module(vllm_venvs_module, {**args, "_ansible_check_mode": True}, capsys)
    assert (failed, result["changed"]) == (False, True)
    assert result["removed"] == [str(root / "0.19.1"), str(wheels / "0.19.1")]
    assert (root / "0.19.1").is_dir()
    failed, result = run_module(vllm_venvs_module, args, capsys)
    assert (failed, result["changed"]) == (False, True)
    assert [v["version"] for v in result["venvs"]] == ["0.22.0", "0.20.1"]
    assert sorted(os.listdir(root)) == ["0.20.1", "0.22.0", "current", "notes"]
    assert sorted(os.listdir(wheels)) == ["0.20.1", "0.22.0"]
    failed, result = run_module(vllm_venvs_module, args, capsys)
    assert (failed, result["changed"], result["removed"]) == (False, False, [])


def test_vllm_venvs_module_refuses_bad_input(tmp_path: Path, capsys) -> None:
    failed, result = run_module(vllm_venvs_module, {"root": str(tmp_path), "current": "0.22.0", "keep": 0}, capsys)
    assert failed is True
    assert result["msg"] == "keep is 0; it must be at least 1 (the current venv)"
    failed, result = run_module(vllm_venvs_module, {"root": str(tmp_path), "current": "main"}, capsys)
    assert failed is True
    assert result["msg"].startswith("current: vLLM version 'main' is not a plain release number")


def test_list_venvs_reads_local_version_labels_and_ignores_other_names(tmp_path: Path) -> None:
    _install(tmp_path, "0.20.1+cu130", "a")
    _install(tmp_path, "0.22.0", "b", marker=False)
    (tmp_path / "current-build").mkdir()
    assert list_venvs(str(tmp_path)) == [
        VenvEntry("0.20.1+cu130", str(tmp_path / "0.20.1+cu130"), True, "a"),
        VenvEntry("0.22.0", str(tmp_path / "0.22.0"), False, ""),
    ]


def test_a_hostile_marker_counts_as_no_marker(tmp_path):
    """Deep nesting, a FIFO or a symlink at the marker: no RecursionError, no hang (issue 23, item 5)."""
    from ansible.module_utils.vllm_venvs import read_marker

    (tmp_path / MARKER).write_text("[" * 100000 + "]" * 100000)
    assert read_marker(str(tmp_path)) is None
    (tmp_path / MARKER).unlink()
    os.mkfifo(tmp_path / MARKER)
    assert read_marker(str(tmp_path)) is None


def test_vllm_venvs_names_an_immutable_file_instead_of_a_traceback(ext4_dir: Path, capsys) -> None:
    """Regression, found on a real ext4 with chattr +i: shutil.rmtree's PermissionError was a traceback."""
    root = ext4_dir / "opt-vllm"
    for version, at in (("0.19.1", "a"), ("0.20.1", "b"), ("0.22.0", "c")):
        _install(root, version, at)
    locked = root / "0.19.1" / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py"
    locked.parent.mkdir(parents=True)
    locked.write_text("")
    args = {"root": str(root), "current": "0.22.0", "history": ["0.20.1"], "keep": 2}
    with realfs.immutable(locked):
        failed, result = run_module(vllm_venvs_module, args, capsys)
        assert failed is True
        assert result["msg"] == (
            f"cannot remove {root / '0.19.1'}: {locked}: Operation not permitted: {locked} is immutable (chattr +i);"
            f" it is partly removed (it is not the current venv): if it is meant to change, run chattr -i {locked}"
            " and run again"
        )
        assert not (root / "0.19.1" / MARKER).exists()  # never again taken for a complete venv
        assert [e.version for e in list_venvs(str(root)) if e.complete] == ["0.20.1", "0.22.0"]
    failed, result = run_module(vllm_venvs_module, args, capsys)
    assert (failed, result["removed"]) == (False, [str(root / "0.19.1")])
    assert sorted(os.listdir(root)) == ["0.20.1", "0.22.0"]
