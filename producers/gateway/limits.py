"""Limits and timeouts of the gateway, the size-limited body reader and the check of a ``?wait`` query.

The body size limit itself is ``FleetSettings.max_body_bytes``; the values here guard the gateway against slow
dependencies and greedy WebSocket clients and are rarely worth changing, so they are not environment settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from fleet.errors import PayloadTooLarge
from fleet.producers.gateway.errors import ApiError


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """Timeouts for calls into the broker and store, the limits of the multiplexed WebSocket (``/v1/ws``), and how
    often a server-sent event stream that has nothing to say sends a keep-alive comment (``sse_keepalive_s``).

    A frame beyond uvicorn's own ``ws_max_size`` (16 MiB by default) is refused by the server, which closes the
    connection with code 1009; frames up to that size but above ``ws_max_frame_bytes`` get an error frame.
    """

    publish_timeout_s: float = 5.0
    store_timeout_s: float = 5.0
    ping_timeout_s: float = 2.0
    ws_wait_chunk_s: float = 30.0
    sse_keepalive_s: float = 15.0
    ws_max_frame_bytes: int = 64 * 1024
    ws_max_ids_per_frame: int = 100
    ws_max_ids_per_connection: int = 1000
    batch_max_bytes: int = 16 << 20  # POST /v1/jobs:batch: the whole body (each item's message: max_message_bytes)
    batch_concurrency: int = 64  # items of one batch submitted at once (their store calls and publishes overlap)


def declared_length(request: Request) -> int | None:
    """The Content-Length header as an int, or None when absent or not a number (chunked bodies have none)."""
    raw = request.headers.get("content-length")
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw)


async def read_limited_body(request: Request, limit_bytes: int) -> bytes:
    """Read the raw body, refusing more than ``limit_bytes`` whether or not the client declared a length.

    Raises:
        PayloadTooLarge: the declared or the actual size is over the limit. For a body without Content-Length
            the reported size is the number of bytes read when the limit was crossed.
    """
    declared = declared_length(request)
    if declared is not None and declared > limit_bytes:
        raise PayloadTooLarge(declared, limit_bytes, what="request body")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise PayloadTooLarge(size, limit_bytes, what="request body")
        chunks.append(chunk)
    return b"".join(chunks)


def check_wait(wait_s: float, max_s: float) -> None:
    """A 422 unless ``0 < wait_s <= max_s`` (a long-poll of a job or a DAG run)."""
    if not 0 < wait_s <= max_s:
        raise ApiError(
            422,
            "invalid_request",
            f"invalid request: query.wait: must be more than 0 and at most {max_s:g} seconds, got {wait_s:g}",
            [{"loc": "query.wait", "msg": f"must be in (0, {max_s:g}]", "type": "out_of_range"}],
        )
