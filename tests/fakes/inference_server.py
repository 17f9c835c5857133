#!/usr/bin/env python3
"""Test double for the inference engines (SGLang, later vLLM) on lab nodes that have no GPU.

It speaks the small part of the OpenAI-compatible HTTP API that the deployment checks
(/health, /v1/models, /v1/completions, /metrics, /version), parses the engine's own command
line, and, while it runs, "holds" the fake GPUs by writing a holder file that the fake
nvidia-smi adds to its memory.used, so waiting for the GPUs to be free is tested for real.

Standard library only: lab nodes have nothing but Debian's python3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOLDERS_DIR = Path(os.environ.get("LAB_FAKES_HOLDERS", "/run/lab-fakes/gpu-holders"))
KNOBS_FILE = Path(os.environ.get("LAB_FAKES_KNOBS", "/etc/lab-fakes/engine-knobs.json"))
# What one H200 of the captured fixtures has (143771 MiB) times SGLang's default
# --mem-fraction-static 0.88: the order of what a serving engine really holds.
HELD_MIB_PER_GPU = 126518


class Refusal(Exception):
    """The engine would refuse to start with this command line; the message is what it prints."""


@dataclass
class Engine:
    """What one engine process serves; subclasses parse their engine's command line."""

    name: str
    model_path: str
    served_name: str
    host: str
    port: int
    gpus: list[int]
    api_key: str | None = None
    counters: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        if not Path(self.model_path, "config.json").is_file():
            raise Refusal(f"model path {self.model_path} has no config.json")

    def metrics(self) -> str:
        return ""

    def on_completion(self, tokens: int) -> None:
        self.counters["generation_tokens"] = self.counters.get("generation_tokens", 0) + tokens


class SGLang(Engine):
    @classmethod
    def from_argv(cls, argv: list[str]) -> SGLang:
        p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
        p.add_argument("--model-path", required=True)
        p.add_argument("--served-model-name")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=30000)
        p.add_argument("--tp-size", type=int, default=1)
        p.add_argument("--api-key")
        # Accepted so the unit can carry Qwen's real MTP command line unchanged.
        for flag in (
            "--speculative-algo",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
            "--mem-fraction-static",
            "--context-length",
            "--mamba-radix-cache-strategy",
            "--reasoning-parser",
        ):
            p.add_argument(flag)
        a = p.parse_args(argv)
        return cls(
            name="sglang",
            model_path=a.model_path,
            served_name=a.served_model_name or a.model_path,
            host=a.host,
            port=a.port,
            gpus=list(range(a.tp_size)),
            api_key=a.api_key or os.environ.get("SGLANG_API_KEY"),
        )

    def metrics(self) -> str:
        tokens = self.counters.get("generation_tokens", 0)
        return f'sglang:generation_tokens_total{{model_name="{self.served_name}"}} {tokens}\n'


ENGINES = {"sglang": SGLang}


def load_knobs() -> dict:
    """Failure knobs a test sets on a node: {"never_healthy": true, "slow_start_s": 5, ...}."""
    try:
        return json.loads(KNOBS_FILE.read_text())
    except FileNotFoundError:
        return {}


def completion_text(prompt: str, max_tokens: int) -> tuple[str, int]:
    """A deterministic, non-empty continuation: the same prompt always gives the same text."""
    words = [w for w in prompt.split() if w] or ["token"]
    out = [words[i % len(words)] for i in range(max(1, min(max_tokens, 64)))]
    return " " + " ".join(out), len(out)


class Holder:
    """The holder file that makes the fake nvidia-smi report this process's GPU memory."""

    def __init__(self, engine: Engine) -> None:
        self.path = HOLDERS_DIR / f"{engine.name}-{os.getpid()}.json"
        self.body = {"pid": os.getpid(), "gpus": engine.gpus, "mib": HELD_MIB_PER_GPU, "name": engine.name}

    def __enter__(self) -> Holder:
        HOLDERS_DIR.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.body))
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


def make_handler(engine: Engine, ready: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        server_version = f"lab-fake-{engine.name}"

        def log_message(self, fmt: str, *args: object) -> None:
            sys.stderr.write(f"{self.command} {self.path} -> {args[1] if len(args) > 1 else ''}\n")

        def _send(self, code: int, body: str | dict, ctype: str = "application/json") -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if not engine.api_key or self.path in ("/health", "/metrics", "/version"):
                return True
            if self.headers.get("Authorization") == f"Bearer {engine.api_key}":
                return True
            self._send(401, {"error": {"message": "invalid API key"}})
            return False

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200 if ready.is_set() else 503, "" if ready.is_set() else "loading", "text/plain")
            elif not ready.is_set():
                self._send(503, {"error": {"message": "model is loading"}})
            elif not self._authorised():
                return
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": engine.served_name, "object": "model"}]})
            elif self.path == "/metrics":
                self._send(200, engine.metrics(), "text/plain; version=0.0.4")
            elif self.path == "/version":
                self._send(200, {"version": f"lab-fake-{engine.name}"})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if not ready.is_set():
                self._send(503, {"error": {"message": "model is loading"}})
                return
            if not self._authorised():
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                req = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                self._send(400, {"error": {"message": "body is not JSON"}})
                return
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            text, n = completion_text(str(req.get("prompt", "")), int(req.get("max_tokens", 16)))
            engine.on_completion(n)
            self._send(
                200,
                {
                    "object": "text_completion",
                    "model": engine.served_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"completion_tokens": n},
                },
            )

    return Handler


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ENGINES:
        print(f"usage: inference_server.py {{{','.join(ENGINES)}}} ENGINE-ARGS...", file=sys.stderr)
        return 2
    knobs = load_knobs()
    try:
        engine = ENGINES[argv[0]].from_argv(argv[1:])
        engine.check()
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if knobs.get("die_at_start"):
        print("error: engine died during start (knob die_at_start)", file=sys.stderr)
        return 1
    ready = threading.Event()
    server = ThreadingHTTPServer((engine.host, engine.port), make_handler(engine, ready))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    with Holder(engine):

        def load() -> None:
            time.sleep(float(knobs.get("slow_start_s", 0.5)))
            if not knobs.get("never_healthy"):
                ready.set()

        threading.Thread(target=load, daemon=True).start()
        print(f"{engine.name} stand-in serving {engine.served_name} on {engine.host}:{engine.port}", flush=True)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
