"""The safetensors_info and dflash_config modules run in-process: check mode, diff, backup, refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dflash_config
import pytest
import realfs
import safetensors_info
from ansible.module_utils.testing import patch_module_args
from module_results import all_text_is_utf8
from safetensors_files import dflash_shapes, fake, write_real, write_sharded

targets = fake("target_configs")


def run(module, args, capsys):
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def lab(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    write_real(drafter / "model.safetensors", dflash_shapes(64, 2, 4, 2, 16, 128, 2))
    target = targets.tiny(tmp_path / "target")
    return drafter, target


def args(drafter, target, **extra):
    return {"drafter": str(drafter), "target": str(target), "dest": str(drafter / "config.json"), **extra}


def listing(directory):
    return sorted(os.listdir(directory))


TINY_CONFIG = """{
  "architectures": [
    "DFlashDraftModel"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "block_size": 16,
  "dflash_config": {
    "mask_token_id": 990,
    "target_layer_ids": [
      1,
      5
    ]
  },
  "head_dim": 16,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 128,
  "max_position_embeddings": 4096,
  "model_type": "qwen3",
  "num_attention_heads": 4,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "num_target_layers": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "use_cache": true,
  "vocab_size": 1000
}
"""


def test_writes_then_idempotent(lab, capsys):
    drafter, target = lab
    first = run(dflash_config, args(drafter, target), capsys)
    assert first["changed"] is True
    assert (drafter / "config.json").read_text() == TINY_CONFIG
    assert oct((drafter / "config.json").stat().st_mode & 0o777) == "0o644"
    # Also emitted as a module warning (not asserted: where warnings go depends on process state).
    assert first["inferred"]["assumptions"] == ["all layers full attention (layer_types not given; shapes cannot tell)"]
    second = run(dflash_config, args(drafter, target), capsys)
    assert second["changed"] is False
    assert listing(drafter) == ["config.json", "model.safetensors"]


def test_check_mode_with_diff_writes_nothing(lab, capsys):
    drafter, target = lab
    out = run(dflash_config, {**args(drafter, target), "_ansible_check_mode": True, "_ansible_diff": True}, capsys)
    assert out["changed"] is True
    assert out["diff"]["before"] == ""
    assert out["diff"]["after"] == TINY_CONFIG
    assert out["diff"]["before_header"] == "(absent)"
    assert listing(drafter) == ["model.safetensors"]


def test_content_change_with_backup(lab, capsys):
    drafter, target = lab
    (drafter / "config.json").write_text('{"hand": "written"}\n')
    out = run(dflash_config, {**args(drafter, target), "backup": True, "_ansible_diff": True}, capsys)
    assert out["changed"] is True
    assert out["diff"]["before"] == '{"hand": "written"}\n'
    backup = out["backup_file"]
    assert Path(backup).read_text() == '{"hand": "written"}\n'
    assert (drafter / "config.json").read_text() == TINY_CONFIG


def test_mode_is_applied_and_reported(lab, capsys):
    drafter, target = lab
    run(dflash_config, args(drafter, target), capsys)
    out = run(dflash_config, {**args(drafter, target), "mode": "0600"}, capsys)
    assert out["changed"] is True
    assert oct((drafter / "config.json").stat().st_mode & 0o777) == "0o600"


REFUSALS = [
    ({"mask_token_id": 1000}, "mask token id 1000 (given) is not below the target's vocab_size 1000"),
    ({"target_layer_ids": [1, 8]}, "target layer id(s) [8] outside the target, which has layers 0..7"),
    ({"target_layer_ids": [1]}, "target_layer_ids has 1 entries but fc.weight taps 2"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "set sliding_window too"),
    ({"block_size": 0}, "block_size must be an integer >= 2"),
]


@pytest.mark.parametrize(("extra", "message"), REFUSALS)
def test_refusals_write_nothing(lab, capsys, extra, message):
    drafter, target = lab
    out = run(dflash_config, args(drafter, target, **extra), capsys)
    assert out["failed"] is True
    assert message in out["msg"]
    assert listing(drafter) == ["model.safetensors"]


def test_refusal_keeps_existing_config_untouched(lab, capsys):
    drafter, target = lab
    (drafter / "config.json").write_text("old\n")
    out = run(dflash_config, args(drafter, target, mask_token_id=5000, backup=True), capsys)
    assert out["failed"] is True
    assert (drafter / "config.json").read_text() == "old\n"
    assert listing(drafter) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("hidden", "the drafter's hidden size 64 differs from the target's 96"),
        ("fc", "its width 100 is not a multiple of the hidden size 64"),
        ("missing", "drafter tensors missing: layers.1.mlp.down_proj.weight"),
        ("taps", "fc.weight taps 3 target layers but the drafter has 2 draft layers"),
        ("tokenizer", "cannot find the mask token id"),
        ("truncated", "the file is truncated"),
        ("ambiguous", "match several published drafters"),
    ],
)
def test_drafter_and_target_refusals_write_nothing(tmp_path, capsys, setup, message):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    shapes = dflash_shapes(64, 2, 4, 2, 16, 128, 3 if setup == "taps" else 2)
    if setup == "fc":
        shapes["fc.weight"] = (64, 100)
    if setup == "missing":
        del shapes["layers.1.mlp.down_proj.weight"]
    target = targets.tiny(tmp_path / "target", hidden=96 if setup == "hidden" else 64)
    if setup == "ambiguous":
        from safetensors_files import QWEN36_27B_DFLASH, write_sparse

        write_sparse(drafter / "model.safetensors", QWEN36_27B_DFLASH)
        target = targets.qwen36_27b(tmp_path / "q36")
    else:
        write_real(drafter / "model.safetensors", shapes)
    if setup == "tokenizer":
        (target / "tokenizer.json").unlink()
    if setup == "truncated":
        data = (drafter / "model.safetensors").read_bytes()
        (drafter / "model.safetensors").write_bytes(data[:-10])
    out = run(dflash_config, args(drafter, target), capsys)
    assert out["failed"] is True
    assert message in out["msg"]
    assert listing(drafter) == ["model.safetensors"]


def test_dest_directory_missing(lab, capsys):
    drafter, target = lab
    out = run(dflash_config, {**args(drafter, target), "dest": str(drafter / "nope" / "config.json")}, capsys)
    assert out["failed"] is True
    assert out["msg"] == f"the directory of dest, {drafter}/nope, does not exist; stage the drafter there first"


def test_safetensors_info_module(tmp_path, capsys):
    write_sharded(tmp_path, {"a": (2, 3), "b": (4,)}, shards=2, sparse=False)
    out = run(safetensors_info, {"path": str(tmp_path), "checksum": "sha256", "_ansible_check_mode": True}, capsys)
    assert out["changed"] is False
    assert out["tensors"] == {
        "a": {"dtype": "F16", "shape": [2, 3], "file": "model-00001-of-00002.safetensors"},
        "b": {"dtype": "F16", "shape": [4], "file": "model-00002-of-00002.safetensors"},
    }
    assert out["total_parameters"] == 10
    assert out["total_bytes"] == 20
    assert out["dtypes"] == {"F16": 10}
    assert [len(f["sha256"]) for f in out["files"]] == [64, 64]
    assert out["index"] == f"{tmp_path}/model.safetensors.index.json"


def test_safetensors_info_module_fails_cleanly(tmp_path, capsys):
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 16)
    out = run(safetensors_info, {"path": str(tmp_path / "x.safetensors")}, capsys)
    assert out["failed"] is True
    assert "exceeds the 104857600-byte limit" in out["msg"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", "path is empty; give a .safetensors file or the directory that holds the weights"),
        ("/opt/a\x00b", "'/opt/a\\x00b': holds a NUL character, which no path can hold; check the path"),
    ],
)
def test_safetensors_info_refuses_empty_and_nul_paths(capsys, path, message):
    """A NUL in the path raised ValueError out of the module (issue 23, LOW)."""
    out = run(safetensors_info, {"path": path}, capsys)
    assert out["failed"] is True
    assert out["msg"] == message


# ------------------------------------------------------------------ hostile drafter directory (issue 23, items 1 and 3)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_symlink_or_fifo_at_config_json_is_refused_and_nothing_disclosed(lab, capsys, tmp_path, kind):
    drafter, target = lab
    secret = tmp_path / "root-only"
    secret.write_text("root-only secret\n")
    os.chmod(secret, 0o600)
    dest = drafter / "config.json"
    if kind == "symlink":
        dest.symlink_to(secret)
    else:
        os.mkfifo(dest)
    out = run(dflash_config, {**args(drafter, target), "_ansible_check_mode": True, "_ansible_diff": True}, capsys)
    assert out["failed"] is True
    what = "is a symlink; it is read only as a regular file" if kind == "symlink" else "is not a regular file (a FIFO)"
    assert out["msg"].startswith(f"the existing {dest} {what}")
    assert out["msg"].endswith("nothing was read or written (dest must be a regular config.json)")
    assert "secret" not in json.dumps(out)
    assert secret.read_text() == "root-only secret\n"
    assert listing(drafter) == ["config.json", "model.safetensors"]


def test_the_write_and_its_backup_go_through_fresh_files_only(lab, capsys, monkeypatch):
    drafter, target = lab
    (drafter / "config.json").write_text('{"hand": "written"}\n')
    seen = []
    real_open = os.open

    def spy(path, flags, *a, **kw):
        if flags & os.O_CREAT:
            seen.append((os.path.basename(path), bool(flags & os.O_EXCL), bool(flags & os.O_NOFOLLOW)))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    out = run(dflash_config, {**args(drafter, target), "backup": True}, capsys)
    monkeypatch.undo()
    assert out["changed"] is True, out
    assert len(seen) == 2
    assert all(excl and nofollow for _, excl, nofollow in seen)
    assert Path(out["backup_file"]).read_text() == '{"hand": "written"}\n'
    assert listing(drafter) == ["config.json", os.path.basename(out["backup_file"]), "model.safetensors"]


@pytest.mark.parametrize("first", ["absent", "same content"])
def test_owner_and_mode_are_set_on_the_descriptor_never_by_path(lab, capsys, monkeypatch, first):
    """A chmod or chown by path in the service account's directory follows a link swapped in after the write:
    owner, group and mode go on the new file's descriptor, or on an O_NOFOLLOW one (issue 23, item 1)."""
    drafter, target = lab
    if first == "same content":
        run(dflash_config, args(drafter, target), capsys)
    by_path = []
    for name in ("chmod", "chown", "lchown", "lchmod"):
        if hasattr(os, name):
            real = getattr(os, name)
            monkeypatch.setattr(
                os, name, lambda path, *a, _n=name, _r=real, **kw: (by_path.append((_n, path)), _r(path, *a, **kw))[1]
            )
    out = run(dflash_config, {**args(drafter, target), "owner": "nobody", "group": "0", "mode": "u=rw,g=r,o="}, capsys)
    monkeypatch.undo()
    assert out["changed"] is True, out
    assert by_path == []
    st = (drafter / "config.json").stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (65534, 0, "0o640")
    assert (drafter / "config.json").read_text() == TINY_CONFIG
    again = run(dflash_config, {**args(drafter, target), "owner": "nobody", "group": "0", "mode": "0640"}, capsys)
    assert again["changed"] is False


def test_a_hard_link_at_config_json_keeps_its_owner_and_mode(lab, capsys, tmp_path):
    drafter, target = lab
    run(dflash_config, args(drafter, target), capsys)
    other = tmp_path / "elsewhere"
    os.link(drafter / "config.json", other)
    out = run(dflash_config, {**args(drafter, target), "owner": "nobody", "mode": "0600"}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"cannot set the owner or mode of {drafter / 'config.json'} (the existing {drafter / 'config.json'} has 1 other"
        " hard link(s); its owner and mode are not changed: remove the extra links (or the file) and run again); its"
        " content is current"
    )
    assert (other.stat().st_uid, oct(other.stat().st_mode & 0o777)) == (0, "0o644")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"owner": "no-such-user-x"}, "user 'no-such-user-x' does not exist on this host; create it or give another"),
        ({"mode": "u=rwz"}, "mode 'u=rwz' is neither octal ('0644') nor symbolic ('u=rw,go=r')"),
        ({"mode": "07777777"}, "mode '07777777' is not a file mode (permission bits only, such as '0644')"),
    ],
)
def test_unknown_owners_and_bad_modes_are_refused_before_writing(lab, capsys, extra, message):
    drafter, target = lab
    out = run(dflash_config, {**args(drafter, target), **extra}, capsys)
    assert out["failed"] is True
    assert out["msg"].startswith(message)
    assert out["msg"].endswith("; nothing was written")
    assert listing(drafter) == ["model.safetensors"]


@pytest.mark.parametrize(("name", "value", "what"), [("dest", "", "is empty"), ("target", "/a\x00b", "holds a NUL")])
def test_empty_or_nul_paths_are_refused(lab, capsys, name, value, what):
    drafter, target = lab
    out = run(dflash_config, {**args(drafter, target), name: value}, capsys)
    assert out["failed"] is True
    assert out["msg"].startswith(f"{name} {what}")
    assert listing(drafter) == ["model.safetensors"]


def drafter_on(where, target_from):
    """The lab's drafter directory on a real, small filesystem, with a hand-written config.json."""
    drafter = where / "drafter"
    drafter.mkdir()
    write_real(drafter / "model.safetensors", dflash_shapes(64, 2, 4, 2, 16, 128, 2))
    (drafter / "config.json").write_text("old\n")
    return drafter, target_from


@pytest.mark.parametrize("backup", [False, True])
def test_a_full_disk_is_a_message_and_the_old_config_survives(lab, tmpfs_dir, capsys, backup):
    """A real full tmpfs: the kernel's ENOSPC, not a patched function (issue 23)."""
    drafter, target = drafter_on(tmpfs_dir, lab[1])
    realfs.fill(tmpfs_dir)
    out = run(dflash_config, {**args(drafter, target), "backup": backup}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"cannot write {drafter / 'config.json'} (No space left on device); it was left as it was: free space on"
        f" the filesystem of {drafter} and run again"
    )
    assert (drafter / "config.json").read_text() == "old\n"
    assert listing(drafter) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("backup", [False, True])
def test_an_immutable_config_is_named_with_its_remedy_and_survives(lab, ext4_dir, capsys, backup):
    """A real ext4 file with chattr +i: the rename over it fails EPERM; no temp and no stray backup stay."""
    drafter, target = drafter_on(ext4_dir, lab[1])
    dest = drafter / "config.json"
    with realfs.immutable(dest):
        out = run(dflash_config, {**args(drafter, target), "backup": backup}, capsys)
        assert out["failed"] is True
        assert out["msg"] == (
            f"cannot write {dest} (Operation not permitted: {dest} is immutable (chattr +i)); it was left as it was:"
            f" if it is meant to change, run chattr -i {dest} and run again"
        )
        assert dest.read_text() == "old\n"
        assert listing(drafter) == ["config.json", "model.safetensors"]
    out = run(dflash_config, args(drafter, target), capsys)
    assert out["changed"] is True, out
    assert listing(drafter) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("backup", [False, True])
def test_a_read_only_filesystem_is_named_with_its_remedy_and_changes_nothing(lab, ext4_dir, capsys, backup):
    """The drafter's filesystem remounted read-only (real ext4, EROFS): named, the remedy given, nothing changed."""
    drafter, target = drafter_on(ext4_dir, lab[1])
    dest = drafter / "config.json"
    with realfs.read_only(ext4_dir):
        out = run(dflash_config, {**args(drafter, target), "backup": backup}, capsys)
        assert out["failed"] is True
        assert out["msg"] == (
            f"cannot write {dest} (Read-only file system); it was left as it was: remount the filesystem of {drafter}"
            " read-write and run again"
        )
        assert dest.read_text() == "old\n"
        assert listing(drafter) == ["config.json", "model.safetensors"]
    out = run(dflash_config, {**args(drafter, target), "backup": backup}, capsys)
    assert out["changed"] is True, out


# ------------------------------------------------------------------ lone surrogates in the target's config (issue 23)


@pytest.mark.parametrize("check_mode", [False, True])
@pytest.mark.parametrize(
    ("field", "value", "escape"),
    [
        ("model_type", '"\\ud800"', "\\ud800"),
        ("hidden_act", '"silu\\udfff"', "\\udfff"),
        ("rope_scaling", '{"rope_type": "yarn", "factor": 2.0, "\\udc00": 1}', "\\udc00"),
    ],
)
def test_a_lone_surrogate_in_the_target_config_is_refused_naming_the_file(
    lab, capsys, check_mode, field, value, escape
):
    """A \\ud800 escape is valid JSON but parses into a str UTF-8 cannot encode: writing the drafter config
    raised UnicodeEncodeError out of the module, and --check returned a result the controller refuses (issue 23)."""
    drafter, target = lab
    config = target / "config.json"
    settings = json.loads(config.read_text())
    settings.pop(field, None)
    config.write_text(json.dumps(settings)[:-1] + f', "{field}": {value}}}')
    out = run(dflash_config, {**args(drafter, target), "_ansible_check_mode": check_mode}, capsys)
    assert out["failed"] is True, out
    assert out["msg"] == (
        f"target config {config} holds a lone surrogate ({escape} escape), which no UTF-8 text can hold;"
        " it is not such a file"
    )
    assert all_text_is_utf8(out)
    assert listing(drafter) == ["model.safetensors"]
