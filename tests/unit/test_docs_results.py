"""The results folders keep only the result files the docs cite, and every file the docs cite is there.

Two folders: ddtree/results/ (the DDTree engine's GPU proofs and benchmarks) and tests/gpu/results/
(the Ansible side's GPU checks: the gpu_check probe, service_swap's unit served for real).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT_DIRS = ("ddtree/results", "tests/gpu/results")


def docs_text() -> str:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "ddtree").rglob("README.md"))]
    return "\n".join(p.read_text() for p in docs)


def cited(folder: str, path: Path, text: str) -> bool:
    rel = path.relative_to(REPO / folder)
    if len(rel.parts) > 1:  # a directory of results is cited as a whole
        return f"{folder}/{rel.parts[0]}/" in text
    if path.name in text or f"{path.stem}.{{json,txt}}" in text or f"{path.stem}.{{txt,json}}" in text:
        return True
    # A family of results cited by pattern: `ddtree/results/trained_*_h100.json`.
    patterns = re.findall(rf"{folder}/([\w.-]*\*[\w.*-]*)", text)
    return any(fnmatch.fnmatch(str(rel), pattern) for pattern in patterns)


def test_every_result_file_is_cited_by_a_doc() -> None:
    text = docs_text()
    for folder in RESULT_DIRS:
        files = [p for p in (REPO / folder).rglob("*") if p.is_file()]
        assert files, folder
        assert [str(p.relative_to(REPO)) for p in files if not cited(folder, p, text)] == []


def test_every_result_file_a_doc_names_exists() -> None:
    text = docs_text()
    # Result files are named for the hardware they ran on (_h200, _h100) or the pair they belong to,
    # and docs may name any of them by its path; {json,txt} names both files of one result.
    names = set(re.findall(r"(?<![\w*])([a-z0-9_]*(?:_h[12]00|_pair_[a-z]+)[a-z0-9_]*\.(?:json|txt))\b", text))
    for folder in RESULT_DIRS:
        for path in re.findall(rf"{folder}/([\w./{{}},*-]+)", text):
            path = path.rstrip(".,")
            if "{json,txt}" in path:
                names |= {path.replace("{json,txt}", "json"), path.replace("{json,txt}", "txt")}
            elif path and "*" not in path:
                names.add(path)
            elif "*" in path:
                assert list((REPO / folder).glob(path)), f"{folder}/{path} names no file"
    assert names

    def found(name: str) -> bool:
        return any((REPO / folder / name).exists() for folder in RESULT_DIRS)

    assert sorted(n for n in names if not found(n)) == []


def test_a_result_no_doc_cites_is_found() -> None:
    text = docs_text()
    assert cited("ddtree/results", REPO / "ddtree/results/step_cost_27b_h200.json", text)
    assert cited("ddtree/results", REPO / "ddtree/results/trained_hybrid_h100.json", text)
    assert not cited("ddtree/results", REPO / "ddtree/results/step_cost_70b_h200.json", text)
    assert not cited("tests/gpu/results", REPO / "tests/gpu/results/h100-nvidia-gpu-probe.json", text)
    assert not cited("tests/gpu/results", REPO / "tests/gpu/results/other/serve_check.json", text)
