"""Text from outside (an engine's answer, a journal line, a node's file) made safe for a terminal or report.

A server under test, a log line or a file on the node can hold terminal escape sequences (ESC [ 2 J
clears the screen, OSC 8 writes a link, OSC 52 sets the clipboard), a carriage return that makes
the terminal overwrite what came before, or a bidirectional override that shows text in another
order than it is. Whatever of it reaches the operator's terminal or a report goes through
``terminal_text`` first, the one helper every module, plugin and role uses for that (issue 43,
class 4): whole escape sequences are removed (not only their ESC, which would leave ``[31m``),
then every other control character; a line break or tab becomes a space (or stays a line break
where the caller keeps lines), so words do not run together.

Standard library only (runs on managed nodes and in controller plugins).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

# ECMA-48: CSI (ESC [ or the 8-bit U+009B) parameters, intermediates, final byte; OSC, DCS, SOS, PM,
# APC strings up to BEL or ST (ESC \ or U+009C), or to the end of the text when unterminated; any
# other escape (ESC and one or more intermediates plus a final byte, e.g. ESC ( B, ESC c).
_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?"
)
# Format characters that reorder or hide text: bidirectional embeddings, overrides and isolates,
# and the line and paragraph separators a terminal or editor may break on.
_INVISIBLE = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u0085\u2028\u2029")
_BREAKS = frozenset("\n\r\t\v\f\u0085\u2028\u2029")
# Past this, text is cut before anything is scanned: no caller shows more than a few KiB.
MAX_TEXT = 64 * 1024


def _unsafe(ch: str) -> bool:
    return ch in _INVISIBLE or unicodedata.category(ch) == "Cc"


def terminal_text(value: Any, limit: int = MAX_TEXT, keep_lines: bool = False) -> str:
    """``value`` as text safe to print: escape sequences and control characters removed, at most ``limit`` characters.

    A line break, tab or form feed becomes one space (``keep_lines``: a line break stays a line break,
    a CR LF one line break); every other control character, and the bidirectional controls, are dropped.
    A value that is not a string is shown with ``str`` first. Text cut at ``limit`` ends in ``...``.
    """
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit
    if cut:
        text = text[:limit]
    if text.isascii() and text.isprintable():
        return text + ("..." if cut else "")
    text = _SEQUENCE.sub("", text).replace("\r\n", "\n")
    out = []
    for ch in text:
        if keep_lines and ch == "\n":
            out.append(ch)
        elif ch in _BREAKS:
            out.append(" ")
        elif not _unsafe(ch):
            out.append(ch)
    return "".join(out) + ("..." if cut else "")


def terminal_lines(lines: Any, limit: int = MAX_TEXT) -> list[str]:
    """Each line of ``lines`` (a list, or one text split at its line breaks) made safe by ``terminal_text``."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    if not isinstance(lines, list | tuple):
        return [terminal_text(lines, limit)]
    return [terminal_text(line, limit) for line in lines]


def terminal_values(value: Any, limit: int = MAX_TEXT, depth: int = 8) -> Any:
    """A module result's strings (keys and values, in dicts and lists ``depth`` levels deep) made safe."""
    if isinstance(value, str):
        return terminal_text(value, limit)
    if depth <= 0:
        return value
    if isinstance(value, dict):
        return {terminal_values(k, limit, 0): terminal_values(v, limit, depth - 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [terminal_values(v, limit, depth - 1) for v in value]
    return value
