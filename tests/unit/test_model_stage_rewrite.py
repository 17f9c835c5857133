"""A same-size drafter rewritten within the same second is staged again (issue 43, LOW).

The quick check compared size and mtime in whole seconds: a retrained drafter of the same shapes,
written over the source within the second its previous copy was taken, was kept as "unchanged" on
every run. The mtime is now compared to the nanosecond (the record's, else the dest file's own),
in the plan, in the node module (controller source and node-local source) and in the controller's
quick check.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from ansible.module_utils.model_stage import DestFile, SourceFile, plan_stage
from safetensors_files import write_real
from test_model_stage import base, call, commit_files, sha, transfer

SECOND = 1_796_026_301
NS = SECOND * 10**9


def source(ns: int | None) -> SourceFile:
    return SourceFile("model.safetensors", "/w/a.safetensors", 4096, SECOND, mtime_ns=ns)


def dest(ns: int | None) -> dict[str, DestFile]:
    return {"model.safetensors": DestFile(4096, SECOND, 0, 0, 0o640, ns)}


def record(ns: int | None) -> dict:
    rec = {"size": 4096, "mtime": SECOND, "sha256": "a" * 64, "source": "/w/a.safetensors"}
    if ns is not None:
        rec["mtime_ns"] = ns
    return {"model.safetensors": rec}


@pytest.mark.parametrize(
    ("src_ns", "dest_ns", "rec_ns", "action"),
    [
        (NS + 155, NS + 155, NS + 155, "keep"),  # unchanged
        (NS + 900_000_000, NS + 155, NS + 155, "transfer"),  # rewritten 0.9 s later, same second
        (NS + 900_000_000, NS + 900_000_000, NS + 155, "transfer"),  # even if someone touched dest to match
        (NS + 155, NS, NS + 155, "keep"),  # a dest filesystem keeping whole seconds: the record decides
        (NS + 155, NS + 155, None, "keep"),  # an older record: dest's own time to the ns, as the copy set it
        (NS + 155, NS, None, "transfer"),  # an older record and a time that cannot tell: staged once more
        (None, NS + 7, NS + 155, "keep"),  # a source time known in seconds only: compared as before
    ],
)
def test_the_plan_compares_modification_times_to_the_nanosecond(src_ns, dest_ns, rec_ns, action) -> None:
    plan = plan_stage([source(src_ns)], dest(dest_ns), record(rec_ns), {}, False)
    assert plan.files[0].action == action
    if action == "transfer":
        assert plan.files[0].reason == "modification time differs within the second (the source was rewritten)"


def rewrite_same_size_same_second(path: Path) -> None:
    """New tensor bytes, the same size, and an mtime in the same whole second as before."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    second = st.st_mtime_ns // 10**9 * 10**9
    other = second + (st.st_mtime_ns - second + 500_000_000) % 10**9
    os.utime(path, ns=(other, other))
    assert path.stat().st_size == st.st_size and int(path.stat().st_mtime) == int(st.st_mtime)


def manifest_ns(path: Path) -> dict:
    st = path.stat()
    return {
        "name": "model.safetensors",
        "origin": str(path),
        "size": st.st_size,
        "mtime": int(st.st_mtime),
        "mtime_ns": st.st_mtime_ns,
        "sha256": None,
    }


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src" / "dflash-q36-27b.safetensors"
    path.parent.mkdir()
    write_real(path, {"fc.weight": (8, 16), "norm.weight": (8,)})
    os.utime(path, ns=(NS + 123_456_789, NS + 123_456_789))
    return path


def test_a_controller_source_rewritten_within_the_second_is_transferred_again(src, tmp_path, capsys) -> None:
    dest_dir = tmp_path / "dest"
    args = {**base(src, dest_dir), "files": [manifest_ns(src)]}
    planned = call({**args, "step": "plan"}, capsys)
    transfer(planned)  # rsync --times: the source's bytes and mtime (here the seconds; the record keeps the ns)
    call({**args, "step": "commit", "files": commit_files(planned)}, capsys)
    side = json.loads((dest_dir / ".model_stage.json").read_text())
    assert side["files"]["model.safetensors"]["mtime_ns"] == NS + 123_456_789
    assert call({**args, "step": "plan"}, capsys)["keep"] == ["model.safetensors"]

    rewrite_same_size_same_second(src)
    args = {**base(src, dest_dir), "files": [manifest_ns(src)]}
    again = call({**args, "step": "plan"}, capsys)
    assert [t["name"] for t in again["transfers"]] == ["model.safetensors"], again
    transfer(again)
    call({**args, "step": "commit", "files": commit_files(again)}, capsys)
    assert sha(dest_dir / "model.safetensors") == sha(src)


def test_a_node_local_source_rewritten_within_the_second_is_copied_again(src, tmp_path, capsys) -> None:
    dest_dir = tmp_path / "dest"
    args = base(src, dest_dir, remote_src=True)

    def stage() -> dict:
        planned = call({**args, "step": "plan"}, capsys)
        if planned["transfers"]:
            files = [{**t, "kind": "transfer"} for t in planned["transfers"]]
            copied = call({**args, "step": "copy", "files": files}, capsys)
            call({**args, "step": "commit", "files": commit_files(planned, copied["digests"])}, capsys)
        return planned

    assert stage()["transfers"]
    assert (dest_dir / "model.safetensors").stat().st_mtime_ns == src.stat().st_mtime_ns  # copied to the ns
    assert stage()["transfers"] == []
    rewrite_same_size_same_second(src)
    assert [t["name"] for t in stage()["transfers"]] == ["model.safetensors"]
    assert sha(dest_dir / "model.safetensors") == sha(src)


def test_the_controller_s_quick_check_sees_a_rewrite_within_the_second() -> None:
    plugin = Path(__file__).resolve().parents[2] / "plugins" / "action" / "safetensors_stage.py"
    spec = importlib.util.spec_from_file_location("safetensors_stage_action_ns", plugin)
    action = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(action)
    digest = "5020823fe0e40834133cbf04f57dc4d8db9a5c8f267dd8dcd2ac0d86e1877658"
    sidecar = json.dumps(
        {"version": 1, "files": {"model.safetensors": {"mtime": SECOND, "sha256": digest, "size": 268435664}}}
    )
    listing = (
        "|4096|1796026849.9072278980|root|vllm|750|d\n"
        "model.safetensors|268435664|1796026301.1552340770|vllm|vllm|640|f\n"
        "--model-stage-sidecar--\n" + sidecar + "\n"
    )
    args = {"owner": "vllm", "group": "vllm", "mode": "0640", "dir_mode": "0750"}
    same = {
        "name": "model.safetensors",
        "origin": "/w/a",
        "size": 268435664,
        "mtime": SECOND,
        "mtime_ns": NS + 155234077,
    }
    assert action.unchanged_on_node(listing, [same], args) is not None
    assert action.unchanged_on_node(listing, [{**same, "mtime_ns": NS + 955234077}], args) is None
    assert action.mtime_ns_of("1796026301.1552340770") == NS + 155234077
    assert action.mtime_ns_of("1796026301") == NS
    for bad in ("1e400", "nan", "-1.5", "1796026301.12a", ""):
        assert action.mtime_ns_of(bad) is None
