"""An inventory value is measured with bounded work before any text is built from it (issue 43, class 5).

A YAML alias bomb of ten lines (nine references per level, nine levels: 9**9 elements) given to a
typed variable hung validate_inventory: the check built the value's whole repr before cutting it to
60 characters (not finished after 300 s). Now it is refused in well under a second, unit by unit and
through ansible-playbook on the real inventory path.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.bounded_value import MAX_ELEMENTS, bounded_repr, measure
from inventory_checks import inventory_problems, rollout_problems, shown
from playbook_run import ansible_playbook

REPO = Path(__file__).resolve().parents[2]
ROLES = str(REPO / "roles")


def bomb_lines(name: str, levels: int = 9) -> str:
    """Ten lines of YAML: ``name`` is a list of 9**levels strings, through aliases."""
    lines = ['_l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels - 1):
        lines.append(f"_l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    lines.append(f"{name}: [{', '.join([f'*l{levels - 2}'] * 9)}]")
    return "\n".join(lines) + "\n"


def bomb(levels: int = 9) -> list:
    return yaml.safe_load(bomb_lines("v", levels))["v"]


def test_a_bomb_is_measured_with_bounded_work(deadline) -> None:
    with deadline(2):
        size = measure(bomb())
    assert size.too_large and size.refused and size.elements <= MAX_ELEMENTS + 9
    assert not measure(["a"] * 100).refused
    deep: list = []
    for _ in range(40):
        deep = [deep]
    assert measure(deep).too_deep


def test_a_bomb_is_shown_without_being_walked(deadline) -> None:
    with deadline(2):
        text = bounded_repr(bomb(), 60)
        shown_text = shown(bomb())
    assert text == "[[[[[[[[['lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol',..."  # nine levels, 60 characters
    assert shown_text == text
    assert len(bounded_repr({"k" * 500: ["v" * 500]}, 60)) == 60


@pytest.mark.parametrize(
    "value",
    ["short", 12, 1.5, True, None, [1, "a"], {"a": [1, 2]}, ("t",), "x" * 200, pytest.param(10**5000, id="huge-int")],
)
def test_small_values_show_as_their_repr_cut_to_60(value) -> None:
    text = bounded_repr(value, 60)
    if isinstance(value, int) and value > 10**100:
        assert text == "<int too long to show>"
    else:
        full = repr(list(value) if isinstance(value, tuple) else value)
        assert text == (full if len(full) <= 60 else full[:57] + "...")


@pytest.mark.parametrize(
    ("name", "kind"),
    [("service_swap_served_model_name", "str"), ("service_swap_extra_args", "list"), ("service_swap_api_key", "str")],
)
def test_a_bomb_in_a_typed_variable_is_refused_fast_whatever_its_type(name, kind, deadline) -> None:
    with deadline(2):
        problems = inventory_problems({name: bomb()}, "n1", ROLES)
    assert problems == [
        f"n1: {name} holds more than {MAX_ELEMENTS} elements (list), far more than any setting: a YAML alias"
        " that expands into itself many times over? Write the value out."
    ]


def test_a_bomb_in_a_rollout_setting_is_refused_fast(deadline) -> None:
    with deadline(2):
        problems = rollout_problems({"n1": {"rollout_serial": bomb()}, "n2": {}}, ["n1", "n2"], ROLES)
    assert problems[0].startswith(f"rollout_serial holds more than {MAX_ELEMENTS} elements (list)")
    assert problems[0].endswith("(on n1)")


def test_a_bomb_through_ansible_playbook_is_refused_in_seconds_naming_the_variable(tmp_path) -> None:
    """The real path: an inventory directory whose group_vars hold the ten lines, site.yml's first play."""
    inv = tmp_path / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        n1: {}\n")
    (inv / "group_vars" / "gpu_nodes.yml").write_text(bomb_lines("service_swap_served_model_name"))
    started = time.monotonic()
    res = ansible_playbook(
        inv, "playbooks/validate_inventory.yml", DFLASH_REPORT_DIR=str(tmp_path / "r"), ANSIBLE_NOCOLOR="1"
    )
    took = time.monotonic() - started
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "n1: service_swap_served_model_name holds more than 10000 elements (list)" in out, out
    assert took < 60, f"took {took:.0f} s"


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_number_setting_that_is_not_finite_is_refused(value) -> None:
    """YAML's .inf passed "service_swap_min_acceptance_length > 1.0", and every swap then failed its gate."""
    problems = inventory_problems({"service_swap_min_acceptance_length": value}, "n1", ROLES)
    assert problems == [f"n1: service_swap_min_acceptance_length is {value!r}; it must be a finite number."]
    assert inventory_problems({"service_swap_min_acceptance_length": 2.5}, "n1", ROLES) == []
