"""model_stage logic: planning, digests, layouts, sidecar, index; the node module run in-process."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
from pathlib import Path

import pytest
import safetensors_stage
from ansible.module_utils.model_stage import (
    DestFile,
    SourceFile,
    StageError,
    build_index,
    check_index,
    check_space,
    describe,
    expected_digests,
    human,
    normalise_digest,
    parse_sidecar,
    plan_stage,
    render_sidecar,
    source_layout,
    temp_name,
)
from ansible.module_utils.testing import patch_module_args
from safetensors_files import write_real

DIGEST_A = "5020823fe0e40834133cbf04f57dc4d8db9a5c8f267dd8dcd2ac0d86e1877658"
OWNER = pwd.getpwuid(os.getuid()).pw_name
GROUP = grp.getgrgid(os.getgid()).gr_name

# ------------------------------------------------------------------ pure helpers


def test_temp_name_is_keyed_by_size_and_mtime():
    assert temp_name("model.safetensors", 3460012345, 1790000000) == (
        ".model_stage-model.safetensors.3460012345-1790000000.part"
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [(512, "512 bytes"), (1536, "1.5 KiB (1536 bytes)"), (4294967504, "4.0 GiB (4294967504 bytes)")],
)
def test_human(n, text):
    assert human(n) == text


def test_normalise_digest_accepts_prefix_and_case():
    assert normalise_digest("SHA256:" + DIGEST_A.upper(), "x") == DIGEST_A


@pytest.mark.parametrize("bad", ["abc123", DIGEST_A[:-1], DIGEST_A + "0", 42, "g" * 64])
def test_normalise_digest_refuses(bad):
    with pytest.raises(StageError, match="SHA-256"):
        normalise_digest(bad, "drafter.safetensors")


def test_expected_digests_single_and_mapping():
    assert expected_digests(DIGEST_A, ["d.safetensors"], "d.safetensors") == {"d.safetensors": DIGEST_A}
    assert expected_digests("", ["d.safetensors"], "d.safetensors") == {}
    assert expected_digests({"a.safetensors": DIGEST_A}, ["a.safetensors", "b.safetensors"], None) == {
        "a.safetensors": DIGEST_A
    }


def test_expected_digests_refusals():
    with pytest.raises(StageError, match="one digest but the source has several files"):
        expected_digests(DIGEST_A, ["a.safetensors", "b.safetensors"], None)
    with pytest.raises(StageError, match=r"sha256 names c.safetensors, which the source does not have"):
        expected_digests({"c.safetensors": DIGEST_A}, ["a.safetensors"], "a.safetensors")


def test_source_layout():
    assert source_layout("/w/dflash-q36-27b.safetensors", False, []) == [
        ("/w/dflash-q36-27b.safetensors", "model.safetensors")
    ]
    assert source_layout("/w", True, ["only.safetensors", "README.md"]) == [
        ("/w/only.safetensors", "model.safetensors")
    ]
    assert source_layout("/w", True, ["b.safetensors", "a.safetensors", "model.safetensors.index.json"]) == [
        ("/w/a.safetensors", "a.safetensors"),
        ("/w/b.safetensors", "b.safetensors"),
        ("/w/model.safetensors.index.json", "model.safetensors.index.json"),
    ]


@pytest.mark.parametrize(
    ("src", "is_dir", "listing", "message"),
    [
        ("/w/weights.bin", False, [], "must be a .safetensors file or a directory of them"),
        ("/w", True, ["config.json"], "the directory holds no .safetensors file"),
    ],
)
def test_source_layout_refusals(src, is_dir, listing, message):
    with pytest.raises(StageError, match=message):
        source_layout(src, is_dir, listing)


def test_sidecar_round_trip_and_garbage():
    rec = {"size": 10, "mtime": 5, "sha256": DIGEST_A, "source": "/w/a.safetensors"}
    text = render_sidecar({"model.safetensors": rec})
    assert json.loads(text) == {"files": {"model.safetensors": rec}, "version": 1}
    assert parse_sidecar(text) == {"model.safetensors": rec}
    for garbage in [None, "", "{", "[]", '{"version": 2, "files": {}}', '{"version": 1, "files": {"x": 1}}']:
        assert parse_sidecar(garbage) == {}


SRC = SourceFile("model.safetensors", "/w/d.safetensors", 1000, 1790000000)
HAVE = DestFile(1000, 1790000000, 0, 0, 0o640)
REC = {"size": 1000, "mtime": 1790000000, "sha256": DIGEST_A, "source": "/w/d.safetensors"}


@pytest.mark.parametrize(
    ("dest", "sidecar", "source", "action", "reason"),
    [
        ({}, {}, SRC, "transfer", "not in the destination"),
        ({"model.safetensors": HAVE}, {"model.safetensors": REC}, SRC, "keep", "unchanged"),
        ({"model.safetensors": DestFile(999, 1790000000, 0, 0, 0o640)}, {}, SRC, "transfer", "size differs"),
        ({"model.safetensors": DestFile(1000, 1, 0, 0, 0o640)}, {}, SRC, "transfer", "modification time differs"),
        ({"model.safetensors": HAVE}, {}, SRC, "transfer", "no verified digest recorded"),
        (
            {"model.safetensors": HAVE},
            {"model.safetensors": {**REC, "mtime": 1}},
            SRC,
            "transfer",
            "no verified digest recorded",
        ),
        (
            {"model.safetensors": HAVE},
            {"model.safetensors": REC},
            SourceFile("model.safetensors", "/w/d.safetensors", 1000, 1790000000, "0" * 64),
            "transfer",
            "the expected SHA-256 differs",
        ),
    ],
)
def test_plan_decides_per_file(dest, sidecar, source, action, reason):
    plan = plan_stage([source], dest, sidecar, {}, False)
    assert plan.files[0].action == action
    assert plan.files[0].reason.startswith(reason)


def test_plan_resumes_matching_partial_and_drops_stale_ones():
    temps = {SRC.temp: 400, ".model_stage-model.safetensors.999-1.part": 10}
    plan = plan_stage([SRC], {}, {}, temps, False)
    assert plan.files[0].partial == 400
    assert plan.bytes_to_write() == 600
    assert plan.stale_temps == [".model_stage-model.safetensors.999-1.part"]
    assert describe(plan) == [
        "copy /w/d.safetensors -> model.safetensors (1000 bytes; not in the destination, resuming after 400 bytes)",
        "remove .model_stage-model.safetensors.999-1.part (left over from an earlier transfer of another source)",
    ]


def test_plan_removes_weights_not_in_the_source_only():
    shards = [SourceFile(f"s{i}.safetensors", f"/w/s{i}.safetensors", 10, 1) for i in (1, 2)]
    dest = {"model.safetensors": HAVE, "config.json": HAVE, "notes.txt": HAVE}
    plan = plan_stage(shards, dest, {}, {}, True)
    assert plan.stale_weights == ["model.safetensors"]
    assert plan.index_stale is True


def test_check_space_says_both_numbers():
    check_space("/d", 0, 10, 0)
    check_space("/d", 100, 10, 110)
    with pytest.raises(StageError) as exc:
        check_space("/d", 4294967504, 1073741824, 67108864)
    assert str(exc.value) == (
        "not enough space for /d: staging needs 4.0 GiB (4294967504 bytes) plus a margin of 1.0 GiB (1073741824 bytes),"
        " but the filesystem has 64.0 MiB (67108864 bytes) free; free up space or stage elsewhere (model_stage_dest)"
    )


def test_build_and_check_index():
    index = build_index({"b.safetensors": {"y": 4}, "a.safetensors": {"x": 2, "z": 6}})
    assert index == {
        "metadata": {"total_size": 12},
        "weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"},
    }
    check_index(index, {"a.safetensors": {"x", "z"}, "b.safetensors": {"y"}}, "idx")
    with pytest.raises(StageError, match=r"tensor 'y' is in both a\.safetensors and b\.safetensors"):
        build_index({"a.safetensors": {"y": 1}, "b.safetensors": {"y": 1}})
    with pytest.raises(StageError, match=r"idx: tensor 'z' is in a\.safetensors but the index maps it to None"):
        check_index({"weight_map": {"x": "a.safetensors"}}, {"a.safetensors": {"x", "z"}}, "idx")
    with pytest.raises(StageError, match=r"idx: names shard\(s\) c.safetensors that the source does not have"):
        check_index({"weight_map": {"x": "c.safetensors"}}, {"a.safetensors": {"x"}}, "idx")
    with pytest.raises(StageError, match="idx: maps tensor 'w' that no shard holds"):
        check_index({"weight_map": {"x": "a.safetensors", "w": "a.safetensors"}}, {"a.safetensors": {"x"}}, "idx")


# ------------------------------------------------------------------ the node module, in-process


def call(args, capsys, check=False):
    if check:
        args = {**args, "_ansible_check_mode": True}
    with patch_module_args(args), pytest.raises(SystemExit):
        safetensors_stage.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src" / "dflash-q36-27b.safetensors"
    path.parent.mkdir()
    write_real(path, {"fc.weight": (8, 16), "norm.weight": (8,)})
    return path


def manifest(path: Path, name="model.safetensors", sha256=None):
    st = path.stat()
    return {"name": name, "origin": str(path), "size": st.st_size, "mtime": int(st.st_mtime), "sha256": sha256}


def base(src, dest, **extra):
    return {"src": str(src), "dest": str(dest), "owner": OWNER, "group": GROUP, "space_margin": 0, **extra}


def sha(path):
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def transfer(planned):
    """What rsync does: the source's bytes and mtime at the temporary name."""
    for t in planned["transfers"]:
        shutil.copyfile(t["origin"], t["temp"])
        os.utime(t["temp"], (t["mtime"], t["mtime"]))


def commit_files(planned, digests=None):
    files = [
        {**t, "kind": "transfer", "digest": (digests or {}).get(t["name"]) or sha(t["origin"]), "digest_from": "source"}
        for t in planned["transfers"]
    ]
    files += [{"name": n, "kind": "keep"} for n in planned["keep"]]
    files += [{"name": n, "kind": "remove"} for n in planned["stale_weights"]]
    if planned["write_index"]:
        files.append({"name": "model.safetensors.index.json", "kind": "generate_index"})
    return files


def test_plan_in_check_mode_changes_nothing(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    out = call({**base(src, dest), "step": "plan", "files": [manifest(src)]}, capsys, check=True)
    assert out["changed"] is True
    assert out["actions"][0] == f"create {dest}"
    assert out["actions"][1].startswith(f"copy {src} -> model.safetensors (")
    size, mtime = src.stat().st_size, int(src.stat().st_mtime)
    assert out["diff"]["before"] == ""
    assert out["diff"]["after"] == f"model.safetensors {size} bytes mtime {mtime} from {src}\n"
    assert not dest.exists()


def test_stage_then_rerun_is_free(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    assert oct(dest.stat().st_mode & 0o7777) == "0o750"
    transfer(planned)
    done = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert done["changed"] is True
    assert done["transferred"] == ["model.safetensors"]
    staged = dest / "model.safetensors"
    assert sha(staged) == sha(src)
    assert oct(staged.stat().st_mode & 0o7777) == "0o640"
    assert int(staged.stat().st_mtime) == int(src.stat().st_mtime)
    assert sorted(os.listdir(dest)) == [".model_stage.json", "model.safetensors"]
    side = json.loads((dest / ".model_stage.json").read_text())
    assert side["files"]["model.safetensors"]["sha256"] == sha(src)
    again = call({**args, "step": "plan"}, capsys)
    assert again["changed"] is False
    assert again["transfers"] == []
    assert again["keep"] == ["model.safetensors"]


def test_digest_mismatch_keeps_the_good_file_and_leaves_no_temp(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    good = sha(dest / "model.safetensors")
    os.utime(src, (1, 1))  # the source "changed"
    args = {**base(src, dest), "files": [manifest(src, sha256="0" * 64)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    files = commit_files(planned)
    files[0].update(digest="0" * 64, digest_from="inventory")
    out = call({**args, "step": "commit", "files": files}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"model.safetensors: SHA-256 of {src} is {sha(src)} but the inventory expects {'0' * 64}: the source is not"
        " the expected file; check model_stage_src and model_stage_sha256 (nothing was replaced)"
    )
    assert sha(dest / "model.safetensors") == good
    assert sorted(os.listdir(dest)) == [".model_stage.json", "model.safetensors"]


def test_corrupt_copy_and_short_copy_are_refused(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    temp = Path(planned["transfers"][0]["temp"])
    transfer(planned)
    data = bytearray(temp.read_bytes())
    data[-1] ^= 0xFF
    temp.write_bytes(bytes(data))
    out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert "the copy is corrupt; run the play again (nothing was replaced)" in out["msg"]
    assert not temp.exists()
    transfer(planned)
    temp.write_bytes(temp.read_bytes()[:-10])
    out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert out["msg"].endswith(f"but the source has {src.stat().st_size}: the copy is incomplete; run the play again")
    assert os.listdir(dest) == []


def test_truncated_source_with_its_own_digest_fails_the_header_check(tmp_path, capsys):
    src = tmp_path / "cut.safetensors"
    write_real(src, {"fc.weight": (8, 16)})
    src.write_bytes(src.read_bytes()[:-4])
    dest = tmp_path / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert "the file is truncated" in out["msg"]
    assert os.listdir(dest) == []


def test_not_enough_space_and_missing_owner(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    out = call({**base(src, dest), "space_margin": 1 << 60, "step": "plan", "files": [manifest(src)]}, capsys)
    assert out["msg"].startswith(f"not enough space for {dest}: staging needs ")
    assert not dest.exists()
    out = call({**base(src, dest), "owner": "no-such-user-here", "step": "plan", "files": [manifest(src)]}, capsys)
    assert out["msg"].startswith("user 'no-such-user-here' does not exist on this node;")


def test_shards_get_an_index_and_replace_a_single_file(tmp_path, capsys):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    write_real(shard_dir / "model-00001-of-00002.safetensors", {"a.weight": (4, 4)})
    write_real(shard_dir / "model-00002-of-00002.safetensors", {"b.weight": (2,)})
    dest = tmp_path / "dest"
    dest.mkdir()
    write_real(dest / "model.safetensors", {"old.weight": (2,)})
    files = [manifest(p, p.name) for p in sorted(shard_dir.iterdir())]
    args = {**base(shard_dir, dest), "files": files}
    planned = call({**args, "step": "plan"}, capsys)
    assert planned["stale_weights"] == ["model.safetensors"]
    assert planned["actions"][-2:] == [
        "write model.safetensors.index.json (the source has shards but no index)",
        "remove model.safetensors (not part of the source)",
    ]
    transfer(planned)
    call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert sorted(os.listdir(dest)) == [
        ".model_stage.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
    again = call({**args, "step": "plan"}, capsys)
    assert (again["changed"], again["index_stale"]) == (False, False)
    (dest / "model.safetensors.index.json").write_text("{}")
    edited = call({**args, "step": "plan"}, capsys)
    assert edited["index_stale"] is True


def test_remote_source_is_copied_on_the_node(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = base(src, dest, remote_src=True)
    planned = call({**args, "step": "plan"}, capsys)
    assert [t["name"] for t in planned["transfers"]] == ["model.safetensors"]
    copied = call({**args, "step": "copy", "files": [{**t, "kind": "transfer"} for t in planned["transfers"]]}, capsys)
    assert copied["digests"] == {"model.safetensors": sha(src)}
    call({**args, "step": "commit", "files": commit_files(planned, copied["digests"])}, capsys)
    assert sha(dest / "model.safetensors") == sha(src)
    missing = call({**base(tmp_path / "nope.safetensors", dest, remote_src=True), "step": "plan"}, capsys)
    assert (
        missing["msg"]
        == f"{tmp_path / 'nope.safetensors'}: the source does not exist on the node; check model_stage_src"
    )


def test_dest_that_is_a_file_is_refused(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    dest.write_text("x")
    out = call({**base(src, dest), "step": "plan", "files": [manifest(src)]}, capsys)
    assert out["msg"] == f"{dest} exists and is not a directory; model_stage_dest must be a directory"


def test_a_commit_run_again_after_it_succeeded_is_a_no_op(src, tmp_path, capsys):
    """An SSH retry can run the commit twice; the second finds the file in place and recorded."""
    dest = tmp_path / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    files = commit_files(planned)
    first = call({**args, "step": "commit", "files": files}, capsys)
    second = call({**args, "step": "commit", "files": files}, capsys)
    assert first["changed"] is True
    assert second.get("failed") is None
    assert second["changed"] is False
    assert second["files"] == first["files"]


def test_follow_hashes_a_finished_file_and_gives_up_on_a_stalled_one(src, tmp_path):
    assert safetensors_stage._follow_one(str(src), src.stat().st_size, 1.0) == sha(src)
    assert safetensors_stage._follow_one(str(src), src.stat().st_size + 1, 0.2) is None
    assert safetensors_stage._follow_one(str(tmp_path / "never"), 10, 0.2) is None


def test_commit_trusts_a_digest_taken_during_transfer_only_when_it_is_right(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    followed = call({**args, "step": "follow", "files": planned["transfers"]}, capsys)
    assert followed["prehashed"] == {"model.safetensors": sha(src)}
    files = commit_files(planned)
    files[0]["prehashed"] = "0" * 64  # wrong: the finished file is read again
    done = call({**args, "step": "commit", "files": files}, capsys)
    assert done["reread"] == ["model.safetensors"]
    assert sha(dest / "model.safetensors") == sha(src)
