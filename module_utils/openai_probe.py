"""Pure helpers for probing an OpenAI-compatible inference server (vLLM, SGLang).

Prometheus text parsing, vLLM's speculative-decoding counters, the mean acceptance length
(1 + accepted / drafts, as vLLM's own dashboards compute it), tokens per second, and the parsing
of ``systemctl show`` output. Standard library only, no I/O: the openai_probe module does the HTTP.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# vLLM's spec-decode counters (same names in 0.20.1 and 0.33.0); prometheus_client exposes a
# counter named N as the sample N_total (and N_created, a timestamp, which is not a count).
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
SPEC_COUNTERS = frozenset({DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS, GENERATION_TOKENS})

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


class MetricsParseError(ValueError):
    """The /metrics body is not Prometheus text exposition format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class SpecCounters:
    """Totals of vLLM's spec-decode counters over every engine of one served model."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    generation_tokens: float = 0.0
    present: bool = False

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": {str(k): v for k, v in sorted(self.accepted_per_position.items())},
            "generation_tokens": self.generation_tokens,
            "present": self.present,
        }


def _unescape(value: str) -> str:
    return value.replace("\\\\", "\0").replace('\\"', '"').replace("\\n", "\n").replace("\0", "\\")


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m or m.end() == pos:
            raise MetricsParseError(f"bad label set {{{text}}}")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return labels


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (version 0.0.4); comments and blank lines skipped."""
    samples: list[Sample] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise MetricsParseError(f"line {number} is not a metric sample: {raw[:120]!r}")
        try:
            value = float(m.group("value"))
        except ValueError:
            raise MetricsParseError(f"line {number}: value {m.group('value')!r} is not a number") from None
        samples.append(Sample(m.group("name"), parse_labels(m.group("labels") or ""), value))
    return samples


def spec_decode_counters(samples: list[Sample], model_name: str | None = None) -> SpecCounters:
    """Sum the spec-decode counters over engines; only `model_name`'s samples when it is given."""
    out = SpecCounters()
    for s in samples:
        if model_name is not None and s.labels.get("model_name", model_name) != model_name:
            continue
        if s.name in SPEC_COUNTERS and not (math.isfinite(s.value) and s.value >= 0):
            # A counter is a count: NaN, Inf or a negative one would turn into a NaN acceptance length.
            raise MetricsParseError(f"{s.name} is {s.value}, not a count; the server's /metrics is broken")
        if s.name == DRAFTS:
            out.drafts += s.value
            out.present = True
        elif s.name == DRAFT_TOKENS:
            out.draft_tokens += s.value
        elif s.name == ACCEPTED:
            out.accepted_tokens += s.value
        elif s.name == ACCEPTED_PER_POS:
            try:
                pos = int(s.labels.get("position", ""))
            except ValueError:
                raise MetricsParseError(f"{ACCEPTED_PER_POS} sample without an integer position label") from None
            out.accepted_per_position[pos] = out.accepted_per_position.get(pos, 0.0) + s.value
        elif s.name == GENERATION_TOKENS:
            out.generation_tokens += s.value
    totals = [out.drafts, out.draft_tokens, out.accepted_tokens, out.generation_tokens]
    if not all(math.isfinite(v) for v in totals + list(out.accepted_per_position.values())):
        raise MetricsParseError("the spec-decode counters add up past any count; the server's /metrics is broken")
    return out


def counters_delta(before: SpecCounters, after: SpecCounters) -> SpecCounters:
    """What happened between two reads. A counter that went down means the server restarted."""
    if after.drafts < before.drafts or after.accepted_tokens < before.accepted_tokens:
        raise MetricsParseError("spec-decode counters went down between two reads: the server restarted meanwhile")
    positions = set(before.accepted_per_position) | set(after.accepted_per_position)
    return SpecCounters(
        drafts=after.drafts - before.drafts,
        draft_tokens=after.draft_tokens - before.draft_tokens,
        accepted_tokens=after.accepted_tokens - before.accepted_tokens,
        accepted_per_position={
            p: after.accepted_per_position.get(p, 0.0) - before.accepted_per_position.get(p, 0.0)
            for p in sorted(positions)
        },
        generation_tokens=after.generation_tokens - before.generation_tokens,
        present=after.present,
    )


def mean_acceptance_length(counters: SpecCounters) -> float | None:
    """1 + accepted / drafts: tokens produced per target step. None when no draft was made."""
    if counters.drafts <= 0:
        return None
    return _finite(1.0 + counters.accepted_tokens / counters.drafts, "mean acceptance length")


def draft_acceptance_rate(counters: SpecCounters) -> float | None:
    """Share of proposed draft tokens the target accepted. None when no draft token was proposed."""
    if counters.draft_tokens <= 0:
        return None
    return _finite(counters.accepted_tokens / counters.draft_tokens, "draft acceptance rate")


def _finite(value: float, what: str) -> float:
    """``value`` rounded, or MetricsParseError: counters of 1e308 accepted over 1e-300 drafts give Infinity,
    which would pass any floor (issue 43)."""
    if not math.isfinite(value):
        raise MetricsParseError(f"the spec-decode counters give a {what} of {value}; the server's /metrics is broken")
    return round(value, 4)


def tokens_per_second(tokens: float, seconds: float) -> float | None:
    """tokens / seconds rounded; None when either is not a finite figure or the quotient is not (never Infinity)."""
    if not (math.isfinite(seconds) and seconds > 0) or isinstance(tokens, bool):
        return None
    try:
        rate = tokens / seconds
    except OverflowError:  # an int too large for a float
        return None
    return round(rate, 2) if math.isfinite(rate) and rate >= 0 else None


def parse_systemctl_show(text: str) -> dict[str, str]:
    """`systemctl show -p A,B UNIT` output (KEY=VALUE lines) as a dict."""
    props: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key.strip()] = value.strip()
    return props


def unit_is_crashing(props: dict[str, str], max_restarts: int) -> str | None:
    """Why the unit cannot become healthy (failed, or restarted more than allowed), else None."""
    active = props.get("ActiveState", "")
    count = props.get("NRestarts", "0") or "0"
    # systemd prints an unsigned count; anything else (a garbled answer) is not a count of restarts.
    restarts = int(count) if count.isascii() and count.isdigit() and len(count) <= 18 else 0
    if active == "failed":
        return f"the unit failed (Result={props.get('Result', 'unknown')}, {restarts} restart(s))"
    if active == "inactive" and props.get("Result", "success") != "success":
        return f"the unit stopped (Result={props.get('Result')})"
    if restarts > max_restarts:
        return f"the unit is crash-looping: systemd restarted it {restarts} times (SubState={props.get('SubState')})"
    return None
