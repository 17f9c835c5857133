"""The benchmark's verdict rests on median_interval: its ranks are checked against the published
table of distribution-free confidence intervals for a median (95%: n = 9 -> ranks 2 and 8,
n = 100 -> ranks 40 and 61)."""

from __future__ import annotations

import sys

from ddtree.repo import repo_file

# The benchmark (a script) puts module_utils first on sys.path when imported, where its vllm_venvs
# would shadow the module of that name in library/ for the tests that run after this one: restore it.
_saved_path = list(sys.path)
median_interval = repo_file("benchmarks/safetensors_inspect.py").median_interval
sys.path[:] = _saved_path


def test_ranks_match_the_table_for_nine_and_a_hundred_values() -> None:
    assert median_interval([float(i) for i in range(1, 10)]) == (5.0, 2.0, 8.0)
    assert median_interval([float(i) for i in range(1, 101)]) == (50.5, 40.0, 61.0)


def test_order_of_the_values_does_not_matter() -> None:
    values = [0.97, 1.02, 0.95, 1.10, 0.99, 1.01, 0.93, 1.04, 0.98]
    assert median_interval(values) == (0.99, 0.95, 1.04)


def test_too_few_values_give_the_whole_range() -> None:
    assert median_interval([2.0, 1.0, 3.0]) == (2.0, 1.0, 3.0)
    assert median_interval([1.5]) == (1.5, 1.5, 1.5)
