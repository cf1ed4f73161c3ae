"""What the gateway's push routes share, for jobs and for DAG runs: WebSocket close codes and the wait for a task
or the client's leaving (``first_of``), and server-sent event framing (``sse_event``, keep-alives, headers).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import WebSocket

CLOSE_NORMAL = 1000
CLOSE_INTERNAL_ERROR = 1011
CLOSE_NOT_FOUND = 4404
KEEP_ALIVE = b": keep-alive\n\n"
OUTAGE_PAUSE_S = 1.0  # between attempts while the store is down (each wait already spent its keep-alive period)
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def sse_event(name: str, data: str) -> bytes:
    """One event; ``data`` must be a single line (compact JSON is)."""
    return f"event: {name}\ndata: {data}\n\n".encode()


async def _until_disconnect(websocket: WebSocket) -> None:
    """Read (and ignore) client frames until the client goes away."""
    while (await websocket.receive())["type"] != "websocket.disconnect":
        pass


async def first_of(main: asyncio.Task[Any], websocket: WebSocket) -> bool:
    """Run ``main`` until done or until the client disconnects; True when ``main`` finished."""
    watcher = asyncio.create_task(_until_disconnect(websocket))
    try:
        await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (main, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(main, watcher, return_exceptions=True)
    return not main.cancelled() and main.done()
