#!/usr/bin/python
"""Ansible module: benchmark an OpenAI-compatible inference server with streamed completions."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: openai_bench
short_description: Benchmark an OpenAI-compatible inference server (tokens per second, TTFT, acceptance)
description:
  - Sends a fixed prompt set as streamed completions (C(stream) set to true on C(/v1/completions), with
    C(stream_options.include_usage)) at each concurrency level of a sweep, one level after the other,
    after I(warmup) unmeasured requests.
  - Per level it reports the aggregate output throughput (output tokens over the level's wall time),
    per-request output tokens per second (tokens over the request's whole time), time to first token
    (first chunk with text) and latency as mean/p50/p90/max, and the mean acceptance length
    1 + accepted / drafts from the delta of vLLM's spec-decode counters on C(/metrics) over the level
    (null for a server without them, e.g. SGLang). Output tokens are the server's
    C(usage.completion_tokens); a server that sends no usage is counted one token per chunk
    (C(tokens_from_usage) false).
  - The counters count every request the server serves; run it while nothing else sends traffic.
  - Read-only on the node, so it runs the same in check mode. Fails with a sentence when the server is
    not healthy or a request fails; the API key is never logged or returned.
extends_documentation_fragment:
  - openai_endpoint
  - attributes
  - attributes.read_only
options:
  prompts:
    description: The prompt set, sent in order and cycled through.
    type: list
    elements: str
    required: true
  concurrency:
    description: Requests in flight at each level of the sweep; 1 is the single-request run.
    type: list
    elements: int
    default: [1, 2, 4]
  requests_per_level:
    description: Requests per level, at most 100000; default every prompt once and at least twice the level's concurrency.
    type: int
  max_tokens:
    description: Tokens to generate per request.
    type: int
    default: 128
  ignore_eos:
    description: Ask the server to generate I(max_tokens) whatever the model would stop at (vLLM and SGLang accept it), so every run measures the same length.
    type: bool
    default: true
  warmup:
    description: Unmeasured requests before the first level, at most 1000.
    type: int
    default: 1
  timeout:
    description:
      - Seconds allowed for each request, start to last byte (a server trickling bytes cannot stretch it); 1 to 86400.
      - Answers are capped (32 MiB, 1 MiB per stream line) and redirects are refused, so the API key never
        goes to another server; a cut stream fails its level.
    type: int
    default: 300
"""

EXAMPLES = r"""
- name: Benchmark the local vLLM at concurrency 1, 2 and 4
  openai_bench:
    url: http://127.0.0.1:8000
    api_key: "{{ vault_vllm_api_key }}"
    prompts: "{{ lookup('ansible.builtin.file', 'bench_prompts.json') | from_json }}"
    concurrency: [1, 2, 4]
  register: __bench

- name: The same in check mode (read-only, so it really measures)
  openai_bench:
    url: http://127.0.0.1:30000
    prompts: ["The capital of France is"]
    concurrency: [1]
  check_mode: true
"""

RETURN = r"""
url:
  description: The server benchmarked.
  type: str
  returned: always
  sample: http://127.0.0.1:8000
healthy:
  description: Whether C(/health) answered 200.
  type: bool
  returned: always
  sample: true
model:
  description: Model the completions were sent to.
  type: str
  returned: success
  sample: Qwen3.6-27B
settings:
  description: What was measured (max_tokens, ignore_eos, warmup, prompts, requests per level, concurrency).
  type: dict
  returned: success
  sample: {"max_tokens": 128, "ignore_eos": true, "warmup": 1, "prompts": 8, "concurrency": [1, 2, 4]}
levels:
  description: One entry per concurrency level, ascending.
  type: list
  elements: dict
  returned: success
  sample:
    - concurrency: 1
      requests: 8
      output_tokens: 1024
      tokens_from_usage: true
      wall_s: 4.1
      throughput_tok_s: 249.8
      request_tok_s: {"mean": 250.1, "p50": 250.3, "p90": 251.0, "max": 251.2}
      ttft_ms: {"mean": 24.1, "p50": 23.9, "p90": 25.0, "max": 25.3}
      latency_s: {"mean": 0.512, "p50": 0.511, "p90": 0.515, "max": 0.516}
      mean_acceptance_length: 6.25
      draft_acceptance_rate: 0.35
summary:
  description: Headline figures (single_request_tok_s, single_request_ttft_ms p50, peak_throughput_tok_s, mean_acceptance_length and draft_acceptance_rate over all levels, spec_decode counter deltas or null).
  type: dict
  returned: success
  sample: {"single_request_tok_s": 250.1, "single_request_ttft_ms": 23.9, "peak_throughput_tok_s": 820.4,
           "mean_acceptance_length": 6.25, "draft_acceptance_rate": 0.35, "spec_decode": null}
metrics_available:
  description: Whether C(/metrics) answered; false means no acceptance figures.
  type: bool
  returned: success
  sample: true
"""

import contextlib
import threading
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.openai_bench import (
    DONE,
    BenchError,
    RequestTiming,
    level_summary,
    parse_sse_line,
    plan_requests,
    request_timing,
    run_summary,
    validate_prompts,
    validate_sweep,
)
from ansible.module_utils.openai_http import Answer, HttpError, build_opener, loads_answer, send, settings_problem
from ansible.module_utils.openai_probe import (
    MetricsParseError,
    SpecCounters,
    counters_delta,
    parse_prometheus_text,
    spec_decode_counters,
)
from ansible.module_utils.terminal_text import terminal_text

# Far beyond any useful run; a bigger count would only hold the play for days (or allocate forever).
MAX_WARMUP = 1000
MAX_REQUESTS_PER_LEVEL = 100000


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "api_key": {"type": "str", "no_log": True},
            "model": {"type": "str"},
            "prompts": {"type": "list", "elements": "str", "required": True},
            "concurrency": {"type": "list", "elements": "int", "default": [1, 2, 4]},
            "requests_per_level": {"type": "int"},
            "max_tokens": {"type": "int", "default": 128},
            "ignore_eos": {"type": "bool", "default": True},
            "warmup": {"type": "int", "default": 1},
            "timeout": {"type": "int", "default": 300},
        },
        supports_check_mode=True,
    )


class Client:
    """The HTTP side: plain requests and streamed completions, the key in a header only.

    One urllib opener (no proxy, one TLS context, redirects refused) for the whole run: Ansible's
    open_url builds its handlers and TLS context on every call, which costs more than a time to
    first token. Each request must be answered completely within ``timeout`` seconds.
    """

    def __init__(self, base: str, api_key: str | None, timeout: int) -> None:
        self.base = base
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.opener = build_opener()

    def open(self, method: str, path: str, body: dict | None = None) -> Answer:
        answer = send(self.opener, method, f"{self.base}{path}", self.headers, body, self.timeout)
        if answer.status != 200:
            detail = ""
            with contextlib.suppress(HttpError):
                detail = answer.text(4096)[:200]
            answer.close()
            raise HttpError(f"{method} {self.base}{path} answered HTTP {answer.status}: {detail}".rstrip(": "))
        return answer

    def get(self, path: str) -> str:
        answer = self.open("GET", path)
        try:
            return answer.text()
        finally:
            answer.close()

    def counters(self, model: str) -> SpecCounters | None:
        """The spec-decode counters, or None when the server has no /metrics."""
        try:
            text = self.get("/metrics")
        except HttpError as e:
            if "answered HTTP" in str(e):
                return None
            raise
        return spec_decode_counters(parse_prometheus_text(text), model)

    def stream(self, body: dict) -> RequestTiming:
        sent = time.monotonic()
        resp = self.open("POST", "/v1/completions", body)
        events: list[tuple[float, dict]] = []
        try:
            while True:
                raw = resp.readline()
                if not raw:
                    raise BenchError("the stream ended without data: [DONE]")
                payload = parse_sse_line(raw.decode("utf-8", "replace"))
                if payload == DONE:
                    return request_timing(events, time.monotonic() - sent)
                if isinstance(payload, dict):
                    events.append((time.monotonic() - sent, payload))
        finally:
            resp.close()


def run_level(client: Client, prompts: list[str], concurrency: int, body: dict) -> tuple[list[RequestTiming], float]:
    """Every prompt of the level through `concurrency` worker threads; the first failure stops the level."""
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    timings: dict[int, RequestTiming] = {}
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if errors or not queue:
                    return
                index, prompt = queue.pop(0)
            try:
                timing = client.stream({**body, "prompt": prompt})
            except (HttpError, BenchError, OSError) as e:
                with lock:
                    errors.append(f"request {index + 1} at concurrency {concurrency}: {e}")
                return
            except Exception as e:  # a worker must never die unrecorded: its level would look good
                with lock:
                    errors.append(f"request {index + 1} at concurrency {concurrency}: {type(e).__name__}: {e}")
                return
            with lock:
                timings[index] = timing

    started = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    if errors:
        raise BenchError(errors[0])
    return [timings[i] for i in sorted(timings)], wall


def run(module: AnsibleModule) -> dict:
    p = module.params
    base = p["url"].rstrip("/")
    client = Client(base, p["api_key"], p["timeout"])
    result: dict = {"changed": False, "url": base, "healthy": False}
    try:
        client.get("/health")
    except HttpError as e:
        module.fail_json(msg=terminal_text(f"the server at {base} is not healthy: {e}", 2000), **result)
    result["healthy"] = True
    try:
        model = p["model"] or loads_answer(client.get("/v1/models"), f"GET {base}/v1/models")["data"][0]["id"]
        levels = validate_sweep(p["concurrency"])
        body = {
            "model": model,
            "max_tokens": p["max_tokens"],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if p["ignore_eos"]:
            body["ignore_eos"] = True
        plans = {c: plan_requests(p["prompts"], c, p["requests_per_level"]) for c in levels}
        for i in range(p["warmup"]):
            client.stream({**body, "prompt": p["prompts"][i % len(p["prompts"])]})
        first = client.counters(model)
        before = first
        summaries = []
        for c in levels:
            timings, wall = run_level(client, plans[c], c, body)
            after = client.counters(model)
            delta = counters_delta(before, after) if before is not None and after is not None else None
            summaries.append(level_summary(c, timings, wall, delta))
            before = after
        total = counters_delta(first, before) if first is not None and before is not None else None
    except (HttpError, BenchError, MetricsParseError) as e:
        # The server's own words (a 500 body, a mid-stream error) without its escape sequences (issue 43).
        module.fail_json(msg=terminal_text(f"benchmark of {base} failed: {e}", 2000), **result)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        detail = f"{type(e).__name__}: {str(e)[:200]}"
        module.fail_json(
            msg=terminal_text(f"the server at {base} did not answer as the OpenAI API does: {detail}", 2000), **result
        )
    result.update(
        model=model,
        settings={
            "max_tokens": p["max_tokens"],
            "ignore_eos": p["ignore_eos"],
            "warmup": p["warmup"],
            "prompts": len(p["prompts"]),
            "requests_per_level": {str(c): len(plans[c]) for c in levels},
            "concurrency": levels,
        },
        levels=summaries,
        summary=run_summary(summaries, total),
        metrics_available=first is not None,
    )
    return result


def validate(module: AnsibleModule) -> None:
    p = module.params
    problem = settings_problem(p["url"], p["api_key"], p["timeout"])
    if problem is not None:
        module.fail_json(msg=problem)
    for name, low in (("max_tokens", 1), ("warmup", 0), ("requests_per_level", 1)):
        if p[name] is not None and p[name] < low:
            module.fail_json(msg=f"{name} must be >= {low}, not {p[name]}")
    for name, high in (("warmup", MAX_WARMUP), ("requests_per_level", MAX_REQUESTS_PER_LEVEL)):
        if p[name] is not None and p[name] > high:
            module.fail_json(msg=f"{name} must be at most {high}, not {p[name]}")
    try:
        validate_prompts(p["prompts"])
        validate_sweep(p["concurrency"])
        if p["requests_per_level"] is not None:
            for c in p["concurrency"]:
                plan_requests(p["prompts"], c, p["requests_per_level"])
    except BenchError as e:
        module.fail_json(msg=str(e))


def main() -> None:
    module = build_module()
    validate(module)
    module.exit_json(**run(module))


if __name__ == "__main__":
    main()
