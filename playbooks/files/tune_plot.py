#!/usr/bin/env python3
"""Controller side of roles/tune: plot every candidate's output tokens/s per concurrency level.

    tune_plot.py HOST.json HOST.png

HOST.json is what roles/tune writes per host (reports/tune/<host>.json). One bar group per
concurrency the node declared (tune_traffic), one bar per candidate that passed its gates; the chosen
one is marked, and the failed ones and those refused at a concurrency are named under the plot with
their reasons. Prints one line for the play: where the
plot is, or why it was not drawn. Without matplotlib (requirements.txt) the plot is skipped with
a note and the exit status is still 0: the JSON holds every figure.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def figure(value: object) -> float:
    """A bar's height: a finite tok/s above zero, else 0 (a stored inf, nan or text is no figure, issue 43)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return 0.0
    try:
        number = float(value)
    except OverflowError:
        return 0.0
    return number if math.isfinite(number) and number > 0 else 0.0


def series(data: dict) -> tuple[list[int], list[tuple[str, list[float], bool]], list[str]]:
    """Concurrency levels, (candidate, tok/s per level, chosen) for those measured, and a note per other one."""
    choice = data.get("choice") or {}
    winner = choice.get("winner")
    rows = {r["name"]: r for r in choice.get("rows") or []}
    levels = sorted({lv["concurrency"] for r in data.get("results") or [] for lv in r.get("levels") or []})
    bars, failed = [], []
    for result in data.get("results") or []:
        name = f"ddtree-{result.get('budget')}" if result.get("method") == "ddtree" else str(result.get("method"))
        if result.get("status") != "ok":
            why = result.get("reason") or rows.get(name, {}).get("note", "failed")
            # A budget DDTree could not run says "not measured: ..." itself; a failure is marked.
            failed.append(f"{name}: {why}" if result.get("status") == "skipped" else f"failed: {name}: {why}")
            continue
        by_level = {lv["concurrency"]: figure(lv.get("throughput_tok_s")) for lv in result.get("levels") or []}
        bars.append((name, [by_level.get(c, 0.0) for c in levels], name == winner))
        note = str(rows.get(name, {}).get("note") or "")
        if note.startswith("refused"):
            failed.append(f"{name}: {note}")
    return levels, bars, failed


def plot(data: dict, path: Path) -> None:
    import matplotlib  # only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels, bars, failed = series(data)
    choice = data.get("choice") or {}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(bars), 1)
    for i, (name, ys, chosen) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(levels))]
        drawn = ax.bar(xs, ys, width, label=name + (" (serves)" if chosen else ""), hatch="//" if chosen else None)
        ax.bar_label(drawn, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(levels)), [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output throughput (tok/s)")
    ax.grid(axis="y", alpha=0.3)
    if bars:
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{data.get('host')}: {choice.get('winner') or 'no candidate'} serves", fontsize=11)
    notes = [str(choice.get("reason") or ""), *failed]
    fig.text(0.01, 0.01, "\n".join(n[:140] for n in notes), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.05 + 0.03 * len(notes), 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: tune_plot.py HOST.json HOST.png", file=sys.stderr)
        return 2
    src, png = Path(argv[0]), Path(argv[1])
    try:
        data = json.loads(src.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: {src} cannot be read as JSON: {e}", file=sys.stderr)
        return 2
    try:
        plot(data, png)
    except ImportError:
        print(f"plot skipped: matplotlib is not installed for {sys.executable} (pip install -r requirements.txt)")
        return 0
    print(f"plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
