"""tests/gpu/results/ keeps only the result files the docs cite, and every file the docs cite is there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tests" / "gpu" / "results"


def docs_text() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def cited(path: Path, text: str) -> bool:
    rel = path.relative_to(RESULTS)
    if len(rel.parts) > 1:  # a directory of results is cited as a whole
        return f"tests/gpu/results/{rel.parts[0]}/" in text
    return path.name in text or f"{path.stem}.{{json,txt}}" in text or f"{path.stem}.{{txt,json}}" in text


def test_every_result_file_is_cited_by_a_doc() -> None:
    text = docs_text()
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert files
    assert [str(p.relative_to(RESULTS)) for p in files if not cited(p, text)] == []


def test_every_result_file_a_doc_names_exists() -> None:
    text = docs_text()
    # Result files are named for the hardware they ran on (_h200) or the pair they belong to, and
    # docs may name any of them by its path; {json,txt} names both files of one result.
    names = set(re.findall(r"\b([a-z0-9_]*(?:_h200|_pair_[a-z]+)[a-z0-9_]*\.(?:json|txt))\b", text))
    for path in re.findall(r"tests/gpu/results/([\w./{},-]+)", text):
        path = path.rstrip(".,")
        if "{json,txt}" in path:
            names |= {path.replace("{json,txt}", "json"), path.replace("{json,txt}", "txt")}
        elif path and "*" not in path:
            names.add(path)
    assert names
    assert sorted(n for n in names if not (RESULTS / n).exists()) == []
