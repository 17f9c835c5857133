"""model_stage logic: planning, digests, layouts, sidecar, index; the node module run in-process."""

from __future__ import annotations

import fcntl
import grp
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import realfs
import safetensors_stage
from ansible.module_utils.model_stage import (
    DestFile,
    NewSet,
    SourceFile,
    StageError,
    build_index,
    check_exchange,
    check_index,
    check_space,
    describe,
    exchange_paths,
    expected_digests,
    human,
    leftovers,
    mount_of,
    normalise_digest,
    parse_sidecar,
    plan_stage,
    prepare_set,
    remove_tree,
    render_sidecar,
    replace_set,
    source_layout,
    swap_paths,
    swap_set,
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
        " but the filesystem has 64.0 MiB (67108864 bytes) free; free up space or stage elsewhere (shared_settings_drafter_dir)"
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
    assert planned["actions"][-3:] == [
        "write model.safetensors.index.json (the source has shards but no index)",
        "remove model.safetensors (not part of the source)",
        "swap the new set in as one directory (the old set stays complete until then)",
    ]
    transfer(planned)
    done = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert done["swapped"] is True
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
    assert out["msg"] == f"{dest} exists and is not a directory; shared_settings_drafter_dir must be a directory"


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


def test_commit_trusts_a_digest_taken_during_transfer_only_when_it_is_right(src, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(safetensors_stage, "FOLLOW_NICE", 0)  # the step lowers its own priority: not pytest's
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


# ------------------------------------------------------------------ a shard set replaced as one directory


def test_a_plan_replaces_a_set_only_when_more_than_one_file_changes():
    one = plan_stage([SRC], {}, {}, {}, False)
    assert one.replaces_set is False
    shards = [SourceFile(f"s{i}.safetensors", f"/w/s{i}.safetensors", 10, 1) for i in (1, 2)]
    recs = {f"s{i}.safetensors": {"size": 10, "mtime": 1, "sha256": DIGEST_A} for i in (1, 2)}
    have = {f"s{i}.safetensors": DestFile(10, 1, 0, 0, 0o640) for i in (1, 2)}
    assert plan_stage(shards, have, recs, {}, True).replaces_set is False  # only the index is written
    have["model.safetensors.index.json"] = DestFile(50, 1, 0, 0, 0o640)
    assert plan_stage(shards, have, recs, {}, True).replaces_set is False  # nothing changes
    changed = plan_stage([shards[0], SourceFile("s2.safetensors", "/w/s2.safetensors", 12, 2)], have, recs, {}, True)
    assert changed.replaces_set is True  # one shard and (maybe) the index
    assert describe(changed)[-1] == "swap the new set in as one directory (the old set stays complete until then)"


def test_swap_paths_sit_beside_dest():
    assert swap_paths("/opt/models/drafter") == (
        "/opt/models/.model_stage-swap-drafter",
        "/opt/models/.model_stage-swap-drafter.probe",
    )
    assert swap_paths("/opt/models/drafter/") == swap_paths("/opt/models/drafter")


MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:27 / /opt/models rw,relatime shared:9 - nfs4 srv:/models rw,vers=4.2
31 30 0:28 / /opt/models/fast\\040disk rw - xfs /dev/nvme0n1 rw
"""


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("/opt/models/drafter", ("/opt/models", "nfs4")),
        ("/opt/models", ("/opt/models", "nfs4")),
        ("/opt/models-old/x", ("/", "ext4")),
        ("/opt/models/fast disk/d", ("/opt/models/fast disk", "xfs")),
    ],
)
def test_mount_of(path, where):
    assert mount_of(path, MOUNTINFO) == where


def test_exchange_paths_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    exchange_paths(str(a), str(b))
    assert [p.name for p in a.iterdir()] == ["y"]
    assert [p.name for p in b.iterdir()] == ["x"]
    with pytest.raises(FileNotFoundError):
        exchange_paths(str(a), str(tmp_path / "missing"))


def test_check_exchange_refuses_a_filesystem_that_cannot_swap_and_leaves_nothing(tmp_path, fuse_dir):
    """A real filesystem without RENAME_EXCHANGE: the kernel's FUSE side answers EINVAL (fuse2fs, as NFS does)."""
    check_exchange(str(tmp_path / "drafter"))  # a filesystem that can, for contrast
    dest = fuse_dir / "drafter"
    dest.mkdir()
    with pytest.raises(StageError) as exc:
        check_exchange(str(dest))
    assert str(exc.value).startswith(
        f"{dest}: the fuse.ext4 filesystem mounted at {fuse_dir} cannot swap two directories in one step (renameat2"
        " RENAME_EXCHANGE: Invalid argument), so a set of several files cannot be replaced atomically there;"
        " nothing was replaced."
    )
    assert sorted(p.name for p in fuse_dir.iterdir()) == ["drafter", "lost+found"]


@pytest.mark.skipif(not os.path.ismount("/dev/shm"), reason="needs /dev/shm mounted on its own")
def test_check_exchange_refuses_a_mount_point():
    with pytest.raises(
        StageError, match=r"^/dev/shm is a mount point: .* set shared_settings_drafter_dir to a directory inside"
    ):
        check_exchange("/dev/shm")


def old_set(tmp_path):
    """A destination holding a shard set, its index, sidecar, config.json, a subdirectory and a symlink."""
    dest = tmp_path / "drafter"
    (dest / "extra").mkdir(parents=True)
    for name, text in [
        ("s1.safetensors", "old 1"),
        ("s2.safetensors", "old 2"),
        ("model.safetensors.index.json", "old index"),
        (".model_stage.json", "old sidecar"),
        ("config.json", '{"architectures": ["DFlashDraftModel"]}'),
        ("extra/notes.txt", "kept"),
    ]:
        (dest / name).write_text(text)
    (dest / "tokenizer.json").symlink_to("../target/tokenizer.json")
    temp = dest / ".model_stage-s2.safetensors.5-1.part"
    temp.write_text("new 2")
    new = NewSet(
        place={"s2.safetensors": str(temp)},
        write={"model.safetensors.index.json": ("new index", 0o640), ".model_stage.json": ("new sidecar", 0o644)},
    )
    return dest, new


def listing(dest):
    return {
        str(p.relative_to(dest)): (os.readlink(p) if p.is_symlink() else p.read_text())
        for p in sorted(dest.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


OLD = {
    ".model_stage-s2.safetensors.5-1.part": "new 2",
    ".model_stage.json": "old sidecar",
    "config.json": '{"architectures": ["DFlashDraftModel"]}',
    "extra/notes.txt": "kept",
    "model.safetensors.index.json": "old index",
    "s1.safetensors": "old 1",
    "s2.safetensors": "old 2",
    "tokenizer.json": "../target/tokenizer.json",
}
NEW = {
    ".model_stage.json": "new sidecar",
    "config.json": '{"architectures": ["DFlashDraftModel"]}',
    "extra/notes.txt": "kept",
    "model.safetensors.index.json": "new index",
    "s1.safetensors": "old 1",
    "s2.safetensors": "new 2",
    "tokenizer.json": "../target/tokenizer.json",
}


def test_replace_set_swaps_in_the_complete_new_set_and_keeps_everything_else(tmp_path):
    dest, new = old_set(tmp_path)
    config_inode = (dest / "config.json").stat().st_ino
    replace_set(str(dest), new, os.getuid(), os.getgid(), 0o750)
    assert listing(dest) == NEW
    assert (dest / "config.json").stat().st_ino == config_inode  # hard-linked, not copied
    assert oct((dest / "model.safetensors.index.json").stat().st_mode & 0o7777) == "0o640"
    assert oct(dest.stat().st_mode & 0o7777) == "0o750"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_replace_set_leaves_out_removed_names(tmp_path):
    dest, new = old_set(tmp_path)
    new.remove = {"s1.safetensors"}
    replace_set(str(dest), new, os.getuid(), os.getgid(), 0o750)
    assert "s1.safetensors" not in listing(dest)


def test_interrupted_before_the_swap_leaves_the_old_set_and_a_rerun_finishes(tmp_path):
    dest, new = old_set(tmp_path)
    staging = prepare_set(str(dest), new, os.getuid(), os.getgid(), 0o750)  # ... then the run dies
    assert listing(dest) == OLD
    assert leftovers(str(dest)) == [staging]
    replace_set(str(dest), new, os.getuid(), os.getgid(), 0o750)
    assert listing(dest) == NEW
    assert leftovers(str(dest)) == []


def test_interrupted_after_the_swap_leaves_the_new_set_and_a_rerun_cleans_up(tmp_path):
    dest, new = old_set(tmp_path)
    staging = prepare_set(str(dest), new, os.getuid(), os.getgid(), 0o750)
    swap_set(str(dest), staging)  # ... then the run dies before removing the old set
    assert listing(dest) == NEW
    assert listing(Path(staging)) == OLD
    assert leftovers(str(dest)) == [staging]
    for path in leftovers(str(dest)):
        remove_tree(path)
    assert listing(dest) == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_a_failure_while_building_the_set_leaves_the_old_set(tmp_path):
    dest, new = old_set(tmp_path)
    new.place["s3.safetensors"] = str(dest / "gone.part")
    with pytest.raises(FileNotFoundError):
        replace_set(str(dest), new, os.getuid(), os.getgid(), 0o750)
    assert listing(dest) == OLD


def test_a_filesystem_without_exchange_changes_nothing(fuse_dir):
    """replace_set on a real filesystem answering EINVAL to RENAME_EXCHANGE (fuse2fs): the old set stays whole."""
    dest, new = old_set(fuse_dir)
    with pytest.raises(StageError, match="cannot swap two directories in one step"):
        replace_set(str(dest), new, os.getuid(), os.getgid(), 0o750)
    assert listing(dest) == OLD
    assert sorted(p.name for p in fuse_dir.iterdir()) == ["drafter", "lost+found"]


def write_shards(where, second_rows=2):
    where.mkdir(exist_ok=True)
    write_real(where / "model-00001-of-00002.safetensors", {"a.weight": (4, 4)})
    write_real(where / "model-00002-of-00002.safetensors", {"b.weight": (second_rows,)})
    return [manifest(p, p.name) for p in sorted(where.iterdir())]


def stage(args, capsys):
    planned = call({**args, "step": "plan"}, capsys)
    assert planned.get("failed") is None, planned
    transfer(planned)
    return planned, call({**args, "step": "commit", "files": commit_files(planned)}, capsys)


def change_second_shard(shard_dir):
    """Shard 2 changes shape (so the generated index changes too); shard 1 keeps its bytes and mtime."""
    first = shard_dir / "model-00001-of-00002.safetensors"
    mtime = first.stat().st_mtime
    write_shards(shard_dir, second_rows=6)
    os.utime(first, (mtime, mtime))
    os.utime(shard_dir / "model-00002-of-00002.safetensors", (5, 5))
    return [manifest(p, p.name) for p in sorted(shard_dir.iterdir())]


def staged_shard_change(shard_dir, dest, capsys):
    """A staged two-shard set whose second shard then changes, planned and transferred but not
    committed: the commit's args, the plan and the digests of what dest held before."""
    stage({**base(shard_dir, dest), "files": write_shards(shard_dir)}, capsys)
    before = {n: sha(dest / n) for n in os.listdir(dest)}
    args = {**base(shard_dir, dest), "files": change_second_shard(shard_dir)}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    return args, planned, before


def staged_file_change(src, dest, capsys):
    """A staged single file that then changes (a new mtime), planned and transferred but not committed:
    the commit's args, the plan and the digest of the model.safetensors dest held before."""
    stage({**base(src, dest), "files": [manifest(src)]}, capsys)
    old = sha(dest / "model.safetensors")
    os.utime(src, (7, 7))
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    return args, planned, old


def test_a_changed_shard_set_is_swapped_in_whole_and_config_json_stays(tmp_path, capsys):
    shard_dir, dest = tmp_path / "shards", tmp_path / "dest"
    stage({**base(shard_dir, dest), "files": write_shards(shard_dir)}, capsys)
    (dest / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    args = {**base(shard_dir, dest), "files": change_second_shard(shard_dir)}
    planned, done = stage(args, capsys)
    assert [t["name"] for t in planned["transfers"]] == ["model-00002-of-00002.safetensors"]
    assert done["swapped"] is True
    assert sorted(os.listdir(dest)) == [
        ".model_stage.json",
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (dest / "config.json").read_text() == '{"architectures": ["DFlashDraftModel"]}'
    assert sha(dest / "model-00002-of-00002.safetensors") == sha(shard_dir / "model-00002-of-00002.safetensors")
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 44}  # 16 + 6 two-byte elements
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "shards"]
    again = call({**args, "step": "plan"}, capsys)
    assert (again["changed"], again["transfers"]) == (False, [])


def test_a_run_killed_between_building_and_swapping_is_finished_by_the_next(tmp_path, capsys, monkeypatch):
    shard_dir, dest = tmp_path / "shards", tmp_path / "dest"
    stage({**base(shard_dir, dest), "files": write_shards(shard_dir)}, capsys)
    before = {n: sha(dest / n) for n in os.listdir(dest)}
    args = {**base(shard_dir, dest), "files": change_second_shard(shard_dir)}

    def killed(dest, new, uid, gid, dir_mode):
        prepare_set(dest, new, uid, gid, dir_mode)
        raise KeyboardInterrupt  # stands for the process being killed here

    monkeypatch.setattr(safetensors_stage, "replace_set", killed)
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    with (
        pytest.raises(KeyboardInterrupt),
        patch_module_args({**args, "step": "commit", "files": commit_files(planned)}),
    ):
        safetensors_stage.main()
    assert {n: sha(dest / n) for n in os.listdir(dest) if not n.startswith(".model_stage-")} == before
    monkeypatch.undo()
    again = call({**args, "step": "plan"}, capsys)
    assert again["actions"][-1] == (
        f"remove {tmp_path / '.model_stage-swap-dest'} (left over from an interrupted replacement of the file set)"
    )
    assert [t["partial"] for t in again["transfers"]] == [t["size"] for t in again["transfers"]]
    transfer(again)
    done = call({**args, "step": "commit", "files": commit_files(again)}, capsys)
    assert done["swapped"] is True
    assert sha(dest / "model-00002-of-00002.safetensors") == sha(shard_dir / "model-00002-of-00002.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "shards"]


def test_a_plan_refuses_a_set_where_it_cannot_be_swapped_before_transferring(tmp_path, fuse_dir, capsys):
    """dest on a real filesystem without RENAME_EXCHANGE (fuse2fs, EINVAL): refused at the plan, nothing made."""
    shard_dir, dest = tmp_path / "shards", fuse_dir / "dest"
    args = {**base(shard_dir, dest), "files": write_shards(shard_dir)}
    out = call({**args, "step": "plan"}, capsys)
    assert out["failed"] is True
    assert "fuse.ext4 filesystem mounted at" in out["msg"]
    assert "cannot swap two directories in one step (renameat2 RENAME_EXCHANGE: Invalid argument)" in out["msg"]
    assert sorted(p.name for p in fuse_dir.iterdir()) == ["lost+found"]


def test_a_single_file_is_still_replaced_by_one_rename(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    _, first = stage({**base(src, dest), "files": [manifest(src)]}, capsys)
    os.utime(src, (7, 7))
    _, second = stage({**base(src, dest), "files": [manifest(src)]}, capsys)
    assert (first["swapped"], second["swapped"]) == (False, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "src"]


def test_a_waiting_run_locks_the_directory_swapped_in_meanwhile(tmp_path):
    dest, other = tmp_path / "dest", tmp_path / "new"
    dest.mkdir()
    other.mkdir()
    seen = []

    def second_run():
        with safetensors_stage._locked(str(dest)):
            fd = os.open(dest, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("not locked")
            except BlockingIOError:
                seen.append("locked")
            finally:
                os.close(fd)

    with safetensors_stage._locked(str(dest)):
        waiter = threading.Thread(target=second_run)
        waiter.start()
        time.sleep(0.3)  # the second run now waits on the directory that is about to be swapped out
        exchange_paths(str(other), str(dest))
    waiter.join(10)
    assert seen == ["locked"]


# ------------------------------------------------------------------ hostile destination (issue 23, items 1 and 4)


@pytest.fixture
def outside(tmp_path):
    """A root-owned file outside the destination that the service account would like to own."""
    path = tmp_path / "etc-sudoers.d-x"
    path.write_bytes(b"root ALL=(ALL) ALL\n")
    os.chmod(path, 0o600)
    return path


def untouched(path):
    st = path.stat()
    return path.read_bytes(), st.st_uid, st.st_gid, st.st_mode & 0o7777


def hostile(src, dest):
    return base(src, dest, owner="nobody", group=grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name)


def test_symlinks_planted_at_temp_and_final_names_are_never_written_through(src, tmp_path, capsys, outside):
    dest = tmp_path / "dest"
    args = {**hostile(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    before = untouched(outside)
    # The names the old code wrote through (a fixed temp name for the sidecar), and the final names.
    for name in (".model_stage-.model_stage.json.write.part", ".model_stage.json"):
        (dest / name).symlink_to(outside)
    transfer(planned)
    done = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert done["changed"] is True, done
    assert untouched(outside) == before
    assert not (dest / ".model_stage.json").is_symlink()
    side = json.loads((dest / ".model_stage.json").read_text())
    assert side["files"]["model.safetensors"]["sha256"] == sha(src)
    again = call({**args, "step": "plan"}, capsys)
    assert "remove .model_stage-.model_stage.json.write.part (not a regular file" in " ".join(again["actions"])
    assert not os.path.lexists(dest / ".model_stage-.model_stage.json.write.part")
    assert untouched(outside) == before


def test_a_symlink_at_the_transfer_temp_is_refused_and_its_target_keeps_its_owner(src, tmp_path, capsys, outside):
    dest = tmp_path / "dest"
    args = {**hostile(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    temp = Path(planned["transfers"][0]["temp"])
    before = untouched(outside)
    temp.symlink_to(outside)
    out = call({**args, "step": "commit", "files": commit_files(planned, {"model.safetensors": sha(src)})}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"model.safetensors: the transferred file {temp} is a symlink; it is read only as a regular file: remove"
        " the link and run again (nothing was replaced)"
    )
    assert untouched(outside) == before
    assert not os.path.lexists(dest / "model.safetensors")


def test_a_hard_link_at_the_transfer_temp_is_refused(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = {**hostile(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    temp = Path(planned["transfers"][0]["temp"])
    victim = tmp_path / "victim"
    shutil.copyfile(src, victim)
    os.link(victim, temp)
    out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert "has other hard links" in out["msg"]
    assert victim.stat().st_uid == os.getuid()


def test_plan_removes_a_fifo_or_symlink_planted_under_the_temp_prefix(src, tmp_path, capsys, outside):
    dest = tmp_path / "dest"
    dest.mkdir()
    os.mkfifo(dest / ".model_stage-fifo.part")
    (dest / ".model_stage-link").symlink_to(outside)
    out = call({**hostile(src, dest), "step": "plan", "files": [manifest(src)]}, capsys)
    assert out.get("failed") is None, out
    assert not os.path.lexists(dest / ".model_stage-fifo.part")
    assert not os.path.lexists(dest / ".model_stage-link")
    assert outside.exists()


def test_remote_copy_never_writes_through_a_symlink_at_its_temp(src, tmp_path, capsys, outside):
    dest = tmp_path / "dest"
    args = {**hostile(src, dest), "remote_src": True}
    planned = call({**args, "step": "plan"}, capsys)
    temp = Path(planned["transfers"][0]["temp"])
    before = untouched(outside)
    temp.symlink_to(outside)
    files = [{**t, "kind": "transfer"} for t in planned["transfers"]]
    copied = call({**args, "step": "copy", "files": files}, capsys)
    assert copied["digests"] == {"model.safetensors": sha(src)}
    assert untouched(outside) == before
    assert not temp.is_symlink()
    assert temp.stat().st_mode & 0o7777 == 0o600


def test_remote_copy_refuses_a_source_rewritten_during_the_copy(src, tmp_path, capsys, monkeypatch):
    dest = tmp_path / "dest"
    args = {**base(src, dest), "remote_src": True}
    planned = call({**args, "step": "plan"}, capsys)
    real_fsync = os.fsync

    def rewrite_then_fsync(fd):
        # The source is rewritten (same size, new inode) while the copy runs.
        data = src.read_bytes()
        src.unlink()
        src.write_bytes(data)
        os.utime(src, (planned["transfers"][0]["mtime"], planned["transfers"][0]["mtime"]))
        real_fsync(fd)

    monkeypatch.setattr(safetensors_stage.os, "fsync", rewrite_then_fsync)
    files = [{**t, "kind": "transfer"} for t in planned["transfers"]]
    out = call({**args, "step": "copy", "files": files}, capsys)
    monkeypatch.undo()
    assert out["failed"] is True
    assert out["msg"] == (
        f"{src} changed while it was copied (size, modification time or inode differ before and after); nothing"
        " was committed: run the play again once the source is complete"
    )
    assert not os.path.lexists(planned["transfers"][0]["temp"])
    assert not os.path.lexists(dest / "model.safetensors")


def test_follow_never_reads_through_a_link_or_a_fifo_at_the_temp(tmp_path, outside):
    link, fifo = tmp_path / "link.part", tmp_path / "fifo.part"
    link.symlink_to(outside)
    os.mkfifo(fifo)
    assert safetensors_stage._follow_one(str(link), outside.stat().st_size, 1.0) is None
    assert safetensors_stage._follow_one(str(fifo), 10, 1.0) is None


def _retarget(entry, **changes):
    return {**entry, **changes}


@pytest.mark.parametrize(
    ("step", "edit", "message"),
    [
        (
            "copy",
            lambda t, out: _retarget(t, temp=str(out)),
            "temp {out!r} is not this file's temporary name in {dest}",
        ),
        (
            "follow",
            lambda t, out: {"name": t["name"], "temp": str(out), "size": 1},
            "is not this file's temporary name",
        ),
        ("commit", lambda t, out: _retarget(t, name="../escaped"), "name '../escaped' is not a plain file name"),
        ("commit", lambda t, out: _retarget(t, kind="bogus"), "kind 'bogus' is none of transfer, keep, remove"),
        ("commit", lambda t, out: {"name": t["name"], "kind": "transfer"}, "lacks origin, temp, size, mtime, digest"),
        ("commit", lambda t, out: _retarget(t, size="-1"), "size '-1' is not a whole number >= 0"),
        ("commit", lambda t, out: _retarget(t, digest="x"), "digest is not a SHA-256 in hex"),
        ("plan", lambda t, out: _retarget(t, name="a/../../escaped"), "name 'a/../../escaped' is not a plain file"),
        # plan and follow take every entry as a transfer: a kind must not excuse one from the checks
        (
            "follow",
            lambda t, out: {"name": t["name"], "temp": str(out), "size": 1, "kind": "keep"},
            "is not this file's temporary name",
        ),
        ("plan", lambda t, out: _retarget(t, kind="keep", size="big"), "size 'big' is not a whole number >= 0"),
    ],
)
def test_a_files_list_that_points_outside_dest_or_is_malformed_is_refused(
    src, tmp_path, capsys, outside, step, edit, message
):
    """The node steps trusted the files list: a temp or name outside dest was written, unlinked or renamed
    there, and a malformed entry raised KeyError (issue 23: never a file written outside its destination)."""
    dest = tmp_path / "dest"
    args = {**hostile(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    entry = {**commit_files(planned)[0], "kind": "transfer"}
    before = untouched(outside)
    out = call({**args, "step": step, "files": [edit(entry, outside)]}, capsys)
    assert out["failed"] is True, out
    assert message.format(out=str(outside), dest=dest) in out["msg"]
    assert out["msg"].endswith(
        "files is what the safetensors_stage action sends its node steps: run the role or"
        " the action, not a step by hand"
    )
    assert untouched(outside) == before
    assert not os.path.lexists(tmp_path / "escaped")


def test_an_owner_or_group_with_a_nul_is_a_message(src, tmp_path, capsys):
    out = call({**base(src, tmp_path / "dest", owner="vllm\x00"), "step": "plan", "files": [manifest(src)]}, capsys)
    assert out["failed"] is True
    assert out["msg"] == "owner 'vllm\\x00' holds a NUL character, which no owner name can hold"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"dest": ""}, "dest is empty; give the path of the directory"),
        ({"src": "/a\x00b"}, "src holds a NUL character, which no path can hold; check model_stage_src"),
        (
            {"space_margin": -1},
            "space_margin is -1; it must be 0 or more bytes (a negative margin would turn the free-space check off)",
        ),
    ],
)
def test_settings_no_staging_can_work_with_are_refused_up_front(src, tmp_path, capsys, extra, message):
    out = call({**base(src, tmp_path / "dest"), "step": "plan", "files": [manifest(src)], **extra}, capsys)
    assert out["failed"] is True
    assert out["msg"] == message
    assert not (tmp_path / "dest").exists()


# ------------------------------------------------------------------ real full and immutable filesystems (issue 23)


def names(dest):
    return sorted(os.listdir(dest))


def test_a_node_local_copy_onto_a_full_disk_is_a_message_and_leaves_no_partial(src, tmpfs_dir, capsys):
    """A real tmpfs filled after the plan (another writer took the space): the copy's write gets ENOSPC."""
    dest = tmpfs_dir / "dest"
    args = base(src, dest, remote_src=True)
    planned = call({**args, "step": "plan"}, capsys)
    realfs.fill(tmpfs_dir)
    temp = planned["transfers"][0]["temp"]
    out = call({**args, "step": "copy", "files": [{**t, "kind": "transfer"} for t in planned["transfers"]]}, capsys)
    assert out["msg"] == (
        f"model.safetensors: copying {src} to {temp} failed (No space left on device); nothing was replaced and the"
        f" partial copy was removed: free space on the filesystem of {dest} and run again"
    )
    assert names(dest) == []


def test_a_full_disk_at_the_commit_names_what_was_placed_and_the_next_run_recovers(src, tmpfs_dir, capsys):
    """A real full tmpfs at the commit: the rename needs no space, the sidecar's write fails with ENOSPC."""
    dest = tmpfs_dir / "dest"
    args = {**base(src, dest), "files": [manifest(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    realfs.fill(tmpfs_dir)
    out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert out["msg"] == (
        f"{dest}: model.safetensors was put in place, verified, but finishing failed (No space left on device); the"
        f" next run checks the files again: free space on the filesystem of {dest} and run again"
    )
    assert names(dest) == ["model.safetensors"]
    assert sha(dest / "model.safetensors") == sha(src)
    (tmpfs_dir / realfs.FILLER).unlink()
    _, done = stage(args, capsys)  # no record of the placed file: it is transferred and verified again
    assert done.get("failed") is None, done
    assert names(dest) == [".model_stage.json", "model.safetensors"]
    assert sha(dest / "model.safetensors") == sha(src)


def test_a_full_disk_while_building_a_shard_set_leaves_the_old_set_and_nothing_beside_it(tmpfs_dir, capsys):
    """Regression: the half-built staging directory stayed beside dest after an ENOSPC (real tmpfs)."""
    shard_dir, dest = tmpfs_dir.parent / "shards", tmpfs_dir / "dest"
    args, planned, before = staged_shard_change(shard_dir, dest, capsys)
    realfs.fill(tmpfs_dir)
    out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    assert out["msg"] == (
        f"{dest}: building the new set of files beside it failed (No space left on device); nothing was replaced and"
        f" the transferred files were removed: free space on the filesystem of {dest} and run again"
    )
    assert {n: sha(dest / n) for n in os.listdir(dest)} == before
    assert sorted(os.listdir(tmpfs_dir)) == ["dest", realfs.FILLER]


def test_an_immutable_weights_file_is_not_replaced_and_is_named(src, ext4_dir, capsys):
    """A real chattr +i model.safetensors (ext4): the commit refuses before the rename, removing its temp."""
    dest = ext4_dir / "dest"
    args, planned, old = staged_file_change(src, dest, capsys)
    final = dest / "model.safetensors"
    with realfs.immutable(final):
        out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
        assert out["msg"] == (
            f"{final} is immutable (chattr +i); nothing was replaced and the transferred files were removed: if it"
            f" is meant to change, run chattr -i {final} and run the play again"
        )
        assert sha(final) == old
        assert names(dest) == [".model_stage.json", "model.safetensors"]


def test_an_immutable_shard_stops_the_set_swap_before_anything_moves(ext4_dir, capsys):
    """The directory swap would replace a chattr +i shard anyway and then fail to remove the old set: refused."""
    shard_dir, dest = ext4_dir / "shards", ext4_dir / "dest"
    args, planned, before = staged_shard_change(shard_dir, dest, capsys)
    locked = dest / "model-00002-of-00002.safetensors"
    with realfs.immutable(locked):
        out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
        assert out["msg"].startswith(f"{locked} is immutable (chattr +i); nothing was replaced")
        assert {n: sha(dest / n) for n in os.listdir(dest)} == before
        assert sorted(os.listdir(ext4_dir)) == ["dest", "lost+found", "shards"]
    _, done = stage(args, capsys)
    assert done["swapped"] is True


def test_an_immutable_unchanged_shard_cannot_be_carried_over_and_is_named(ext4_dir, capsys):
    """A kept chattr +i shard cannot be hard-linked into the new set (EPERM, real ext4): nothing changes."""
    shard_dir, dest = ext4_dir / "shards", ext4_dir / "dest"
    args, planned, before = staged_shard_change(shard_dir, dest, capsys)
    kept = dest / "model-00001-of-00002.safetensors"
    with realfs.immutable(kept):
        out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
        assert out["msg"] == (
            f"{dest}: building the new set of files beside it failed (Operation not permitted: {kept} is immutable"
            f" (chattr +i)); nothing was replaced and the transferred files were removed: if it is meant to change,"
            f" run chattr -i {kept} and run again"
        )
        assert {n: sha(dest / n) for n in os.listdir(dest)} == before
        assert sorted(os.listdir(ext4_dir)) == ["dest", "lost+found", "shards"]


def test_a_read_only_filesystem_at_the_commit_is_named_and_nothing_is_replaced(src, ext4_dir, capsys):
    """Regression: dest remounted read-only after the transfer (real ext4) failed in fchown with a message naming
    only dest ("dest: Read-only file system (dest)"). Now the temp is named, with the remedy; nothing changes."""
    dest = ext4_dir / "dest"
    args, planned, old = staged_file_change(src, dest, capsys)
    listed = names(dest)
    with realfs.read_only(ext4_dir):
        out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
        temp = planned["transfers"][0]["temp"]
        assert out["msg"] == (
            f"{temp}: setting its owner and mode failed (Read-only file system); nothing was replaced (the"
            f" transferred files stay for the next run): remount the filesystem of {dest} read-write and run again"
        )
        assert sha(dest / "model.safetensors") == old
        assert names(dest) == listed
    _, done = stage(args, capsys)
    assert done.get("failed") is None, done


def test_a_read_only_filesystem_while_swapping_a_shard_set_leaves_the_old_set(ext4_dir, capsys):
    """dest remounted read-only before a shard set is built beside it (real ext4, EROFS): the old set stays."""
    shard_dir, dest = ext4_dir.parent / "shards", ext4_dir / "dest"
    args, planned, before = staged_shard_change(shard_dir, dest, capsys)
    listed, held = sorted(os.listdir(ext4_dir)), {n: sha(dest / n) for n in os.listdir(dest)}
    assert {n: d for n, d in held.items() if not n.startswith(".model_stage-")} == before
    with realfs.read_only(ext4_dir):
        out = call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
        [temp] = [t["temp"] for t in planned["transfers"]]
        assert out["msg"] == (
            f"{temp}: setting its owner and mode failed (Read-only file system); nothing was replaced (the"
            f" transferred files stay for the next run): remount the filesystem of {dest} read-write and run again"
        )
        assert {n: sha(dest / n) for n in os.listdir(dest)} == held
        assert sorted(os.listdir(ext4_dir)) == listed
    _, done = stage(args, capsys)
    assert done["swapped"] is True


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to stage for another account")
def test_the_service_account_reads_dest_but_can_create_nothing_in_it(src, capsys, request):
    """Issue 23: an account that owns dest can plant a link at a temp name between the plan and
    rsync's write (rsync opens its temp by name, following links). dest is root's, with the
    account's group: it reads the weights and creates nothing."""
    base_dir = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's own tmp_path sits under a 0700 directory
    request.addfinalizer(lambda: shutil.rmtree(base_dir))
    base_dir.chmod(0o755)
    dest = base_dir / "dest"
    dest.mkdir()
    os.chown(dest, 65534, 65534)  # left owned by the account, as an earlier release of this module did
    args = {**base(src, dest), "owner": "nobody", "group": "nogroup", "files": [manifest(src)]}
    checked = call({**args, "step": "plan"}, capsys, check=True)
    assert checked["changed"] is True
    assert checked["actions"][0] == f"set owner root, group nogroup and mode 0750 of {dest}"
    assert dest.stat().st_uid == 65534  # --check changed nothing
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)
    call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    st, weights = dest.stat(), (dest / "model.safetensors").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 65534, 0o750)
    assert (weights.st_uid, weights.st_gid) == (65534, 65534)
    as_account = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    planted = subprocess.run(
        [*as_account, "ln", "-s", "/etc/passwd", str(dest / ".model_stage-x.part")], capture_output=True, text=True
    )
    assert planted.returncode != 0 and "Permission denied" in planted.stderr
    read = subprocess.run([*as_account, "head", "-c", "8", str(dest / "model.safetensors")], capture_output=True)
    assert read.returncode == 0 and len(read.stdout) == 8
    assert call({**args, "step": "plan"}, capsys)["changed"] is False


@pytest.mark.parametrize("mode", ["0770", "0757", "0775"])
def test_a_dest_mode_that_lets_others_create_entries_is_refused(src, tmp_path, capsys, mode):
    dest = tmp_path / "dest"
    out = call({**base(src, dest), "dir_mode": mode, "step": "plan", "files": [manifest(src)]}, capsys)
    assert out["failed"] is True
    assert out["msg"] == f"dir_mode {mode!r} lets the group or others create entries in dest; use 0750 or 0755"
    assert not dest.exists()
