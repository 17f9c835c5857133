"""No templated value in the roles' tasks and vars, the playbooks or site.yml is longer than 300 characters.

A Jinja expression that long is a decision or a long string living in YAML, where no test reaches it:
it belongs in a filter plugin or module_utils (typed, unit-tested), or split into named values so
the task reads as steps (issue 44 item 4). A value counts once YAML has read it (a folded scalar's
text) and only if it holds Jinja (``{{`` or ``{%``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LIMIT = 300


def yaml_files() -> list[Path]:
    globs = ["roles/*/tasks/**/*.yml", "roles/*/vars/**/*.yml", "playbooks/*.yml", "site.yml"]
    return sorted({p for g in globs for p in REPO.glob(g)})


def _step(key: object, value: object) -> str:
    """A list item that is a task or play goes by its name; anything else by its index or key."""
    return str(value["name"]) if isinstance(value, dict) and isinstance(value.get("name"), str) else str(key)


def _walk(node: object, where: list[str]) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            inner = key in ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers")
            yield from _walk(value, where if inner else [*where, str(key)])
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, [*where, _step(index, value)])
    elif isinstance(node, str) and ("{{" in node or "{%" in node):
        yield " > ".join(where), node


def long_values() -> dict[str, int]:
    found = {}
    for path in yaml_files():
        for where, value in _walk(yaml.safe_load(path.read_text()), []):
            if len(value) > LIMIT:
                found[f"{path.relative_to(REPO)}: {where}"] = len(value)
    return found


def test_no_templated_value_is_longer_than_300_characters() -> None:
    offenders = long_values()
    assert not offenders, (
        "templated values over 300 characters (move them into a filter plugin or split them):\n"
        + "\n".join(f"  {where}: {n} characters" for where, n in sorted(offenders.items()))
    )


def test_the_scan_finds_a_long_value(tmp_path: Path) -> None:
    task = [{"name": "A step", "ansible.builtin.debug": {"msg": "{{ x }}" + "y" * 300}}]
    assert list(_walk(task, [])) == [("A step > ansible.builtin.debug > msg", "{{ x }}" + "y" * 300)]
    play = [
        {"name": "P", "hosts": "all", "tasks": [{"name": "T", "block": [{"name": "B", "vars": {"v": "{% if %}"}}]}]}
    ]
    assert [w for w, _ in _walk(play, [])] == ["P > T > B > vars > v"]
