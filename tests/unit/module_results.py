"""What the controller accepts back from a module, shared by the module tests."""

from __future__ import annotations

from typing import Any


def all_text_is_utf8(value: Any) -> bool:
    """No lone surrogates (undecodable bytes) anywhere in a result: the controller refuses them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(all_text_is_utf8(k) and all_text_is_utf8(v) for k, v in value.items())
    if isinstance(value, list):
        return all(all_text_is_utf8(v) for v in value)
    return True
