"""The safetensors_stage action plugin's controller-side helpers: rsync quoting, the digest cache and rsync's
progress on a multi-GB transfer (shown instead of minutes of silence)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "action" / "safetensors_stage.py"


@pytest.fixture(scope="module")
def action():
    """The plugin, loaded when these tests run (loading it reads Ansible's configuration)."""
    spec = importlib.util.spec_from_file_location("safetensors_stage_action", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("ssh", "ssh"),
        ("UserKnownHostsFile=/var/lib/lab/known_hosts", "UserKnownHostsFile=/var/lib/lab/known_hosts"),
        ("IdentityFile=/home/op/my keys/id", "'IdentityFile=/home/op/my keys/id'"),
        ("ProxyCommand=ssh -W %h:%p 'jump'", "\"ProxyCommand=ssh -W %h:%p 'jump'\""),
        ("", "''"),
    ],
)
def test_rsync_quote(action, arg, quoted):
    assert action.rsync_quote(arg) == quoted


def test_digest_is_cached_by_size_mtime_and_inode(action, tmp_path):
    src = tmp_path / "d.safetensors"
    src.write_bytes(b"abc" * 1000)
    cache = tmp_path / "cache"
    first = action.cached_sha256(str(src), str(cache))
    assert first == hashlib.sha256(b"abc" * 1000).hexdigest()
    (entry,) = cache.glob("*.json")
    rec = json.loads(entry.read_text())
    # A cached digest is returned without reading the file again ...
    entry.write_text(json.dumps({**rec, "sha256": "f" * 64}))
    assert action.cached_sha256(str(src), str(cache)) == "f" * 64
    # ... until the file's mtime (or size, or inode) changes.
    os.utime(src, ns=(rec["mtime_ns"] + 1, rec["mtime_ns"] + 1))
    assert action.cached_sha256(str(src), str(cache)) == first
    src.write_bytes(b"xyz")
    assert action.cached_sha256(str(src), str(cache)) == hashlib.sha256(b"xyz").hexdigest()


DIGEST = "5020823fe0e40834133cbf04f57dc4d8db9a5c8f267dd8dcd2ac0d86e1877658"
SIDECAR = (
    '{"files": {"model.safetensors": {"mtime": 1796026301, "sha256": "' + DIGEST + '",'
    ' "size": 268435664, "source": "/w/a.safetensors"}}, "version": 1}'
)
LISTING = (
    "|4096|1796026849.9072278980|root|vllm|750|d\r\n"
    "model.safetensors|268435664|1796026301.1552340770|vllm|vllm|640|f\r\n"
    ".model_stage.json|247|1796026849.9011244160|vllm|vllm|644|f\r\n"
    "--model-stage-sidecar--\r\n" + SIDECAR + "\r\n"
)
SOURCES = [{"name": "model.safetensors", "origin": "/w/a.safetensors", "size": 268435664, "mtime": 1796026301}]
ARGS = {"owner": "vllm", "group": "vllm", "mode": "0640", "dir_mode": "0750"}


def test_quick_check_sees_an_unchanged_node(action):
    assert action.unchanged_on_node(LISTING, SOURCES, ARGS) == {
        "model.safetensors": {"mtime": 1796026301, "sha256": DIGEST, "size": 268435664, "source": "/w/a.safetensors"}
    }
    assert action.unchanged_on_node(LISTING, [{**SOURCES[0], "sha256": DIGEST}], ARGS) is not None


@pytest.mark.parametrize(
    ("listing", "sources", "args"),
    [
        (LISTING.replace("|1796026301.155", "|1796026302.155"), SOURCES, ARGS),  # mtime differs
        (LISTING.replace("|268435664|", "|268435000|"), SOURCES, ARGS),  # size differs
        (LISTING, SOURCES, {**ARGS, "owner": "root"}),  # owner drifted
        (LISTING, SOURCES, {**ARGS, "mode": "0644"}),  # mode drifted
        (LISTING, SOURCES, {**ARGS, "dir_mode": "0755"}),  # directory mode drifted
        (LISTING.replace("|root|vllm|750|d", "|vllm|vllm|750|d"), SOURCES, ARGS),  # the service account owns dest
        (LISTING, [{**SOURCES[0], "sha256": "0" * 64}], ARGS),  # the inventory expects another digest
        (LISTING.replace(".model_stage.json|", ".model_stage-x.1-1.part|"), SOURCES, ARGS),  # a stale temp
        (LISTING.replace("model.safetensors|", "model-00001.safetensors|x|"), SOURCES, ARGS),  # unparsable
        (LISTING.split("--model-stage-sidecar--")[0], SOURCES, ARGS),  # no sidecar
        (LISTING.replace(DIGEST, "nope"), [{**SOURCES[0], "sha256": DIGEST}], ARGS),
        ("", SOURCES, ARGS),
        (LISTING.replace("|1796026301.155", "|1e400"), SOURCES, ARGS),  # an mtime no int holds
        (LISTING.replace("|1796026301.155", "|nan"), SOURCES, ARGS),
    ],
)
def test_quick_check_leaves_everything_else_to_the_node(action, listing, sources, args):
    assert action.unchanged_on_node(listing, sources, args) is None


@pytest.mark.parametrize("leftover", [None, ".model_stage-swap-drafter", ".model_stage-swap-drafter.probe"])
def test_quick_check_command_fails_while_a_staging_directory_is_left_over(action, tmp_path, leftover):
    dest = tmp_path / "drafter"
    dest.mkdir()
    (dest / ".model_stage.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(dest)
    if leftover:
        (tmp_path / leftover).mkdir()
    for path in (dest, link):  # a symlinked destination: the staging directory sits beside its target
        res = subprocess.run(
            ["sh", "-c", action.quick_check_command(str(path) + "/")], capture_output=True, text=True, check=False
        )
        if leftover:
            assert (res.returncode, res.stdout) == (1, "")
        else:
            assert res.returncode == 0
            assert res.stdout.endswith("--model-stage-sidecar--\n{}")


@pytest.mark.parametrize("kind", ["zero", "fifo"])
def test_quick_check_never_reads_a_sidecar_that_is_not_a_regular_file(action, tmp_path, kind):
    """A sidecar symlinked to /dev/zero took the controller to its memory cap; a FIFO hung (issue 23, item 5)."""
    dest = tmp_path / "drafter"
    dest.mkdir()
    if kind == "zero":
        (dest / ".model_stage.json").symlink_to("/dev/zero")
    else:
        os.mkfifo(dest / ".model_stage.json")
    res = subprocess.run(
        ["sh", "-c", action.quick_check_command(str(dest))], capture_output=True, text=True, check=False, timeout=20
    )
    assert res.returncode == 1
    assert res.stdout.endswith("--model-stage-sidecar--\n")


def test_quick_check_refuses_an_oversized_or_deeply_nested_sidecar(action):
    big = LISTING.split("--model-stage-sidecar--")[0] + "--model-stage-sidecar--\n" + " " * (64 * 1024 * 1024 + 1)
    assert action.unchanged_on_node(big, SOURCES, ARGS) is None
    deep = LISTING.replace(SIDECAR, "[" * 100000 + "]" * 100000)
    assert action.unchanged_on_node(deep, SOURCES, ARGS) is None


# --------------------------------------------------------------------------- rsync's progress
@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("    130,285,568  43%   58.62MB/s    0:00:02  ", (130285568, 43, "58.62MB/s", "0:00:02")),
        ("         32,768   0%    0.00kB/s    0:00:00", (32768, 0, "0.00kB/s", "0:00:00")),
        ("  3,543,210,112 100%  112.40MB/s    0:00:30 (xfr#1, to-chk=0/1)", (3543210112, 100, "112.40MB/s", "0:00:30")),
        ("sending incremental file list", None),
        ("", None),
    ],
)
def test_rsync_progress_lines_are_read(action, line, parsed):
    assert action.rsync_progress(line) == parsed


def test_the_progress_message_says_bytes_rate_and_time_left(action):
    assert action.progress_message(
        "qwen-ct101", "model.safetensors", 1610612736, 3543210112, 48, "112.40MB/s", "0:00:16"
    ) == ("qwen-ct101: staging model.safetensors: 1.5 of 3.3 GiB (48%), 112.40MB/s, 0:00:16 left")


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_a_slow_transfer_reports_progress_at_the_interval_and_a_failure_its_stderr(action, tmp_path):
    src = tmp_path / "d.safetensors"
    src.write_bytes(b"\0" * (24 * 1024 * 1024))
    seen = []
    # 24 MiB at 8 MiB/s: about 3 s, reported at most every second.
    rc, err = action.run_rsync(
        ["rsync", "--bwlimit=8192", str(src), str(tmp_path / "out")], lambda *p: seen.append(p), every_s=1
    )
    assert (rc, err) == (0, "")
    assert 1 <= len(seen) <= 4
    assert all(isinstance(done, int) and 0 <= pct <= 100 and rate.endswith("/s") for done, pct, rate, _ in seen)
    assert (tmp_path / "out").read_bytes() == src.read_bytes()

    rc, err = action.run_rsync(["rsync", str(tmp_path / "missing"), str(tmp_path / "x")], seen.append)
    assert rc == 23
    assert 'link_stat "' + str(tmp_path / "missing") + '" failed: No such file or directory' in err
