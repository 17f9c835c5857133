"""The summary table printed at the end of every run."""

from rollout_report import failure_message, summary_rows, summary_table

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
        "host  outcome  gpus  serving  acceptance  tok/s  note\nn1    ok       -     -        -           -"
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
