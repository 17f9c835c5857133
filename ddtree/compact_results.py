#!/usr/bin/env python3
"""Make a GPU result file what git keeps: the reviewed summary, compact (maintainer tool).

    python3 -m ddtree.compact_results ddtree/results/NAME.json ...    # rewrites each file in place
    python3 -m ddtree.compact_results --check ddtree/results/*.json   # exit 1 if any is not compact
                                                                      # or lacks a field below

A result of record keeps its claim (``note``, ``command``), its figures and verdicts, the change set
(``manifest_sha256``) and the GPU; what a run printed for itself goes:

- vLLM's printed config objects (``ModelConfig(...)``, ``ParallelConfig(...)`` in the engine
  arguments the driver recorded): several KB each per run, and the engine arguments around them
  already say what ran;
- log lines longer than ``MAX_LOG_LINE`` characters that carry the same config objects, as vLLM
  logs them. Any other text stays, however long: a check's message is evidence.

Every result names its claim (``note``), the GPU (``hardware``), the change set (``manifest_sha256``)
and the ``command``; where a run did not record one, the field says so and where the value came from.
A file a proof ran on rather than a result (a tiny pair's models, prompts, apply report) says so with
``"kind": "input"``, its ``note`` and the ``result`` file beside it that it belongs to.

Every number stays as it was written (JSON numbers are read and written back unchanged), and lists
of numbers are written one per line instead of one item per line. The raw file stays in git history.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MAX_LOG_LINE = 300
# Markers of a printed vLLM config object (a dataclass repr or a transformers config dump).
CONFIG_REPRS = ("Config(", "Config {")
COMPACTED = (
    "Compacted for git (python3 -m ddtree.compact_results): vLLM's printed config objects (also as log lines) "
    "removed, every figure kept; the raw file is in git history."
)


RESULT_FIELDS = ("note", "hardware", "manifest_sha256", "command")
INPUT_FIELDS = ("note", "result")


def missing_fields(data: Any, folder: Path) -> list[str]:
    """The fields a result file (or an input file in ``folder``) lacks: absent, empty or not text."""
    if not isinstance(data, dict):
        return list(RESULT_FIELDS)
    fields = INPUT_FIELDS if data.get("kind") == "input" else RESULT_FIELDS
    missing = [f for f in fields if not (isinstance(data.get(f), str) and data[f].strip())]
    result = data.get("result")
    if "result" in fields and "result" not in missing and not (folder / result).is_file():
        missing.append(f"result (no {result} beside it)")
    return missing


def _printed_config(value: Any) -> bool:
    return isinstance(value, str) and len(value) > MAX_LOG_LINE and any(m in value for m in CONFIG_REPRS)


def strip(value: Any) -> tuple[Any, bool]:
    """``value`` without printed config objects and over-long log lines; whether anything went."""
    if isinstance(value, dict):
        out, dropped = {}, False
        for key, item in value.items():
            if _printed_config(item):
                dropped = True
                continue
            out[key], gone = strip(item)
            dropped |= gone
        return out, dropped
    if isinstance(value, list):
        items = [strip(item) for item in value]
        kept = [v for v, _ in items if not _printed_config(v)]
        return kept, len(kept) < len(items) or any(gone for _, gone in items)
    return value, False


def _flat(value: Any) -> bool:
    """A list whose items are numbers, strings, null or such lists: written on one line."""
    if isinstance(value, list):
        return all(_flat(v) for v in value)
    return not isinstance(value, dict)


def dumps(value: Any, indent: int = 0) -> str:
    """JSON with one key per line and flat lists on one line."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and value and not _flat(value):
        return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value, separators=(", ", ": "))


def compact(text: str) -> str:
    data = json.loads(text)
    data, dropped = strip(data)
    if dropped and isinstance(data, dict):
        data.setdefault("compacted", COMPACTED)
    return dumps(data) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is not compact")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    loose, incomplete = [], []
    for path in args.files:
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            continue  # an empty result (a run that wrote nothing) stays as it is
        missing = missing_fields(json.loads(text), path.parent)
        if missing:
            incomplete.append(f"{path}: lacks {', '.join(missing)}")
        new = compact(text)
        if new != text:
            loose.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    for path in loose:
        print(f"{'not compact' if args.check else 'compacted'}: {path}")
    for line in incomplete:
        print(f"{line}: add it (the doc that cites the file says what it shows; git log says where it ran)")
    return 1 if incomplete or (args.check and loose) else 0


if __name__ == "__main__":
    sys.exit(main())
