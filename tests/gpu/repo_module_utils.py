"""The repository's module_utils for scripts that run without Ansible (GPU machines have none).

module_utils files import each other as ``ansible.module_utils.<name>``, as Ansible ships them to a
node. Where ansible-core is installed its package path is extended; where it is not, an empty
``ansible`` package with ``module_utils`` pointing at this repository stands in. The files are
also importable by their plain names.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

MODULE_UTILS = str(Path(__file__).resolve().parents[2] / "module_utils")


def use_repo_module_utils() -> None:
    if MODULE_UTILS not in sys.path:
        sys.path.insert(0, MODULE_UTILS)
    try:
        import ansible.module_utils as package
    except ImportError:
        ansible = types.ModuleType("ansible")
        ansible.__path__ = []
        package = types.ModuleType("ansible.module_utils")
        package.__path__ = []
        ansible.module_utils = package
        sys.modules["ansible"] = ansible
        sys.modules["ansible.module_utils"] = package
    if MODULE_UTILS not in package.__path__:
        package.__path__.append(MODULE_UTILS)
