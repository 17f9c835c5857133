"""openai_probe run in-process against the lab's stand-in vLLM (tests/fakes/inference_server.py) on loopback."""

from __future__ import annotations

import json
import os
import time

import openai_probe
import pytest
from ansible.module_utils.testing import patch_module_args
from stand_in_engine import StandIns, answers, free_port

KEY = "sk-unit-0b9c4e"


@pytest.fixture
def vllm(tmp_path, target):
    """Start the stand-in vLLM; yields a function that takes knobs and returns its URL."""
    engines = StandIns(tmp_path, target, KEY)

    def start(knobs: dict | None = None, spec: bool = True) -> str:
        url = engines.start("vllm", knobs, spec=spec)
        answers(f"{url}/version", 10, any_status=True)  # answers while loading too (503)
        return url

    yield start
    engines.stop()


def probe(args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        openai_probe.main()
    return json.loads(capsys.readouterr().out)


def wait_healthy(url: str, capsys) -> dict:
    for _ in range(100):
        result = probe({"url": url}, capsys)
        if result["healthy"]:
            return result
        time.sleep(0.05)
    raise AssertionError(f"stand-in never became healthy: {result}")


def test_completions_and_acceptance_of_a_healthy_drafter(vllm, capsys):
    url = vllm()
    wait_healthy(url, capsys)
    result = probe({"url": url, "api_key": KEY, "requests": 3, "prompt": "one two three four"}, capsys)
    assert result["error"] == ""
    assert result["model"] == "Qwen3.6-27B"
    assert result["completions"] == 3
    assert result["completion_text"].startswith(" one two three four one")
    assert result["completion_tokens"] == 192
    # 64 tokens per request at 15 tokens per draft, 35% accepted: 11 drafts, 53 accepted, each time.
    assert result["spec_decode"] == {
        "drafts": 33.0,
        "draft_tokens": 495.0,
        "accepted_tokens": 159.0,
        "accepted_per_position": {str(i): (33.0 if i < 4 else 27.0 if i == 4 else 0.0) for i in range(15)},
        "generation_tokens": 192.0,
        "present": True,
    }
    assert result["mean_acceptance_length"] == 5.8182
    assert result["draft_acceptance_rate"] == 0.3212
    assert result["tokens_per_second"] > 0
    assert KEY not in json.dumps(result)
    assert result["changed"] is False


def test_low_acceptance_knob_shows_in_the_mean(vllm, capsys):
    url = vllm({"low_acceptance": True})
    wait_healthy(url, capsys)
    result = probe({"url": url, "api_key": KEY, "requests": 2}, capsys)
    assert result["spec_decode"]["drafts"] == 122.0
    assert result["spec_decode"]["accepted_tokens"] == 6.0
    assert result["mean_acceptance_length"] == 1.0492


def test_without_spec_decode_there_is_no_mean(vllm, capsys):
    url = vllm(spec=False)
    wait_healthy(url, capsys)
    result = probe({"url": url, "api_key": KEY, "requests": 1}, capsys)
    assert result["spec_decode"]["present"] is False
    assert result["mean_acceptance_length"] is None


def test_wrong_key_is_reported_not_raised(vllm, capsys):
    url = vllm()
    wait_healthy(url, capsys)
    result = probe({"url": url, "api_key": "wrong", "model": "Qwen3.6-27B", "requests": 1}, capsys)
    assert result["healthy"] is True
    assert result["error"].startswith(f"POST {url}/v1/completions answered HTTP 401")
    assert "completions" not in result


def test_never_healthy_answers_503(vllm, capsys):
    url = vllm({"never_healthy": True})
    time.sleep(0.7)
    result = probe({"url": url, "requests": 1}, capsys)
    assert result["health_status"] == 503
    assert result["healthy"] is False
    assert result["error"] == f"GET {url}/health answered HTTP 503, not 200"


def test_nothing_listening(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    result = probe({"url": url}, capsys)
    assert result["health_status"] is None
    assert result["error"].startswith(f"GET {url}/health: ")


def test_unit_state_is_read_with_systemctl(monkeypatch, capsys, tmp_path):
    fake = tmp_path / "systemctl"
    fake.write_text(
        "#!/bin/sh\nprintf 'ActiveState=activating\\nSubState=auto-restart\\nNRestarts=4\\nResult=exit-code\\n'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    result = probe({"url": f"http://127.0.0.1:{free_port()}", "unit": "vllm-qwen.service"}, capsys)
    assert result["unit_state"]["NRestarts"] == "4"
    assert result["unit_problem"] == "the unit is crash-looping: systemd restarted it 4 times (SubState=auto-restart)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"url": "127.0.0.1:8000"},
            "url '127.0.0.1:8000' must start with http:// or https://, e.g. http://127.0.0.1:8000",
        ),
        ({"url": "http://x", "requests": -1}, "requests must be >= 0, not -1"),
        (
            {"url": "http://x", "requests": 1001},
            "requests must be at most 1000 (a probe, not a benchmark), not 1001",
        ),
        ({"url": "http://x", "timeout": 0}, "timeout must be >= 1, not 0"),
    ],
)
def test_bad_parameters_fail_with_the_fix(args, message, capsys):
    result = probe(args, capsys)
    assert result["failed"] is True
    assert result["msg"] == message
