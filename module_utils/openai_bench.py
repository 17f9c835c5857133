"""Pure helpers of the serving benchmark (openai_bench): requests planned, streams read, figures summed.

The module sends streamed completions (``stream: true`` on ``/v1/completions``: server-sent events,
one ``data: {json}`` line per chunk, ``data: [DONE]`` last) and records when each chunk arrived.
These helpers turn that into figures: time to first token (first chunk with text), output tokens
per second, per concurrency level the aggregate throughput and the latency spread, and the mean
acceptance length from the spec-decode counters (parsed by ``openai_probe``'s helpers). Standard
library only, no I/O: the module does the HTTP and the clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ansible.module_utils.figures import FigureError, require_positive, token_count
from ansible.module_utils.openai_probe import SpecCounters, draft_acceptance_rate, mean_acceptance_length
from ansible.module_utils.safe_io import lone_surrogate

DONE = "[DONE]"
# Biggest sweep accepted: beyond this a "small concurrency sweep" is a load test.
MAX_CONCURRENCY = 256


class BenchError(ValueError):
    """The server's answer is not what the OpenAI streaming API sends, or a setting is unusable."""


@dataclass(frozen=True)
class RequestTiming:
    """One streamed completion, times in seconds from the moment the request was sent."""

    ttft_s: float
    total_s: float
    tokens: int
    tokens_from_usage: bool
    chunks: int

    @property
    def tokens_per_second(self) -> float:
        # level_summary refuses a request whose time is not above zero before any of this is read.
        return self.tokens / self.total_s if self.total_s > 0 else 0.0


def validate_sweep(levels: list[int]) -> list[int]:
    """The concurrency levels in ascending order; each an integer from 1 to MAX_CONCURRENCY, no repeats."""
    if not levels:
        raise BenchError("concurrency is empty: give at least one level, e.g. [1, 2, 4]")
    bad = [v for v in levels if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CONCURRENCY]
    if bad:
        raise BenchError(f"concurrency levels must be integers from 1 to {MAX_CONCURRENCY}, not {bad}")
    if len(set(levels)) != len(levels):
        raise BenchError(f"concurrency levels repeat: {levels}; give each level once")
    return sorted(levels)


def validate_prompts(prompts: list[str]) -> list[str]:
    if not prompts:
        raise BenchError("the prompt set is empty: give at least one prompt")
    empty = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()]
    if empty:
        raise BenchError(f"prompt(s) at index {empty} are empty: every prompt needs text")
    return prompts


def plan_requests(prompts: list[str], concurrency: int, requests: int | None) -> list[str]:
    """Prompts of one level, in order, cycling through the set.

    Default count: every prompt once and at least two requests per slot, so that the level really
    holds ``concurrency`` requests in flight for a while.
    """
    count = requests if requests is not None else max(len(prompts), 2 * concurrency)
    if count < concurrency:
        raise BenchError(
            f"{count} request(s) per level cannot keep {concurrency} in flight: give at least {concurrency}"
        )
    return [prompts[i % len(prompts)] for i in range(count)]


def parse_sse_line(line: str) -> dict | str | None:
    """One line of an SSE stream: the JSON payload of a ``data:`` line, DONE, or None for anything else."""
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None  # blank separator, ": comment", "event:", "id:", "retry:"
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):  # ValueError: also an integer past Python's digit limit
        raise BenchError(f"stream chunk is not JSON: {data[:120]!r}") from None
    escape = lone_surrogate(payload, data)
    if escape is not None:  # the result (and this message) must stay UTF-8: the chunk is never echoed
        raise BenchError(f"stream chunk holds a lone surrogate ({escape} escape), which no UTF-8 text can hold")
    if not isinstance(payload, dict):
        raise BenchError(f"stream chunk is not a JSON object: {data[:120]!r}")
    if "error" in payload:
        raise BenchError(f"the server reported an error mid-stream: {str(payload['error'])[:200]}")
    return payload


def chunk_text(payload: dict) -> str:
    """Generated text a completion chunk carries (``choices[0].text``); empty for the usage chunk."""
    choices = payload.get("choices")
    if not isinstance(choices, list):
        raise BenchError(f"stream chunk has no choices list: {json.dumps(payload)[:160]}")
    return "".join(str(c.get("text") or "") for c in choices if isinstance(c, dict))


def chunk_usage_tokens(payload: dict) -> int | None:
    usage = payload.get("usage")
    if not isinstance(usage, dict) or usage.get("completion_tokens") is None:
        return None
    try:
        return token_count(usage["completion_tokens"], "usage.completion_tokens")
    except FigureError as exc:  # 8e306 made every figure of the run Infinity or NaN (issue 43)
        raise BenchError(f"{exc}; the server's usage figures are broken") from None


def request_timing(events: list[tuple[float, dict]], done_s: float) -> RequestTiming:
    """Figures of one stream from its chunks as (seconds since sent, payload) and the time [DONE] came.

    Tokens are the server's ``usage.completion_tokens`` (asked with ``stream_options.include_usage``);
    a server that sends no usage is counted one token per chunk with text, which undercounts an
    engine that sends several tokens per chunk (speculative decoding): ``tokens_from_usage`` says which.
    """
    ttft = None
    chunks = 0
    usage = None
    for at, payload in events:
        if chunk_text(payload):
            chunks += 1
            if ttft is None:
                ttft = at
        counted = chunk_usage_tokens(payload)
        if counted is not None:
            usage = counted
    if ttft is None:
        raise BenchError("the stream ended without any generated text")
    if usage == 0:
        raise BenchError(
            "usage.completion_tokens is 0 for a stream that carried text; the server's usage figures are broken"
        )
    tokens = usage if usage is not None else chunks
    return RequestTiming(round(ttft, 6), round(done_s, 6), tokens, usage is not None, chunks)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q from 0 to 100."""
    if not values:
        raise BenchError("no values to take a percentile of")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def describe(values: list[float], digits: int = 2) -> dict[str, float]:
    """mean, p50, p90 and max of a list, rounded."""
    return {
        "mean": round(sum(values) / len(values), digits),
        "p50": round(percentile(values, 50), digits),
        "p90": round(percentile(values, 90), digits),
        "max": round(max(values), digits),
    }


def level_summary(concurrency: int, timings: list[RequestTiming], wall_s: float, spec: SpecCounters | None) -> dict:
    """One concurrency level: throughput over the level's wall time, per-request figures, acceptance.

    ``spec`` is the spec-decode counter delta over the level, None when the server has no such
    counters (SGLang): then the acceptance figures are null.
    """
    if not timings:
        raise BenchError(f"concurrency {concurrency}: no request finished")
    tokens = sum(t.tokens for t in timings)
    present = spec is not None and spec.present
    try:  # every figure finite and above zero, or none is reported (issue 43)
        wall = require_positive(wall_s, f"concurrency {concurrency}: the level's wall time")
        throughput = require_positive(round(tokens / wall, 2), f"concurrency {concurrency}: the throughput in tok/s")
        for t in timings:
            require_positive(t.total_s, f"concurrency {concurrency}: a request's time")
    except FigureError as exc:
        raise BenchError(f"{exc}; no figure of this level can be reported") from None
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "output_tokens": tokens,
        "tokens_from_usage": all(t.tokens_from_usage for t in timings),
        "wall_s": round(wall_s, 3),
        "throughput_tok_s": throughput,
        "request_tok_s": describe([t.tokens_per_second for t in timings]),
        "ttft_ms": describe([t.ttft_s * 1000 for t in timings], 1),
        "latency_s": describe([t.total_s for t in timings], 3),
        "mean_acceptance_length": mean_acceptance_length(spec) if present and spec else None,
        "draft_acceptance_rate": draft_acceptance_rate(spec) if present and spec else None,
    }


def run_summary(levels: list[dict], spec: SpecCounters | None) -> dict:
    """Headline figures of a run: single-request speed and TTFT (concurrency 1), peak throughput, acceptance."""
    single = next((lv for lv in levels if lv["concurrency"] == 1), None)
    present = spec is not None and spec.present
    return {
        "single_request_tok_s": single["request_tok_s"]["mean"] if single else None,
        "single_request_ttft_ms": single["ttft_ms"]["p50"] if single else None,
        "peak_throughput_tok_s": max((lv["throughput_tok_s"] or 0.0) for lv in levels) if levels else None,
        "mean_acceptance_length": mean_acceptance_length(spec) if present and spec else None,
        "draft_acceptance_rate": draft_acceptance_rate(spec) if present and spec else None,
        "spec_decode": spec.as_dict() if present and spec else None,
    }
