"""Filters for text from outside (an engine's journal, a module's message quoting a server) on its way
to the operator's terminal or the run's report: module_utils/terminal_text.py's one helper (issue 43).

``terminal_text``: escape sequences and control characters removed, a line break made a space, at most
``limit`` characters. ``terminal_lines``: the same per line of a list (or of a text split at its breaks).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C

for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.terminal_text import MAX_TEXT, terminal_lines, terminal_text


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    return terminal_text("" if value is None else value, int(limit))


def _lines(value: Any, limit: int = MAX_TEXT) -> list[str]:
    return terminal_lines([] if value is None else value, int(limit))


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"terminal_text": _text, "terminal_lines": _lines}
