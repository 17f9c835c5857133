"""One report directory for every run's JSON report and bench.yml's results, found from the repository root."""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path

import pytest
from playbook_run import ansible_playbook
from rollout_report import report_dir

REPO = Path(__file__).resolve().parents[2]


def test_a_relative_setting_is_under_the_repository_root_and_an_absolute_one_is_kept() -> None:
    assert report_dir("reports", Path("/srv/dflash-deploy")) == Path("/srv/dflash-deploy/reports")
    assert report_dir("out/runs", Path("/srv/dflash-deploy")) == Path("/srv/dflash-deploy/out/runs")
    assert report_dir("/var/log/dflash", Path("/srv/dflash-deploy")) == Path("/var/log/dflash")


def test_the_default_is_reports_at_the_repository_root() -> None:
    # Expected literally: the checkout that holds plugins/callback/rollout_report.py.
    assert report_dir("reports") == REPO / "reports"
    assert "\n[rollout_report]\n" in (REPO / "ansible.cfg").read_text()


@pytest.fixture
def relative_reports():
    """A relative report setting of its own, under the repository's (ignored) reports/."""
    name = f"reports/.pytest-{uuid.uuid4().hex[:12]}"
    yield name
    shutil.rmtree(REPO / name, ignore_errors=True)


def test_rollout_and_bench_reports_land_in_one_place_whatever_the_current_directory(
    tmp_path: Path, relative_reports: str
) -> None:
    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    gpu_nodes:\n      hosts:\n        n1:\n          ansible_host: 127.0.0.1\n"
        f"          ansible_connection: local\n          ansible_python_interpreter: {sys.executable}\n"
    )
    # Run from elsewhere: neither the current directory nor the playbook's decides where reports go.
    res = ansible_playbook(
        "hosts.yml",
        REPO / "playbooks/bench.yml",
        "--tags",
        "report_dir",
        cwd=tmp_path,
        ANSIBLE_INJECT_FACT_VARS="False",
        DFLASH_REPORT_DIR=relative_reports,
        ANSIBLE_NOCOLOR="1",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    where = REPO / relative_reports
    assert f"bench results go to {where}/bench/<host>/" in res.stdout
    assert [p.name.split("-")[0] for p in where.glob("*.json")] == ["bench"]  # the rollout report of that run
    assert not list(tmp_path.rglob("*.json"))
    assert not (REPO / "playbooks" / relative_reports).exists()


def test_bench_report_dir_is_refused_with_what_replaces_it(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    gpu_nodes:\n      hosts:\n        n1:\n          ansible_host: 127.0.0.1\n"
        "          ansible_connection: local\n          bench_report_dir: /tmp/elsewhere\n"
    )
    res = ansible_playbook(
        "hosts.yml",
        REPO / "playbooks/validate_inventory.yml",
        cwd=tmp_path,
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
    )
    assert res.returncode == 2, res.stdout
    assert "n1: bench_report_dir is no longer used: bench results go under the one report directory" in res.stdout
