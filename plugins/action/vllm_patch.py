"""Action plugin (controller side) of vllm_patch: the change set travels as module arguments.

With ``changeset_src`` (a directory on the controller holding ``vllm-<version>/`` change sets) the
module runs once with every release's ``manifest.json`` text; it finds the installed vLLM, judges
every touched file by digest and, when nothing must change (the idempotent case), returns: one
module call, nothing copied. When a change is needed it fails, changing nothing, naming the diffs
and added files the change needs (``missing_sources``); this plugin then runs it a second time with
exactly those files, base64, read from ``changeset_src``. Only files a manifest names are ever sent.

With ``changeset_root`` (change sets already on the node) the module runs as it is.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

MODULE = "vllm_patch"
MANIFEST = "manifest.json"


def read_manifests(src: str) -> dict[str, str]:
    """``{release: manifest.json text}`` for every ``vllm-<release>/manifest.json`` under ``src``."""
    base = Path(src)
    if not base.is_dir():
        raise AnsibleActionFail(
            f"changeset_src {src} is not a directory on the controller; point it at the directory "
            "that holds vllm-<version>/manifest.json (the repository's ddtree/, the DDTree engine's home)."
        )
    out: dict[str, str] = {}
    for manifest in sorted(base.glob(f"vllm-*/{MANIFEST}")):
        out[manifest.parent.name[len("vllm-") :]] = manifest.read_text(encoding="utf-8")
    if not out:
        raise AnsibleActionFail(f"changeset_src {src} holds no vllm-<version>/{MANIFEST}: there is no change set.")
    return out


def named_sources(manifests: dict[str, str]) -> set[str]:
    """Every diff and added file the manifests name (what may be sent); unreadable manifests name none."""
    names: set[str] = set()
    for text in manifests.values():
        try:
            entries = json.loads(text).get("files", [])
        except (ValueError, AttributeError):
            continue
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict):
                for key in ("diff", "source"):
                    if isinstance(entry.get(key), str):
                        names.add(entry[key])
    return names


def read_sources(src: str, wanted: list[str], manifests: dict[str, str]) -> dict[str, str]:
    """The files the node asked for, base64; refuses any the manifests do not name or that leave ``src``."""
    allowed = named_sources(manifests)
    root = os.path.realpath(src)
    out: dict[str, str] = {}
    for name in wanted:
        path = os.path.realpath(os.path.join(root, name))
        if name not in allowed or not path.startswith(root + os.sep):
            raise AnsibleActionFail(
                f"vllm_patch on the node asked for {name!r}, which no change-set manifest under {src} names; "
                "nothing was sent and nothing was changed."
            )
        if not os.path.isfile(path):
            raise AnsibleActionFail(f"The change set is incomplete: {path} is missing on the controller.")
        with open(path, "rb") as handle:
            out[name] = base64.b64encode(handle.read()).decode("ascii")
    return out


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("venv", "state", "patchset", "changeset_root", "changeset_src"))

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        try:
            return self._run(dict(self._task.args), task_vars, result)
        finally:
            self._remove_tmp_path(self._connection._shell.tmpdir)

    def _run(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        src = args.pop("changeset_src", None)
        if src is None:
            result.update(self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars))
            return result
        if args.get("changeset_root") is not None:
            raise AnsibleActionFail("Give changeset_src (on the controller) or changeset_root (on the node), not both.")
        manifests = read_manifests(str(src))
        args["manifests"] = manifests
        res = self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars)
        sent: list[str] = []
        if res.get("failed") and isinstance(res.get("missing_sources"), list):
            sent = [str(n) for n in res["missing_sources"]]
            sources = read_sources(str(src), sent, manifests)
            res = self._execute_module(
                module_name=MODULE, module_args={**args, "sources": sources}, task_vars=task_vars
            )
        # The invocation echoes the arguments: keep the report readable (names, not file contents).
        invocation = res.get("invocation", {}).get("module_args")
        if isinstance(invocation, dict):
            invocation["manifests"] = sorted(manifests)
            invocation["sources"] = sent
        res["sources_sent"] = sent
        result.update(res)
        return result
