"""Molecule's lab nodes are this clone's: two clones' scenarios never remove each other's containers.

tests/molecule/shared/vars/lab_name.yml names a scenario's lab "m", the six hex digits that
tests/lab/labctl.py puts in this clone's own lab name, "-" and the scenario's LAB_NAME.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(REPO.glob("tests/molecule/*/molecule.yml"))


def lab_names() -> dict[str, str]:
    return {p.parent.name: yaml.safe_load(p.read_text())["ansible"]["env"]["LAB_NAME"] for p in SCENARIOS}


def test_every_scenario_has_its_own_short_lab_name() -> None:
    names = lab_names()
    assert len(names) == len(SCENARIOS) >= 10
    assert len(set(names.values())) == len(names)
    # labctl.py takes at most 20 characters: "m" + 6 digits + "-" leaves 12.
    assert all(0 < len(n) <= 12 and n.replace("-", "").isalnum() for n in names.values()), names


def render_lab_name(project_dir: Path, lab: str) -> str:
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible"),
            "localhost",
            "-m",
            "ansible.builtin.debug",
            "-a",
            "var=molecule_lab_name",
            "-e",
            f"@{REPO}/tests/molecule/shared/vars/lab_name.yml",
        ],
        env={
            **os.environ,
            "MOLECULE_PROJECT_DIRECTORY": str(project_dir),
            "LAB_NAME": lab,
            "ANSIBLE_STDOUT_CALLBACK": "json",
        },
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    return json.loads(out.split("=>", 1)[1])["molecule_lab_name"]


def test_the_lab_name_carries_the_clones_hash_as_labctl_computes_it(tmp_path: Path) -> None:
    labctl = subprocess.run(
        [sys.executable, "-c", "import labctl; print(labctl.default_lab_name())"],
        cwd=REPO / "tests" / "lab",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert labctl.startswith("lab-")
    assert render_lab_name(REPO, "tune") == f"m{labctl.removeprefix('lab-')}-tune"
    # Another clone (here: a link to this one is the same clone, a different path is another).
    other = render_lab_name(tmp_path, "tune")
    assert other.startswith("m") and other.endswith("-tune") and other != f"m{labctl.removeprefix('lab-')}-tune"
    link = tmp_path / "link"
    link.symlink_to(REPO)
    assert render_lab_name(link, "tune") == render_lab_name(REPO, "tune")
