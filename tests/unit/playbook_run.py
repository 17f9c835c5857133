"""One way for the unit tests to run a play: this venv's ansible-playbook with the repository's ansible.cfg.

``ansible_playbook`` runs it with its output captured as text; ``localhost_inventory`` writes the inventory of a
test that runs on this machine alone, and ``local_play`` a play against it. Each test passes the rest of its
environment (``DFLASH_REPORT_DIR``, ``ANSIBLE_NOCOLOR``, ...) itself, so what a run sees is written where it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "ansible.cfg"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
# A play against localhost that gathers no facts; its tasks follow, indented by four spaces.
LOCAL_PLAY = "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"


def localhost_inventory(folder: Path) -> Path:
    """Writes ``folder/localhost.ini``, localhost alone with connection local and this Python, and returns it.

    Only localhost: the repository's default inventory (the lab's group_vars) must not leak in. A file, not
    ANSIBLE_INVENTORY="localhost,": that is a path list whose empty second item is the working directory, which
    Ansible then walks, running every executable in the repository as an inventory script with --list."""
    inventory = folder / "localhost.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    return inventory


def local_play(path: Path, tasks: str) -> Path:
    """Writes a play against localhost, without facts, running ``tasks`` (YAML lines indented under ``tasks:``,
    four spaces) to ``path``, and returns it."""
    path.write_text(LOCAL_PLAY + tasks)
    return path


def ansible_playbook(
    inventory: Path | str,
    *args: str | Path,
    cwd: Path = REPO,
    config: Path | None = CONFIG,
    timeout: float = 120,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """``ansible-playbook -i inventory *args`` in ``cwd``, its output captured as text, killed after ``timeout`` s.

    The environment is this process's, with ANSIBLE_CONFIG set to ``config`` (left as it is where ``config`` is
    None, for a test that sets up its plugins through the environment alone) and ``env`` on top."""
    environ = dict(os.environ, **env) if config is None else dict(os.environ, ANSIBLE_CONFIG=str(config), **env)
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), *map(str, args)],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
