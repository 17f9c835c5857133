"""ddtree/tests/conftest.py (through ddtree/tests/torch_set_up.py) imports torch only for the test modules that
import it, and sets it up for them whichever module ran first (TRITON_INTERPRET before Triton,
torch._dynamo beside Ansible's sys.intern).

Each case runs pytest in a fresh process with a small plugin that writes, at the end of the session,
what that process had imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ddtree.tests.torch_set_up import imports_torch

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, sys

def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["TORCH_PROBE_OUT"], "w") as out:
        json.dump({
            "exitstatus": int(exitstatus),
            "torch": "torch" in sys.modules,
            "triton": "triton" in sys.modules,
            "dynamo": "torch._dynamo" in sys.modules,
            "interpret": os.environ.get("TRITON_INTERPRET"),
            "cuda": sys.modules["torch"].cuda.is_available() if "torch" in sys.modules else None,
            "intern": type(sys.intern).__name__,
        }, out)
"""


def _run(tmp_path: Path, *args: str) -> dict:
    (tmp_path / "torch_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a fresh shell has it
    env["PYTHONPATH"] = str(tmp_path)
    env["TORCH_PROBE_OUT"] = str(tmp_path / "probe.json")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "torch_probe", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads((tmp_path / "probe.json").read_text())


def test_a_module_without_torch_runs_without_importing_it(tmp_path: Path) -> None:
    probe = _run(tmp_path, "tests/unit/test_inventory_checks.py")
    assert probe == {
        "exitstatus": 0,
        "torch": False,
        "triton": False,
        "dynamo": False,
        "interpret": None,
        "cuda": None,
        "intern": "SysInternPatch",  # the module ran Ansible's controller code
    }


def test_a_torch_module_after_ansible_code_gets_the_set_up(tmp_path: Path) -> None:
    # test_inventory_checks.py imports Ansible's controller code (sys.intern wrapped) before
    # test_ddtree_runtime.py imports torch: the order the old conftest had to prevent.
    probe = _run(tmp_path, "tests/unit/test_inventory_checks.py", "ddtree/tests/test_ddtree_runtime.py")
    assert probe["exitstatus"] == 0
    assert probe["torch"] and probe["dynamo"] and probe["triton"]
    assert probe["interpret"] == (None if probe["cuda"] else "1")  # the kernels' tests in Triton's interpreter
    assert probe["intern"] == "SysInternPatch"  # Ansible's wrapper back in place after the import


def test_which_modules_count_as_needing_torch(tmp_path: Path) -> None:
    # The Ansible side's tests never import torch; the engine's kernel and runtime tests do.
    needing = sorted(p.name for p in (REPO / "tests" / "unit").glob("test_*.py") if imports_torch(p))
    assert needing == []
    engine = REPO / "ddtree" / "tests"
    needing = sorted(p.name for p in engine.glob("test_*.py") if imports_torch(p))
    assert needing == [
        "test_ddtree_attention.py",
        "test_ddtree_drafter_limits.py",
        "test_ddtree_expand_parts.py",
        "test_ddtree_gdn.py",
        "test_ddtree_moves.py",
        "test_ddtree_runtime.py",
        "test_ddtree_tp.py",
        "test_ddtree_tree.py",
        "test_gdn_replay.py",
        "test_gdn_verify_bench.py",
        "test_host_copies.py",
        "test_num_accepted_on_gpu.py",
        "test_trained_models.py",
        "test_trained_proof.py",
        "test_tree_attn_prefills.py",
    ]
    cases = {
        "import torch.nn.functional as F\n": True,
        "from triton import language\n": True,
        "import os, torch\n": True,
        "def f():\n    import torch\n": False,  # imported when a test runs, not at collection
        "import torchaudio\n": False,
        "from . import torch\n": False,
        "# import torch\n": False,
        'torch = pytest.importorskip("torch")\n': True,
        'pytest.importorskip("triton")\n': True,
        'pytest.importorskip("yaml")\n': False,
    }
    for source, want in cases.items():
        path = tmp_path / "test_case.py"
        path.write_text(source)
        assert imports_torch(path) is want, source
