"""Conventions every role follows, read from the roles themselves (issue 25)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"
SHARED = "shared_settings"


def role_defaults() -> dict[str, dict]:
    return {
        path.parts[-3]: yaml.safe_load(path.read_text()) or {} for path in sorted(ROLES.glob("*/defaults/main.yml"))
    }


def test_no_variable_is_defined_in_two_roles_defaults() -> None:
    owners: dict[str, list[str]] = {}
    for role, defaults in role_defaults().items():
        for name in defaults:
            owners.setdefault(name, []).append(role)
    assert {name: roles for name, roles in owners.items() if len(roles) > 1} == {}


def test_a_role_s_defaults_carry_its_own_prefix_only() -> None:
    """A cross-role fact lives in shared_settings, under its prefix; no role defines another's name."""
    misplaced = {
        role: [name for name in defaults if not name.startswith(f"{role}_")]
        for role, defaults in role_defaults().items()
    }
    assert {role: names for role, names in misplaced.items() if names} == {}


def test_the_shared_settings_are_defaults_only_and_documented() -> None:
    assert sorted(p.name for p in (ROLES / SHARED).iterdir()) == ["defaults", "meta"]
    defaults = yaml.safe_load((ROLES / SHARED / "defaults/main.yml").read_text())
    spec = yaml.safe_load((ROLES / SHARED / "meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    assert sorted(options) == sorted(defaults)
    assert {name: opt.get("default") for name, opt in options.items()} == defaults


@pytest.mark.parametrize("role", sorted(p.parts[-2] for p in ROLES.glob("*/tasks")))
def test_a_role_that_reads_a_shared_setting_depends_on_shared_settings(role: str) -> None:
    text = "\n".join(p.read_text() for p in (ROLES / role).rglob("*.y*ml"))
    text += "\n".join(p.read_text() for p in (ROLES / role).rglob("*.j2"))
    meta = yaml.safe_load((ROLES / role / "meta/main.yml").read_text())
    deps = [d["role"] if isinstance(d, dict) else d for d in meta.get("dependencies") or []]
    if f"{SHARED}_" in text:
        assert SHARED in deps


# --- one tag and phase scheme: tags [<role>, <phase>] on each phase include, phases in order ----

PHASES = ("preflight", "install", "configure", "service", "verify")
TASK_ROLES = sorted(p.parts[-3] for p in ROLES.glob("*/tasks/main.yml") if p.parts[-3] != "vllm_account")


def phase_includes(role: str) -> list[dict]:
    tasks = yaml.safe_load((ROLES / role / "tasks/main.yml").read_text())
    # A role may wrap its phases in one block whose rescue records how it ended (service_swap_result).
    tasks = [t for task in tasks for t in task.get("block", [task])]
    return [t for t in tasks if {"ansible.builtin.import_tasks", "ansible.builtin.include_tasks"} & set(t)]


@pytest.mark.parametrize("role", TASK_ROLES)
def test_every_phase_include_is_tagged_with_the_role_and_its_phase(role: str) -> None:
    includes = phase_includes(role)
    assert includes
    for task in includes:
        role_tag, phase = task["tags"]
        assert role_tag == role and phase in PHASES, task["name"]
        applied = (task.get("ansible.builtin.include_tasks") or {}).get("apply", {}).get("tags")
        assert applied in (None, task["tags"]), task["name"]


@pytest.mark.parametrize("role", TASK_ROLES)
def test_the_phases_run_in_the_documented_order_starting_with_the_preflight(role: str) -> None:
    order = [PHASES.index(task["tags"][1]) for task in phase_includes(role)]
    assert order == sorted(order)
    assert order[0] == PHASES.index("preflight")


@pytest.mark.parametrize("role", sorted(p.parts[-3] for p in ROLES.glob("*/tasks/main.yml")))
def test_task_names_carry_no_role_or_phase_prefix(role: str) -> None:
    prefixed = []
    for path in sorted((ROLES / role / "tasks").glob("*.yml")):
        for line in path.read_text().splitlines():
            name = line.strip().removeprefix("- ").removeprefix("name: ") if "name: " in line else ""
            head = name.split(" | ")[0] if " | " in name else ""
            if head.lower() in (role, role.replace("_", " "), *PHASES):
                prefixed.append(f"{path.name}: {name}")
    assert prefixed == []
