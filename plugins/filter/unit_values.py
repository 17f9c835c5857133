"""Values that reach a systemd unit or environment file, checked before either is rendered.

systemd reads a unit and an EnvironmentFile line by line: a newline (or any control character)
in a value ends its line, and what follows becomes a directive of its own (``ExecStartPre=`` run
as root, another ``Environment=``, ``LD_PRELOAD`` in the env file). Values that the unit joins
with spaces (``ReadWritePaths=``, ``After=``) must also be single words, and environment
variable names must be names. Each problem is one sentence naming the variable and what to do;
values of secret variables are never shown.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Line and paragraph separators systemd's parser does not split on, but editors and journals do.
_SEPARATORS = {"\u0085", "\u2028", "\u2029"}


def control_position(text: str) -> int | None:
    """Index of the first control character (newline, CR, tab, NUL, ...) in ``text``, or None."""
    for i, ch in enumerate(text):
        if ch in _SEPARATORS or unicodedata.category(ch) == "Cc":
            return i
    return None


def _describe(ch: str) -> str:
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL"}
    return names.get(ch, f"the control character U+{ord(ch):04X}")


# Echoed values are cut to this many characters: a message names the problem, not the whole value.
MAX_SHOWN = 60


def _shown(value: str) -> str:
    return repr(value[:MAX_SHOWN]) + ("..." if len(value) > MAX_SHOWN else "")


def _text_problem(where: str, value: Any, secret: bool = False, word: bool = False) -> str | None:
    if not isinstance(value, str):
        value = str(value)
    pos = control_position(value)
    if pos is not None:
        at = "" if secret else f" at position {pos}"
        return (
            f"{where} holds {_describe(value[pos])}{at}: it would end its line in the unit or environment file"
            " and let the rest inject directives; remove it."
        )
    if word and (not value or any(ch.isspace() for ch in value)):
        return f"{where} must be one word without spaces (the unit joins such values with spaces); got {_shown(value)}."
    return None


def unit_value_problems(
    texts: Mapping[str, Any],
    words: Mapping[str, Any] | None = None,
    env: Mapping[str, Any] | None = None,
    secrets: Mapping[str, Any] | None = None,
) -> list[str]:
    """Every problem with values that reach the unit or its environment file.

    ``texts``: variable name -> a string or a list of strings (arguments, paths, names);
    ``words``: the same, where each string must also be one word (joined with spaces in the unit);
    ``env``: variable name -> a mapping of environment variable names to values;
    ``secrets``: variable name -> a string whose value is never shown.
    """
    problems: list[str] = []
    for group, word in ((texts, False), (words or {}, True)):
        for name, value in group.items():
            items = value if isinstance(value, list | tuple) else [value]
            for i, item in enumerate(items):
                if item is None:
                    continue
                where = f"{name}[{i}]" if isinstance(value, list | tuple) else name
                problem = _text_problem(where, item, word=word)
                if problem:
                    problems.append(problem)
    for name, mapping in (env or {}).items():
        if not isinstance(mapping, Mapping):
            problems.append(f"{name} must be a mapping of environment variable names to values.")
            continue
        for key, value in mapping.items():
            key = str(key)
            if not _ENV_NAME.match(key):
                problems.append(
                    f"{name} has the key {key[:60]!r}, which is not an environment variable name (letters, digits"
                    " and _, not starting with a digit); rename it."
                )
                continue
            problem = _text_problem(f"{name}[{key!r}]", "" if value is None else value)
            if problem:
                problems.append(problem)
    for name, value in (secrets or {}).items():
        problem = _text_problem(name, "" if value is None else value, secret=True)
        if problem:
            problems.append(problem)
    return problems


# systemd 252's syscall groups (systemd-analyze syscall-filter). systemd ignores an unknown group or
# name with a warning in the journal, so a typo would silently change the filter: groups are checked
# against this list; syscall names only for their form (systemd ignores names it cannot resolve).
SYSCALL_GROUPS = frozenset(
    [
        "@aio",
        "@basic-io",
        "@chown",
        "@clock",
        "@cpu-emulation",
        "@debug",
        "@default",
        "@file-system",
        "@io-event",
        "@ipc",
        "@keyring",
        "@known",
        "@memlock",
        "@module",
        "@mount",
        "@network-io",
        "@obsolete",
        "@pkey",
        "@privileged",
        "@process",
        "@raw-io",
        "@reboot",
        "@resources",
        "@setuid",
        "@signal",
        "@swap",
        "@sync",
        "@system-service",
        "@timer",
    ]
)
_SYSCALL_WORD = re.compile(r"^(@?[a-z0-9_-]+)(?::(E[A-Z0-9]+|[0-9]{1,4}))?$")
_ERRNO = re.compile(r"^(E[A-Z0-9]+|[0-9]{1,4})$")


def syscall_filter_problems(lines: Any, error_number: Any) -> list[str]:
    """Problems with service_swap_system_call_filter (one SystemCallFilter= line per item) and
    service_swap_system_call_error_number, each one sentence saying what to do."""
    name = "service_swap_system_call_filter"
    if not isinstance(lines, list | tuple):
        return [
            f"{name} must be a list, one item per SystemCallFilter= line (e.g. ['@system-service', '~@privileged'])."
        ]
    problems = []
    for i, line in enumerate(lines):
        where = f"{name}[{i}]"
        if not isinstance(line, str):
            problems.append(f"{where} must be a string of syscall names and @groups; got {type(line).__name__}.")
            continue
        problem = _text_problem(where, line)
        if problem:
            problems.append(problem)
            continue
        deny = line.startswith("~")
        for word in (line[1:] if deny else line).split():
            m = _SYSCALL_WORD.match(word)
            if not m:
                problems.append(
                    f"{where} has {_shown(word)}, which is neither a syscall name nor an @group (optionally"
                    " ':ERRNO' on a ~ line); see 'systemd-analyze syscall-filter'."
                )
            elif m.group(1).startswith("@") and m.group(1) not in SYSCALL_GROUPS:
                problems.append(
                    f"{where} names the group {_shown(m.group(1))}, which systemd 252 does not have (it would ignore it);"
                    " the groups are " + " ".join(sorted(SYSCALL_GROUPS)) + "."
                )
            elif m.group(2) and not deny:
                problems.append(
                    f"{where} gives {_shown(word)} an errno, which only denied calls take (a line starting with ~)."
                )
    if not isinstance(error_number, str) or not (error_number == "" or _ERRNO.match(error_number)):
        problems.append(
            f"service_swap_system_call_error_number must be an errno name such as EPERM, a number, or ''"
            f" (then a denied call kills vLLM); got {str(error_number)[:60]!r}."
        )
    return problems


_LOOPBACK = re.compile(r"^(127(\.\d{1,3}){3}|::1|\[::1\]|localhost)$")


def open_api_problem(host: str, api_key: str, allowed: bool) -> str | None:
    """A sentence when vLLM would serve without a key on an address other machines reach."""
    if api_key or allowed or _LOOPBACK.match(str(host).strip()):
        return None
    return (
        f"service_swap_vllm_host is {host!r} but service_swap_api_key is empty: vLLM would serve an open API to"
        " the network. Set service_swap_api_key (e.g. from 'openssl rand -hex 32', in a vault), listen on"
        " 127.0.0.1, or set service_swap_allow_open_api: true where the network itself is the access control."
    )


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "unit_value_problems": unit_value_problems,
            "open_api_problem": open_api_problem,
            "syscall_filter_problems": syscall_filter_problems,
        }
