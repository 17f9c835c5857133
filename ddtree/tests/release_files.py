"""The real vLLM 0.20.1 wheel's files, pristine and with the ddtree change set applied.

The wheel is downloaded once into /var/cache/dflash-lab/wheels (outside the repository) with
``pip download --no-deps vllm==0.20.1``; only the files asked for are read from it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from ddtree import HOME, repo

cs = repo.module_util("vllm_changeset")  # what vllm_patch applies on a node

CHANGESET_ROOT = str(HOME)
WHEEL_DIR = Path(os.environ.get("DFLASH_LAB_WHEELS", "/var/cache/dflash-lab/wheels"))


def wheel(version: str = "0.20.1") -> Path:
    found = sorted(WHEEL_DIR.glob(f"vllm-{version}-*.whl"))
    if not found:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", f"vllm=={version}", "-d", str(WHEEL_DIR)],
            check=True,
        )
        found = sorted(WHEEL_DIR.glob(f"vllm-{version}-*.whl"))
    return found[0]


def pristine(paths: list[str]) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel()) as whl:
        return {p: whl.read(p) for p in paths}


def patched(paths: list[str]) -> dict[str, bytes]:
    """The files as the change set leaves them, computed with the project's own change-set engine."""
    changeset = cs.load_changeset(CHANGESET_ROOT, "0.20.1", "ddtree")
    changes = {c.path: c for c in changeset.files}
    out = {}
    for path, data in pristine(paths).items():
        change = changes[path]
        assert change.hunks is not None
        out[path] = cs.apply_hunks(data.decode("utf-8"), change.hunks).encode("utf-8")
        assert cs.sha256_bytes(out[path]) == change.patched_sha256, path
    return out


def method(source: str, cls: str, name: str, namespace: dict[str, Any]):
    """One method of a class in a wheel file's source, compiled on its own: its module's imports
    are replaced by ``namespace`` (what the method uses)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    scope = dict(namespace)
                    exec(compile(ast.Module([item], []), f"{cls}.{name}", "exec"), scope)
                    return scope[name]
    raise AssertionError(f"{cls}.{name} is not in the wheel")


def function(source: str, name: str, namespace: dict[str, Any]):
    """One module-level function of a wheel file's source, compiled on its own like ``method``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            scope = dict(namespace)
            exec(compile(ast.Module([node], []), name, "exec"), scope)
            return scope[name]
    raise AssertionError(f"{name} is not in the file")
