"""The summary table printed at the end of every run, and the JSON report of a stopped rollout."""

import json
import sys
from pathlib import Path

from playbook_run import ansible_playbook
from rollout_report import (
    failure_message,
    note,
    outcome,
    reason,
    summary_rows,
    summary_table,
    tune_levels,
    tune_rows,
    tune_table,
    unreached,
)

PLUGINS = Path(__file__).resolve().parents[2] / "plugins" / "callback"

HOSTS = {
    "gpu-b": {
        "outcome": "failed",
        "report": {"gpu_check": {"summary": "2x NVIDIA H200"}, "service_swap": {"serving": "sglang"}},
        "errors": [{"task": "Gate on acceptance", "msg": "mean acceptance length 1.02 is under 2.0\nmore"}],
    },
    "gpu-a": {
        "outcome": "changed",
        "report": {
            "gpu_check": {"summary": "1x NVIDIA H200"},
            "service_swap": {"serving": "vllm", "mean_acceptance_length": 3.456, "tokens_per_second": 181.2},
        },
        "errors": [],
    },
    "gpu-c": {"outcome": "unreachable", "report": {}, "errors": [{"task": "Gathering Facts", "msg": "timed out"}]},
}


def test_rows_are_sorted_and_say_what_serves_and_why_a_host_failed() -> None:
    assert summary_rows(HOSTS) == [
        ("gpu-a", "changed", "1x NVIDIA H200", "vllm", "3.46", "181.2", ""),
        ("gpu-b", "failed", "2x NVIDIA H200", "sglang", "-", "-", "mean acceptance length 1.02 is under 2.0"),
        ("gpu-c", "unreachable", "-", "-", "-", "-", "timed out"),
    ]


def test_table_aligns_columns() -> None:
    assert summary_table(summary_rows({"n1": {"outcome": "ok", "report": {}, "errors": []}})) == (
        "host  outcome  gpus  serving  acceptance  probe tok/s  note\nn1    ok       -     -        -           -"
    )


def test_an_empty_message_gives_an_empty_note() -> None:
    hosts = {"n1": {"outcome": "failed", "report": {}, "errors": [{"task": "t", "msg": ""}]}}
    assert summary_rows(hosts)[0][-1] == ""


def test_a_failed_loop_reports_its_failed_items() -> None:
    result = {
        "msg": "One or more items failed",
        "results": [{"failed": False, "msg": "fine"}, {"failed": True, "msg": "GPU 0 has 2435 MiB in use"}],
    }
    assert failure_message(result) == "GPU 0 has 2435 MiB in use"
    assert failure_message({"msg": "plain"}) == "plain"
    # A result whose results is not a list (found by the input fuzz): its msg, no TypeError.
    assert failure_message({"msg": "n1: gpu_check failed", "results": True}) == "n1: gpu_check failed"
    assert failure_message({"msg": "x", "results": 5}) == "x"


def test_hosts_of_batches_that_never_started_are_not_reached() -> None:
    plays = {
        "p1": {"name": "GPU preflight", "targets": ["n1", "n2", "n3"], "reached": {"n1", "n2", "n3"}},
        "p2": {"name": "Deploy", "targets": ["n1", "n2", "n3"], "reached": {"n1", "n2"}},
    }
    assert unreached(plays) == {"n3": ["Deploy"]}


def test_outcome_comes_from_the_recap_and_a_rescued_failure_does_not_fail_the_host() -> None:
    assert outcome({"ok": 5, "changed": 0, "failures": 0, "rescued": 1}, "failed", []) == "ok"
    assert outcome({"ok": 5, "changed": 2, "failures": 1, "rescued": 1}, "failed", []) == "failed"
    assert outcome({"ok": 1, "unreachable": 1}, "unreachable", []) == "unreachable"
    assert outcome({"ok": 9, "changed": 0}, "ok", ["Deploy"]) == "not reached"
    assert outcome({"ok": 9, "changed": 3}, "ok", []) == "changed"
    assert outcome({}, "failed", []) == "failed"


def test_rows_say_a_host_was_rolled_back_or_not_reached() -> None:
    hosts = {
        "n2": {
            "outcome": "failed",
            "report": {"service_swap": {"serving": "sglang", "rolled_back": True}},
            "errors": [{"task": "Gate 3", "msg": "mean acceptance length 1.0 is under the floor"}],
        },
        "n3": {"outcome": "not reached", "report": {}, "errors": [], "not_reached": ["Deploy"]},
    }
    assert summary_rows(hosts) == [
        ("n2", "failed", "-", "sglang (rolled back)", "-", "-", "mean acceptance length 1.0 is under the floor"),
        ("n3", "not reached", "-", "-", "-", "-", "not reached: Deploy stopped before its batch"),
    ]


GATE3 = (
    "mean acceptance length 1.31 over 3 requests is under the floor service_swap_min_acceptance_length 2.0"
    " (1 + 59 accepted / 192 drafts): the drafter runs but its drafts are rejected (wrong drafter config,"
    " target_layer_ids, or an unpatched vLLM layer offset)"
)
GATE3_NOTE = (
    "mean acceptance length 1.31 over 3 requests is under the floor service_swap_min_acceptance_length 2.0 (1 + 59..."
)


def test_a_failed_swaps_row_shows_the_reason_not_the_host_and_task() -> None:
    failed = (
        'service_swap failed on qwen-ct101 at "Gate 3, the drafter\'s mean acceptance length is above the floor": '
        + GATE3
        + " Restored: vllm-qwen.service stopped and disabled (previous unit file put back);"
    )
    hosts = {
        # As the rollout report records a rolled-back swap: the gate's failure, then the role's.
        "qwen-ct101": {
            "outcome": "failed",
            "report": {
                "service_swap": {
                    "serving": "sglang",
                    "rolled_back": True,
                    "failed_task": "Gate 3, the drafter's mean acceptance length is above the floor",
                    "reason": GATE3,
                }
            },
            "errors": [
                {"task": "Gate 3, the drafter's mean acceptance length is above the floor", "msg": GATE3},
                {"task": "Fail the host with what failed, what was restored and what to look at", "msg": failed},
            ],
        },
        # Only the role's message, with the host and task in front.
        "qwen-ct201": {
            "outcome": "failed",
            "report": {},
            "errors": [{"task": "Fail the host", "msg": failed.replace("qwen-ct101", "qwen-ct201")}],
        },
    }
    rows = summary_rows(hosts)
    assert rows[0] == ("qwen-ct101", "failed", "-", "sglang (rolled back)", "-", "-", GATE3_NOTE)
    assert rows[1][-1] == GATE3_NOTE
    assert (
        "mean acceptance length 1.31 over 3 requests is under the floor service_swap_min_acceptance_length 2.0"
        in (summary_table(rows).splitlines()[1])
    )


def test_the_reason_drops_the_host_and_task_prefixes_only() -> None:
    assert reason("n2: gpu_check_gpu_cuont is not a variable of any role.", "n2") == (
        "gpu_check_gpu_cuont is not a variable of any role."
    )
    assert reason('service_swap failed on n2 at "Gate 1, vLLM is healthy": vLLM did  not become\nhealthy', "n2") == (
        "vLLM did not become"
    )
    assert reason("n20: something", "n2") == "n20: something"
    assert note("a" * 10, 8) == "aaaaa..."
    assert note("one two three four", 12) == "one two..."


def test_the_probe_column_says_what_the_probe_measured() -> None:
    swap = {"serving": "vllm", "tokens_per_second": 181.2, "probe_requests": 3, "probe_max_tokens": 64}
    one = {"outcome": "ok", "report": {"service_swap": swap}, "errors": []}
    assert summary_table(summary_rows({"n1": one, "n2": one})).splitlines() == [
        "host  outcome  gpus  serving  acceptance  probe tok/s (3x64)  note",
        "n1    ok       -     vllm     -           181.2",
        "n2    ok       -     vllm     -           181.2",
    ]
    other = {"outcome": "ok", "report": {"service_swap": {**swap, "probe_requests": 8}}, "errors": []}
    assert summary_table(summary_rows({"n1": one, "n2": other})).splitlines() == [
        "host  outcome  gpus  serving  acceptance  probe tok/s   note",
        "n1    ok       -     vllm     -           181.2 (3x64)",
        "n2    ok       -     vllm     -           181.2 (8x64)",
    ]


ROLLOUT = """
- name: Preflight
  hosts: nodes
  gather_facts: false
  tasks:
    - name: Look
      ansible.builtin.debug:
        msg: looked
- name: Deploy
  hosts: nodes
  gather_facts: false
  serial: 1
  max_fail_percentage: 0
  tasks:
    - name: Try, and roll back on failure
      block:
        - name: Gate
          ansible.builtin.assert:
            that: inventory_hostname != 'n2'
            fail_msg: acceptance under the floor
      rescue:
        - name: Report the rollback
          ansible.builtin.set_fact:
            dflash_report: {service_swap: {serving: sglang, rolled_back: true, reason: acceptance under the floor}}
        - name: Fail the host
          ansible.builtin.fail:
            msg: 'service_swap failed on n2 at "Gate": acceptance under the floor. Restored: SGLang.'
"""


def test_a_failed_batch_leaves_later_hosts_not_reached_in_the_json_report(tmp_path: Path) -> None:
    (tmp_path / "play.yml").write_text(ROLLOUT)
    (tmp_path / "hosts.yml").write_text(
        "nodes:\n  hosts:\n    n1: {}\n    n2: {}\n    n3: {}\n  vars:\n    ansible_connection: local\n"
    )
    # The report callback alone, from plugins/ (not the repository's ansible.cfg and its other callbacks).
    run = ansible_playbook(
        "hosts.yml",
        "play.yml",
        cwd=tmp_path,
        config=None,
        ANSIBLE_CALLBACK_PLUGINS=str(PLUGINS),
        ANSIBLE_CALLBACKS_ENABLED="rollout_report",
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_PYTHON_INTERPRETER=sys.executable,
        ANSIBLE_NOCOLOR="1",
    )
    assert run.returncode == 2, run.stdout
    (report,) = (tmp_path / "reports").glob("play-*.json")
    hosts = json.loads(report.read_text())["hosts"]
    assert {name: h["outcome"] for name, h in hosts.items()} == {"n1": "ok", "n2": "failed", "n3": "not reached"}
    assert hosts["n3"]["not_reached"] == ["Deploy"]
    assert hosts["n2"]["report"] == {
        "service_swap": {"serving": "sglang", "rolled_back": True, "reason": "acceptance under the floor"}
    }
    assert [e["msg"] for e in hosts["n2"]["errors"]] == [
        "acceptance under the floor",
        'service_swap failed on n2 at "Gate": acceptance under the floor. Restored: SGLang.',
    ]
    assert "n3    not reached" in run.stdout
    assert (
        "n2    failed       -     sglang (rolled back)  -           -            acceptance under the floor\n"
        in run.stdout
    )


def test_a_malformed_report_entry_does_not_break_the_table() -> None:
    """Issue 23, LOW: a report whose role sections are not mappings broke the summary."""
    hosts = {
        "n1": {"outcome": "ok", "report": {"service_swap": "oops", "gpu_check": ["x"]}, "errors": []},
        "n2": {"outcome": "ok", "report": {"service_swap": {"mean_acceptance_length": 2.5, "serving": ""}}},
    }
    assert summary_rows(hosts) == [
        ("n1", "ok", "-", "-", "-", "-", ""),
        ("n2", "ok", "-", "-", "2.50", "-", ""),
    ]


def test_two_runs_in_the_same_second_keep_both_reports(tmp_path: Path) -> None:
    from rollout_report import write_report

    first = write_report(tmp_path, "site-20261201T000000Z", '{"run": 1}')
    second = write_report(tmp_path, "site-20261201T000000Z", '{"run": 2}')
    assert (first.name, second.name) == ("site-20261201T000000Z.json", "site-20261201T000000Z-2.json")
    assert first.read_text() == '{"run": 1}\n'
    assert second.read_text() == '{"run": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


TRAFFIC = [{"concurrency": 1, "weight": 1.0}, {"concurrency": 8, "weight": 1.0}]


def _tuned(winner: str, reason: str, rows: list[dict], traffic: list[dict] = TRAFFIC) -> dict:
    return {
        "outcome": "changed",
        "errors": [{"task": "Benchmark it", "msg": "a rescued candidate failure"}],
        "report": {
            "service_swap": {"serving": "vllm", "mean_acceptance_length": 6.25, "tokens_per_second": 480.0},
            "tune": {"winner": winner, "reason": reason, "traffic": traffic, "rows": rows},
        },
    }


def _row(name: str, status: str, levels: list, vs_chain: float | None, chosen: bool = False, note: str = "") -> dict:
    method, _, budget = name.partition("-")
    return {
        "name": name,
        "method": method,
        "budget": int(budget) if budget else None,
        "status": status,
        "levels": [{"concurrency": c, "tok_s": t, "acceptance": a, "vs_chain": v} for c, t, a, v in levels],
        "acceptance": levels[0][2] if levels else None,
        "vs_chain": vs_chain,
        "refused_at": [],
        "chosen": chosen,
        "note": note,
    }


WHY = "ddtree-16 is weighted x1.100 the chain's tok/s (c=1 x1.100, c=8 x1.100), at least the 5% margin"
TUNED = {
    "n1": _tuned(
        "ddtree-16",
        WHY,
        [
            _row("dflash", "ok", [(1, 500.0, 6.25, 1.0), (8, 2000.0, 6.25, 1.0)], 1.0),
            _row("ddtree-16", "ok", [(1, 550.0, 7.75, 1.1), (8, 2200.0, 7.75, 1.1)], 1.1, chosen=True),
            _row(
                "ddtree-32",
                "ok",
                [(1, 700.0, 10.0, 1.4), (8, 1000.0, 10.0, 0.5)],
                0.95,
                note="refused: at concurrency 8 it is x0.500 the chain, more than the 5% margin slower",
            ),
            _row(
                "ddtree-64",
                "failed",
                [(1, None, None, None), (8, None, None, None)],
                None,
                note="Gate 1, vLLM is healthy: vLLM did not become healthy",
            ),
        ],
    ),
}


def test_a_tuned_host_says_what_serves_and_why_not_a_rescued_candidate() -> None:
    row = summary_rows(TUNED)[0]
    assert row[3] == "vllm ddtree-16"
    assert row[-1] == "tuned: " + WHY


def test_the_tuning_table_has_every_candidate_at_every_concurrency() -> None:
    assert tune_levels(TUNED) == [1, 8]
    assert tune_table(tune_rows(TUNED, [1, 8]), [1, 8]).splitlines() == [
        "host  method  budget  c=1 tok/s     c=8 tok/s      weighted vs chain  acceptance  note",
        "n1    dflash  -       500.0 x1.000  2000.0 x1.000  x1.000             6.25",
        "n1    ddtree  16      550.0 x1.100  2200.0 x1.100  x1.100             7.75        serves: " + WHY,
        "n1    ddtree  32      700.0 x1.400  1000.0 x0.500  x0.950             10.00       refused: at concurrency 8 it"
        " is x0.500 the chain, more than the 5% margin slower",
        "n1    ddtree  64      -             -              -                  -           failed, skipped: Gate 1,"
        " vLLM is healthy: vLLM did not become healthy",
    ]


def test_hosts_with_other_traffic_show_a_dash_where_they_measured_nothing() -> None:
    rows = [_row("dflash", "ok", [(4, 900.0, 6.25, 1.0)], 1.0, chosen=True)]
    hosts = {
        **TUNED,
        "n2": _tuned("dflash", "the chain (c=4 900.0 tok/s): no DDTree", rows, [{"concurrency": 4, "weight": 1}]),
    }
    levels = tune_levels(hosts)
    assert levels == [1, 4, 8]
    assert tune_table(tune_rows(hosts, levels), levels).splitlines()[-1] == (
        "n2    dflash  -       -             900.0 x1.000  -              x1.000             6.25        serves: the"
        " chain (c=4 900.0 tok/s): no DDTree"
    )


def test_no_tuning_no_rows() -> None:
    assert tune_levels(HOSTS) == []
    assert tune_rows(HOSTS, []) == []


def test_a_ddtree_budget_not_measured_says_why_in_the_table() -> None:
    rows = [
        _row("dflash", "ok", [(1, 500.0, 6.25, 1.0)], 1.0, chosen=True),
        _row(
            "ddtree-16",
            "skipped",
            [(1, None, None, None)],
            None,
            note="not measured: DDTree is not available on this node: the target has Mamba layers (mamba)",
        ),
    ]
    one = [{"concurrency": 1, "weight": 1}]
    hosts = {"n2": _tuned("dflash", "the chain (c=1 500.0 tok/s): no DDTree candidate was measured", rows, one)}
    assert tune_table(tune_rows(hosts, [1]), [1]).splitlines()[2] == (
        "n2    ddtree  16      -             -                  -           not measured: DDTree is not available on"
        " this node: the target has Mamba layers (mamba)"
    )


def test_a_node_tune_yml_skipped_says_so_and_what_to_do() -> None:
    hosts = {
        "n3": {
            "outcome": "ok",
            "stats": {"changed": 0},
            "report": {"tune": {"skipped": "serves sglang, not vLLM: run site.yml -l n3 first"}},
        }
    }
    assert summary_rows(hosts)[0][-1] == "not tuned: serves sglang, not vLLM: run site.yml -l n3 first"
    assert tune_rows(hosts, tune_levels(hosts)) == []
