"""The query of ``GET /v1/usage`` read into a checked window and grouping: pure, answering 422 in microseconds.

``from`` and ``to`` are unix seconds, ISO 8601 times (``2026-12-05T10:00:00Z``; without a zone: UTC) or a time
ago (``90m``, ``24h``, ``7d``). ``to`` defaults to now and ``from`` to 24 hours before ``to``; ``from`` after ``to``
and a range longer than ``USAGE_MAX_RANGE_S`` (31 days) are refused, as are times before 2000 or far in the future.
``group_by`` is a comma-separated subset of tenant, model, version and device, each once (default: model).
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

from fleet import constants as c
from fleet.producers.gateway.errors import ApiError
from fleet.schemas.usage import GROUP_FIELDS, GroupField

DEFAULT_RANGE_S = 86400.0
EARLIEST_S = 946684800.0  # 2000-01-01: nothing older was ever counted
LATEST_AHEAD_S = 86400.0  # a ``to`` at most a day ahead of now (clock skew), never years
MAX_PARAM_CHARS = 64
_AGO = re.compile(r"^(\d{1,7})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def invalid(message: str) -> ApiError:
    return ApiError(422, "invalid_request", message)


def parse_time(name: str, value: str, now: float) -> float:
    """``value`` (unix seconds, ISO 8601 or a time ago) as unix seconds; raises a 422 ``ApiError`` naming ``name``."""
    text = value.strip()
    if len(text) > MAX_PARAM_CHARS:
        raise invalid(f"{name}: at most {MAX_PARAM_CHARS} characters")
    ago = _AGO.match(text)
    if ago:
        at = now - int(ago.group(1)) * _UNIT_S[ago.group(2)]
    else:
        try:
            at = float(text)
        except ValueError:
            at = _iso(name, value)
    if not math.isfinite(at) or at < EARLIEST_S or at > now + LATEST_AHEAD_S:
        raise invalid(f"{name} {value!r} is not a time between 2000 and now")
    return at


def _iso(name: str, value: str) -> float:
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise invalid(
            f"{name} {value!r} is not a time: write unix seconds, ISO 8601 (2026-12-05T10:00:00Z) or a time ago "
            "(90m, 24h, 7d)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def window(start: str | None, end: str | None, now: float) -> tuple[float, float]:
    """The ``[from, to)`` a query asks for, checked (see the module docstring)."""
    to = parse_time("to", end, now) if end else now
    since = parse_time("from", start, now) if start else to - DEFAULT_RANGE_S
    if since > to:
        raise invalid(f"from ({since:.0f}) is after to ({to:.0f})")
    if to - since > c.USAGE_MAX_RANGE_S:
        days = c.USAGE_MAX_RANGE_S // 86400
        raise invalid(f"the range from {since:.0f} to {to:.0f} is longer than {days} days: ask for less at a time")
    return since, to


def group_fields(value: str | None) -> list[GroupField]:
    """``group_by`` as a list of known fields, each once, in the order given."""
    if value is None or not value.strip():
        return ["model"]
    if len(value) > MAX_PARAM_CHARS:
        raise invalid(f"group_by: at most {MAX_PARAM_CHARS} characters")
    fields: list[GroupField] = []
    for part in (p.strip() for p in value.split(",")):
        if part not in GROUP_FIELDS:
            raise invalid(f"group_by {part!r} is not one of {', '.join(GROUP_FIELDS)}")
        if part in fields:
            raise invalid(f"group_by names {part!r} twice")
        fields.append(part)  # type: ignore[arg-type]  # checked against GROUP_FIELDS above
    return fields
