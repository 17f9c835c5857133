"""The GPU proofs run where Ansible is not installed: what they load from the repository must import there."""

from __future__ import annotations

import subprocess
import sys

from ddtree import REPO

# Any import of the ansible package fails, as on a GPU machine that has none.
NO_ANSIBLE = """
import importlib.abc, sys
class NoAnsible(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ansible" or name.startswith("ansible."):
            if name in ("ansible", "ansible.module_utils") and name in sys.modules:
                return None
            if not name.startswith("ansible.module_utils."):
                raise ImportError(f"no module named {name!r} (Ansible is not installed here)")
        return None
sys.meta_path.insert(0, NoAnsible())
"""


def run_without_ansible(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_ANSIBLE + code], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_blocker_blocks():
    """The guard itself: with it, importing Ansible fails (else the test below proves nothing)."""
    proc = run_without_ansible("from ansible import constants")
    assert proc.returncode != 0
    assert "Ansible is not installed here" in proc.stderr


def test_cudagraph_sizes_filter_loads_without_ansible():
    """pair_proof and step_cost load the CUDA-graph sizes filter through ddtree.repo; it read
    ansible.constants at import, so every GPU proof failed before its first run."""
    proc = run_without_ansible(
        "from ddtree import repo\n"
        "f = repo.repo_file('plugins/filter/ddtree_method.py')\n"
        "print(callable(f.ddtree_cudagraph_sizes), 'ansible.module_utils.ddtree_base' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
