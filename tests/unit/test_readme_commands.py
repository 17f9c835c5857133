"""Every ansible / ansible-playbook command in README.md works when copied into a clone.

The commands are read out of the README's ``sh`` blocks, not restated here, so a command edited in
the README is the command tested. A real run needs the nodes, so each playbook command runs as
written plus ``--syntax-check`` (the playbook exists and parses, every option is one
ansible-playbook takes) with an inventory that does not parse made an error; commands that name an
inventory also have it loaded with the same -i and vault options as written (every group_vars and
host_vars file read, vault.yml decrypted) and each -l host found in it. Ad-hoc commands run as
written with ``--list-hosts``. The lab commands (no -i) are checked against the lab inventory
directory, which has no hosts until ``make lab``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def readme_commands(text: str) -> list[list[str]]:
    """The ansible commands of the ``sh`` blocks, as argument lists (comments dropped)."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and Path(words[0]).name in ("ansible", "ansible-playbook"):
                commands.append(words)
    return commands


COMMANDS = readme_commands((REPO / "README.md").read_text())


def run(words: list[str], *extra: str, strict_inventory: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_INJECT_FACT_VARS="False")
    if strict_inventory:
        env["ANSIBLE_INVENTORY_UNPARSED_FAILED"] = "True"
    exe = str(BIN / Path(words[0]).name)
    return subprocess.run([exe, *words[1:], *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def option_values(words: list[str], *names: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w in names]


def test_the_readme_has_the_operator_commands() -> None:
    # What the operator guide must show, so that the tests below cannot pass on an empty list.
    playbooks = sorted({w for c in COMMANDS for w in c if w.endswith(".yml")})
    assert playbooks == ["playbooks/bench.yml", "playbooks/rollback.yml", "site.yml"]
    production = [c for c in COMMANDS if option_values(c, "-i", "--inventory") == ["inventory/production"]]
    assert len(production) == 9
    assert len(COMMANDS) == 11  # and the lab's two


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c[1:]) for c in COMMANDS])
def test_a_copied_command_works(words: list[str]) -> None:
    # Copied from the repository root of a clone after `make`: the venv's own binaries, by path.
    assert words[0] in (".venv/bin/ansible", ".venv/bin/ansible-playbook"), (
        f"{words[0]}: write .venv/bin/{Path(words[0]).name}, which a fresh clone has after make"
    )
    inventories = option_values(words, "-i", "--inventory")
    for inv in inventories:
        assert (REPO / inv).exists(), f"{inv} does not exist in the repository"
    if Path(words[0]).name == "ansible-playbook":
        res = run(words, "--syntax-check", strict_inventory=bool(inventories))
    else:
        res = run(words, "--list-hosts", strict_inventory=bool(inventories))
    assert res.returncode == 0, res.stdout + res.stderr
    if not inventories:
        return

    # The inventory as the command names it, its vault decrypted with the command's vault options.
    vault = [
        w
        for i, w in enumerate(words)
        if w.startswith("--vault") or (i and words[i - 1] in ("--vault-password-file", "--vault-id"))
    ]
    loaded = subprocess.run(
        [str(BIN / "ansible-inventory"), *(a for inv in inventories for a in ("-i", inv)), *vault, "--list"],
        cwd=REPO,
        env=dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_INVENTORY_UNPARSED_FAILED="True"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr
    hostvars = json.loads(loaded.stdout)["_meta"]["hostvars"]
    assert "vault_service_swap_api_key" in hostvars["qwen-ct101"]  # from the encrypted vault.yml
    for limit in option_values(words, "-l", "--limit"):
        assert limit in hostvars, f"-l {limit}: no such host in {', '.join(inventories)}"
