"""Run one of the project's Ansible modules in this Python process, as Ansible runs it on a node.

The GPU checks use it where no Ansible controller is at hand: only ansible-core must be importable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_module(name: str, args: dict) -> dict:
    """``library/<name>.py`` with ``args`` as its parameters; returns the JSON it prints."""
    import ansible.module_utils
    from ansible.module_utils.testing import patch_module_args

    if str(REPO / "module_utils") not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(str(REPO / "module_utils"))
    module = sys.modules.get(name)
    if module is None:
        # By its path, not through sys.path: library/ is no package, and its names are common words.
        spec = importlib.util.spec_from_file_location(name, REPO / "library" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    out = io.StringIO()
    with patch_module_args(args), contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        module.main()
    return json.loads(out.getvalue())
