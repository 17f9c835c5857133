"""openai_wait: waiting for /health prints a line per phase or per progress_s, not a retry line per poll."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from playbook_run import ansible_playbook, local_play, localhost_inventory

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "plugins" / "action" / "openai_wait.py"


@pytest.fixture(scope="module")
def action():
    spec = importlib.util.spec_from_file_location("openai_wait_action", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Lines vLLM 0.20.1 logs while it starts (journalctl -o cat), oldest first.
VLLM_START = [
    "INFO 11-30 10:00:01 [api_server.py:1793] vLLM API server version 0.20.1",
    "INFO 11-30 10:00:09 [gpu_model_runner.py:2012] Starting to load model /opt/models/Qwen3.6-27B...",
    "Loading safetensors checkpoint shards:  45% Completed | 5/11 [00:21<00:26,  4.36s/it]",
    "INFO 11-30 10:01:02 [gpu_model_runner.py:2104] Model loading took 52.8 GiB and 51.3 seconds",
    "INFO 11-30 10:01:31 [backends.py:548] Dynamo bytecode transform time: 21.17 s",
    "INFO 11-30 10:02:02 [monitor.py:34] torch.compile takes 44.0 s in total",
    "INFO 11-30 10:02:09 [gpu_worker.py:298] Available KV cache memory: 61.2 GiB",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  40%|####      | 27/67 [00:05<00:07,  5.33it/s]",
    "INFO 11-30 10:02:51 [api_server.py:1857] Starting vLLM API server 0 on http://0.0.0.0:8000",
]


@pytest.mark.parametrize(
    ("upto", "phase"),
    [
        (0, "starting"),
        (1, "starting"),
        (2, "loading weights"),
        (3, "loading weights"),
        (4, "weights loaded"),
        (5, "compiling"),
        (6, "compiling"),
        (7, "sizing the KV cache"),
        (8, "capturing CUDA graphs"),
        (9, "starting the API server"),
    ],
)
def test_the_phase_is_the_newest_line_that_names_one(action, upto, phase):
    assert action.phase_of(VLLM_START[:upto]) == phase


def test_a_line_is_due_on_a_phase_change_or_every_progress_s(action):
    p = action.Progress(30)
    due = [p.due(phase, t) for phase, t in [("a", 0), ("a", 5), ("a", 29), ("a", 30), ("b", 31), ("b", 35), ("b", 61)]]
    assert due == [True, False, False, True, True, False, True]


def test_the_progress_line_says_what_it_waits_for(action):
    line = action.progress_line(
        "n1",
        "vllm-qwen.service",
        "capturing CUDA graphs",
        185.2,
        {"health_status": None, "error": "connection refused"},
    )
    assert (
        line
        == "n1: waiting for vllm-qwen.service's /health: capturing CUDA graphs (3m05s; /health: connection refused)"
    )
    assert action.progress_line("n1", "", "starting", 7, {"health_status": 503}) == (
        "n1: waiting for /health: starting (7s; /health: answered 503)"
    )


class _Health(BaseHTTPRequestHandler):
    # Healthy this long after the first poll, not after the test starts: ansible-playbook's own
    # start-up time varies with the machine's load, and must not eat the simulated start.
    healthy_after_s = 0.0
    first_poll = None

    def do_GET(self):
        cls = type(self)
        if self.path == "/health" and cls.first_poll is None:
            cls.first_poll = time.monotonic()
        ok = self.path == "/health" and time.monotonic() - cls.first_poll >= cls.healthy_after_s
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Health.healthy_after_s, _Health.first_poll = 0.0, None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def wait(tmp_path: Path, url: str, **args) -> subprocess.CompletedProcess:
    task = {"openai_wait": {"url": url, "timeout": 2, "journal_lines": 0, **args}, "register": "w"}
    result = {"ansible.builtin.debug": {"msg": "RESULT {{ w | to_json }}"}}
    play = local_play(tmp_path / "wait.yml", "".join(f"    - {json.dumps(t)}\n" for t in (task, result)))
    return ansible_playbook(
        localhost_inventory(tmp_path),
        play,
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_INJECT_FACT_VARS="False",
    )


def result_of(res: subprocess.CompletedProcess) -> dict:
    line = next(ln for ln in res.stdout.splitlines() if '"msg": "RESULT ' in ln)
    return json.loads(json.loads("{" + line.strip() + "}")["msg"][len("RESULT ") :])


def test_a_slow_start_prints_a_few_progress_lines_and_no_retry_lines(tmp_path, server):
    _Health.healthy_after_s = 7
    res = wait(tmp_path, f"http://127.0.0.1:{server.server_port}", wait_s=60, poll_s=1, progress_s=3)
    assert res.returncode == 0, res.stdout + res.stderr
    progress = [ln for ln in res.stdout.splitlines() if ln.startswith("localhost: waiting for /health: starting (")]
    # About 7 s of polls every second: a line at 0 s, then one every 3 s, not one per poll.
    assert 2 <= len(progress) <= 4, res.stdout
    assert progress[0].endswith("; /health: answered 503)")
    assert "RETRYING" not in res.stdout
    got = result_of(res)
    assert got["healthy"] is True
    # Polled more than once, and never faster than poll_s (each poll is a module run: on a loaded
    # machine a poll takes over a second, so the count within the 7 s varies).
    assert 2 <= got["polls"] <= got["waited_s"] + 1
    # One phase, seen at the first poll (its second can read 1 on a loaded machine).
    assert [p["phase"] for p in got["phases"]] == ["starting"]
    assert got["phases"][0]["after_s"] <= 2


def test_it_gives_up_after_wait_s_with_the_last_answer(tmp_path, server):
    _Health.healthy_after_s = 3600
    res = wait(tmp_path, f"http://127.0.0.1:{server.server_port}", wait_s=3, poll_s=1, progress_s=30)
    assert res.returncode == 0, res.stdout + res.stderr
    got = result_of(res)
    assert got["healthy"] is False
    assert got["health_status"] == 503
    assert 3 <= got["waited_s"] <= 6
    assert len([ln for ln in res.stdout.splitlines() if ln.startswith("localhost: waiting for")]) == 1


def test_a_completion_request_is_refused(tmp_path, server):
    res = wait(tmp_path, f"http://127.0.0.1:{server.server_port}", wait_s=3, requests=3)
    assert res.returncode == 2
    assert "openai_wait waits for /health only: leave requests out (use openai_probe)." in res.stdout
