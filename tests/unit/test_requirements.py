"""requirements.txt is what an operator's controller installs; requirements-test.txt adds the test tools.

Both are fully pinned, nothing is pinned twice, the runtime file holds no test or GPU tooling, and
every dependency (per the installed packages' metadata) of a runtime package is in the runtime file,
so `pip install -r requirements.txt` alone gives a controller that runs site.yml and bench.yml.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(name: str) -> list[str]:
    return [
        line.strip() for line in (REPO / name).read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in _lines(name):
        if line.startswith("-r "):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{name}: {line} is not pinned with =="
        pins[_norm(req.name)] = spec.version
    return pins


def test_the_test_file_starts_with_the_runtime_file() -> None:
    assert _lines("requirements-test.txt")[0] == "-r requirements.txt"
    assert [line for line in _lines("requirements-test.txt") if line.startswith("-")] == ["-r requirements.txt"]
    assert not [line for line in _lines("requirements.txt") if line.startswith("-")]


def test_nothing_is_pinned_twice() -> None:
    assert set(_pins("requirements.txt")) & set(_pins("requirements-test.txt")) == set()


def test_the_runtime_holds_what_the_controller_runs_and_no_test_tooling() -> None:
    runtime = _pins("requirements.txt")
    for name in ("ansible-core", "jinja2", "pyyaml", "uv", "matplotlib"):
        assert name in runtime, name
    for name in ("torch", "triton", "pytest", "molecule", "ruff", "ansible-lint", "yamllint", "safetensors"):
        assert name not in runtime, name
        assert name in _pins("requirements-test.txt"), name


def test_the_runtime_file_pins_its_transitive_dependencies() -> None:
    runtime = _pins("requirements.txt")
    missing = set()
    for name in runtime:
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:  # not installed here: nothing to read its dependencies from
            continue
        for line in requires:
            req = Requirement(line)
            applies = req.marker is None or req.marker.evaluate({"extra": ""})
            if applies and _norm(req.name) not in runtime:
                missing.add(f"{_norm(req.name)} (needed by {name})")
    assert not missing, sorted(missing)
