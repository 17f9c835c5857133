"""The repository's module_utils (drafter_config's rules, the safetensors header reader) for code that
runs without Ansible, as on a GPU machine. They import each other as ``ansible.module_utils.<name>``."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

_DIR = str(Path(__file__).resolve().parents[2] / "module_utils")


def _package() -> types.ModuleType:
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
    if _DIR not in package.__path__:
        package.__path__.append(_DIR)
    return package


_package()
dflash_drafter = importlib.import_module("ansible.module_utils.dflash_drafter")
safetensors_header = importlib.import_module("ansible.module_utils.safetensors_header")
