"""Parsing what another party sent: JSON of bounded size and depth, finite numbers.

Every error is a ``ValueError``, which a service turns into a 4xx: a peer's input never
surfaces as a ``RecursionError`` or an ``OverflowError`` from deep inside a handler.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_JSON_BYTES = 64 * 2**10
MAX_JSON_DEPTH = 16


def bounded_json(
    text: str | bytes, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """``json.loads(text)``, refusing more than ``max_bytes`` or nesting deeper than ``max_depth``
    with ``ValueError``. NaN and infinities are refused too (they are not JSON).

    >>> bounded_json('{"a": [1, 2]}')
    {'a': [1, 2]}
    """
    if len(text) > max_bytes:
        raise ValueError(f"JSON of {len(text)} bytes, over the limit of {max_bytes}")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if _depth(value) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth}")
    return value


def finite_float(value: Any, what: str = "value") -> float:
    """``value`` as a finite float; ``ValueError`` for a bool, a non-number, an overflow, NaN or
    an infinity (an integer of 400 digits included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large for a float") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {number}")
    return number


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def declared_over(declared: str | None, limit: int) -> bool:
    """Whether a body's declared ``Content-Length`` refuses it before a byte is read: over
    ``limit``, or not a plain decimal number. No declared length passes (the body is then
    counted as it comes)."""
    return declared is not None and (not declared.isdigit() or int(declared) > limit)
