"""The engine's one door into the rest of the repository, for code that runs without Ansible.

The GPU proofs and benchmarks reuse the project's module_utils (the change-set engine of
vllm_patch, drafter_config's rules, the safetensors header reader), one filter plugin (the
CUDA-graph sizes service_swap renders) and the lab's stand-in models. None of those folders is a
Python package, so each is loaded here by its file path, never through sys.path (library/ modules
and module_utils/ files share names).

module_utils files import each other as ``ansible.module_utils.<name>``, as Ansible ships them to a
node. Where ansible-core is installed its package path is extended; where it is not (a GPU machine
may have none), an empty ``ansible.module_utils`` package pointing at this repository stands in.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from ddtree import REPO

MODULE_UTILS = str(REPO / "module_utils")


def _module_utils_package() -> types.ModuleType:
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
    return package


def module_util(name: str) -> types.ModuleType:
    """``module_utils/<name>.py``, imported as Ansible imports it (``ansible.module_utils.<name>``)."""
    _module_utils_package()
    return importlib.import_module(f"ansible.module_utils.{name}")


def repo_file(relpath: str, name: str | None = None) -> types.ModuleType:
    """A Python file of the repository that is not in a package (a filter plugin, a lab fake), by path;
    loaded once per name. module_utils are ready first: the filter plugins import them."""
    name = name or relpath.rsplit("/", 1)[-1].removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    _module_utils_package()
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
