"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, Field

from fleet.producers.gateway.errors import error_response
from fleet.producers.gateway.metrics import REGISTRY
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import ErrorResponse

router = APIRouter()


class Health(BaseModel):
    status: str = Field(description="'ok'")


class ModelReadiness(BaseModel):
    ready_workers: int = Field(
        description="workers of this model whose fresh heartbeat (within 3 heartbeat intervals) says 'ready'"
    )


class Readiness(BaseModel):
    status: str = Field(description="'ready'")
    broker: str = Field(description="'ok' or why the broker does not answer")
    store: str = Field(description="'ok' or why the store does not answer")
    models: dict[str, ModelReadiness] = Field(
        description="per served model, how many workers can take its jobs now; 0 does not make the gateway unready "
        "(submissions queue until a worker comes), except under `fleet up`, which is ready once each has one"
    )


@router.get("/healthz", tags=["ops"], summary="Liveness", response_model=Health)
async def healthz() -> Health:
    """Always 200 while the process serves requests."""
    return Health(status="ok")


async def _probe(call: Awaitable[None], timeout_s: float) -> str:
    try:
        async with asyncio.timeout(timeout_s):
            await call
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except Exception as exc:
        return getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return "ok"


@router.get(
    "/readyz",
    tags=["ops"],
    summary="Readiness",
    response_model=Readiness,
    responses={503: {"model": ErrorResponse}},
)
async def readyz(request: Request, state: GatewayState = Depends(gateway_state)) -> Response:
    """200 when the broker and the store both answer a ping (submissions are accepted and queue); 503 naming the
    one(s) that do not. The body lists each model's ready workers; under ``fleet up`` a model without one is also
    a 503 (``fleet up`` is ready only once every model has a warm worker)."""
    timeout_s = state.limits.ping_timeout_s
    broker, store = await asyncio.gather(_probe(state.broker.ping(), timeout_s), _probe(state.store.ping(), timeout_s))
    checks = {"broker": broker, "store": store}
    schemes = {"broker": state.broker.scheme, "store": state.store.scheme}
    failing = [f"{name} ({schemes[name]}): {why}" for name, why in checks.items() if why != "ok"]
    counts = state.workers.ready.counts(state.specs)
    models = {name: {"ready_workers": n} for name, n in counts.items()}
    if state.require_ready_workers:
        failing += [f"model {name!r} has no ready worker yet" for name, n in counts.items() if n == 0]
    if failing:
        return error_response(503, "not_ready", "not ready: " + "; ".join(failing), {**checks, "models": models})
    return JSONResponse(Readiness(status="ready", models=models, **checks).model_dump())


@router.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Every metric of this process in the Prometheus text format (gateway and, under ``fleet up``, workers), or
    in the OpenMetrics format (with exemplars: a stage latency's trace id) when the scraper accepts it."""
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(REGISTRY), media_type=content_type)
