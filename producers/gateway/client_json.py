"""Client JSON at the gateway: every request body and ``/v1/ws`` frame is read by ``fleet.strict_json.loads``,
and a refusal becomes ``400 malformed_json`` (not JSON, or nested past ``MAX_DEPTH``) or ``422 invalid_request``
(a value JSON cannot carry exactly: NaN, Infinity, 1e400, an integer past ``MAX_INT_DIGITS`` digits, a lone
surrogate), with ``details: {"limit": N}`` where a limit was passed."""

from __future__ import annotations

from typing import Any

from fleet.producers.gateway.errors import ApiError
from fleet.strict_json import MAX_DEPTH, MAX_INT_DIGITS, JsonRefused, loads

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "parse_json"]


def parse_json(raw: bytes | str, what: str = "the request body") -> Any:
    """The value ``raw`` holds, exactly.

    Raises:
        ApiError: 400 ``malformed_json`` or 422 ``invalid_request`` naming what was wrong (and the limit).
    """
    try:
        return loads(raw, what)
    except JsonRefused as exc:
        details = None if exc.limit is None else {"limit": exc.limit}
        if exc.malformed:
            raise ApiError(400, "malformed_json", exc.message, details) from None
        raise ApiError(422, "invalid_request", exc.message, details) from None
