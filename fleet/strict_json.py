"""The one parser of JSON that comes from outside: the gateway's request bodies and ``/v1/ws`` frames
(``fleet.producers.gateway.client_json`` turns a refusal into its 4xx), the lines of ``fleet publish`` and the CLI's
``--input``. A value survives exactly or is refused (``JsonRefused``, saying what and naming the limit); it is
never changed on the way.

* Not JSON at all: refused as *malformed* (the gateway's ``400 malformed_json``) with the parser's words.
* ``NaN``, ``Infinity``, ``-Infinity`` (not JSON, but Python's parser takes them) and a number too large for a
  64-bit float (``1e400``): refused (``422 invalid_request``). Stored as JSON they would come back as ``null``.
* An integer of more than ``MAX_INT_DIGITS`` digits: refused, naming the limit. Smaller integers are kept exactly,
  also past 64 bits (orjson would read those as floats: a text with a run of 19 or more digits is read again by the
  standard parser, which keeps them as integers).
* A string with a lone UTF-16 surrogate (``"\\ud800x"``): refused; it cannot be stored as UTF-8.
* Arrays and objects nested deeper than ``MAX_DEPTH`` (the text's own value is level 1): refused as malformed,
  naming the limit. Every later reader (pydantic's parser in the worker stops at 200 levels, orjson's writer at
  255) then has room to spare.

Cost: one orjson parse; the depth is walked only when the body holds more brackets than ``MAX_DEPTH`` (fewer
cannot nest deeper); the standard parser runs only for a body orjson refused or one with a long run of digits.
Duplicate keys keep the last value, as every JSON parser here does.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

MAX_DEPTH = 100
"""Levels of arrays and objects in one body or frame, the body itself included."""
MAX_INT_DIGITS = 4300
"""Digits of one integer (Python's own bound on turning text into an int, ``sys.get_int_max_str_digits``)."""

_LONG_DIGITS = re.compile(rb"\d{19}")  # an integer this long may be past 64 bits, which orjson reads as a float


class JsonRefused(ValueError):
    """A text that is not JSON Fleet takes: ``malformed`` (not JSON, or nested past ``MAX_DEPTH``) or holding a
    value JSON cannot carry exactly; ``limit`` is the limit it went past, if any."""

    def __init__(self, message: str, *, malformed: bool, limit: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.malformed = malformed
        self.limit = limit


class _Refused(Exception):  # raised inside the standard parser's hooks, which wrap nothing they raise
    def __init__(self, error: JsonRefused) -> None:
        self.error = error


def loads(raw: bytes | str, what: str = "the request body") -> Any:
    """The value ``raw`` holds, exactly.

    Raises:
        JsonRefused: see the module docstring; ``what`` names the text in the message ("the request body", "the
            frame", "line 3").
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        value = _fallback(data, exc, what)
    else:
        if _LONG_DIGITS.search(data) is not None:
            value = _exact(data, what)
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and _too_deep(value):
        raise too_deep(what)
    return value


def too_deep(what: str) -> JsonRefused:
    message = f"{what} nests arrays and objects more than {MAX_DEPTH} levels deep, over the limit of {MAX_DEPTH}"
    return JsonRefused(message, malformed=True, limit=MAX_DEPTH)


def _exact(data: bytes, what: str) -> Any:
    """The standard parser, with every number checked (the slow path: a body orjson refused, or one with long
    runs of digits)."""

    def number(text: str) -> float:
        value = float(text)
        if value - value != 0:  # inf - inf and nan - nan are nan
            raise _Refused(_non_finite(text, what))
        return value

    def integer(text: str) -> int:
        digits = len(text) - (text[0] == "-")
        if digits > MAX_INT_DIGITS:
            message = f"{what} holds an integer of {digits} digits, over the limit of {MAX_INT_DIGITS} digits"
            raise _Refused(JsonRefused(f"{message}; send it as a string", malformed=False, limit=MAX_INT_DIGITS))
        return int(text)

    def constant(text: str) -> Any:
        raise _Refused(_non_finite(text, what))

    try:
        return json.loads(data, parse_float=number, parse_int=integer, parse_constant=constant)
    except _Refused as exc:
        raise exc.error from None
    except RecursionError:
        raise too_deep(what) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise JsonRefused(f"{what} is not valid JSON: {exc}", malformed=True) from None


def _fallback(data: bytes, exc: orjson.JSONDecodeError, what: str) -> Any:
    """What orjson refused: too deep, not JSON, a number it cannot hold (an integer past a float's range, which
    the standard parser keeps exactly), a lone surrogate or text that is not UTF-8 (which the standard parser takes,
    so its strings are checked)."""
    reason = str(exc)
    if "depth" in reason or "recursion" in reason:
        raise too_deep(what)
    value = _exact(data, what)
    try:
        data.decode()
        _check_strings(value)
    except UnicodeError:
        if "surrogate" in reason:
            message = f"{what} holds a string that is not valid Unicode ({reason}): a lone UTF-16 surrogate such "
            raise JsonRefused(message + "as \\ud800 cannot be stored; send valid text", malformed=False) from None
        raise JsonRefused(f"{what} is not valid UTF-8 JSON: {reason}", malformed=True) from None
    return value


def _check_strings(value: Any) -> None:
    """Raises UnicodeEncodeError for a string (value or key) with a lone surrogate."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            node.encode()
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _non_finite(text: str, what: str) -> JsonRefused:
    message = (
        f"{what} holds the number {text}, which JSON cannot carry (NaN and Infinity are not JSON numbers, and a "
        "number past a 64-bit float's range is infinite): send a finite number, or a string"
    )
    return JsonRefused(message, malformed=False)


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests deeper than ``MAX_DEPTH`` (without recursion: the walk itself must not overflow)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False
