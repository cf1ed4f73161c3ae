"""WebSockets that push terminal job records.

``/v1/jobs/{job_id}/ws`` serves one job: it sends the terminal record once as JSON text and closes with 1000,
also when the job ended before the socket opened, or while the store was unreachable (the socket waits for it).
An unknown job gets ``{"error": {...}}`` and close code 4404.

``/v1/ws`` multiplexes many jobs on one connection. The client sends text frames::

    {"subscribe": ["id1", "id2"]}      start watching these ids (ids already watched are ignored)
    {"unsubscribe": ["id1"]}           stop watching them

and the server sends, once per subscription, ``{"type": "result", "job": {...record...}}`` when the job ends, or
``{"type": "error", "job_id": "id9", "error": {...}}`` for an unknown job. A store outage is no error: the watchers
wait it out and send each result once the store is back. A frame the server cannot use (not JSON, or a value JSON
cannot carry exactly: ``fleet.producers.gateway.client_json``; wrong shape, more than
``GatewayLimits.ws_max_ids_per_frame`` ids, more than ``ws_max_ids_per_connection`` ids watched at once, over
``ws_max_frame_bytes``) gets ``{"type": "error", "job_id": null, "error": {...}}`` and the connection stays open.
Subscribing again to an id whose result was already sent sends it again. Keep-alive: uvicorn pings every
``ws_ping_interval`` (20 s). A failure of the gateway itself closes the connection with 1011 and a reason, never
silently.

Another tenant's job is an unknown job on both routes (the same frame, the same close code 4404); the operator
token watches every tenant's jobs (``fleet.tenancy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from fleet import tenancy
from fleet.errors import JobNotFound, StoreError
from fleet.producers.gateway.access import websocket_principal, ws_subprotocol
from fleet.producers.gateway.calls import patiently
from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import ApiError, error_json
from fleet.producers.gateway.metrics import WEBSOCKETS_OPEN
from fleet.producers.gateway.push import CLOSE_INTERNAL_ERROR, CLOSE_NORMAL, CLOSE_NOT_FOUND, first_of
from fleet.producers.gateway.state import GatewayState
from fleet.schemas.jobs import JobRecord

logger = logging.getLogger(__name__)

router = APIRouter(tags=["push"])


async def wait_terminal(state: GatewayState, job_id: str, viewer: str | None = tenancy.ALL_TENANTS) -> JobRecord | None:
    """The job's terminal record, waiting as long as it takes in bounded steps; None for an unknown job, or one of
    a tenant other than ``viewer`` (known from the first read: nothing is waited for).

    A socket has no deadline, so a store outage is waited out however long it lasts (``calls.patiently``): the
    client gets the terminal record once the store is back. Raises ``StoreError`` only when it is not retriable.
    """
    store, limits, bounded = state.store, state.limits, state.bounded
    record = await patiently(lambda: bounded(store.get(job_id)), job_id)
    if record is not None and not tenancy.readable(record, viewer):
        return None
    chunk_s = limits.ws_wait_chunk_s
    while record is not None and not record.terminal:
        record = await patiently(lambda: bounded(store.wait(job_id, chunk_s), waits_s=chunk_s), job_id)
    return record


@router.websocket("/v1/jobs/{job_id}/ws", name="job_ws")
async def job_ws(websocket: WebSocket, job_id: str) -> None:
    """Push one job's terminal record, then close (1000); unknown job: an error frame and close code 4404."""
    state: GatewayState = websocket.app.state.gateway
    principal = await websocket_principal(websocket)
    if principal is None:
        return
    await websocket.accept(subprotocol=ws_subprotocol(websocket))
    WEBSOCKETS_OPEN.inc()
    try:
        main = asyncio.create_task(wait_terminal(state, job_id, principal.tenant))
        if not await first_of(main, websocket):
            return  # the client left first
        try:
            record = main.result()
        except StoreError as exc:
            await websocket.send_text(json.dumps(error_json("store_unavailable", exc.message)))
            await websocket.close(CLOSE_INTERNAL_ERROR)
            return
        except Exception as exc:  # a bug or a corrupt record: tell the client, keep the gateway serving
            logger.exception("websocket for job %s failed", job_id)
            await websocket.send_text(json.dumps(error_json("internal_error", f"{type(exc).__name__}: {exc}")))
            await websocket.close(CLOSE_INTERNAL_ERROR)
            return
        if record is None:
            body = error_json("job_not_found", JobNotFound(job_id).message, {"job_id": job_id})
            await websocket.send_text(json.dumps(body))
            await websocket.close(CLOSE_NOT_FOUND)
            return
        await websocket.send_text(record.model_dump_json())
        await websocket.close(CLOSE_NORMAL)
    except WebSocketDisconnect:
        logger.debug("websocket for job %s closed by the client", job_id)
    finally:
        WEBSOCKETS_OPEN.dec()


class FrameError(Exception):
    """A client frame the multiplexer cannot use; becomes an error frame, the connection stays open."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


def parse_frame(text: str, max_bytes: int, max_ids: int) -> tuple[str, list[str]]:
    """``("subscribe" | "unsubscribe", ids)`` from one client frame.

    Raises:
        FrameError: the frame is too big, not JSON, of the wrong shape or names too many ids.
    """
    size = len(text.encode())
    if size > max_bytes:
        raise FrameError("frame_too_large", f"frame is {size} bytes, over the limit of {max_bytes} bytes")
    try:
        data = parse_json(text, "the frame")
    except ApiError as exc:  # not JSON, or a value JSON cannot carry exactly (fleet.producers.gateway.client_json)
        raise FrameError("invalid_frame", exc.message) from None
    shape = 'a frame is {"subscribe": ["<job id>", ...]} or {"unsubscribe": [...]}'
    if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in ("subscribe", "unsubscribe"):
        raise FrameError("invalid_frame", f"unexpected frame {text[:200]!r}: {shape}")
    action, ids = next(iter(data.items()))
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise FrameError("invalid_frame", f"{action!r} must be a list of non-empty job id strings: {shape}")
    if len(ids) > max_ids:
        raise FrameError("too_many_ids", f"frame names {len(ids)} job ids, over the limit of {max_ids} per frame")
    return action, list(dict.fromkeys(ids))


class Multiplexer:
    """One ``/v1/ws`` connection: a reader loop and one watcher task per subscribed job id, for a caller reading
    as ``viewer`` (``fleet.tenancy``)."""

    def __init__(self, websocket: WebSocket, state: GatewayState, viewer: str | None = tenancy.ALL_TENANTS) -> None:
        self.websocket = websocket
        self.state = state
        self.viewer = viewer
        self.watchers: dict[str, asyncio.Task[None]] = {}
        self.send_lock = asyncio.Lock()

    async def run(self) -> None:
        try:
            while (text := await self._receive_text()) is not None:
                await self._handle(text)
        finally:
            tasks = list(self.watchers.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _receive_text(self) -> str | None:
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            return None
        if message.get("text") is not None:
            return str(message["text"])
        return bytes(message.get("bytes") or b"").decode(errors="replace")

    async def _handle(self, text: str) -> None:
        limits = self.state.limits
        try:
            action, ids = parse_frame(text, limits.ws_max_frame_bytes, limits.ws_max_ids_per_frame)
            if action == "subscribe":
                self._subscribe(ids)
            else:
                self._unsubscribe(ids)
        except FrameError as exc:
            await self.send({"type": "error", "job_id": None, "error": error_json(exc.type, exc.message)["error"]})

    def _subscribe(self, ids: list[str]) -> None:
        new = [i for i in ids if i not in self.watchers]
        limit = self.state.limits.ws_max_ids_per_connection
        if len(self.watchers) + len(new) > limit:
            raise FrameError(
                "too_many_ids",
                f"subscribing {len(new)} more job ids would watch {len(self.watchers) + len(new)}, over the limit "
                f"of {limit} per connection; unsubscribe some or open another connection",
            )
        for job_id in new:
            self.watchers[job_id] = asyncio.create_task(self._watch(job_id), name=f"ws-watch-{job_id}")

    def _unsubscribe(self, ids: list[str]) -> None:
        for job_id in ids:
            task = self.watchers.pop(job_id, None)
            if task is not None:
                task.cancel()

    async def _watch(self, job_id: str) -> None:
        try:
            record = await wait_terminal(self.state, job_id, self.viewer)
            if record is None:
                error = error_json("job_not_found", JobNotFound(job_id).message, {"job_id": job_id})["error"]
                await self.send({"type": "error", "job_id": job_id, "error": error})
            else:
                await self.send({"type": "result", "job": record.model_dump(mode="json")})
        except StoreError as exc:
            error = error_json("store_unavailable", exc.message)["error"]
            await self.send({"type": "error", "job_id": job_id, "error": error})
        finally:
            if self.watchers.get(job_id) is asyncio.current_task():
                del self.watchers[job_id]

    async def send(self, frame: dict[str, Any]) -> None:
        """Send one frame; a client that already left is not an error."""
        async with self.send_lock:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.websocket.send_text(json.dumps(frame))


@router.websocket("/v1/ws", name="multiplexed_ws")
async def multiplexed_ws(websocket: WebSocket) -> None:
    """Push the terminal records of many jobs on one connection (see the module docstring for the protocol)."""
    state: GatewayState = websocket.app.state.gateway
    principal = await websocket_principal(websocket)
    if principal is None:
        return
    await websocket.accept(subprotocol=ws_subprotocol(websocket))
    WEBSOCKETS_OPEN.inc()
    try:
        await Multiplexer(websocket, state, principal.tenant).run()
    except Exception as exc:  # a bug: the client gets a close frame with a reason, not a dropped socket
        logger.exception("/v1/ws failed")
        with contextlib.suppress(Exception):
            await websocket.close(CLOSE_INTERNAL_ERROR, f"internal error ({type(exc).__name__}); see the gateway log")
    finally:
        WEBSOCKETS_OPEN.dec()
