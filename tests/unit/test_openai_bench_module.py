"""openai_bench run in-process against the lab's stand-in engines (tests/fakes/inference_server.py) on loopback."""

from __future__ import annotations

import importlib.util
import json
import sys

import openai_bench
import pytest
from ansible.module_utils.testing import patch_module_args
from stand_in_engine import SERVER, StandIns, answers, free_port

KEY = "sk-bench-7f3a91"
PROMPTS = ["one two three four", "five six seven"]

_spec = importlib.util.spec_from_file_location("inference_server_bench", SERVER)
fake = importlib.util.module_from_spec(_spec)
sys.modules["inference_server_bench"] = fake
_spec.loader.exec_module(fake)


@pytest.fixture
def serve(tmp_path, target):
    """Start a stand-in engine ("vllm" with a DFlash drafter, or "sglang" with MTP); returns its URL once healthy."""
    engines = StandIns(tmp_path, target, KEY)

    def start(engine: str, knobs: dict | None = None) -> str:
        url = engines.start(engine, knobs)
        if answers(f"{url}/health", 15):
            return url
        raise AssertionError(f"the stand-in {engine} never became healthy")

    yield start
    engines.stop()


def bench(args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        openai_bench.main()
    return json.loads(capsys.readouterr().out)


def test_stand_in_speeds_come_from_the_engines_speculative_settings(target):
    # vLLM: 1 bonus + 35% of 15 draft tokens; SGLang MTP: 1 + 35% of 3 steps; no speculation: 1.
    sglang = fake.SGLang.from_argv(
        ["--model-path", str(target), "--speculative-algo", "NEXTN", "--speculative-num-steps", "3"]
    )
    assert sglang.tokens_per_step() == pytest.approx(2.05)
    assert fake.SGLang.from_argv(["--model-path", str(target)]).tokens_per_step() == 1.0
    vllm = fake.VLLM.from_argv(["serve", str(target)])
    vllm.speculative = {"num_speculative_tokens": 15}
    assert vllm.tokens_per_step() == pytest.approx(6.25)
    vllm.accept_share = fake.LOW_ACCEPT_SHARE
    assert vllm.tokens_per_step() == pytest.approx(1.06)


def test_vllm_sweep_with_acceptance(serve, capsys):
    url = serve("vllm")
    result = bench({"url": url, "api_key": KEY, "prompts": PROMPTS, "concurrency": [2, 1], "max_tokens": 24}, capsys)
    assert result["changed"] is False
    assert result["healthy"] is True
    assert result["model"] == "Qwen3.6-27B"
    assert result["metrics_available"] is True
    assert result["settings"] == {
        "max_tokens": 24,
        "ignore_eos": True,
        "warmup": 1,
        "prompts": 2,
        "requests_per_level": {"1": 2, "2": 4},
        "concurrency": [1, 2],
    }
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert [lv["requests"] for lv in result["levels"]] == [2, 4]
    assert [lv["output_tokens"] for lv in result["levels"]] == [48, 96]
    for level in result["levels"]:
        assert level["tokens_from_usage"] is True
        assert level["throughput_tok_s"] > 0
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["max"]
        assert level["mean_acceptance_length"] > 1.0
    summary = result["summary"]
    assert summary["single_request_tok_s"] > 0
    assert summary["mean_acceptance_length"] > 1.0
    assert summary["spec_decode"]["generation_tokens"] == 144.0
    assert KEY not in json.dumps(result)


def test_sglang_has_no_acceptance_and_is_slower(serve, capsys):
    sglang = bench({"url": serve("sglang"), "prompts": PROMPTS, "concurrency": [1], "max_tokens": 48}, capsys)
    vllm = bench(
        {"url": serve("vllm"), "api_key": KEY, "prompts": PROMPTS, "concurrency": [1], "max_tokens": 48}, capsys
    )
    assert sglang["summary"]["mean_acceptance_length"] is None
    assert sglang["levels"][0]["mean_acceptance_length"] is None
    assert sglang["summary"]["spec_decode"] is None
    assert sglang["summary"]["single_request_tok_s"] > 0
    assert vllm["summary"]["single_request_tok_s"] > 1.5 * sglang["summary"]["single_request_tok_s"]


def test_wrong_key_fails_with_the_status(serve, capsys):
    result = bench({"url": serve("vllm"), "api_key": "sk-wrong", "prompts": PROMPTS, "concurrency": [1]}, capsys)
    assert result["failed"] is True
    assert result["msg"] == (
        f"benchmark of {result['url']} failed: GET {result['url']}/v1/models answered HTTP 401: "
        '{"error": {"message": "invalid API key"}}'
    )
    assert "sk-wrong" not in json.dumps(result)


def test_nothing_listening_is_not_healthy(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    result = bench({"url": url, "prompts": PROMPTS}, capsys)
    assert result["failed"] is True
    assert result["healthy"] is False
    assert result["msg"].startswith(f"the server at {url} is not healthy: GET {url}/health: ")
    assert "Connection refused" in result["msg"]


def test_still_loading_is_not_healthy(target, capsys, tmp_path):
    engines = StandIns(tmp_path, target, KEY)
    try:
        url = engines.start("sglang", {"never_healthy": True}, spec=False)
        answers(f"{url}/health", 5, any_status=True)
        result = bench({"url": url, "prompts": PROMPTS}, capsys)
    finally:
        engines.stop()
    assert result["failed"] is True
    assert result["msg"] == f"the server at {url} is not healthy: GET {url}/health answered HTTP 503: loading"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"url": "127.0.0.1:8000"},
            "url '127.0.0.1:8000' must start with http:// or https://, e.g. http://127.0.0.1:8000",
        ),
        ({"max_tokens": 0}, "max_tokens must be >= 1, not 0"),
        ({"warmup": -1}, "warmup must be >= 0, not -1"),
        ({"warmup": 1001}, "warmup must be at most 1000, not 1001"),
        ({"requests_per_level": 100001}, "requests_per_level must be at most 100000, not 100001"),
        ({"prompts": []}, "the prompt set is empty: give at least one prompt"),
        ({"concurrency": [1, 1]}, "concurrency levels repeat: [1, 1]; give each level once"),
        (
            {"concurrency": [8], "requests_per_level": 4},
            "4 request(s) per level cannot keep 8 in flight: give at least 8",
        ),
    ],
)
def test_bad_parameters_fail_with_the_fix(args, message, capsys):
    result = bench({"url": "http://127.0.0.1:9", "prompts": PROMPTS, **args}, capsys)
    assert result["failed"] is True
    assert result["msg"] == message
