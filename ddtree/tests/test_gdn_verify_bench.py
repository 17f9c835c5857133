"""ddtree/bench/gdn_verify.py's CPU side: its command line and the cases it plans."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch  # noqa: F401 - the bench imports it: set up first (ddtree/tests/conftest.py)

from ddtree import REPO
from ddtree.bench import gdn_verify


def test_the_command_line_says_what_it_measures():
    done = subprocess.run(
        [sys.executable, "-m", "ddtree.bench.gdn_verify", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: python3 -m ddtree.bench.gdn_verify" in done.stdout
    assert "--state-dtype {float32,bfloat16}" in done.stdout


def test_the_default_plan_is_the_chain_and_three_budgets_at_batch_1_and_8(capsys):
    assert gdn_verify.main(["--plan"]) == 0
    cases = json.loads(capsys.readouterr().out)
    assert [(c["batch"], c["method"], c["rows"], c["tree"]) for c in cases] == [
        (1, "chain", 16, None),
        (1, "ddtree16", 17, "random"),
        (1, "ddtree32", 33, "random"),
        (1, "ddtree64", 65, "random"),
        (8, "chain", 16, None),
        (8, "ddtree16", 17, "random"),
        (8, "ddtree32", 33, "random"),
        (8, "ddtree64", 65, "random"),
    ]


def test_each_tree_shape_is_a_case_of_its_own():
    a = gdn_verify.parse_args(["--plan", "--batches", "2", "--methods", "ddtree32,chain", "--trees", "fan,random"])
    assert [(c.method, c.tree) for c in a.cases] == [("ddtree32", "fan"), ("ddtree32", "random"), ("chain", None)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plan", "--methods", "ddtree16,ddtree128"], "unknown methods: ddtree128 (choose from chain, ddtree16"),
        (["--plan", "--trees", "bushy"], "unknown trees: bushy (choose from random, fan)"),
        (["--plan", "--batches", "1,0"], "batch '0' is not a whole number of requests"),
        (["--plan", "--batches", ","], "--batches is empty"),
        ([], "give --out FILE for the results (or --plan to list the cases)"),
    ],
)
def test_a_bad_argument_is_refused_with_what_to_give(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        gdn_verify.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shape_is_verify_parts_own():
    from ddtree.bench import verify_parts

    assert gdn_verify.GDN is verify_parts.GDN
    assert (gdn_verify.GDN["key_heads"], gdn_verify.GDN["value_heads"], gdn_verify.GDN["head"]) == (16, 48, 128)
