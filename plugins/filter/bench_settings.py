"""playbooks/bench.yml's decisions, as typed pure functions instead of long Jinja expressions.

Which settings are unusable (one sentence each), the concurrency levels an operator gave (a list,
or a string such as "1,2,4" from -e), which engine to benchmark (the setting, the local fact
service_swap left, or what answers on vLLM's port), the argv of the report script, and the line
that shows a run's figures.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

ENGINES = ("vllm", "sglang")
_LABEL = re.compile(r"^[A-Za-z0-9._-]+$")


def bench_concurrency(raw: Any) -> list[int]:
    """The concurrency levels: a list of numbers, or every integer in a string ("1,2,4", "[1, 2]")."""
    if isinstance(raw, str):
        return [int(n) for n in re.findall(r"-?\d+", raw)]
    return [int(n) for n in raw]


def bench_setting_problems(
    engine: str,
    compare: str,
    baseline_label: str,
    label: Any,
    concurrency: Sequence[int],
    concurrency_raw: Any,
    url_given: bool,
) -> list[str]:
    """One sentence per unusable setting; ``label`` is None when bench_label is not set."""
    problems = []
    if engine not in ("auto", *ENGINES):
        problems.append(f"bench_engine must be auto, vllm or sglang, not {engine}")
    if compare not in ("auto", "true", "false"):
        problems.append(f"bench_compare must be auto, true or false, not {compare}")
    for name, value in (("bench_baseline_label", baseline_label), ("bench_label", label)):
        if value is not None and not _LABEL.match(str(value)):
            problems.append(f'{name} names a file: letters, digits, ".", "_" or "-" only, not {value}')
    if not concurrency:
        problems.append(f"bench_concurrency must list integers such as [1, 2, 4], not {concurrency_raw}")
    if url_given and engine == "auto":
        problems.append(
            "with bench_url, say which engine answers there: -e bench_engine=vllm or -e bench_engine=sglang"
        )
    return problems


def bench_engine(setting: str, local_fact: Mapping[str, Any] | None, vllm_healthy: bool) -> str:
    """The engine to benchmark: the setting, else what service_swap's local fact says serves, else
    vLLM when its port answers /health, else SGLang."""
    if setting != "auto":
        return setting
    serving = local_fact.get("serving", "") if isinstance(local_fact, Mapping) else ""
    if serving in ENGINES:
        return serving
    return "vllm" if vllm_healthy else "sglang"


def bench_report_argv(
    python: str, script: str, run_dir: str, label: str, baseline: str | None, baseline_label: str
) -> list[str]:
    """The report script's argv: the run and its plot, plus the comparison when a baseline exists."""
    argv = [python, script, "--run", f"{run_dir}/{label}.json", "--png", f"{run_dir}/{label}.png"]
    if baseline:
        argv += ["--baseline", baseline, "--compare-out", f"{run_dir}/{label}-vs-{baseline_label}.json"]
    return argv


def _figure(value: Any) -> str:
    return "-" if value in (None, "") else str(value)


def bench_figures_line(
    summary: Mapping[str, Any],
    host: str,
    label: str,
    engine: str,
    concurrency: Sequence[int],
    comparison: Mapping[str, Any] | None,
    baseline_label: str,
    files: str,
) -> str:
    """What the run measured, in one line: the single request's tok/s and TTFT, the peak throughput over the
    sweep, the mean acceptance length; with a comparison (bench_report.py's JSON), each ratio to the baseline
    and whether the settings differ (then the figures are not comparable); and where the files are."""
    acceptance = summary.get("mean_acceptance_length")
    line = (
        f"{host} {label} ({engine}): single request {_figure(summary.get('single_request_tok_s'))} tok/s, "
        f"TTFT p50 {_figure(summary.get('single_request_ttft_ms'))} ms, "
        f"peak {summary.get('peak_throughput_tok_s')} tok/s (sweep {', '.join(str(c) for c in sorted(concurrency))}), "
        f"mean acceptance length {acceptance if acceptance not in (None, '') else 'none (no spec-decode counters)'}."
    )
    if comparison is not None:
        ratios = comparison.get("summary") or {}

        def ratio(key: str) -> str:
            entry = ratios.get(key)
            return _figure(entry.get("ratio") if isinstance(entry, Mapping) else None)

        differ = comparison.get("settings_differ") or []
        caveat = f" (NOT comparable: {', '.join(differ)} differ)" if differ else ""
        line += (
            f" Against {baseline_label}: single request x{ratio('single_request_tok_s')}, "
            f"TTFT x{ratio('single_request_ttft_ms')}, peak throughput x{ratio('peak_throughput_tok_s')}{caveat}."
        )
    return f"{line} Files: {files}.{{json,png}}"


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "bench_concurrency": bench_concurrency,
            "bench_setting_problems": bench_setting_problems,
            "bench_engine": bench_engine,
            "bench_report_argv": bench_report_argv,
            "bench_figures_line": bench_figures_line,
        }
