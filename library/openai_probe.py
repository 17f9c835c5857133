#!/usr/bin/python
"""Ansible module: probe an OpenAI-compatible inference server (health, completion, spec-decode counters)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: openai_probe
short_description: Probe an OpenAI-compatible inference server and its vLLM spec-decode counters
description:
  - Reads C(/health); with I(requests) > 0 also sends that many real completions to
    C(/v1/completions), reads C(/metrics) before and after, and computes from vLLM's spec-decode
    counters (C(vllm:spec_decode_num_drafts), C(..._num_draft_tokens), C(..._num_accepted_tokens),
    C(..._num_accepted_tokens_per_pos)) the mean acceptance length, 1 + accepted / drafts, over
    exactly those requests, and the tokens per second the client saw.
  - With I(unit), also reads the systemd unit's state, so a caller waiting for health can stop
    waiting when the unit failed or is crash-looping (a unit can be C(active) while it restarts).
  - Never fails because of what it finds (the caller asserts on the result); fails only on bad
    parameters. Read-only (it changes nothing on the node), so it runs the same in check mode.
extends_documentation_fragment:
  - openai_endpoint
  - attributes
  - attributes.read_only
options:
  requests:
    description: Completions to send, at most 1000. C(0) reads C(/health) (and the unit) only.
    type: int
    default: 0
  prompt:
    description: Prompt of every completion.
    type: str
    default: "The capital of France is Paris. The capital of Italy is"
  max_tokens:
    description: Tokens to generate per completion.
    type: int
    default: 64
  timeout:
    description:
      - Seconds allowed for each HTTP request, start to last byte (a server trickling bytes cannot stretch it); 1 to 86400.
      - Answers are capped at 32 MiB and redirects are refused, so the API key never goes to another server.
    type: int
    default: 60
  unit:
    description: systemd unit serving the endpoint, to report its state and whether it is crash-looping.
    type: str
  max_restarts:
    description: With I(unit), more restarts than this count as crash-looping.
    type: int
    default: 2
"""

EXAMPLES = r"""
- name: Wait for vLLM to answer /health, stopping early if its unit crash-loops
  openai_probe:
    url: http://127.0.0.1:8000
    unit: vllm-qwen.service
  register: __health
  until: __health.healthy or __health.unit_problem
  retries: 360
  delay: 5

- name: One real completion and the acceptance length over three requests
  openai_probe:
    url: http://127.0.0.1:8000
    api_key: "{{ vault_vllm_api_key }}"
    requests: 3
  register: __probe

- name: The same in check mode (read-only, so it really probes)
  openai_probe:
    url: http://127.0.0.1:8000
  check_mode: true
"""

RETURN = r"""
health_status:
  description: HTTP status of C(/health); null when the server did not answer.
  type: int
  returned: always
  sample: 200
healthy:
  description: Whether C(/health) answered 200.
  type: bool
  returned: always
  sample: true
error:
  description: The first thing that went wrong (connection refused, HTTP error, bad /metrics); empty when nothing did.
  type: str
  returned: always
  sample: ""
unit_state:
  description: ActiveState, SubState, NRestarts, Result and MainPID of I(unit).
  type: dict
  returned: when unit is given
  sample: {"ActiveState": "active", "SubState": "running", "NRestarts": "0", "Result": "success", "MainPID": "812"}
unit_problem:
  description: Why the unit cannot become healthy (failed, crash-looping); empty when none or no unit given.
  type: str
  returned: always
  sample: ""
model:
  description: Model the completions were sent to.
  type: str
  returned: when requests > 0
  sample: Qwen3.6-27B
completions:
  description: Completions that came back with non-empty text.
  type: int
  returned: when requests > 0
  sample: 3
completion_text:
  description: Text of the first completion (the evidence that the model generates).
  type: str
  returned: when requests > 0
  sample: " Rome. The capital of Spain is Madrid."
completion_tokens:
  description: Tokens generated over all completions, as the server's usage reports them.
  type: int
  returned: when requests > 0
  sample: 192
tokens_per_second:
  description: completion_tokens divided by the wall time of the completions (single stream, sequential).
  type: float
  returned: when requests > 0
  sample: 142.7
spec_decode:
  description: Spec-decode counter deltas over the probe requests (drafts, draft_tokens, accepted_tokens, accepted_per_position, generation_tokens, present).
  type: dict
  returned: when requests > 0
  sample: {"drafts": 33, "draft_tokens": 495, "accepted_tokens": 159, "accepted_per_position": {"0": 33}, "generation_tokens": 192, "present": true}
mean_acceptance_length:
  description: 1 + accepted / drafts over the probe requests; null when the server made no drafts.
  type: float
  returned: when requests > 0
  sample: 5.8182
draft_acceptance_rate:
  description: accepted / draft_tokens over the probe requests; null when no draft token was proposed.
  type: float
  returned: when requests > 0
  sample: 0.3212
"""

import contextlib
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.figures import MAX_TOKENS, FigureError, token_count
from ansible.module_utils.openai_http import HttpError, build_opener, loads_answer, send, settings_problem
from ansible.module_utils.openai_probe import (
    MetricsParseError,
    SpecCounters,
    counters_delta,
    draft_acceptance_rate,
    mean_acceptance_length,
    parse_prometheus_text,
    parse_systemctl_show,
    spec_decode_counters,
    tokens_per_second,
    unit_is_crashing,
)
from ansible.module_utils.terminal_text import terminal_text, terminal_values

SYSTEMCTL_PROPS = "ActiveState,SubState,NRestarts,Result,MainPID"
# Each completion may take up to timeout seconds: a probe that sends more is a benchmark (openai_bench).
MAX_REQUESTS = 1000
_OPENER = build_opener()


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "api_key": {"type": "str", "no_log": True},
            "model": {"type": "str"},
            "requests": {"type": "int", "default": 0},
            "prompt": {"type": "str", "default": "The capital of France is Paris. The capital of Italy is"},
            "max_tokens": {"type": "int", "default": 64},
            "timeout": {"type": "int", "default": 60},
            "unit": {"type": "str"},
            "max_restarts": {"type": "int", "default": 2},
        },
        supports_check_mode=True,
    )


def http(module: AnsibleModule, method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    """Status and body of one request, answered completely within ``timeout`` seconds, at most 32 MiB.

    Redirects are refused (the API key would go along); a cut, stalled or oversized answer is an HttpError.
    """
    p = module.params
    headers = {"Content-Type": "application/json"}
    if p["api_key"]:
        headers["Authorization"] = f"Bearer {p['api_key']}"
    answer = send(_OPENER, method, url, headers, body, p["timeout"])
    try:
        if answer.status != 200:
            detail = ""
            with contextlib.suppress(HttpError):
                detail = answer.text(4096)[:300]
            return answer.status, detail
        return answer.status, answer.text()
    finally:
        answer.close()


def read_counters(module: AnsibleModule, base: str, model: str) -> SpecCounters:
    code, text = http(module, "GET", f"{base}/metrics")
    if code != 200:
        raise HttpError(f"GET {base}/metrics answered HTTP {code}")
    return spec_decode_counters(parse_prometheus_text(text), model)


def run(module: AnsibleModule) -> dict:
    p = module.params
    base = p["url"].rstrip("/")
    result: dict = {"changed": False, "health_status": None, "healthy": False, "error": "", "unit_problem": ""}
    if p["unit"]:
        rc, out, err = module.run_command(
            ["systemctl", "show", "-p", SYSTEMCTL_PROPS, p["unit"]], environ_update={"LC_ALL": "C"}
        )
        if rc != 0:
            result["unit_problem"] = f"systemctl show {p['unit']} failed: {(err or out).strip()}"
        else:
            state = parse_systemctl_show(out)
            result["unit_state"] = state
            result["unit_problem"] = unit_is_crashing(state, p["max_restarts"]) or ""
    try:
        code, _ = http(module, "GET", f"{base}/health")
        result["health_status"] = code
        result["healthy"] = code == 200
    except HttpError as e:
        result["error"] = str(e)
        return result
    if p["requests"] == 0:
        return result
    if not result["healthy"]:
        result["error"] = f"GET {base}/health answered HTTP {result['health_status']}, not 200"
        return result
    try:
        model = p["model"]
        if not model:
            code, text = http(module, "GET", f"{base}/v1/models")
            if code != 200:
                raise HttpError(f"GET {base}/v1/models answered HTTP {code}: {text[:200]}")
            model = loads_answer(text, f"GET {base}/v1/models")["data"][0]["id"]
        result["model"] = model
        before = read_counters(module, base, model)
        texts: list[str] = []
        tokens = 0
        started = time.monotonic()
        for _ in range(p["requests"]):
            body = {"model": model, "prompt": p["prompt"], "max_tokens": p["max_tokens"], "temperature": 0}
            code, text = http(module, "POST", f"{base}/v1/completions", body)
            if code != 200:
                raise HttpError(f"POST {base}/v1/completions answered HTTP {code}: {text[:200]}")
            answer = loads_answer(text, f"POST {base}/v1/completions")
            texts.append(str(answer["choices"][0].get("text") or ""))
            # A count in range before any arithmetic: 400 digits (or 1e308 twice) crashed float() (issue 43).
            used = token_count((answer.get("usage") or {}).get("completion_tokens") or 0, "usage.completion_tokens")
            tokens = token_count(tokens + used, "the completions' usage.completion_tokens together", MAX_TOKENS)
        elapsed = time.monotonic() - started
        after = read_counters(module, base, model)
        delta = counters_delta(before, after)
    except (HttpError, MetricsParseError) as e:
        result["error"] = str(e)
        return result
    except FigureError as e:
        result["error"] = f"the server's answer cannot be measured: {e}; its usage figures are broken"
        return result
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        result["error"] = f"the server's answer is not what the OpenAI API returns: {type(e).__name__}: {str(e)[:200]}"
        return result
    result.update(
        completions=sum(1 for t in texts if t.strip()),
        completion_text=texts[0] if texts else "",
        completion_tokens=tokens,
        tokens_per_second=tokens_per_second(tokens, elapsed),
        spec_decode=delta.as_dict(),
        mean_acceptance_length=mean_acceptance_length(delta),
        draft_acceptance_rate=draft_acceptance_rate(delta),
    )
    return result


def main() -> None:
    module = build_module()
    p = module.params
    for name in ("requests", "max_tokens", "timeout", "max_restarts"):
        if p[name] < (0 if name in ("requests", "max_restarts") else 1):
            module.fail_json(
                msg=f"{name} must be {'>= 0' if name in ('requests', 'max_restarts') else '>= 1'}, not {p[name]}"
            )
    if p["requests"] > MAX_REQUESTS:
        module.fail_json(msg=f"requests must be at most {MAX_REQUESTS} (a probe, not a benchmark), not {p['requests']}")
    problem = settings_problem(p["url"], p["api_key"], p["timeout"])
    if problem is not None:
        module.fail_json(msg=problem)
    result = run(module)
    # What the server, systemd or the network said reaches the operator's terminal through the gates'
    # messages: escape sequences and control characters are removed first (issue 43).
    for key in ("error", "unit_problem"):
        result[key] = terminal_text(result[key], 2000)
    if "unit_state" in result:
        result["unit_state"] = terminal_values(result["unit_state"], 200)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
