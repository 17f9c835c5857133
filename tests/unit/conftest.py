"""Fixtures shared by the unit tests: the lab's stand-in target model, small real filesystems (realfs),
a deadline for "never hangs" tests, the tests/gpu scripts' CPU parts, and a synthetic second vLLM base. (The DDTree engine's
fixtures are in ddtree/tests/conftest.py.)"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import realfs

from ddtree.repo import repo_file

TARGET_MODEL = Path(__file__).resolve().parents[2] / "tests" / "fakes" / "target_model.py"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The lab's stand-in Qwen3.6-27B directory (config.json, tokenizer files, small shards)."""
    path = tmp_path_factory.mktemp("models") / "Qwen3.6-27B"
    subprocess.run([sys.executable, str(TARGET_MODEL), str(path)], check=True, capture_output=True)
    return path


def _mount_or_skip(stack: contextlib.ExitStack, cm: contextlib.AbstractContextManager[Path]) -> Path:
    try:
        return stack.enter_context(cm)
    except realfs.CannotMount as exc:
        pytest.skip(f"cannot make a real filesystem here: {exc}")


@pytest.fixture
def tmpfs_dir(tmp_path) -> Iterator[Path]:
    """A real 16 MiB tmpfs (fill it with ``realfs.fill`` for ENOSPC); unmounted after the test, pass or fail."""
    with contextlib.ExitStack() as stack:
        yield _mount_or_skip(stack, realfs.tmpfs(tmp_path / "tmpfs", "16m"))


@pytest.fixture
def ext4_dir(tmp_path) -> Iterator[Path]:
    """A real 16 MiB ext4 filesystem, loop-mounted (``chattr +i`` works there, not on tmpfs); always unmounted."""
    with contextlib.ExitStack() as stack:
        yield _mount_or_skip(stack, realfs.ext4(tmp_path / "ext4", tmp_path / "ext4.img", "16M"))


@pytest.fixture
def fuse_dir(tmp_path) -> Iterator[Path]:
    """A real 16 MiB ext4 image served through FUSE (fuse2fs): RENAME_EXCHANGE answers EINVAL; always unmounted."""
    with contextlib.ExitStack() as stack:
        yield _mount_or_skip(stack, realfs.fuse_ext4(tmp_path / "fuse", tmp_path / "fuse.img", "16M"))


class Hung(BaseException):
    """What ``deadline`` raises in a call that did not return in time (a BaseException: no `except Exception` in
    the code under test can swallow it)."""


@pytest.fixture
def deadline() -> Iterator[Callable[[float], contextlib.AbstractContextManager[None]]]:
    """``with deadline(s):`` fails the test when the block runs longer than ``s`` seconds (SIGALRM),
    so a test of "never hangs" fails instead of hanging when the guard it tests is taken out."""

    @contextlib.contextmanager
    def within(seconds: float) -> Iterator[None]:
        def expire(_signum: int, _frame: object) -> None:
            raise Hung(f"still running after {seconds} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    yield within


@pytest.fixture(scope="module")
def gpu_script() -> Callable[[str], object]:
    """Loads a tests/gpu script by name (``gpu_script("syscall_filter")``) by its path, with the repository's
    one importer for files outside a package (ddtree.repo.repo_file): tests/gpu never goes on sys.path,
    where its scripts' names could shadow library/ modules."""
    return lambda name: repo_file(f"tests/gpu/{name}.py")


# A vLLM base whose rules differ from 0.20.1's (ddtree/vllm-0.20.1/base.json) in every field the Ansible
# side reads: trees on Gated DeltaNet and Mamba-2 layers with a width-3 convolution, as many draft slots
# per sequence as verified tokens, two extra graph tokens per request, at most 4 graphs and none
# smaller than two requests' tokens on a grid of 2 then every 10 from 10, and a KV cache of 64-token block multiples, one state slot per
# verified token (no root), width + verified tokens convolution columns and groups merged up to 16x.
SYNTHETIC_BASE = {
    "format": 1,
    "tree_state": {"layers": ["linear_attention", "mamba2"], "conv_width": 3},
    "scheduler": {"draft_slots_per_sequence": {"verified_tokens_plus": 0}},
    "cudagraphs": {
        "tokens_per_request": {"verified_tokens_plus": 2},
        "max_sizes": 4,
        "capture_size": {"min_requests": 2, "grid": {"sizes": [2], "steps": [{"from": 10, "every": 10}]}},
    },
    "kv_layout": {
        "block_tokens_multiple": 64,
        "state_slots_per_request": {"verified_tokens_plus": 0},
        "conv_columns": {"width_plus_verified_tokens_plus": 0},
        "group_merge_ratio": 16,
    },
}


@pytest.fixture
def synthetic_base() -> Callable[..., Path]:
    """``synthetic_base(home, release="9.9.9", **changes)`` writes SYNTHETIC_BASE (top-level fields replaced
    by ``changes``) as ``home/vllm-<release>/base.json`` and returns ``home``: a second base, to prove that
    its descriptor alone changes what the filters decide."""

    def write(home: Path, release: str = "9.9.9", **changes: object) -> Path:
        folder = home / f"vllm-{release}"
        folder.mkdir(parents=True)
        (folder / "base.json").write_text(json.dumps({**SYNTHETIC_BASE, "release": release, **changes}))
        return home

    return write
