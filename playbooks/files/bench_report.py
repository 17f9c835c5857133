#!/usr/bin/env python3
"""Controller side of playbooks/bench.yml: compare a bench run with its baseline and plot both.

    bench_report.py --run RUN.json --png RUN.png [--baseline BASE.json --compare-out CMP.json]

RUN.json and BASE.json are what bench.yml stores per host (reports/bench/<host>/<label>.json).
With a baseline it writes the comparison (each figure side by side with its ratio, current over
baseline) and plots both runs in one PNG; without, the PNG shows the run alone. Prints one JSON
line (the comparison's summary and settings_differ, or null) for the playbook. Plots need matplotlib (requirements.txt);
the comparison needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# Figures compared, where they are in a run, and whether higher is better.
SUMMARY_FIGURES = {
    "single_request_tok_s": True,
    "single_request_ttft_ms": False,
    "peak_throughput_tok_s": True,
    "mean_acceptance_length": True,
}
LEVEL_FIGURES = {
    "throughput_tok_s": (("throughput_tok_s",), True),
    "request_tok_s_mean": (("request_tok_s", "mean"), True),
    "ttft_ms_p50": (("ttft_ms", "p50"), False),
    "ttft_ms_p90": (("ttft_ms", "p90"), False),
    "mean_acceptance_length": (("mean_acceptance_length",), True),
}
# Settings that must match for the figures to be comparable.
COMPARABLE_SETTINGS = ("max_tokens", "ignore_eos", "prompts", "prompt_set_sha256", "concurrency")


class ReportError(ValueError):
    """A run file is missing or not what bench.yml writes."""


def _not_a_figure(_text: str) -> None:
    """NaN, Infinity, or a number past a float (1e400) in a stored run: no figure, shown as missing (issue 43)."""
    return None


def _finite_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def figure(value: object) -> float | None:
    """A figure to compare: a finite number above zero, else None (never inf, nan, 0 or a bool)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and number > 0 else None


def load_run(path: Path) -> dict:
    try:
        run = json.loads(path.read_text(), parse_constant=_not_a_figure, parse_float=_finite_or_none)
    except FileNotFoundError:
        raise ReportError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(run, dict) or not isinstance(run.get("levels"), list) or not run["levels"]:
        raise ReportError(f"{path} is not a bench result (no levels): re-run playbooks/bench.yml to write it")
    if not isinstance(run.get("summary"), dict):
        raise ReportError(f"{path} is not a bench result (no summary): re-run playbooks/bench.yml to write it")
    return run


def ratio(baseline: float | None, current: float | None) -> float | None:
    """current / baseline, None when either is missing or not a finite figure above zero."""
    baseline, current = figure(baseline), figure(current)
    if baseline is None or current is None:
        return None
    value = current / baseline
    return round(value, 3) if math.isfinite(value) else None


def side_by_side(baseline: float | None, current: float | None, higher_is_better: bool) -> dict:
    return {
        "baseline": figure(baseline),
        "current": figure(current),
        "ratio": ratio(baseline, current),
        "higher_is_better": higher_is_better,
    }


def _dig(level: dict, keys: tuple[str, ...]) -> float | None:
    value: object = level
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return figure(value)


def _describe(run: dict) -> dict:
    return {k: run.get(k) for k in ("label", "engine", "model", "url", "time")}


def compare_runs(baseline: dict, current: dict) -> dict:
    """Each figure of both runs side by side with current/baseline; levels matched by concurrency."""
    base_levels = {lv["concurrency"]: lv for lv in baseline["levels"]}
    cur_levels = {lv["concurrency"]: lv for lv in current["levels"]}
    both = sorted(set(base_levels) & set(cur_levels))
    b_set, c_set = baseline.get("settings") or {}, current.get("settings") or {}
    return {
        "host": current.get("host"),
        "baseline": _describe(baseline),
        "current": _describe(current),
        "summary": {
            name: side_by_side(baseline["summary"].get(name), current["summary"].get(name), better)
            for name, better in SUMMARY_FIGURES.items()
        },
        "levels": [
            {
                "concurrency": c,
                **{
                    name: side_by_side(_dig(base_levels[c], keys), _dig(cur_levels[c], keys), better)
                    for name, (keys, better) in LEVEL_FIGURES.items()
                },
            }
            for c in both
        ],
        "unmatched_concurrency": sorted(set(base_levels) ^ set(cur_levels)),
        "settings_differ": [k for k in COMPARABLE_SETTINGS if b_set.get(k) != c_set.get(k)],
    }


def _title(run: dict) -> str:
    acc = run["summary"].get("mean_acceptance_length")
    acc_text = f"acceptance {acc:.2f}" if isinstance(acc, (int, float)) else "no acceptance counters"
    return f"{run.get('label')} ({run.get('engine')}, {acc_text})"


def plot_runs(current: dict, baseline: dict | None, path: Path) -> None:
    """Output throughput, per-request tokens/s and TTFT p50 per concurrency level; baseline bars beside."""
    import matplotlib  # only the plot needs it: the comparison works without

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in (baseline, current) if r is not None]
    levels = sorted({lv["concurrency"] for r in runs for lv in r["levels"]})
    panels = [
        ("output throughput (tok/s)", ("throughput_tok_s",)),
        ("per-request speed (tok/s, mean)", ("request_tok_s", "mean")),
        ("time to first token (ms, p50)", ("ttft_ms", "p50")),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    width = 0.8 / len(runs)
    for ax, (ylabel, keys) in zip(axes[0], panels, strict=True):
        for i, run in enumerate(runs):
            by_level = {lv["concurrency"]: lv for lv in run["levels"]}
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(levels))]
            ys = [(_dig(by_level[c], keys) or 0.0) if c in by_level else 0.0 for c in levels]
            bars = ax.bar(xs, ys, width, label=_title(run))
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    title = f"{current.get('host')}: {current.get('label')}"
    if baseline is not None:
        title += f" vs {baseline.get('label')}"
    fig.suptitle(
        f"{title} - {current.get('model')}, {(current.get('settings') or {}).get('max_tokens')} tokens/request"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--compare-out", type=Path)
    a = parser.parse_args(argv)
    if (a.baseline is None) != (a.compare_out is None):
        parser.error("--baseline and --compare-out go together")
    try:
        current = load_run(a.run)
        baseline = load_run(a.baseline) if a.baseline else None
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    comparison = None
    if baseline is not None and a.compare_out is not None:
        comparison = compare_runs(baseline, current)
        a.compare_out.parent.mkdir(parents=True, exist_ok=True)
        a.compare_out.write_text(json.dumps(comparison, indent=2) + "\n")
    try:
        plot_runs(current, baseline, a.png)
    except ImportError:
        print(
            f"error: matplotlib is not installed for {sys.executable}, so {a.png} was not drawn "
            "(the JSON results are written): pip install -r requirements.txt",
            file=sys.stderr,
        )
        return 3
    shown = {k: comparison[k] for k in ("summary", "settings_differ")} if comparison else None
    print(json.dumps(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
