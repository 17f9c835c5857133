"""The tune role's report of a host (roles/tune): whether the controller-side files are up to date,
and the sentences that end a tuning (where the figures are; why the host failed).

The report is reports/tune/<host>.json and the plot drawn from it beside it (<host>.png). On an
idempotent run the JSON's content does not change, and drawing the plot again costs the
controller a Python start and a matplotlib import per host (issue 25). ``tune_report_current``
says the report needs nothing: its directory is there with mode 0755, the JSON is a regular file
with mode 0644 holding exactly ``content``, and the plot is a regular file no older than the JSON.
Anything else (a missing or different file, another mode, a plot missing or older than its JSON,
a file that cannot be read) is not current, and the role writes and plots as before.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

DIR_MODE = 0o755
JSON_MODE = 0o644


def tune_report_current(json_path: str, content: str, png_path: str) -> bool:
    """True when the directory, the JSON (mode and content) and its plot need no change."""
    try:
        parent = os.stat(os.path.dirname(json_path) or ".")
        js = os.stat(json_path)
        png = os.stat(png_path)
        if not (stat.S_ISDIR(parent.st_mode) and stat.S_IMODE(parent.st_mode) == DIR_MODE):
            return False
        if not (stat.S_ISREG(js.st_mode) and stat.S_IMODE(js.st_mode) == JSON_MODE):
            return False
        if not stat.S_ISREG(png.st_mode) or png.st_mtime_ns < js.st_mtime_ns:
            return False
        want = content.encode("utf-8")
        if js.st_size != len(want):
            return False
        with open(json_path, "rb") as f:
            return f.read(len(want) + 1) == want
    except OSError:
        return False


def tune_figures_text(
    result: Mapping[str, Any], host: str, json_path: str, png_path: str, plot: Mapping[str, Any]
) -> str:
    """What serves, why, and where the figures are. ``plot`` is the plot task's result: skipped where
    the report was already current (its plot is there), else what tune_plot.py said (nothing when it
    said nothing)."""
    if plot.get("skipped"):
        where = f"; plot {png_path}"
    else:
        said = str(plot.get("stdout") or "")
        where = f"; {said}" if said else ""
    return (
        f"{host} serves {result.get('winner') or 'no candidate'}: {result.get('reason')}. Figures: {json_path}{where}"
    )


def tune_failure_text(reason: Any, host: str, serving: Any, sglang_unit: str, vllm_unit: str) -> str:
    """Why the host fails when no candidate won, whether SGLang serves again, and what to do."""
    sglang = (
        "serves again"
        if serving == "sglang"
        else f"did NOT come back healthy: the node serves nothing; see journalctl -u {sglang_unit}"
    )
    return (
        f"tune failed on {host}: {reason}. {sglang_unit} {sglang}. Fix the cause (journalctl -u {vllm_unit},"
        f" reports/tune/{host}.json) and re-run playbooks/tune.yml."
    )


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "tune_report_current": tune_report_current,
            "tune_figures_text": tune_figures_text,
            "tune_failure_text": tune_failure_text,
        }
