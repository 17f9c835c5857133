"""Per-host report of every run: JSON on the controller and a summary table at the end.

Roles add what they found and did to one fact per host, ``dflash_report`` (a dict keyed by
role: ``{"gpu_check": {...}, "service_swap": {...}}``), with ``ansible.builtin.set_fact`` and
``combine``. This callback keeps the newest value per host, adds the outcome (ok, changed,
failed with the task and its message, unreachable, or not reached: targeted by a play whose
batches stopped before the host's batch, as when a failed batch ends a rollout) and, when the
playbook ends, writes ``<report_dir>/<playbook>-<UTC time>.json`` and prints one line per host.
The report directory is ``reports/`` at the repository root by default, whatever the current
directory (playbooks/bench.yml writes under the same setting's ``bench/``).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: rollout_report
type: aggregate
short_description: per-host JSON report and a summary table
description:
  - Collects the C(dflash_report) fact of every host and each host's outcome, writes them as JSON
    under the report directory and prints a summary table when the playbook ends.
requirements:
  - enabled in ansible.cfg (callbacks_enabled)
options:
  report_dir:
    description:
      - Directory for the JSON reports (and, under C(bench/), playbooks/bench.yml's results).
      - A relative path is relative to the repository root (the directory above C(plugins/)),
        not to the current directory or the playbook's.
    default: reports
    env:
      - name: DFLASH_REPORT_DIR
    ini:
      - section: rollout_report
        key: report_dir
"""

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C
from ansible.plugins.callback import CallbackBase

REPO = Path(__file__).resolve().parents[2]
for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(REPO / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.figures import is_number
from ansible.module_utils.terminal_text import terminal_text

COLUMNS = ("host", "outcome", "gpus", "serving", "acceptance", "probe tok/s", "note")
# The note is the last column: long enough for a reason's figures and what they are compared with.
NOTE_WIDTH = 120


def report_dir(setting: str, root: Path = REPO) -> Path:
    """The report directory: an absolute setting as it is, a relative one under the repository root."""
    path = Path(setting).expanduser()
    return path if path.is_absolute() else root / path


def _section(report: Any, role: str) -> dict[str, Any]:
    """A role's part of a host's report; anything malformed counts as nothing reported."""
    section = report.get(role) if isinstance(report, dict) else None
    return section if isinstance(section, dict) else {}


def _get(report: dict[str, Any], role: str, key: str) -> Any:
    value = _section(report, role).get(key)
    return "-" if value is None or value == "" else value


def failure_message(result: dict[str, Any]) -> str:
    """The operator's sentence of a failed task; for a loop, the failed items' messages."""
    results = result.get("results")
    items = (
        [r.get("msg") for r in results if isinstance(r, dict) and r.get("failed")] if isinstance(results, list) else []
    )
    if items:
        return "\n".join(str(m) for m in items if m)
    return str(result.get("msg") or "")


def reason(msg: str, host: str) -> str:
    """A failure message without the host and task it starts with, which the table's row already says.

    'service_swap failed on n2 at "Gate 3, ...": mean acceptance ...' and 'n2: gpu_check_...' give
    the reason alone; of a message of several lines (one problem per line), the first.
    """
    lines = msg.strip().splitlines()
    text = " ".join(lines[0].split()) if lines else ""
    text = re.sub(rf'^[\w.-]+ failed on {re.escape(host)} at "[^"]*":\s*', "", text)
    text = re.sub(rf"^{re.escape(host)}:\s+", "", text)
    return text


def note(text: str, width: int = NOTE_WIDTH) -> str:
    """The table's note: the reason, cut at a word with '...' when longer than width."""
    text = terminal_text(text, 4 * width)
    if len(text) <= width:
        return text
    return text[: width - 3].rsplit(" ", 1)[0] + "..."


def unreached(plays: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Per host, the plays that targeted it but ran no batch containing it, in play order.

    ``plays`` maps a play's id to ``{"name": str, "targets": [host, ...], "reached": {host, ...}}``
    (targets: every host the play would run on, all batches together; reached: the hosts of the
    batches that started).
    """
    out: dict[str, list[str]] = {}
    for play in plays.values():
        for host in play["targets"]:
            if host not in play["reached"]:
                out.setdefault(host, []).append(play["name"])
    return out


def outcome(stats: dict[str, int], before: str, not_reached: list[str]) -> str:
    """A host's outcome from its recap counters; a failure that a rescue handled does not fail it.

    ``before`` is what the task results said (ok, failed, unreachable), used where the host has
    no recap counters.
    """
    if stats.get("unreachable"):
        return "unreachable"
    if stats.get("failures"):
        return "failed"
    if not stats and before in ("failed", "unreachable"):
        return before
    if not_reached:
        return "not reached"
    return "changed" if stats.get("changed") else "ok"


def _probe_shape(swap: dict[str, Any]) -> str:
    """What the swap's tok/s measured: requests x max tokens of its probe, such as '3x64'."""
    requests, tokens = swap.get("probe_requests"), swap.get("probe_max_tokens")
    return f"{requests}x{tokens}" if requests not in (None, "") and tokens not in (None, "") else ""


def _figure(value: Any) -> str:
    """A reported figure as text: a number that is not finite (inf, nan) shows as "-", as a missing one does."""
    return _fmt(value, "") if is_number(value) else str(value)


def summary_rows(hosts: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per host: what it runs now and, if it failed, the reason first."""
    rows = []
    for name in sorted(hosts):
        h = hosts[name]
        report = h.get("report") or {}
        swap = _section(report, "service_swap")
        first = next((e["msg"] for e in h.get("errors") or [] if e.get("msg")), "")
        if swap.get("rolled_back") and swap.get("reason"):
            first = str(swap["reason"])  # why the swap was undone, recorded without host or task
        tune = _section(report, "tune")
        if tune.get("reason") and h.get("outcome") in ("ok", "changed"):
            first = "tuned: " + str(tune["reason"])  # a candidate's rescued failure is in the tuning table
        elif tune.get("skipped"):
            first = "not tuned: " + str(tune["skipped"])  # playbooks/tune.yml on a node vLLM does not serve
        if h.get("outcome") == "not reached" and h.get("not_reached"):
            first = "not reached: " + h["not_reached"][0] + " stopped before its batch"
        acceptance = _get(report, "service_swap", "mean_acceptance_length")
        serving = str(_get(report, "service_swap", "serving"))
        if swap.get("rolled_back"):
            serving += " (rolled back)"
        elif tune.get("winner") and serving == "vllm":
            serving += f" {tune['winner']}"
        tok_s = _figure(_get(report, "service_swap", "tokens_per_second"))
        shape = _probe_shape(swap)
        rows.append(
            (
                name,
                h.get("outcome", "ok"),
                str(_get(report, "gpu_check", "summary")),
                serving,
                _fmt(acceptance, ".2f") if isinstance(acceptance, float) else _figure(acceptance),
                f"{tok_s} ({shape})" if shape and tok_s != "-" else tok_s,
                note(reason(first, name)) if first else "",
            )
        )
    return rows


def summary_table(rows: list[tuple[str, ...]]) -> str:
    """The rows under their headers. The probe column says what it measured: the probe's few short
    requests (service_swap_probe_requests x service_swap_probe_max_tokens), not a benchmark; one
    shape for every row goes into the header."""
    columns = list(COLUMNS)
    i = columns.index("probe tok/s")
    shapes = {r[i].rsplit(" (", 1)[1] for r in rows if r[i].endswith(")")}
    if len(shapes) == 1:
        columns[i] = f"probe tok/s ({shapes.pop()[:-1]})"
        rows = [(*r[:i], r[i].rsplit(" (", 1)[0], *r[i + 1 :]) for r in rows]
    return _table(columns, rows)


def _table(columns: list[str], rows: list[tuple[str, ...]]) -> str:
    """Rows under their headers in aligned columns. Every cell may hold what an engine, a node or the
    inventory said: escape sequences and control characters never reach the terminal (issue 43)."""
    table = [tuple(terminal_text(cell, 1000) for cell in r) for r in [tuple(columns), *rows]]
    widths = [max(len(r[k]) for r in table) for k in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table)


# The tuning table: one "c=N tok/s" column per declared concurrency goes after the budget.
TUNE_COLUMNS = ("host", "method", "budget", "weighted vs chain", "acceptance", "note")
# The tuning note carries the whole choice (figures, ratio and margin) or a candidate's failure.
TUNE_NOTE_WIDTH = 200


def _fmt(value: Any, spec: str) -> str:
    """A figure as the table shows it; anything that is not a finite number shows as "-", never inf or nan."""
    if not is_number(value):
        return "-"
    try:
        number = float(value)
    except OverflowError:
        return "-"
    return format(number, spec) if math.isfinite(number) else "-"


def tune_levels(hosts: dict[str, dict[str, Any]]) -> list[int]:
    """Every concurrency a tuned host declared (tune_traffic), smallest first: one table column each."""
    levels: set[int] = set()
    for h in hosts.values():
        traffic = _section(h.get("report"), "tune").get("traffic")
        for t in traffic if isinstance(traffic, list) else []:
            if isinstance(t, dict) and isinstance(t.get("concurrency"), int) and not isinstance(t["concurrency"], bool):
                levels.add(t["concurrency"])
    return sorted(levels)


def _level_cell(row: dict[str, Any], concurrency: int) -> str:
    """'600.0 x1.200': a candidate's tok/s at one concurrency and its ratio to the chain's there."""
    levels = row.get("levels") if isinstance(row.get("levels"), list) else []
    lv = next((lv for lv in levels if isinstance(lv, dict) and lv.get("concurrency") == concurrency), {})
    tok_s = _fmt(lv.get("tok_s"), ".1f")
    if tok_s == "-" or lv.get("vs_chain") is None:
        return tok_s
    return f"{tok_s} x{_fmt(lv.get('vs_chain'), '.3f')}"


def tune_rows(hosts: dict[str, dict[str, Any]], levels: list[int]) -> list[tuple[str, ...]]:
    """One row per tuned host and candidate: its figures at every concurrency in ``levels`` (a host
    that did not declare one shows "-"), its weighted ratio to the chain, and why it serves or not."""
    rows = []
    for name in sorted(hosts):
        tune = _section(hosts[name].get("report"), "tune")
        for r in tune.get("rows") or []:
            if not isinstance(r, dict):
                continue
            if r.get("chosen"):
                text = "serves: " + str(tune.get("reason") or "")
            elif r.get("status") == "skipped":
                text = str(r.get("note") or "not measured")  # "not measured: <why>"
            elif r.get("status") != "ok":
                text = "failed, skipped: " + str(r.get("note") or "")
            else:
                text = str(r.get("note") or "")  # "refused: at concurrency N it is ..." or nothing
            rows.append(
                (
                    name,
                    str(r.get("method") or "-"),
                    str(r.get("budget")) if r.get("budget") not in (None, "") else "-",
                    *(_level_cell(r, c) for c in levels),
                    "x" + _fmt(r.get("vs_chain"), ".3f") if r.get("vs_chain") is not None else "-",
                    _fmt(r.get("acceptance"), ".2f"),
                    note(text, TUNE_NOTE_WIDTH),
                )
            )
    return rows


def tune_table(rows: list[tuple[str, ...]], levels: list[int]) -> str:
    """The tuning rows under their headers: tok/s and the ratio to the chain at each concurrency."""
    columns = [*TUNE_COLUMNS[:3], *(f"c={c} tok/s" for c in levels), *TUNE_COLUMNS[3:]]
    return _table(columns, rows)


def write_report(out_dir: Path, stem: str, text: str) -> Path:
    """Write ``text`` as ``stem.json`` in ``out_dir``, or ``stem-2.json``... if a run of the same second has it.

    The whole file appears at once (a hard link of a complete temporary file), and never replaces another's.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        for n in range(1, 1000):
            path = out_dir / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
            try:
                os.link(tmp, path)
            except FileExistsError:
                continue
            return path
        raise OSError(f"{out_dir} holds 999 reports named {stem}*; clean it up")
    finally:
        os.unlink(tmp)


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "rollout_report"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.playbook = "playbook"
        self.started = time.time()
        self.hosts: dict[str, dict[str, Any]] = {}
        self.plays: dict[str, dict[str, Any]] = {}

    def _host(self, name: str) -> dict[str, Any]:
        return self.hosts.setdefault(name, {"outcome": "ok", "report": {}, "errors": []})

    def v2_playbook_on_start(self, playbook: Any) -> None:
        self.playbook = Path(playbook._file_name).stem

    def v2_playbook_on_play_start(self, play: Any) -> None:
        # Sent once per batch, with the inventory restricted to that batch's hosts.
        inventory = getattr(play.get_variable_manager(), "_inventory", None)
        if inventory is None:
            return
        pattern = play.hosts
        entry = self.plays.setdefault(
            str(getattr(play, "_uuid", "") or play.get_name()),
            {
                "name": play.get_name(),
                "targets": [h.name for h in inventory.get_hosts(pattern, ignore_restrictions=True)],
                "reached": set(),
            },
        )
        entry["reached"].update(h.name for h in inventory.get_hosts(pattern))

    def v2_runner_on_ok(self, result: Any) -> None:
        facts = result._result.get("ansible_facts") or {}
        if isinstance(facts.get("dflash_report"), dict):
            self._host(result._host.get_name())["report"] = facts["dflash_report"]

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        if ignore_errors:
            return
        host = self._host(result._host.get_name())
        host["outcome"] = "failed"
        host["errors"].append({"task": result._task.get_name(), "msg": failure_message(result._result)})

    def v2_runner_on_unreachable(self, result: Any) -> None:
        host = self._host(result._host.get_name())
        host["outcome"] = "unreachable"
        host["errors"].append({"task": result._task.get_name(), "msg": str(result._result.get("msg", ""))})

    def v2_playbook_on_stats(self, stats: Any) -> None:
        missed = unreached(self.plays)
        for name in sorted(set(stats.processed) | set(missed) | set(self.hosts)):
            s = stats.summarize(name) if name in stats.processed else {}
            if name == "localhost" and not s.get("failures") and name not in self.hosts:
                continue  # the controller's own checks are not a node
            host = self._host(name)
            host["stats"] = s
            if missed.get(name):
                host["not_reached"] = missed[name]
            host["outcome"] = outcome(s, host["outcome"], missed.get(name, []))
        if not self.hosts:
            return
        out_dir = report_dir(self.get_option("report_dir"))
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.started))
        out_dir.mkdir(parents=True, exist_ok=True)
        body = {"playbook": self.playbook, "started": stamp, "hosts": self.hosts}
        path = write_report(
            out_dir, f"{self.playbook}-{stamp}", json.dumps(body, indent=2, sort_keys=True, default=str)
        )
        self._display.banner("ROLLOUT REPORT")
        self._display.display(summary_table(summary_rows(self.hosts)))
        levels = tune_levels(self.hosts)
        tuned = tune_rows(self.hosts, levels)
        if tuned:
            self._display.banner("TUNING")
            self._display.display(tune_table(tuned, levels))
        self._display.display(f"report: {path}")
