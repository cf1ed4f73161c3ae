"""Helpers of the result-cache tests: per-test model specs, one shared embedding model, a served gateway.

Model references (resolved through the module ``__getattr__``):

* ``tests.cache_helpers:echotext_<token>``: the echo model named ``echotext-<token>`` whose ``text`` field the L3
  cache embeds (threshold 0.9), so that L3 is tested with the real embedding model and the cheap echo worker;
* ``tests.cache_helpers:echov2_<token>``: the echo model ``echo-<token>`` at version "2" (version invalidation).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import REGISTRY

from fleet.brokers.base import Broker
from fleet.errors import ConfigError
from fleet.producers.gateway import CacheParts, create_app
from fleet.producers.gateway.cache.embedder import TextModel, load_embed_handler
from fleet.schemas.models import ECHO, ModelSpec
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from tests.gateway_helpers import FAST_LIMITS, ObservedWorker, served


def __getattr__(name: str) -> ModelSpec:
    base, sep, token = name.partition("_")
    if sep and base == "echotext":
        return dataclasses.replace(ECHO, name=f"echotext-{token}", cache_text="text", cache_threshold=0.9)
    if sep and base == "echov2":
        return dataclasses.replace(ECHO, name=f"echo-{token}", version="2")
    raise AttributeError(name)


_LOADING = threading.Lock()


def shared_text_model(name: str = "embed") -> TextModel:
    """The ``embed`` handler's model, loaded once per test session (every gateway of every test shares it): the L3
    embedder ``embed``; another name is refused as the gateway's own loader refuses it."""
    if name != "embed":
        raise ConfigError(f"{name!r} is not an L3 embedder of the tests; known: embed")
    with _LOADING:
        return _load_once()


@functools.cache
def _load_once() -> TextModel:
    return load_embed_handler("cpu")


@dataclass
class Gateway:
    """A gateway served over real HTTP (uvicorn), with an httpx client on it."""

    app: FastAPI
    base: str
    client: httpx.AsyncClient

    async def submit(self, model: str, value: dict[str, Any], **extra: Any) -> dict[str, Any]:
        headers = extra.pop("headers", None)
        response = await self.client.post("/v1/jobs", json={"model": model, "input": value, **extra}, headers=headers)
        assert response.status_code == 202, response.text
        body: dict[str, Any] = response.json()
        return body

    async def record(self, job_id: str, wait_s: float = 10) -> dict[str, Any]:
        response = await self.client.get(f"/v1/jobs/{job_id}", params={"wait": wait_s})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


@contextlib.asynccontextmanager
async def gateway(
    settings: FleetSettings,
    broker: Broker,
    store: ResultStore,
    parts: CacheParts | None = None,
    stores: Stores | None = None,
) -> AsyncIterator[Gateway]:
    """A gateway on ``broker`` and ``store`` (or ``stores``, shared with the caller) with the shared embedding model
    for L3."""
    parts = parts or CacheParts(load_text_model=shared_text_model)
    await asyncio.to_thread(shared_text_model)  # once per session (importing torch takes most of it)
    stores = stores or Stores.beside(store)
    app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS, cache_parts=parts)
    async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        cache = app.state.gateway.cache
        if cache is not None and cache.embedders is not None:
            await cache.embedders.warm()
        yield Gateway(app, base, client)


def worker(broker: Broker, store: ResultStore, model: str) -> ObservedWorker:
    """The real worker serving echo under ``model``; ``seen`` counts what it computed."""
    return ObservedWorker(broker, store, model)


def cache_count(model: str, level: str, result: str) -> float:
    value = REGISTRY.get_sample_value("fleet_cache_requests_total", {"model": model, "level": level, "result": result})
    return value or 0.0
