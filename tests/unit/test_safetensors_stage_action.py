"""The safetensors_stage action plugin's controller-side helpers: rsync quoting and the digest cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
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
