"""The dispatcher process's small HTTP surface: ``/healthz``, ``/status`` (JSON for the dashboard), ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fleet.dispatcher.service import Dispatcher


def create_status_app(dispatchers: list[Dispatcher]) -> FastAPI:
    """An app over running dispatchers (one per model served by this process)."""
    app = FastAPI(title="Fleet dispatcher", summary="Idle queues, routes and per-worker load of the dispatchers.")

    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/status", summary="Per dispatcher: idle queue, assignment routes, per-worker outstanding work")
    async def status() -> list[dict[str, Any]]:
        return [d.status() for d in dispatchers]

    @app.get("/metrics", summary="Prometheus metrics (fleet_dispatcher_*)")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
