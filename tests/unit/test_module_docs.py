"""Every module's DOCUMENTATION, EXAMPLES and RETURN are valid YAML and document its argument spec.

ansible-doc shows nothing for a module whose DOCUMENTATION does not parse (a plain scalar holding
': ' is enough), so this reads every module's documentation through ansible-doc itself (the
repository's ansible.cfg, doc fragments from plugins/doc_fragments merged) and compares the
options with the argument spec the module really builds.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils.basic import FILE_COMMON_ARGUMENTS

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "library"
MODULES = sorted(p.stem for p in LIBRARY.glob("*.py"))


@pytest.fixture(scope="module")
def ansible_doc() -> dict[str, Any]:
    """What ``ansible-doc --json`` reads for every module (one run for all of them)."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
    run = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-doc")), "-t", "module", "--json", *MODULES],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _action_only_options(name: str, spec: dict[str, Any]) -> set[str]:
    """Options the same-named action plugin takes on the controller and never passes on (documented
    with the module, as Ansible does for copy's src): its _VALID_ARGS beyond the module's spec."""
    plugin = REPO / "plugins" / "action" / f"{name}.py"
    if not plugin.exists():
        return set()
    for node in ast.walk(ast.parse(plugin.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_VALID_ARGS" for t in node.targets):
            return set(ast.literal_eval(node.value.args[0])) - set(spec)
    return set()


class _Recorder:
    """Stands in for AnsibleModule: keeps the arguments build_module() passes, runs nothing."""

    def __init__(self, argument_spec: dict[str, Any], **kwargs: Any) -> None:
        self.argument_spec = argument_spec
        self.kwargs = kwargs


def _argument_spec(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], dict[str, Any]]:
    module = importlib.import_module(name)
    monkeypatch.setattr(module, "AnsibleModule", _Recorder)
    built = module.build_module()
    return built.argument_spec, built.kwargs


def _text(description: Any) -> bool:
    """A description is text or a list of texts ('- Read-only: ...' parses as a mapping instead)."""
    items = description if isinstance(description, list) else [description]
    return bool(items) and all(isinstance(item, str) and item for item in items)


def test_every_module_is_covered() -> None:
    assert len(MODULES) >= 11, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_documentation_parses_and_matches_the_argument_spec(
    name: str, ansible_doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert name in ansible_doc, f"ansible-doc cannot read {name}'s documentation"
    doc = ansible_doc[name]["doc"]
    assert doc["module"] == name
    assert yaml.safe_load(ansible_doc[name]["examples"])
    returned = ansible_doc[name]["return"]
    assert returned is None or isinstance(returned, dict)
    spec, kwargs = _argument_spec(name, monkeypatch)
    if kwargs.get("add_file_common_args"):  # AnsibleModule adds them; the files fragment documents them
        spec = {**spec, **FILE_COMMON_ARGUMENTS}
    options = doc.get("options") or {}
    assert set(options) == set(spec) | _action_only_options(name, spec)
    for option, want in spec.items():
        got = options[option]
        assert got.get("type", "str") == want.get("type", "str"), option
        assert got.get("default") == want.get("default"), option
        assert bool(got.get("required")) == bool(want.get("required")), option
        assert got.get("elements") == want.get("elements"), option
        assert got.get("choices") == want.get("choices"), option
        assert _text(got.get("description")), option
    assert _text(doc["description"]) and _text(doc["short_description"])
    check_mode = doc["attributes"]["check_mode"]["support"]
    assert (check_mode != "none") == bool(kwargs.get("supports_check_mode")), check_mode
