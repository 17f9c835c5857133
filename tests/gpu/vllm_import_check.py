#!/usr/bin/env python3
"""GPU check of vllm_install's import verification: vllm_venv_info with verify_import on a real venv.

Run on a machine with an NVIDIA GPU, against a venv that holds vLLM with its dependencies (torch
with CUDA), for example one the vllm_install role made with ``vllm_install_no_deps: false``:

    python3 tests/gpu/vllm_import_check.py --venv /opt/vllm/0.20.1 --method ddtree --out /tmp/out

The Python running this script needs ansible-core; the module runs in-process exactly as Ansible
runs it on a node, reads the venv from its files, then imports the DFlash proposer, the DFlash
drafter model and (for ddtree) tree attention with the venv's own Python. Writes
``<out>/vllm_import_check.json`` and exits non-zero unless every import is ``ok``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from in_process import run_module  # tests/gpu/, beside this script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", required=True)
    parser.add_argument("--method", default="ddtree", choices=["dflash", "ddtree"])
    parser.add_argument("--expected-version")
    parser.add_argument("--out", default=".")
    opts = parser.parse_args()

    result = run_module(
        "vllm_venv_info",
        {
            "venv": opts.venv,
            "method": opts.method,
            "expected_version": opts.expected_version,
            "verify_import": True,
            "require": True,
        },
    )
    smi = shutil.which("nvidia-smi")
    gpu = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout.strip() if smi else None
    python = Path(opts.venv) / "bin" / "python"
    torch_line = "no bin/python in the venv"
    if python.exists():
        probe = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
        proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
        torch_line = proc.stdout.strip() or proc.stderr.strip()[-500:]
    summary = {
        "gpu": gpu,
        "torch": torch_line,
        "failed": bool(result.get("failed")),
        "msg": result.get("msg"),
        "version": result.get("version"),
        "missing": result.get("missing"),
        "detected": result.get("detected"),
        "imports": result.get("imports"),
    }
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    (Path(opts.out) / "vllm_import_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    imports = summary["imports"] or {}
    ok = not summary["failed"] and imports and all(v == "ok" for v in imports.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
