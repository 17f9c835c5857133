"""Values reaching service_swap's unit and environment file (issue 23, item 7)."""

from __future__ import annotations

import pytest
from unit_values import control_position, unit_value_problems


def test_clean_values_pass():
    assert (
        unit_value_problems(
            {"service_swap_served_model_name": "Qwen 100% $HOME", "service_swap_extra_args": ["--enforce-eager"]},
            {"service_swap_read_write_paths": ["/srv/a"], "shared_settings_service_user": "vllm"},
            {"service_swap_extra_env": {"VLLM_LOGGING_LEVEL": "DEBUG", "A_B": "x y"}},
            {"service_swap_api_key": "0123abcd"},
        )
        == []
    )


@pytest.mark.parametrize(
    ("texts", "env", "message"),
    [
        (
            {"service_swap_served_model_name": "Qwen\nExecStartPre=/bin/sh -c 'id > /tmp/x'"},
            {},
            "service_swap_served_model_name holds a newline at position 4: it would end its line in the unit or"
            " environment file and let the rest inject directives; remove it.",
        ),
        (
            {"service_swap_extra_args": ["--ok", "--x\rExecStartPost=/bin/true"]},
            {},
            "service_swap_extra_args[1] holds a carriage return at position 3: it would end its line in the unit or"
            " environment file and let the rest inject directives; remove it.",
        ),
        (
            {},
            {"service_swap_extra_env": {"FOO": "bar\nExecStartPre=/bin/true"}},
            "service_swap_extra_env['FOO'] holds a newline at position 3: it would end its line in the unit or"
            " environment file and let the rest inject directives; remove it.",
        ),
        (
            {},
            {"service_swap_extra_env": {"FOO\nExecStartPre=/bin/true": "x"}},
            "service_swap_extra_env has the key 'FOO\\nExecStartPre=/bin/true', which is not an environment"
            " variable name (letters, digits and _, not starting with a digit); rename it.",
        ),
        (
            {},
            {"service_swap_extra_env": {"1X": "x"}},
            "service_swap_extra_env has the key '1X', which is not an environment variable name (letters, digits"
            " and _, not starting with a digit); rename it.",
        ),
        (
            {"service_swap_served_model_name": "a\x00b"},
            {},
            "service_swap_served_model_name holds a NUL at position 1",
        ),
        (
            {"service_swap_served_model_name": "a\u2028b"},
            {},
            "service_swap_served_model_name holds the control character U+2028 at position 1",
        ),
    ],
)
def test_control_characters_are_refused_naming_the_variable(texts, env, message):
    problems = unit_value_problems(texts, {}, env, {})
    assert len(problems) == 1
    assert problems[0].startswith(message)


def test_words_joined_with_spaces_must_be_one_word():
    assert unit_value_problems({}, {"service_swap_read_write_paths": ["/a b"]}) == [
        "service_swap_read_write_paths[0] must be one word without spaces (the unit joins such values with"
        " spaces); got '/a b'."
    ]


def test_a_secret_is_never_shown():
    problems = unit_value_problems({}, secrets={"service_swap_api_key": "s3cr3t\nLD_PRELOAD=/tmp/x.so"})
    assert problems == [
        "service_swap_api_key holds a newline: it would end its line in the unit or environment file and let the"
        " rest inject directives; remove it."
    ]


def test_control_position():
    assert control_position("abc") is None
    assert control_position("a\tb") == 1
    assert control_position("\x7f") == 0


@pytest.mark.parametrize(
    ("host", "key", "allowed", "refused"),
    [
        ("0.0.0.0", "", False, True),
        ("10.0.0.5", "", False, True),
        ("::", "", False, True),
        ("0.0.0.0", "", True, False),
        ("0.0.0.0", "k", False, False),
        ("127.0.0.1", "", False, False),
        ("127.1.2.3", "", False, False),
        ("::1", "", False, False),
        ("localhost", "", False, False),
    ],
)
def test_an_open_api_on_the_network_is_refused_unless_allowed(host, key, allowed, refused):
    from unit_values import open_api_problem

    problem = open_api_problem(host, key, allowed)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"service_swap_vllm_host is {host!r} but service_swap_api_key is empty")


def test_the_default_syscall_filter_and_widened_ones_pass():
    from unit_values import syscall_filter_problems

    assert syscall_filter_problems(["@system-service pidfd_getfd", "~@privileged"], "EPERM") == []
    assert syscall_filter_problems(["@system-service", "~@privileged @resources:EACCES", "ptrace", ""], "1") == []
    assert syscall_filter_problems([], "") == []


@pytest.mark.parametrize(
    ("lines", "error_number", "message"),
    [
        (
            ["@system-service\nExecStartPre=/bin/true"],
            "EPERM",
            "service_swap_system_call_filter[0] holds a newline at position 15: it would end its line in the unit or"
            " environment file and let the rest inject directives; remove it.",
        ),
        (
            ["@system-servce"],
            "EPERM",
            "service_swap_system_call_filter[0] names the group '@system-servce', which systemd 252 does not have"
            " (it would ignore it); the groups are @aio @basic-io",
        ),
        (
            ["@system-service", "ptrace:EPERM"],
            "EPERM",
            "service_swap_system_call_filter[1] gives 'ptrace:EPERM' an errno, which only denied calls take (a line"
            " starting with ~).",
        ),
        (
            ["~mount;reboot"],
            "EPERM",
            "service_swap_system_call_filter[0] has 'mount;reboot', which is neither a syscall name nor an @group"
            " (optionally ':ERRNO' on a ~ line); see 'systemd-analyze syscall-filter'.",
        ),
        (
            "@system-service",
            "EPERM",
            "service_swap_system_call_filter must be a list, one item per SystemCallFilter= line (e.g."
            " ['@system-service', '~@privileged']).",
        ),
        (
            ["@system-service"],
            "eperm",
            "service_swap_system_call_error_number must be an errno name such as EPERM, a number, or '' (then a"
            " denied call kills vLLM); got 'eperm'.",
        ),
    ],
)
def test_a_bad_syscall_filter_is_named_with_what_to_do(lines, error_number, message):
    from unit_values import syscall_filter_problems

    problems = syscall_filter_problems(lines, error_number)
    assert len(problems) == 1
    assert problems[0].startswith(message)


def test_echoed_values_are_cut_to_a_readable_length():
    """Issue 23: a value is shown to name the problem, never whole (it may carry a token)."""
    from unit_values import syscall_filter_problems

    [problem] = unit_value_problems({}, words={"service_swap_read_write_paths": ["/srv/a b" + "x" * 5000]})
    assert problem.endswith("got '/srv/a b" + "x" * 52 + "'....")
    [group] = syscall_filter_problems(["@" + "g" * 5000], "EPERM")
    assert group.startswith("service_swap_system_call_filter[0] names the group '@" + "g" * 59 + "'..., which")
    [errno] = syscall_filter_problems(["r" * 5000 + ":EPERM"], "EPERM")
    assert (
        errno == "service_swap_system_call_filter[0] gives '" + "r" * 60 + "'... an errno, which only denied calls"
        " take (a line starting with ~)."
    )
    assert max(len(p) for p in (problem, errno)) < 200
