"""The example production inventory passes site.yml's inventory validation, vault included."""

import json
import os
import subprocess
import sys
from pathlib import Path

from playbook_run import ansible_playbook

REPO = Path(__file__).resolve().parents[2]


def validate(inventory: Path, reports: Path, *extra: str) -> subprocess.CompletedProcess:
    return ansible_playbook(
        inventory, *extra, REPO / "playbooks/validate_inventory.yml", DFLASH_REPORT_DIR=str(reports)
    )


def inventory(tmp_path: Path, hosts_yml: str) -> Path:
    """An inventory directory holding hosts.yml."""
    inv = tmp_path / "inv"
    inv.mkdir()
    (inv / "hosts.yml").write_text(hosts_yml)
    return inv


def test_the_example_production_inventory_is_valid(tmp_path: Path) -> None:
    prod = REPO / "inventory/production"
    res = validate(prod, tmp_path / "reports", "--vault-password-file", str(prod / "vault-password.example"))
    assert res.returncode == 0, res.stdout[-3000:]
    for host in ("qwen-ct101", "qwen-ct201", "qwen-ct202"):
        assert f"{host}" in res.stdout


def test_a_typo_in_a_copy_of_it_is_caught(tmp_path: Path) -> None:
    inv = inventory(
        tmp_path,
        "all:\n  children:\n    gpu_nodes:\n      hosts:\n        ct1:\n          ansible_host: 192.0.2.1\n"
        "          gpu_check_gpu_cuont: 2\n          gpu_check_enforce: 'yes'\n",
    )
    res = validate(inv, tmp_path / "reports")
    assert res.returncode != 0
    assert "ct1: gpu_check_gpu_cuont is not a variable of any role. Did you mean gpu_check_gpu_count?" in res.stdout
    assert "ct1: gpu_check_enforce is the string 'yes'; write true without quotes so it is a boolean." in res.stdout


def test_a_template_that_cannot_render_is_caught_but_an_undefined_name_is_left_to_the_role(tmp_path: Path) -> None:
    """Issue 23, LOW: templates that failed to render passed validation."""
    inv = inventory(
        tmp_path,
        "all:\n  children:\n    gpu_nodes:\n      hosts:\n        ct1:\n          ansible_host: 192.0.2.1\n"
        "          gpu_check_gpu_count: '{{ 1 +* 2 }}'\n          gpu_check_enforce: '{{ a_role_default }}'\n",
    )
    res = validate(inv, tmp_path / "reports")
    assert res.returncode != 0
    assert (
        "ct1: gpu_check_gpu_count is a template that cannot be rendered (Syntax error in template: unexpected '*');"
        " fix it (its Jinja, or the vault password)."
    ) in res.stdout
    assert "gpu_check_enforce" not in res.stdout.split("fatal:")[1].split("PLAY RECAP")[0]


def test_only_the_listed_hosts_are_hosts() -> None:
    # A directory inventory reads every file in it; the example vault password file must not
    # become a host named after the password (ansible.cfg's inventory_ignore_extensions).
    prod = REPO / "inventory/production"
    res = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-inventory"),
            "-i",
            str(prod),
            "--vault-password-file",
            str(prod / "vault-password.example"),
            "--list",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg")),
    )
    assert res.returncode == 0, res.stderr
    hosts = sorted(json.loads(res.stdout)["_meta"]["hostvars"])
    assert hosts == ["pve-a6000", "pve-blackwell", "qwen-ct101", "qwen-ct201", "qwen-ct202"]


def test_what_it_stages_from_the_controller_and_the_reports_are_never_committed() -> None:
    # The example inventory stages {{ playbook_dir }}/../models/... and .../wheelhouse/vllm-0.20.1
    # (GBs of weights and wheels) from the repository root; reports are written there too.
    paths = [
        "models/dflash-q36-27b.safetensors",
        "wheelhouse/vllm-0.20.1/vllm-0.20.1-cp38-abi3-manylinux1_x86_64.whl",
        "reports/site-20261201T120000Z.json",
        "reports/bench/qwen-ct101/baseline.json",
    ]
    res = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    assert res.stdout.split() == paths, res.stderr
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    leaked = [p for p in tracked.split() if Path(p).name.startswith(("site-", "validate_inventory-", "bench-"))]
    assert leaked == []


def test_a_batch_size_set_differently_per_gpu_class_is_refused(tmp_path: Path) -> None:
    """serial is a play keyword taken from the play's first node: per-class values would silently be one."""
    inv = inventory(
        tmp_path,
        "all:\n  children:\n    gpu_nodes:\n      children:\n"
        "        a6000:\n          vars: {rollout_serial: [1, 2]}\n          hosts: {ct1: {ansible_host: 192.0.2.1}}\n"
        "        blackwell:\n          hosts: {ct2: {ansible_host: 192.0.2.2}, ct3: {ansible_host: 192.0.2.3}}\n",
    )
    res = validate(inv, tmp_path / "reports")
    assert res.returncode != 0
    assert (
        "rollout_serial differs between the nodes ([1, 2] on ct1; [1, '25%'] on ct2, ct3); a play takes one value"
        " for all of them: set it once, in group_vars/all or with -e."
    ) in res.stdout
    # One value from the command line holds for every node.
    assert validate(inv, tmp_path / "reports", "-e", '{"rollout_serial": [2]}').returncode == 0
