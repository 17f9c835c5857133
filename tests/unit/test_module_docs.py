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
    attributes = doc["attributes"]
    assert set(attributes) == {"check_mode", "diff_mode"}, attributes
    for attribute in attributes.values():  # the description from the fragment, the support from the module
        assert _text(attribute["description"]) and attribute["support"] in ("full", "partial", "none", "N/A")
    check_mode = attributes["check_mode"]["support"]
    assert (check_mode != "none") == bool(kwargs.get("supports_check_mode")), check_mode


def _documentation(name: str) -> tuple[ast.Module, dict[str, Any]]:
    tree = ast.parse((LIBRARY / f"{name}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DOCUMENTATION":
            return tree, yaml.safe_load(node.value.value)
    raise AssertionError(f"{name} has no DOCUMENTATION")


@pytest.mark.parametrize("name", MODULES)
def test_documentation_comes_before_the_imports(name: str) -> None:
    """As community.general lays a module out: docstring, __future__, DOCUMENTATION, EXAMPLES,
    RETURN, then the imports and the code."""
    tree, _ = _documentation(name)
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert isinstance(body[0], ast.ImportFrom) and body[0].module == "__future__"
    assert [getattr(node.targets[0], "id", None) for node in body[1:4]] == ["DOCUMENTATION", "EXAMPLES", "RETURN"]


@pytest.mark.parametrize("name", MODULES)
def test_attributes_are_described_by_the_fragment(name: str) -> None:
    """Each module gives its support; plugins/doc_fragments/attributes.py describes the attributes
    once (a read-only module takes both from attributes.read_only)."""
    _, raw = _documentation(name)
    fragments = raw.get("extends_documentation_fragment") or []
    assert "attributes" in fragments, fragments
    own = raw.get("attributes") or {}
    if "attributes.read_only" in fragments:
        assert own == {}, own
    else:
        assert set(own) == {"check_mode", "diff_mode"}, own
        assert all("description" not in attribute and "support" in attribute for attribute in own.values()), own
