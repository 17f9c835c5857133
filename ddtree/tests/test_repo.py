"""ddtree.repo, the engine's door into module_utils: a proof that judges with them can still load a model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddtree import REPO

pytest.importorskip("torch")
pytest.importorskip("ansible")


def test_torch_dynamo_loads_after_the_proof_imports_module_utils():
    # ansible-core's module_utils patch sys.intern, and torch._dynamo (which transformers' model loading
    # imports) refuses to load after that; summarise judged identity, then loaded the target and died.
    code = "import ddtree.gpu.pair_proof; import torch._dynamo; print('loaded')"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]
