"""Every module's DOCUMENTATION, EXAMPLES and RETURN are valid YAML and document its argument spec.

ansible-doc shows nothing for a module whose DOCUMENTATION does not parse (a plain scalar holding
': ' is enough), so this parses each the way it does and compares the options with the argument
spec the module really builds.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "library"
MODULES = sorted(p.stem for p in LIBRARY.glob("*.py"))


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


def test_every_module_is_covered() -> None:
    assert len(MODULES) >= 11, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_documentation_parses_and_matches_the_argument_spec(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(name)
    doc = yaml.safe_load(module.DOCUMENTATION)
    assert doc["module"] == name
    assert yaml.safe_load(module.EXAMPLES)
    returned = yaml.safe_load(module.RETURN)
    assert returned is None or isinstance(returned, dict)
    spec, kwargs = _argument_spec(name, monkeypatch)
    options = doc.get("options") or {}
    assert set(options) == set(spec) | _action_only_options(name, spec)
    for option, want in spec.items():
        got = options[option]
        assert got.get("type", "str") == want.get("type", "str"), option
        assert got.get("default") == want.get("default"), option
        assert bool(got.get("required")) == bool(want.get("required")), option
        assert got.get("elements") == want.get("elements"), option
        assert got.get("choices") == want.get("choices"), option
        assert got.get("description"), option
    check_mode = doc["attributes"]["check_mode"]["support"]
    assert (check_mode != "none") == bool(kwargs.get("supports_check_mode")), check_mode
