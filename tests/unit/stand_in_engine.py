"""The lab's stand-in engines (tests/fakes/inference_server.py) started on loopback for the module tests.

One way for openai_probe's and openai_bench's tests to run a stand-in vLLM (with a DFlash drafter or
without speculation) or SGLang (with MTP), each on a free port, with the failure knobs it is given,
and to wait until it answers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "tests" / "fakes" / "inference_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, seconds: float, any_status: bool = False) -> bool:
    """Whether ``url`` answers 200 within ``seconds`` (``any_status``: any HTTP status, 503 while loading too)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return True
        except urllib.error.HTTPError:
            if any_status:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


class StandIns:
    """Stand-in engines serving ``target`` with the API key ``key``; ``stop()`` ends every one started."""

    def __init__(self, tmp_path: Path, target: Path, key: str):
        self.tmp_path, self.target, self.key = tmp_path, target, key
        self.drafter = tmp_path / "drafter"
        self.drafter.mkdir()
        config = {"block_size": 16, "dflash_config": {"mask_token_id": 248070}}
        (self.drafter / "config.json").write_text(json.dumps(config))
        self.procs: list[subprocess.Popen] = []

    def argv(self, engine: str, port: int, spec: bool) -> list[str]:
        """The engine's command line: vLLM with a DFlash drafter as service_swap renders it, SGLang with MTP
        (``spec``), or either without speculation."""
        if engine == "vllm":
            argv = ["vllm", "serve", str(self.target)]
            if spec:
                cfg = {"method": "dflash", "model": str(self.drafter), "num_speculative_tokens": 15}
                argv += ["--speculative-config", json.dumps(cfg)]
                argv += ["--max-num-seqs", "32", "--max-num-batched-tokens", "16384"]  # as service_swap renders
        else:
            argv = ["sglang", "--model-path", str(self.target)]
            if spec:
                argv += ["--speculative-algo", "NEXTN", "--speculative-num-steps", "3"]
        return [*argv, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "Qwen3.6-27B"]

    def start(self, engine: str, knobs: dict | None = None, spec: bool = True) -> str:
        """Start one ("vllm" or "sglang") with its failure knobs; returns its URL at once."""
        port = free_port()
        (self.tmp_path / "knobs.json").write_text(json.dumps({engine: knobs or {}}))
        env = dict(
            os.environ,
            LAB_FAKES_HOLDERS=str(self.tmp_path / "holders"),
            LAB_FAKES_KNOBS=str(self.tmp_path / "knobs.json"),
            VLLM_API_KEY=self.key,
        )
        argv = [sys.executable, str(SERVER), *self.argv(engine, port, spec)]
        self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait(5)
