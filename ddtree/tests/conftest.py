"""Fixtures of the engine's CPU tests: torch set up before a test module that imports it, Triton's
interpreter made to run the DDTree kernels on the CPU, and the DDTree runtime with stand-ins for vLLM.

The Ansible side's fixtures (module_utils on ``ansible.module_utils``, real filesystems, the lab's
stand-in model) are in tests/conftest.py and tests/unit/conftest.py; these tests need none of them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ddtree.tests.torch_set_up import imports_torch, set_up_torch


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Set torch up before pytest imports a test module that imports it (and never otherwise)."""
    if isinstance(collector, pytest.Module) and imports_torch(collector.path):
        set_up_torch()


@pytest.fixture(scope="module")
def interpreter_scalar_index() -> Iterator[None]:
    """Triton 3.6's interpreter turns a loaded scalar into a Python int with ``int(array)``, which
    numpy 2 refuses for its one-element arrays; the kernels loop ``range(n)`` over such a scalar (a
    sequence's length). Index through the array's one element instead, for the tests that ask."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    yield
    interpreter._patch_lang_tensor = original


@pytest.fixture(scope="module")
def dd():
    """The DDTree runtime the change set adds to vLLM 0.20.1 (``vllm/v1/spec_decode/ddtree.py``),
    loaded with ddtree/tests/vllm_modules.py standing in for vLLM; the stand-ins leave sys.modules
    again, so that no other test sees a fake ``vllm``."""
    from ddtree.tests import vllm_modules

    before = set(sys.modules)
    module = vllm_modules.load_ddtree_runtime()
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]
    return module
