"""The GPU proofs and benchmarks call the rest of the repository with arguments that fit its functions.

A call from ddtree/gpu, ddtree/bench or ddtree/trained into module_utils (through ddtree.repo), a filter
plugin, a lab fake or another ddtree module runs only on a GPU, after minutes of vLLM's start-up: a
signature that moved under it (memory_fit's keyword-only ``base``, which ``memory_profile_check fit`` did
not pass) failed there, never here. This reads every such file's source, resolves each name bound to one of
those modules or functions, and binds every call's arguments to the callee's real signature; every
attribute read from such a module must exist.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

from ddtree import HOME, repo

# The code that runs only on a GPU (its CPU tests call parts of it, not every call it makes).
GPU_CODE = [
    *sorted(
        p for folder in ("gpu", "bench", "trained") for p in (HOME / folder).glob("*.py") if p.name != "__init__.py"
    ),
    HOME / "changeset.py",
    HOME / "bases.py",
]
# Functions that return a module by name (ddtree/trained/proof.py imports pair_proof lazily).
MODULE_FACTORIES = {"_pair_proof": "ddtree.gpu.pair_proof"}


@pytest.fixture(scope="module", autouse=True)
def torch_ready() -> None:
    """Several of the files import torch at their top: set it up as the engine's torch tests have it."""
    from ddtree.tests.torch_set_up import set_up_torch

    set_up_torch()


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _loaded(call: ast.expr) -> object | None:
    """What a right-hand side loads: repo.module_util("x"), repo.repo_file("p")[.attr],
    importlib.import_module("ddtree..."), a module factory; else None."""
    attr = None
    if isinstance(call, ast.Attribute) and isinstance(call.value, ast.Call):
        attr, call = call.attr, call.value
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    arg = _literal(call.args[0]) if call.args else None
    if name == "module_util" and arg:
        module = repo.module_util(arg)
    elif name == "repo_file" and arg:
        module = repo.repo_file(arg)
    elif name == "import_module" and arg and arg.startswith("ddtree"):
        module = importlib.import_module(arg)
    elif name in MODULE_FACTORIES and not call.args:
        module = importlib.import_module(MODULE_FACTORIES[name])
    else:
        return None
    return getattr(module, attr) if attr else module


def bindings(tree: ast.Module) -> dict[str, object]:
    """Every name in a file (at any depth: the proofs import inside functions) bound to a module or function
    of the repository."""
    names: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddtree") and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(module, alias.name, None)
                if value is None:
                    value = importlib.import_module(f"{node.module}.{alias.name}")
                names[alias.asname or alias.name] = value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = (
                zip(target.elts, value.elts, strict=False)
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                else [(target, value)]
            )
            for t, v in pairs:
                loaded = _loaded(v)
                if isinstance(t, ast.Name) and loaded is not None:
                    names[t.id] = loaded
    return names


def _callee(func: ast.expr, names: dict[str, object]) -> tuple[str, object] | None:
    if isinstance(func, ast.Name) and func.id in names and not isinstance(names[func.id], ModuleType):
        return func.id, names[func.id]
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        module = names.get(func.value.id)
        if isinstance(module, ModuleType):
            return f"{func.value.id}.{func.attr}", getattr(module, func.attr, None)
    return None


def problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = bindings(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and isinstance(names.get(node.value.id), ModuleType)
            and not hasattr(names[node.value.id], node.attr)
        ):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr} does not exist")
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node.func, names)
        if callee is None or not callable(callee[1]):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue  # *args or **kwargs: the call's arity is not in the source
        try:
            signature = inspect.signature(callee[1])
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as exc:
            found.append(f"{path.name}:{node.lineno}: {callee[0]}{signature}: {exc}")
    return found


@pytest.mark.parametrize("path", GPU_CODE, ids=lambda p: str(p.relative_to(HOME)))
def test_every_call_into_the_repository_fits_its_callee(path):
    assert problems(path) == []


def test_a_call_without_a_required_argument_is_found(tmp_path):
    """The check itself: memory_fit called as memory_profile_check called it before base was passed, a
    keyword that does not exist, and a missing module attribute are each reported."""
    source = tmp_path / "proof.py"
    source.write_text(
        "from ddtree import repo\n"
        "mf = repo.module_util('memory_fit')\n"
        "sizes = repo.repo_file('plugins/filter/ddtree_method.py').ddtree_cudagraph_sizes\n"
        "mf.memory_fit({}, {}, target_weights=0, drafter_weights=0, gpu_memory_mib=1, gpu_memory_utilization=0.9,\n"
        "    tensor_parallel_size=1, max_model_len=1, max_num_seqs=1, max_num_batched_tokens=1, spec_tokens=1,\n"
        "    depth=1, ddtree=True, reserve_mib=0)\n"
        "sizes(8, 15, 2048, budget=3)\n"
        "mf.NO_SUCH_THING\n"
    )
    found = problems(source)
    assert len(found) == 3, found
    assert any("missing a required argument: 'base'" in f for f in found)
    assert any("unexpected keyword argument 'budget'" in f for f in found)
    assert any("mf.NO_SUCH_THING does not exist" in f for f in found)
