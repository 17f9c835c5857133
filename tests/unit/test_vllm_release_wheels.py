"""The release knowledge base checked against the real vLLM wheels from PyPI.

Reads each wheel found in the wheel cache (default /var/cache/dflash-lab/wheels, override with
DFLASH_LAB_WHEELS) without installing it: METADATA for the version and torch pin, the source
files for DFlash, the aux-layer fix, sliding-layer handling and tree attention. Fill the cache with
``pip download --no-deps vllm==X -d /var/cache/dflash-lab/wheels``. Wheels not present are skipped;
the Molecule scenario fetches 0.20.1 and 0.22.0, so CI reads at least those.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
from ansible.module_utils.vllm_releases import (
    RELEASES,
    compare_with_row,
    detect_features,
    detect_prompt_as_decode,
    find_release,
)

WHEELS = Path(os.environ.get("DFLASH_LAB_WHEELS", "/var/cache/dflash-lab/wheels"))


def _wheels() -> list[Path]:
    if not WHEELS.is_dir():
        return []
    return sorted(WHEELS.glob("vllm-*.whl"))


def _read_wheel(path: Path) -> tuple[str, object]:
    archive = zipfile.ZipFile(path)
    names = set(archive.namelist())
    metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA") and n.startswith("vllm-"))

    def read(rel: str) -> str | None:
        if rel not in names:
            return None
        return archive.read(rel).decode("utf-8", errors="replace")

    return archive.read(metadata_name).decode(), read


@pytest.mark.parametrize("wheel", _wheels(), ids=lambda p: p.name.split("-")[1])
def test_knowledge_base_row_matches_wheel(wheel: Path) -> None:
    metadata, read = _read_wheel(wheel)
    detected = detect_features(read, metadata)
    assert detected.version is not None
    row = find_release(detected.version)
    assert row is not None, f"no knowledge-base row covers {detected.version}"
    assert compare_with_row(detected, row) == []
    assert detected.version in row.verified, f"{detected.version} was read but is not listed as verified"


@pytest.mark.parametrize("wheel", _wheels(), ids=lambda p: p.name.split("-")[1])
def test_the_prompt_as_decode_bug_is_on_the_rows_whose_wheels_show_it(wheel: Path) -> None:
    metadata, read = _read_wheel(wheel)
    detected = detect_features(read, metadata)
    row = find_release(detected.version or "")
    assert row is not None
    if not row.dflash:
        pytest.skip(f"{detected.version} has no DFlash")
    found = detect_prompt_as_decode(read)
    assert found is not None, f"{detected.version}: no V1 runner or GDN builder"
    assert ("prompt_as_decode" in row.bugs) == found


def test_the_lab_release_is_described_as_read_off_its_wheel() -> None:
    wheel = next((w for w in _wheels() if w.name.startswith("vllm-0.20.1-")), None)
    if wheel is None:
        pytest.skip(f"vLLM 0.20.1 wheel not in {WHEELS}")
    metadata, read = _read_wheel(wheel)
    detected = detect_features(read, metadata)
    assert detected.as_dict() == {
        "version": "0.20.1",
        "torch": "2.11.0",
        "dflash": True,
        "aux_offset_fixed": False,
        "sliding": "silent_full",
        "tree_attention": True,
    }
    assert detect_prompt_as_decode(read) is True


def test_every_row_names_the_wheels_it_was_read_from() -> None:
    for row in RELEASES:
        assert row.verified, f"row {row.since} has no verified release"
        for version in row.verified:
            assert find_release(version) is row
