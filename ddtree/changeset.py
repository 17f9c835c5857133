#!/usr/bin/env python3
"""Regenerate a vLLM change set's diffs and digests (maintainer tool, runs on the controller).

    python3 -m ddtree.changeset --version 0.20.1 \\
        --pristine /tmp/vllm-0.20.1-pristine --patched /tmp/vllm-0.20.1-patched

``--pristine`` is the unpacked release wheel (``unzip vllm-0.20.1-*.whl``), ``--patched`` the
same tree with the edits. For every ``patch`` entry of ``vllm-<version>/manifest.json`` the
diff is rewritten from the two trees and both digests are recorded; for every ``add`` entry
the digest of its source is recorded. Without ``--patched`` only the ``add`` digests are
refreshed (after editing an added file such as ``common/ddtree_tree.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree import HOME as ROOT
from ddtree import repo

# vllm_patch's own change-set engine: what it reads is what this writes.
cs = repo.module_util("vllm_changeset")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", required=True)
    parser.add_argument("--pristine", type=Path)
    parser.add_argument("--patched", type=Path)
    args = parser.parse_args()

    manifest_path = cs.changeset_dir(str(ROOT), args.version) / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    for entry in manifest["files"]:
        if entry["kind"] == "add":
            entry["patched_sha256"] = cs.sha256_bytes((ROOT / entry["source"]).read_bytes())
        elif args.patched is not None:
            if args.pristine is None:
                parser.error("--patched needs --pristine")
            pristine = (args.pristine / entry["path"]).read_bytes()
            patched = (args.patched / entry["path"]).read_bytes()
            (ROOT / entry["diff"]).parent.mkdir(parents=True, exist_ok=True)
            (ROOT / entry["diff"]).write_text(cs.make_unified_diff(entry["path"], pristine, patched), "utf-8")
            entry["pristine_sha256"] = cs.sha256_bytes(pristine)
            entry["patched_sha256"] = cs.sha256_bytes(patched)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    changeset = cs.load_changeset(str(ROOT), args.version, manifest["patchset"])
    print(f"{manifest_path}: {len(changeset.files)} files, manifest sha256 {changeset.manifest_sha256}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
