"""Make the repo's module_utils and library importable in tests the way Ansible sees them.

Ansible resolves ``ansible.module_utils.<name>`` from the configured module_utils
directory; pytest has no such hook, so we extend the package path once here. Modules and plugins
are not packages: Ansible loads them by folder and bare name, and so do the tests, so this one place
puts those three folders on sys.path (no test edits it). Every other file outside a package
(plugins/action, whose names clash with library/, playbooks/files, benchmarks/, tests/fakes, tests/gpu)
is loaded by its path with ddtree.repo.repo_file. (The DDTree engine's tests, which use torch, are in
ddtree/tests with their own conftest.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import ansible.module_utils

REPO = Path(__file__).resolve().parent.parent
ansible.module_utils.__path__.append(str(REPO / "module_utils"))
sys.path.insert(0, str(REPO / "library"))
sys.path.insert(0, str(REPO / "plugins" / "filter"))
sys.path.insert(0, str(REPO / "plugins" / "callback"))
