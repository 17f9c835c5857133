"""The ddtree change set against the real vLLM 0.20.1 wheel's files, and the vllm_patch module.

The wheel comes from ``release_files`` (downloaded once, outside the repository); only the files
the change set touches are unpacked.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import py_compile
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import realfs
import vllm_patch
from ansible.errors import AnsibleError
from ansible.module_utils import vllm_changeset as cs
from ansible.module_utils.testing import patch_module_args

from ddtree import HOME
from ddtree.tests import release_files

REPO = Path(__file__).resolve().parents[2]
ROOT = str(HOME)

# Digests of the files as vLLM 0.20.1 ships them (read off the PyPI wheel).
PRISTINE_SHA256 = {
    "vllm/config/speculative.py": "acda68dc772634d761646cd3e0c828678cecd1b39915cb2cb307a4e4fb8fae82",
    "vllm/v1/worker/gpu_model_runner.py": "d71f4eb4547717a26a893d46d1dcb877731f9f5cba1de2f65376d24a6f95221f",
}
TOUCHED = [
    "vllm/config/speculative.py",
    "vllm/config/vllm.py",
    "vllm/sampling_params.py",
    "vllm/model_executor/models/qwen3_dflash.py",
    "vllm/v1/attention/backends/tree_attn.py",
    "vllm/v1/attention/ops/triton_unified_attention.py",
    "vllm/v1/attention/selector.py",
    "vllm/v1/spec_decode/dflash.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/model_executor/layers/fla/ops/fused_sigmoid_gating.py",
    "vllm/model_executor/layers/mamba/ops/causal_conv1d.py",
    "vllm/model_executor/layers/mamba/gdn_linear_attn.py",
    "vllm/v1/attention/backends/gdn_attn.py",
]
ADDED = [
    "vllm/v1/spec_decode/ddtree.py",
    "vllm/v1/spec_decode/ddtree_attention.py",
    "vllm/v1/spec_decode/ddtree_kernels.py",
    "vllm/v1/spec_decode/ddtree_moves.py",
    "vllm/v1/spec_decode/ddtree_tree.py",
]


def _wheel() -> Path:
    return release_files.wheel()


@pytest.fixture(scope="session")
def pristine_files() -> dict[str, bytes]:
    with zipfile.ZipFile(_wheel()) as whl:
        names = set(whl.namelist())
        out = {name: whl.read(name) for name in TOUCHED}
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        out["METADATA"] = whl.read(meta)
    return out


@pytest.fixture
def venv(tmp_path, pristine_files) -> Path:
    """A venv layout holding the real 0.20.1 files the change set touches."""
    return make_venv(tmp_path, pristine_files)


def make_venv(base: Path, pristine_files: dict[str, bytes]) -> Path:
    site = base / "venv" / "lib" / "python3.12" / "site-packages"
    for name in TOUCHED:
        target = site / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(pristine_files[name])
    (site / "vllm" / "__init__.py").write_text("")
    dist = site / "vllm-0.20.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_bytes(pristine_files["METADATA"])
    return base / "venv"


def site_of(venv: Path) -> Path:
    return venv / "lib" / "python3.12" / "site-packages"


def snapshot(site: Path) -> dict[str, tuple[str, int]]:
    out = {}
    for name in TOUCHED + ADDED:
        path = site / name
        if path.exists():
            out[name] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


def changeset() -> cs.ChangeSet:
    return cs.load_changeset(ROOT, "0.20.1", "ddtree")


# --- the real wheel -----------------------------------------------------------


def test_wheel_files_are_the_release_files(pristine_files):
    for name, digest in PRISTINE_SHA256.items():
        assert hashlib.sha256(pristine_files[name]).hexdigest() == digest


def test_manifest_names_exactly_these_files_and_pristine_digests():
    entries = {f.path: f for f in changeset().files}
    assert sorted(entries) == sorted(TOUCHED + ADDED)
    for name, digest in PRISTINE_SHA256.items():
        assert entries[name].pristine_sha256 == digest
    assert [entries[n].kind for n in ADDED] == ["add"] * len(ADDED)


def test_find_vllm_reads_metadata_without_importing(venv):
    install = cs.find_vllm(str(venv))
    assert install.version == "0.20.1"
    assert install.site_packages == str(site_of(venv))
    assert "vllm" not in sys.modules


def test_apply_then_reapply_then_remove_restores_pristine_bytes(venv, pristine_files):
    site = site_of(venv)
    first = cs.plan(changeset(), str(site), cs.PRESENT)
    assert first.file_states() == {**dict.fromkeys(TOUCHED, "pristine"), **dict.fromkeys(ADDED, "missing")}
    assert sorted(cs.execute(first)) == sorted(TOUCHED + ADDED)
    patched = snapshot(site)
    manifest = {f.path: f.patched_sha256 for f in changeset().files}
    assert {name: digest for name, (digest, _) in patched.items()} == manifest

    again = cs.plan(changeset(), str(site), cs.PRESENT)
    assert again.changed is False
    assert cs.execute(again) == []
    assert snapshot(site) == patched  # digests and mtimes: nothing rewritten

    removed = cs.plan(changeset(), str(site), cs.ABSENT)
    assert sorted(cs.execute(removed)) == sorted(TOUCHED + ADDED)
    for name in TOUCHED:
        assert (site / name).read_bytes() == pristine_files[name]
    for name in ADDED:
        assert not (site / name).exists()
    assert cs.plan(changeset(), str(site), cs.ABSENT).changed is False


def test_patched_files_compile(venv, tmp_path):
    site = site_of(venv)
    cs.execute(cs.plan(changeset(), str(site), cs.PRESENT))
    for name in TOUCHED + ADDED:
        py_compile.compile(str(site / name), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_patched_sources_carry_the_fixes(venv):
    site = site_of(venv)
    cs.execute(cs.plan(changeset(), str(site), cs.PRESENT))
    runner = (site / "vllm/v1/worker/gpu_model_runner.py").read_text()
    assert "layer_ids = [int(i) + 1 for i in layer_ids]" in runner
    spec = (site / "vllm/config/speculative.py").read_text()
    assert '"ddtree",' in spec
    assert "def use_ddtree(self) -> bool:" in spec
    assert "def _check_sliding_window_dflash_drafter(self) -> None:" in spec
    assert "branch-local state in this change set" in spec
    drafter = (site / "vllm/model_executor/models/qwen3_dflash.py").read_text()
    assert "self.attn.impl.sliding_window = (sliding_window - 1, 0)" in drafter
    gdn = (site / "vllm/model_executor/layers/mamba/gdn_linear_attn.py").read_text()
    assert gdn.count("parent_rows=tree_parents,") == 2
    assert "a_spec = a.index_select(0, spec_token_indx)" in gdn
    config = (site / "vllm/config/vllm.py").read_text()
    assert "DDTree on a hybrid target needs prefix caching off" in config
    kernel = (site / "vllm/v1/attention/ops/triton_unified_attention.py").read_text()
    assert "+ seq_idx * qq_bias_stride_seq" in kernel


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")
def test_owners_and_modes_are_kept(venv):
    """vllm_install's venvs belong to the service user: patched and added files stay theirs."""
    site = site_of(venv)
    for path in [site, *site.rglob("*")]:
        os.chown(path, 4242, 4343)
    runner = site / "vllm/v1/worker/gpu_model_runner.py"
    runner.chmod(0o640)
    cs.execute(cs.plan(changeset(), str(site), cs.PRESENT))
    for name in TOUCHED + ADDED:
        st = (site / name).stat()
        assert (st.st_uid, st.st_gid) == (4242, 4343), name
    assert runner.stat().st_mode & 0o777 == 0o640
    assert (site / "vllm/v1/spec_decode/ddtree.py").stat().st_mode & 0o777 == 0o644
    cs.execute(cs.plan(changeset(), str(site), cs.ABSENT))
    assert (runner.stat().st_uid, runner.stat().st_mode & 0o777) == (4242, 0o640)


def test_tampered_file_is_refused_and_nothing_changes(venv):
    site = site_of(venv)
    victim = site / "vllm/v1/spec_decode/dflash.py"
    victim.write_bytes(victim.read_bytes() + b"# local edit\n")
    before = snapshot(site)
    with pytest.raises(cs.ChangeSetError, match=r"dflash\.py has sha256 .* neither pristine vLLM 0\.20\.1"):
        cs.plan(changeset(), str(site), cs.PRESENT)
    assert snapshot(site) == before


def test_tampered_added_file_is_refused(venv):
    site = site_of(venv)
    (site / "vllm/v1/spec_decode/ddtree.py").write_text("print('not ours')\n")
    with pytest.raises(cs.ChangeSetError, match=r"ddtree\.py exists but is not this change set's file"):
        cs.plan(changeset(), str(site), cs.ABSENT)


def test_unknown_version_is_refused(venv):
    meta = site_of(venv) / "vllm-0.20.1.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.20.1", "Version: 0.21.0"))
    install = cs.find_vllm(str(venv))
    assert install.version == "0.21.0"
    refused = r"no change set for vLLM 0\.21\.0 .* exist for vLLM: 0\.20\.1"
    with pytest.raises(cs.ChangeSetError, match=refused):
        cs.load_changeset(ROOT, install.version, "ddtree")


def test_unknown_patchset_is_refused():
    with pytest.raises(cs.ChangeSetError, match="patchset 'eagle' does not exist for this release"):
        cs.load_changeset(ROOT, "0.20.1", "eagle")


def test_missing_venv_and_missing_vllm_are_refused(tmp_path):
    with pytest.raises(cs.ChangeSetError, match=r"does not exist\. Install vLLM first"):
        cs.find_vllm(str(tmp_path / "nope"))
    (tmp_path / "empty" / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    with pytest.raises(cs.ChangeSetError, match="No vLLM found in the venv"):
        cs.find_vllm(str(tmp_path / "empty"))


def tree(root: Path) -> list[str]:
    """Every file under root (temporary files included), relative."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def test_a_full_disk_changes_no_file_and_says_so(tmpfs_dir, pristine_files, capsys):
    """A real full tmpfs: the first write fails with the kernel's ENOSPC; nothing changes, no temp stays."""
    venv = make_venv(tmpfs_dir, pristine_files)
    site = site_of(venv)
    before, files = snapshot(site), tree(venv)
    realfs.fill(tmpfs_dir)
    out = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
    first = site / next(a.path for a in cs.plan(changeset(), str(site), cs.PRESENT).actions if a.changes)
    assert out["failed"] is True
    assert out["msg"] == (
        f"Writing {first} failed (No space left on device), every file was put back as it was: free space on the"
        f" filesystem of {first.parent} and run again"
    )
    assert snapshot(site) == before
    assert tree(venv) == files


def test_an_immutable_file_halfway_puts_every_file_back_and_names_it(ext4_dir, pristine_files, capsys):
    """Issue 23, LOW, for real: the 4th write fails on a chattr +i file (ext4); the three written before are
    put back, and the failed one is not 'restored' (restoring it would fail too, on the same flag)."""
    venv = make_venv(ext4_dir, pristine_files)
    site = site_of(venv)
    before, files = snapshot(site), tree(venv)
    the_plan = cs.plan(changeset(), str(site), cs.PRESENT)
    changing = [a for a in the_plan.actions if a.changes]
    failing = site / changing[3].path
    assert changing[3].before is not None  # a file vLLM ships, so it exists to be made immutable
    with realfs.immutable(failing):
        out = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
        assert out["failed"] is True
        assert out["msg"] == (
            f"Writing {failing} failed (Operation not permitted: {failing} is immutable (chattr +i)), every file was"
            f" put back as it was: if it is meant to change, run chattr -i {failing} and run again"
        )
        assert {k: v[0] for k, v in snapshot(site).items()} == {k: v[0] for k, v in before.items()}
        assert tree(venv) == files
    assert run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)["changed"] is True


def test_a_disk_filling_up_halfway_puts_every_file_back_and_the_next_run_applies(tmpfs_dir, pristine_files, capsys):
    """A real tmpfs left with room for the first writes but not for gpu_model_runner.py (the largest file,
    ninth): the kernel's ENOSPC comes after eight files are replaced. Every file is put back, no temp or
    record stays, the message names the file and the remedy; with space freed the next run applies."""
    venv = make_venv(tmpfs_dir, pristine_files)
    site = site_of(venv)
    files = tree(venv)
    changing = [a for a in cs.plan(changeset(), str(site), cs.PRESENT).actions if a.changes]
    k = max(range(len(changing)), key=lambda i: len(changing[i].after or b""))
    assert k >= 3, "the largest file must come after others for the disk to fill up halfway"

    def pages(data: bytes | None) -> int:
        return -(-len(data or b"") // 4096)

    # tmpfs counts whole pages; an atomic write needs the new file's pages while the old one still exists.
    used, room = 0, 0
    for action in changing[:k]:
        room = max(room, used + pages(action.after))
        used += pages(action.after) - pages(action.before)
    room += 4  # slack for the pages rounding
    assert room < used + pages(changing[k].after)
    filler = realfs.fill(tmpfs_dir)
    os.truncate(filler, filler.stat().st_size - room * 4096)
    assert room * 4096 <= realfs.free_bytes(tmpfs_dir) < (used + pages(changing[k].after)) * 4096

    failing = site / changing[k].path
    out = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"Writing {failing} failed (No space left on device), every file was put back as it was: free space on the"
        f" filesystem of {failing.parent} and run again"
    )
    pristine = {name: hashlib.sha256(pristine_files[name]).hexdigest() for name in TOUCHED}
    assert {name: digest for name, (digest, _) in snapshot(site).items()} == pristine
    assert tree(venv) == files  # no temporary file, no added file, no record
    filler.unlink()
    assert run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)["changed"] is True
    patched = {c.path: c.patched_sha256 for c in changeset().files}
    assert {name: digest for name, (digest, _) in snapshot(site).items()} == patched
    assert (venv / cs.RECORD_NAME).exists()


def test_a_read_only_filesystem_changes_no_file_and_names_the_remedy(ext4_dir, pristine_files, capsys):
    """site-packages remounted read-only (real ext4): the first write gets the kernel's EROFS; nothing changes."""
    venv = make_venv(ext4_dir, pristine_files)
    site = site_of(venv)
    before, files = snapshot(site), tree(venv)
    first = site / next(a.path for a in cs.plan(changeset(), str(site), cs.PRESENT).actions if a.changes)
    with realfs.read_only(ext4_dir):
        out = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
        assert out["failed"] is True
        assert out["msg"] == (
            f"Writing {first} failed (Read-only file system), every file was put back as it was: remount the"
            f" filesystem of {first.parent} read-write and run again"
        )
        assert snapshot(site) == before
        assert tree(venv) == files
    assert run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)["changed"] is True


def test_corrupt_changeset_is_refused(tmp_path):
    root = tmp_path / "files"
    (root / "vllm-0.20.1").mkdir(parents=True)
    (root / "added.py").write_text("x = 1\n")
    manifest = {
        "format": 1,
        "patchset": "ddtree",
        "vllm_version": "0.20.1",
        "files": [{"path": "vllm/x.py", "kind": "add", "source": "added.py", "patched_sha256": "0" * 64}],
    }
    (root / "vllm-0.20.1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(cs.ChangeSetError, match=r"The change set is corrupt: .*added\.py has sha256"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")
    manifest["files"][0]["source"] = "../../etc/passwd"
    (root / "vllm-0.20.1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(cs.ChangeSetError, match="unsafe source path"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")


# --- the diff engine ------------------------------------------------------------


def test_diff_round_trip_on_literal_text():
    old = b"a\nb\nc\nd\ne\nf\ng\nh\n"
    new = b"a\nb\nC\nd\ne\nf\ng\nh\nI\n"
    diff = cs.make_unified_diff("f.py", old, new)
    body = ["@@ -1,8 +1,9 @@", " a", " b", "-c", "+C", " d", " e", " f", " g", " h", "+I"]
    assert diff.splitlines()[2:] == body
    hunks = cs.parse_unified_diff(diff)
    assert cs.apply_hunks(old.decode(), hunks) == new.decode()
    assert cs.apply_hunks(new.decode(), hunks, reverse=True) == old.decode()


def test_diff_with_wrong_context_is_refused():
    hunks = cs.parse_unified_diff("@@ -1,2 +1,2 @@\n a\n-b\n+B\n")
    with pytest.raises(cs.ChangeSetError, match="does not apply: the lines at 1 differ"):
        cs.apply_hunks("x\nb\n", hunks)


# --- the module, in-process -------------------------------------------------------


def run_module(args: dict, capsys, check: bool = False, diff: bool = False) -> dict:
    extra = {"_ansible_check_mode": check, "_ansible_diff": diff}
    with patch_module_args({**args, **extra}), pytest.raises(SystemExit):
        vllm_patch.main()
    return json.loads(capsys.readouterr().out)


def test_module_check_mode_then_apply_then_idempotent_then_absent(venv, capsys, pristine_files):
    site = site_of(venv)
    args = {"venv": str(venv), "changeset_root": ROOT}
    before = snapshot(site)

    checked = run_module(args, capsys, check=True, diff=True)
    assert checked["changed"] is True
    assert sorted(checked["changed_files"]) == sorted(TOUCHED + ADDED)
    assert len(checked["diff"]) == len(TOUCHED + ADDED)
    assert snapshot(site) == before
    assert not (venv / "vllm-changeset.json").exists()

    applied = run_module(args, capsys)
    assert applied["changed"] is True
    assert applied["vllm_version"] == "0.20.1"
    assert applied["patch_state"] == "present"
    rec = json.loads((venv / "vllm-changeset.json").read_text())
    assert rec["patchset"] == "ddtree"
    assert rec["vllm_version"] == "0.20.1"
    assert rec["manifest_sha256"] == applied["manifest_sha256"]

    again = run_module(args, capsys)
    assert again["changed"] is False
    assert again["changed_files"] == []
    assert set(again["files_before"].values()) == {"patched"}

    removed = run_module({**args, "state": "absent"}, capsys)
    assert removed["changed"] is True
    assert not (venv / "vllm-changeset.json").exists()
    for name in TOUCHED:
        assert (site / name).read_bytes() == pristine_files[name]


def test_module_fails_with_reason_on_tampered_vllm(venv, capsys):
    site = site_of(venv)
    (site / "vllm/config/vllm.py").write_text("tampered\n")
    result = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
    assert result["failed"] is True
    assert "Refusing to touch vLLM" in result["msg"]
    assert "Nothing was changed" in result["msg"]
    assert not (site / "vllm/v1/spec_decode/ddtree.py").exists()


# --- the change set passed in as arguments (what the action plugin does) ---------------------


def manifests() -> dict[str, str]:
    return {"0.20.1": (Path(ROOT) / "vllm-0.20.1" / "manifest.json").read_text()}


def sources(names: list[str]) -> dict[str, str]:
    return {n: base64.b64encode((Path(ROOT) / n).read_bytes()).decode() for n in names}


DIFFS = sorted(f"vllm-0.20.1/patches/{name.replace('/', '__')}.diff" for name in TOUCHED)
ADDED_SOURCES = [
    "common/ddtree_attention.py",
    "common/ddtree_kernels.py",
    "common/ddtree_moves.py",
    "common/ddtree_tree.py",
    "vllm-0.20.1/added/ddtree.py",
]


def test_inline_pristine_venv_asks_for_every_file_and_changes_nothing(venv, capsys):
    site = site_of(venv)
    before = snapshot(site)
    asked = run_module({"venv": str(venv), "manifests": manifests()}, capsys)
    assert asked["failed"] is True
    assert sorted(asked["missing_sources"]) == sorted(DIFFS + ADDED_SOURCES)
    assert "Nothing was changed" in asked["msg"]
    assert snapshot(site) == before


def test_inline_check_apply_idempotent_absent(venv, capsys, pristine_files):
    site = site_of(venv)
    before = snapshot(site)
    every = {"venv": str(venv), "manifests": manifests(), "sources": sources(DIFFS + ADDED_SOURCES)}

    checked = run_module(every, capsys, check=True, diff=True)
    assert checked["changed"] is True
    assert len(checked["diff"]) == len(TOUCHED + ADDED)
    assert snapshot(site) == before

    applied = run_module(every, capsys)
    assert applied["changed"] is True
    assert sorted(applied["changed_files"]) == sorted(TOUCHED + ADDED)
    assert applied["manifest_sha256"] == changeset().manifest_sha256
    patched = snapshot(site)
    assert {n: d for n, (d, _) in patched.items()} == {f.path: f.patched_sha256 for f in changeset().files}

    # Patched venv, manifests only: nothing asked for, nothing rewritten, the record unchanged.
    record_before = (venv / "vllm-changeset.json").read_bytes()
    again = run_module({"venv": str(venv), "manifests": manifests()}, capsys, diff=True)
    assert again["changed"] is False
    assert again["changed_files"] == []
    assert again["diff"] == []
    assert set(again["files_before"].values()) == {"patched"}
    assert snapshot(site) == patched
    assert (venv / "vllm-changeset.json").read_bytes() == record_before

    # absent needs the diffs (to un-apply), not the added files (they are removed).
    asked = run_module({"venv": str(venv), "manifests": manifests(), "state": "absent"}, capsys)
    assert sorted(asked["missing_sources"]) == DIFFS
    assert snapshot(site) == patched

    dry = run_module({**every, "state": "absent"}, capsys, check=True)
    assert dry["changed"] is True
    assert snapshot(site) == patched

    removed = run_module(
        {"venv": str(venv), "manifests": manifests(), "sources": sources(DIFFS), "state": "absent"}, capsys
    )
    assert removed["changed"] is True
    assert not (venv / "vllm-changeset.json").exists()
    for name in TOUCHED:
        assert (site / name).read_bytes() == pristine_files[name]
    for name in ADDED:
        assert not (site / name).exists()

    # Pristine venv, absent, manifests only: already there, nothing asked for.
    nothing = run_module({"venv": str(venv), "manifests": manifests(), "state": "absent"}, capsys)
    assert nothing["changed"] is False


def test_inline_tampered_file_refused_before_asking_for_anything(venv, capsys):
    site = site_of(venv)
    (site / "vllm/config/vllm.py").write_text("tampered\n")
    before = snapshot(site)
    result = run_module({"venv": str(venv), "manifests": manifests()}, capsys)
    assert result["failed"] is True
    assert "missing_sources" not in result
    assert "Refusing to touch vLLM" in result["msg"]
    assert "vllm/config/vllm.py has sha256" in result["msg"]
    assert snapshot(site) == before


def test_inline_unknown_release_corrupt_source_and_bad_base64_are_refused(venv, capsys):
    site = site_of(venv)
    before = snapshot(site)
    other = {"0.19.1": manifests()["0.20.1"].replace('"0.20.1"', '"0.19.1"')}
    unknown = run_module({"venv": str(venv), "manifests": other}, capsys)
    assert "There is no change set for vLLM 0.20.1; change sets exist for vLLM: 0.19.1." in unknown["msg"]

    corrupt = sources(DIFFS + ADDED_SOURCES)
    corrupt["common/ddtree_tree.py"] = base64.b64encode(b"# not the file\n").decode()
    bad = run_module({"venv": str(venv), "manifests": manifests(), "sources": corrupt}, capsys)
    assert bad["msg"].startswith("The change set is corrupt: the file common/ddtree_tree.py sent has sha256 ")

    garbled = run_module(
        {"venv": str(venv), "manifests": manifests(), "sources": {"common/ddtree_tree.py": "!!"}}, capsys
    )
    assert garbled["msg"].startswith("sources['common/ddtree_tree.py'] is not base64")

    both = run_module({"venv": str(venv), "changeset_root": ROOT, "sources": {"x": ""}}, capsys)
    assert both["msg"] == "sources go with manifests; with changeset_root the files are read on the node."
    assert snapshot(site) == before


# --- the action plugin, through ansible-playbook on localhost ---------------------------------

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - {name: apply, vllm_patch: {venv: "{{ venv }}", changeset_src: "{{ src }}"}, register: apply}
    - {name: again, vllm_patch: {venv: "{{ venv }}", changeset_src: "{{ src }}"}, register: again}
    - {name: dry, vllm_patch: {venv: "{{ venv }}", changeset_src: "{{ src }}", state: absent},
       check_mode: true, diff: true, register: dry}
    - {name: absent, vllm_patch: {venv: "{{ venv }}", changeset_src: "{{ src }}", state: absent}, register: absent}
    - {name: tamper, ansible.builtin.copy: {dest: "{{ tampered }}", content: "tampered\\n", mode: "0644"}}
    - {name: refused, vllm_patch: {venv: "{{ venv }}", changeset_src: "{{ src }}"}, register: refused,
       ignore_errors: true}
    - {name: both, vllm_patch: {venv: "{{ venv }}", changeset_src: "{{ src }}", changeset_root: /nowhere},
       register: both, ignore_errors: true}
    - name: results
      ansible.builtin.copy:
        dest: "{{ out }}"
        mode: "0644"
        content: "{{ {'apply': apply, 'again': again, 'dry': dry, 'absent': absent, 'refused': refused,
                      'both': both} | to_json }}"
"""


def test_action_plugin_sends_files_only_when_something_changes(venv, tmp_path, pristine_files):
    site = site_of(venv)
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "localhost.ini").write_text(
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    out = tmp_path / "results.json"
    extra = {"venv": str(venv), "src": ROOT, "out": str(out), "tampered": str(site / "vllm/config/vllm.py")}
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), DFLASH_REPORT_DIR=str(tmp_path / "reports"))
    res = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            str(tmp_path / "localhost.ini"),
            str(tmp_path / "play.yml"),
            "-e",
            json.dumps(extra),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(out.read_text())

    assert got["apply"]["changed"] is True
    assert sorted(got["apply"]["sources_sent"]) == sorted(DIFFS + ADDED_SOURCES)
    assert got["again"]["changed"] is False
    assert got["again"]["sources_sent"] == []
    assert got["dry"]["changed"] is True
    assert got["dry"]["check_mode"] is True
    assert len(got["dry"]["diff"]) == len(TOUCHED + ADDED)
    assert got["absent"]["changed"] is True
    assert sorted(got["absent"]["sources_sent"]) == DIFFS
    assert got["refused"]["failed"] is True
    assert "Refusing to touch vLLM" in got["refused"]["msg"]
    assert got["refused"]["sources_sent"] == []
    assert got["both"]["msg"] == "Give changeset_src (on the controller) or changeset_root (on the node), not both."
    for name in TOUCHED:
        if name != "vllm/config/vllm.py":
            assert (site / name).read_bytes() == pristine_files[name]
    for name in ADDED:
        assert not (site / name).exists()


def test_action_plugin_serves_only_files_a_manifest_names(tmp_path):
    spec = importlib.util.spec_from_file_location("vllm_patch_action", REPO / "plugins" / "action" / "vllm_patch.py")
    action = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(action)
    known = action.read_manifests(ROOT)
    assert sorted(known) == ["0.20.1"]
    assert action.named_sources(known) == set(DIFFS + ADDED_SOURCES)
    sent = action.read_sources(ROOT, ["common/ddtree_tree.py"], known)
    assert base64.b64decode(sent["common/ddtree_tree.py"]) == (Path(ROOT) / "common/ddtree_tree.py").read_bytes()
    for name in ["build_changeset.py", "../../../ansible.cfg", "/etc/passwd", "vllm-0.20.1/manifest.json"]:
        with pytest.raises(AnsibleError, match=r"which no change-set manifest under .* names; nothing was sent"):
            action.read_sources(ROOT, [name], known)
    with pytest.raises(AnsibleError, match=r"changeset_src .*/nowhere is not a directory on the controller"):
        action.read_manifests(str(tmp_path / "nowhere"))
    with pytest.raises(AnsibleError, match=r"holds no vllm-<version>/manifest.json: there is no change set"):
        action.read_manifests(str(tmp_path))


# --- the patched functions themselves, lifted out of the patched sources ------------
#
# vLLM cannot be imported here (no torch), so these tests take the patched methods' source
# out of the patched files with ast and run them on plain objects.


def _method(site: Path, relpath: str, cls: str, name: str, env: dict):
    import ast
    import textwrap

    tree = ast.parse((site / relpath).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    item.returns = None
                    for arg in item.args.args:
                        arg.annotation = None
                    code = textwrap.dedent(ast.unparse(item))
                    scope = dict(env)
                    exec(compile(code, relpath, "exec"), scope)
                    return scope[name]
    raise AssertionError(f"{cls}.{name} not found in {relpath}")


class Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, msg, *args):
        self.lines.append(msg % args)


@pytest.fixture
def patched_site(venv) -> Path:
    site = site_of(venv)
    cs.execute(cs.plan(changeset(), str(site), cs.PRESENT))
    return site


def test_dflash_target_layer_ids_are_captured_one_layer_later(patched_site, venv):
    fn = _method(
        patched_site,
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        "_get_eagle3_aux_layers_from_config",
        {},
    )
    hf = Obj(eagle_aux_hidden_state_layer_ids=None, dflash_config={"target_layer_ids": [1, 16, 31, 46, 61]})
    runner = Obj(speculative_config=Obj(draft_model_config=Obj(hf_config=hf)))
    assert fn(runner) == (2, 17, 32, 47, 62)
    # EAGLE3 ids already mean "after k layers": unchanged.
    hf.eagle_aux_hidden_state_layer_ids = [2, 32, 61]
    assert fn(runner) == (2, 32, 61)
    # The pristine release passes DFlash ids through unchanged (the bug).
    pristine = site_of(venv).parent / "pristine"
    (pristine / "vllm/v1/worker").mkdir(parents=True)
    with zipfile.ZipFile(_wheel()) as whl:
        (pristine / "vllm/v1/worker/gpu_model_runner.py").write_bytes(whl.read("vllm/v1/worker/gpu_model_runner.py"))
    old = _method(
        pristine,
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        "_get_eagle3_aux_layers_from_config",
        {},
    )
    hf.eagle_aux_hidden_state_layer_ids = None
    assert old(runner) == (1, 16, 31, 46, 61)


def _function(site: Path, relpath: str, name: str, env: dict):
    """A module-level function of a patched file, lifted out as _method lifts methods."""
    import ast
    import textwrap

    for node in ast.parse((site / relpath).read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.returns = None
            for arg in node.args.args:
                arg.annotation = None
            scope = dict(env)
            exec(compile(textwrap.dedent(ast.unparse(node)), relpath, "exec"), scope)
            return scope[name]
    raise AssertionError(f"{name} not found in {relpath}")


QWEN36_LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]


def test_the_drafters_target_layers_key_the_compilation_cache(patched_site):
    """vLLM loads a cached compiled target without guards, and the target returns the states of
    the layers the drafter names: a drafter naming other layers must miss that cache, and so must
    stock 0.20.1's reading of the same ids (one layer early) against this change set's."""
    import hashlib

    fn = _method(
        patched_site,
        "vllm/config/speculative.py",
        "SpeculativeConfig",
        "compute_hash",
        {"safe_hash": lambda data, usedforsecurity: hashlib.sha256(data), "Any": object},
    )

    def spec(dflash_config, method="dflash"):
        hf = Obj(dflash_config=dflash_config)
        return Obj(method=method, ddtree_depth=None, ddtree_budget=None, draft_model_config=Obj(hf_config=hf))

    ids = {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    other = {"mask_token_id": 248070, "target_layer_ids": [2, 17, 32, 47, 62]}
    assert fn(spec(ids)) == fn(spec(dict(ids)))
    assert fn(spec(ids)) != fn(spec(other))
    assert fn(spec(ids)) != fn(spec({"mask_token_id": 248070}))


def test_sliding_window_drafter_layers_run_causal_over_their_window(patched_site):
    """Qwen3.6-27B-DFlash: four causal layers over a 2048-token window, then one full non-causal
    layer (the rule later vLLM releases use); the pristine release ran all five full."""
    rule = _function(
        patched_site,
        "vllm/model_executor/models/qwen3_dflash.py",
        "dflash_layer_attention",
        {"_SLIDING_ATTENTION": "sliding_attention"},
    )
    qwen36 = Obj(layer_types=QWEN36_LAYER_TYPES, sliding_window=2048, dflash_config={})
    assert [rule(qwen36, i) for i in range(5)] == [(2048, True)] * 4 + [(None, False)]
    qwen35 = Obj(layer_types=["full_attention"] * 5, sliding_window=None, dflash_config={})
    assert [rule(qwen35, i) for i in range(5)] == [(None, False)] * 5
    # dflash_config.swa_window_size wins over sliding_window; use_swa without layer_types slides all.
    sized = Obj(layer_types=QWEN36_LAYER_TYPES, sliding_window=2048, dflash_config={"swa_window_size": 512})
    assert rule(sized, 0) == (512, True)
    flag = Obj(layer_types=None, sliding_window=64, dflash_config={"use_swa": True})
    assert rule(flag, 2) == (64, False)
    # use_swa with layer_types that mark no layer sliding: every layer slides (as 0.26.0 reads it).
    all_full = Obj(layer_types=["full_attention"] * 5, sliding_window=64, dflash_config={"use_swa": True})
    assert [rule(all_full, i) for i in range(5)] == [(64, False)] * 5
    forced = Obj(layer_types=QWEN36_LAYER_TYPES, sliding_window=2048, dflash_config={"causal": False})
    assert rule(forced, 0) == (2048, False)
    no_window = Obj(layer_types=QWEN36_LAYER_TYPES, sliding_window=None, dflash_config={})
    with pytest.raises(ValueError, match=r"layer 0 slides, but no window size is set"):
        rule(no_window, 0)


def test_a_drafter_whose_layer_types_cannot_be_run_is_refused(patched_site):
    fn = _method(
        patched_site,
        "vllm/config/speculative.py",
        "SpeculativeConfig",
        "_check_sliding_window_dflash_drafter",
        {"logger": Log()},
    )
    short = Obj(
        model="d", draft_model_config=Obj(hf_config=Obj(layer_types=["sliding_attention"], num_hidden_layers=5))
    )
    with pytest.raises(ValueError, match=r"needs one entry per draft layer \(5\)"):
        fn(short)
    odd = Obj(
        model="d", draft_model_config=Obj(hf_config=Obj(layer_types=["chunked_attention"] * 2, num_hidden_layers=2))
    )
    with pytest.raises(ValueError, match=r"'sliding_attention' or 'full_attention'"):
        fn(odd)
    full = Obj(
        model="d", draft_model_config=Obj(hf_config=Obj(layer_types=["full_attention"] * 5, num_hidden_layers=5))
    )
    assert fn(full) is None


class InfoLog(Log):
    def info(self, msg, *args):
        self.lines.append(msg % args)


def test_ddtree_keeps_trees_on_gated_deltanet_hybrids_and_falls_back_on_mamba(patched_site):
    log = InfoLog()
    fn = _method(
        patched_site,
        "vllm/config/speculative.py",
        "SpeculativeConfig",
        "_check_ddtree_recurrent_target",
        {"logger": log},
    )
    qwen36_text = Obj(
        model_type="qwen3_5_text", layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4
    )
    spec = Obj(
        target_model_config=Obj(hf_text_config=qwen36_text, is_hybrid=True),
        num_speculative_tokens=64,
        ddtree_depth=15,
        ddtree_budget=64,
    )
    fn(spec)
    assert (spec.num_speculative_tokens, spec.ddtree_depth, spec.ddtree_budget) == (64, 15, 64)
    assert log.lines == [
        "DDTree on a Gated DeltaNet hybrid (qwen3_5_text): every tree node keeps its own recurrent state "
        "slot (65 per request)."
    ]
    nemotron = Obj(model_type="nemotron_h", layers_block_type=["mamba", "attention"], layer_types=None)
    mamba = Obj(
        target_model_config=Obj(hf_text_config=nemotron, is_hybrid=True),
        num_speculative_tokens=64,
        ddtree_depth=15,
        ddtree_budget=64,
    )
    fn(mamba)
    assert (mamba.num_speculative_tokens, mamba.ddtree_depth, mamba.ddtree_budget) == (15, None, None)
    assert log.lines[-1].startswith("DDTree refused: the target (nemotron_h) has recurrent layers (mamba) without")
    dense = Obj(
        target_model_config=Obj(hf_text_config=Obj(model_type="qwen3", layer_types=["full_attention"] * 4)),
        num_speculative_tokens=64,
        ddtree_depth=15,
        ddtree_budget=64,
    )
    fn(dense)
    assert (dense.num_speculative_tokens, dense.ddtree_depth, dense.ddtree_budget) == (64, 15, 64)


# --- a hostile venv and change set (issue 23, items 1 and 5) ---------------------


def test_symlinks_planted_at_the_record_names_are_never_written_through(venv, capsys, tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"root-only\n")
    os.chmod(outside, 0o600)
    for name in ("vllm-changeset.json", "vllm-changeset.json.tmp"):
        (venv / name).symlink_to(outside)
    applied = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
    assert applied["changed"] is True, applied
    assert outside.read_bytes() == b"root-only\n"
    assert (outside.stat().st_uid, outside.stat().st_mode & 0o7777) == (0, 0o600)
    assert not (venv / "vllm-changeset.json").is_symlink()
    assert json.loads((venv / "vllm-changeset.json").read_text())["patchset"] == "ddtree"


def test_a_site_packages_write_never_follows_a_planted_temp(venv, tmp_path, monkeypatch):
    """mkstemp's names were random already; the new file is still created O_EXCL|O_NOFOLLOW."""
    flags_seen = []
    real_open = os.open

    def spy(path, flags, *a, **kw):
        if flags & os.O_CREAT:
            flags_seen.append(flags)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    cs.execute(cs.plan(changeset(), str(site_of(venv)), cs.PRESENT))
    monkeypatch.undo()
    assert len(flags_seen) == len(TOUCHED + ADDED)
    assert all(f & os.O_EXCL and f & os.O_NOFOLLOW for f in flags_seen)


def test_a_vllm_directory_swapped_for_a_symlink_takes_no_file_out_of_site_packages(venv, tmp_path):
    """Issue 23: site-packages belongs to the service account, which could swap vllm/v1/spec_decode for
    a link to any directory; root then wrote the added ddtree*.py files there, as their owner."""
    site = site_of(venv)
    elsewhere = tmp_path / "elsewhere"
    (site / "vllm/v1/spec_decode").rename(elsewhere)
    (site / "vllm/v1/spec_decode").symlink_to(elsewhere)
    before = {name: digest for name, (digest, _mtime) in snapshot(site).items()}
    outside = sorted(p.name for p in elsewhere.iterdir())
    the_plan = cs.plan(changeset(), str(site), cs.PRESENT)
    with pytest.raises(cs.ChangeSetError) as refused:
        cs.execute(the_plan)
    assert str(refused.value) == (
        f"Writing failed, every file was put back as it was: {site}/vllm/v1/spec_decode is a symlink or not a"
        " directory (Not a directory); vLLM's own directories are never links: reinstall vLLM"
        " (vllm_install) and run again"
    )
    assert sorted(p.name for p in elsewhere.iterdir()) == outside
    assert {name: digest for name, (digest, _mtime) in snapshot(site).items()} == before


def test_deeply_nested_or_huge_manifests_are_refused_naming_the_file(tmp_path):
    root = tmp_path / "files"
    (root / "vllm-0.20.1").mkdir(parents=True)
    path = root / "vllm-0.20.1" / "manifest.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(cs.ChangeSetError, match=rf"^{path} is nested 100000 levels deep \(at most 64\)"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")
    path.write_bytes(b"{" + b" " * (5 * 1024 * 1024) + b"}")
    with pytest.raises(cs.ChangeSetError, match=rf"^{path} is larger than 4194304 bytes"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")


def test_a_fifo_where_a_vllm_file_should_be_is_refused(venv):
    target = site_of(venv) / "vllm/config/vllm.py"
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(cs.ChangeSetError, match=r"vllm\.py is not a regular file \(a FIFO\).*reinstall vLLM"):
        cs.plan(changeset(), str(site_of(venv)), cs.PRESENT)


@pytest.mark.parametrize("files", [5, {"a": 1}, ["x"], [5]])
def test_malformed_manifest_shapes_are_refused_not_raised(tmp_path, files):
    root = tmp_path / "files"
    (root / "vllm-0.20.1").mkdir(parents=True)
    manifest = {"format": 1, "patchset": "ddtree", "vllm_version": "0.20.1", "files": files}
    (root / "vllm-0.20.1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(cs.ChangeSetError, match=r"'files' must be a list of objects"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")


def test_a_non_utf8_manifest_or_diff_is_refused(tmp_path):
    root = tmp_path / "files"
    (root / "vllm-0.20.1").mkdir(parents=True)
    path = root / "vllm-0.20.1" / "manifest.json"
    path.write_bytes(b'{"format": 1, "x": "\xff"}')
    with pytest.raises(cs.ChangeSetError, match="is not UTF-8 text"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")
    (root / "d.diff").write_bytes(b"\xff\xfe")
    manifest = {
        "format": 1,
        "patchset": "ddtree",
        "vllm_version": "0.20.1",
        "files": [{"path": "vllm/x.py", "kind": "patch", "diff": "d.diff"}],
    }
    path.write_text(json.dumps(manifest))
    with pytest.raises(cs.ChangeSetError, match=r"d\.diff is not UTF-8 text"):
        cs.load_changeset(str(root), "0.20.1", "ddtree")


def test_a_record_that_cannot_be_written_on_a_full_disk_is_a_message_not_a_traceback(tmpfs_dir, pristine_files, capsys):
    """A real full tmpfs after patching: only the record is left to write, and it fails with ENOSPC."""
    venv = make_venv(tmpfs_dir, pristine_files)
    args = {"venv": str(venv), "changeset_root": ROOT}
    assert run_module(args, capsys)["changed"] is True
    record_path = venv / "vllm-changeset.json"
    record_path.unlink()
    files = tree(venv)
    realfs.fill(tmpfs_dir)
    out = run_module(args, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"vLLM was patched but its record {record_path} could not be written (No space left on device); free space"
        f" on the filesystem of {venv} and run again"
    )
    assert tree(venv) == files
    (tmpfs_dir / realfs.FILLER).unlink()
    assert run_module(args, capsys)["changed"] is True
    assert record_path.exists()


def test_an_immutable_record_is_named_with_its_remedy_both_ways(ext4_dir, pristine_files, capsys):
    """A stale record with chattr +i (ext4): applying cannot replace it, removing cannot remove it."""
    venv = make_venv(ext4_dir, pristine_files)
    args = {"venv": str(venv), "changeset_root": ROOT}
    record_path = venv / "vllm-changeset.json"
    record_path.write_text("{}\n")
    files = tree(venv)
    with realfs.immutable(record_path):
        out = run_module(args, capsys)
        assert out["msg"] == (
            f"vLLM was patched but its record {record_path} could not be written (Operation not permitted:"
            f" {record_path} is immutable (chattr +i)); if it is meant to change, run chattr -i {record_path} and"
            " run again"
        )
        assert record_path.read_text() == "{}\n"
        out = run_module({**args, "state": "absent"}, capsys)
        assert out["msg"] == (
            f"vLLM's files were put back but its record {record_path} could not be removed (Operation not"
            f" permitted: {record_path} is immutable (chattr +i)); if it is meant to change, run chattr -i"
            f" {record_path} and run again"
        )
        assert tree(venv) == files
    assert run_module({**args, "state": "absent"}, capsys)["changed"] is True
    assert not record_path.exists()


def test_a_record_lost_after_patching_is_written_by_the_next_run(venv, capsys):
    """Issue 23, LOW: a failed record write after patching was never rewritten."""
    args = {"venv": str(venv), "changeset_root": ROOT}
    first = run_module(args, capsys)
    record_path = venv / "vllm-changeset.json"
    good = record_path.read_text()
    record_path.unlink()
    checked = run_module(args, capsys, check=True)
    assert checked["changed"] is True
    assert checked["changed_files"] == []
    assert not record_path.exists()
    again = run_module(args, capsys)
    assert again["changed"] is True
    assert record_path.read_text() == good
    assert run_module(args, capsys)["changed"] is False
    assert first["changed"] is True


def test_a_venv_or_changeset_root_no_path_can_name_is_a_message(venv, capsys):
    """Issue 23: a path too long for the kernel raised OSError out of the module (a traceback)."""
    long = "x" * 5000
    out = run_module({"venv": long, "changeset_root": ROOT}, capsys)
    assert out["failed"] is True
    assert out["msg"] == f"The venv {long[:200]!r} cannot be looked at (File name too long); give the venv's path."
    out = run_module({"venv": str(venv), "changeset_root": long}, capsys)
    assert out["failed"] is True
    assert out["msg"].endswith(": File name too long; check the venv and changeset_root paths")
    assert len(out["msg"]) < 400


def test_with_manifests_an_unusable_path_names_only_the_venv(venv, capsys, monkeypatch):
    """The controller sends manifests, so the node has no changeset_root to blame."""

    def too_long(*_args, **_kwargs):
        raise OSError(36, "File name too long", "/opt/vllm/" + "x" * 500)

    monkeypatch.setattr(vllm_patch, "plan", too_long)
    out = run_module({"venv": str(venv), "manifests": manifests()}, capsys)
    assert out["failed"] is True
    assert out["msg"] == "/opt/vllm/" + "x" * 290 + ": File name too long; check the venv's path"


def test_a_huge_metadata_is_named_not_read_whole(venv, capsys, deadline):
    """Issue 23: METADATA was read whole, however big (a sparse 1 TiB one filled the memory). Just over the
    limit here: without the bound the module goes on and patches."""
    meta = site_of(venv) / "vllm-0.20.1.dist-info" / "METADATA"
    limit = 4 * 1024 * 1024
    with open(meta, "r+b") as fh:
        fh.truncate(limit + 1)
    with deadline(10):
        out = run_module({"venv": str(venv), "changeset_root": ROOT}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"vLLM's METADATA cannot be read: {meta} is larger than {limit} bytes, more than such a"
        " file ever holds; check it. Reinstall vLLM into the venv (role vllm_install)."
    )
