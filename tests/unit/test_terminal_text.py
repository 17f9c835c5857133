"""Text from outside reaches the operator's terminal and the reports without control characters (issue 43, class 4).

An engine's status line or 500 body, a journal line, a progress line and the rollout report's
tables: each goes through module_utils/terminal_text.py on its way, and the play path through
ansible-playbook prints no escape sequence that a server sent.
"""

from __future__ import annotations

import json

import openai_bench
import openai_probe
import pytest
from ansible.module_utils.terminal_text import terminal_lines, terminal_text, terminal_values
from ansible.module_utils.testing import patch_module_args
from playbook_run import ansible_playbook, local_play, localhost_inventory
from rollout_report import summary_rows, summary_table, tune_rows, tune_table
from test_openai_hostile import Hostile, fixed, healthy

from ddtree.repo import repo_file

# Clear the screen, a red colour, a hyperlink (OSC 8), the clipboard (OSC 52), a title (OSC 0 ended by
# ST), an 8-bit CSI, a carriage return that overwrites the line, a bidirectional override, a NUL.
HOSTILE = (
    "\x1b[2J\x1b[31mred\x1b[0m \x1b]8;;http://evil/\x07link\x1b]8;;\x07 \x1b]52;c;ZXZpbA==\x07"
    "\x1b]0;title\x1b\\ \x9b1;1H ok\rFAKE \u202egnp.exe\x00 end\x1b"
)
CONTROL = [chr(c) for c in range(32) if chr(c) not in "\n"] + ["\x7f", "\x1b", "\x9b", "\u202e", "\u2066"]


def clean(text: str) -> bool:
    return not any(ch in text for ch in [*CONTROL, "\n"])


def test_whole_sequences_and_every_control_character_go() -> None:
    assert terminal_text(HOSTILE) == "red link   ok FAKE gnp.exe end"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain text, unchanged", "plain text, unchanged"),
        ("two\nlines\r\nand\ttab", "two lines and tab"),
        ("Ünïcödé — 中文", "Ünïcödé — 中文"),
        ("\x1b[38;5;196mcolour\x1b[m", "colour"),
        ("\x1b(Bcharset", "charset"),
        ("unterminated \x1b]8;;http://x", "unterminated "),
        ("bell\x07 and backspace\x08", "bell and backspace"),
        ("line\u2028separator", "line separator"),
    ],
)
def test_cases(text: str, expected: str) -> None:
    assert terminal_text(text) == expected


def test_lines_can_be_kept_and_values_walked() -> None:
    assert terminal_text("a\x1b[1m\r\nb\nc", keep_lines=True) == "a\nb\nc"
    assert terminal_lines("one\x1b[2K\ntwo\r\n") == ["one", "two"]
    assert terminal_lines(["\x1b[31mx", 5]) == ["x", "5"]
    assert terminal_values({"Result\x1b[0m": ["\x1b]0;t\x07v"], "n": 3}) == {"Result": ["v"], "n": 3}


def test_a_long_text_is_cut_before_it_is_scanned() -> None:
    assert terminal_text("a" * 100, 10) == "a" * 10 + "..."
    assert terminal_text(42) == "42"


# --- the modules: what the server says never reaches a gate's message raw ------------------------------------


def run_module(module, args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def server():
    s = Hostile()
    yield s
    s.close()


def test_a_500_body_with_escapes_reaches_the_probe_s_error_cleaned(server, capsys) -> None:
    healthy(server)
    server.behaviour["/v1/completions"] = fixed(HOSTILE.encode(), "500 Internal Server Error")
    result = run_module(openai_probe, {"url": server.url, "requests": 1, "timeout": 5}, capsys)
    assert result["error"].startswith(f"POST {server.url}/v1/completions answered HTTP 500: red link")
    assert clean(result["error"]), result["error"]


def test_a_status_line_with_escapes_reaches_the_probe_s_error_cleaned(server, capsys) -> None:
    server.behaviour["/health"] = b"HTTP/1.1 200 \x1b[2J\x1b]0;owned\x07OK\r\nContent-Length: 0\r\n\r\n"
    healthy_result = run_module(openai_probe, {"url": server.url, "timeout": 5}, capsys)
    assert clean(json.dumps(healthy_result, ensure_ascii=False))
    server.behaviour["/v1/models"] = fixed(b"\x1b[31mnope\x1b[0m", "503 \x1b[2JUnavailable")
    result = run_module(openai_probe, {"url": server.url, "requests": 1, "timeout": 5}, capsys)
    assert "nope" in result["error"] and clean(result["error"]), result["error"]


def test_the_bench_s_failure_message_is_cleaned(server, capsys) -> None:
    healthy(server)
    server.behaviour["/v1/completions"] = fixed(
        b'data: {"error": "\\u001b[2J\\u001b]52;c;ZXZpbA==\\u0007boom"}\n\n', "200 OK"
    )
    result = run_module(openai_bench, {"url": server.url, "prompts": ["p"], "concurrency": [1], "timeout": 5}, capsys)
    assert result["failed"] and "boom" in result["msg"]
    assert clean(result["msg"]), result["msg"]


def test_the_wait_s_progress_line_is_cleaned() -> None:
    progress_line = repo_file("plugins/action/openai_wait.py").progress_line
    line = progress_line("n1", "vllm.service", "compiling", 65, {"error": HOSTILE})
    assert line == "n1: waiting for vllm.service's /health: compiling (1m05s; /health: red link   ok FAKE gnp.exe end)"


def test_the_rollout_report_s_tables_show_no_control_character() -> None:
    hosts = {
        "n1": {
            "outcome": "failed",
            "errors": [{"task": "t", "msg": f'service_swap failed on n1 at "Gate 2": {HOSTILE}'}],
            "report": {
                "service_swap": {"serving": "sglang\x1b[8m", "tokens_per_second": float("inf")},
                "tune": {
                    "winner": "dflash",
                    "reason": HOSTILE,
                    "rows": [
                        {
                            "method": "dflash\x1b[2J",
                            "status": "ok",
                            "chosen": True,
                            "levels": [{"concurrency": 1, "tok_s": 5.0}],
                        },
                        {"method": "ddtree", "budget": "3\x1b]0;x\x07", "status": "failed", "note": HOSTILE},
                    ],
                },
            },
        }
    }
    table = summary_table(summary_rows(hosts)) + "\n" + tune_table(tune_rows(hosts, [1]), [1])
    assert all(clean(line) for line in table.splitlines()), table
    assert "red link" in table and "inf" not in table


# --- the play path: a gate's message printed by ansible-playbook --------------------------------------------


def test_a_gate_fed_by_a_hostile_server_prints_no_escape_through_ansible_playbook(server, tmp_path) -> None:
    """service_swap's Gate 2 as the operator meets it: the probe's error in an assert's fail_msg."""
    healthy(server)
    server.behaviour["/v1/completions"] = fixed(HOSTILE.encode(), "500 Internal Server Error")
    play = local_play(
        tmp_path / "gate.yml",
        f"    - openai_probe: {{url: '{server.url}', requests: 1, timeout: 5}}\n"
        "      register: probe\n"
        "    - ansible.builtin.assert:\n"
        "        that: probe.error | length == 0\n"
        "        fail_msg: 'vLLM answers /health but not completions: {{ probe.error }}'\n"
        "    - ansible.builtin.debug:\n"
        "        msg: \"{{ 'journal: ' ~ (['\\u001b[2Jline\\u001b]0;t\\u0007'] | terminal_lines | join(' | ')) }}\"\n",
    )
    res = ansible_playbook(
        localhost_inventory(tmp_path),
        play,
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
    )
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "answered HTTP 500: red link" in out, out
    assert "\x1b" not in out and "\x9b" not in out and "\u202e" not in out, repr(out)


def test_the_roles_filters_are_the_one_helper() -> None:
    from outside_text import FilterModule

    filters = FilterModule().filters()
    assert filters["terminal_text"](HOSTILE) == terminal_text(HOSTILE)
    assert filters["terminal_text"](None) == ""
    assert filters["terminal_text"]("x" * 50, 10) == "x" * 10 + "..."
    assert filters["terminal_lines"](["\x1b[2Ja", "b\x07"]) == ["a", "b"]
    assert filters["terminal_lines"](None) == []
