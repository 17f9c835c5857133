"""torch for the test modules that need it, set up once before the first of them is imported.

ddtree/tests/conftest.py calls set_up_torch() before pytest imports a test module that imports torch or
triton at its top (imports_torch); a run of other modules never imports torch.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

# sys.intern as Python has it: ansible-core wraps it (to accept str subclasses) when its controller
# code or AnsibleModule is first imported, and keeps the original on the wrapper.
_SYS_INTERN = getattr(sys.intern, "unpatched_implementation", sys.intern)

# The top-level packages whose import at the top of a test module means it needs the set-up.
TORCH_PACKAGES = frozenset({"torch", "triton"})


def imports_torch(path: Path) -> bool:
    """Whether the test module imports torch or triton at its top level (read, not imported)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return False  # pytest reports the module's error when it imports it
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif skip := _importorskip(node):
            names = [skip]
        else:
            continue
        if any(name.partition(".")[0] in TORCH_PACKAGES for name in names):
            return True
    return False


def _importorskip(node: ast.stmt) -> str | None:
    """The module a top-level ``pytest.importorskip("name")`` (bare or assigned) imports, else None."""
    call = node.value if isinstance(node, (ast.Expr, ast.Assign)) else None
    if (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "importorskip"
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    ):
        return call.args[0].value
    return None


def set_up_torch() -> None:
    """Import torch the way the DDTree tests need it (once; later calls do nothing).

    Without a GPU the DDTree Triton kernels' tests run in Triton's interpreter: Triton reads
    TRITON_INTERPRET when it is first imported (its own library functions are decorated then), and
    torch._dynamo imports it. torch's dynamo registers a stand-in for sys.intern when it is first
    imported and refuses the wrapper Ansible's controller code installs over it (the DDTree tree
    tests trace operators through dynamo), so it is imported with Python's own sys.intern in place
    and Ansible's wrapper is put back after: the state that importing it before anything of Ansible
    gives, whichever test module ran first.
    """
    if "torch._dynamo" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    current = sys.intern
    sys.intern = _SYS_INTERN
    try:
        import torch._dynamo  # registers its stand-ins and imports Triton
    finally:
        sys.intern = current
