"""Make the repo's module_utils and library importable in tests the way Ansible sees them, and set
torch up for the test modules that need it, only for them.

Ansible resolves ``ansible.module_utils.<name>`` from the configured module_utils
directory; pytest has no such hook, so we extend the package path once here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ansible.module_utils
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from torch_set_up import imports_torch, set_up_torch  # noqa: E402  (tests/ is on sys.path from here)

ansible.module_utils.__path__.append(str(REPO / "module_utils"))
sys.path.insert(0, str(REPO / "library"))
sys.path.insert(0, str(REPO / "plugins" / "filter"))
sys.path.insert(0, str(REPO / "plugins" / "callback"))


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Set torch up before pytest imports a test module that imports it (and never otherwise)."""
    if isinstance(collector, pytest.Module) and imports_torch(collector.path):
        set_up_torch()
