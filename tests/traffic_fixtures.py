"""Fixtures of the traffic policy tests: a model repository whose model has several versions, each served by the
echo handler (``runtime: handler``), a gateway on it with API keys, and the real worker of the model serving all
three versions through a model pool (``fleet.consumers.pool``; it writes the version that answered into each
record), with the settle hook that counts outcomes per version and compares shadows
(``fleet.consumers.version_outcomes``). Version ``ODD_VERSION`` answers differently (its output also says
``"by": "3"``), so a shadow of it disagrees with an echo."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery
from fleet.cli.httpserver import QuietServer
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.pool import ModelPool, ServedVersions
from fleet.consumers.requests import Job
from fleet.consumers.version_outcomes import VersionOutcomes
from fleet.consumers.worker import Worker
from fleet.producers.gateway import create_app
from fleet.producers.gateway.policies import TrafficPolicies
from fleet.schemas.jobs import JobRecord
from fleet.schemas.models import EchoOutput
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from tests.gateway_helpers import FAST_LIMITS, WORKER_SETTINGS
from tests.infra import connected_pair, settings_for

ECHO_REF = "fleet.consumers.handlers.echo:EchoHandler"
TOKEN = "operator-token-for-traffic-tests"
VERSIONS = ("1", "2", "3")
ODD_VERSION = DEFAULT_VERSION = "3"  # the highest, as a repository model's default


class VersionedEcho(EchoHandler):
    """Echo as one version of a model; ``ODD_VERSION`` adds ``"by": "3"`` to each output."""

    def __init__(self, *, version: str = DEFAULT_VERSION, **options: Any) -> None:
        super().__init__(**options)
        self.version = version

    def output_json(self, output: EchoOutput, encoding: str = "float") -> Any:
        plain = super().output_json(output, encoding)
        return {**plain, "by": self.version} if self.version == ODD_VERSION else plain


def versioned_model(root: Path, name: str, versions: tuple[str, ...] = ("1", "2", "3")) -> Path:
    """Write ``root/name/<version>/model.yaml`` for each version: echo as a user's handler, one tiny weight file."""
    for version in versions:
        folder = root / name / version
        folder.mkdir(parents=True)
        payload = f"weights of {name} {version}".encode()
        (folder / "weights.safetensors").write_bytes(payload)
        manifest = {
            "runtime": "handler",
            "handler": ECHO_REF,
            "description": f"{name} {version}",
            "weights": {"files": {"weights.safetensors": hashlib.sha256(payload).hexdigest()}},
        }
        (folder / "model.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return root


@dataclass
class TrafficEnv:
    """A gateway (in-process, ASGI) serving ``model`` from a repository of three versions, a worker of it, and
    clients: the operator token (``token``), an operator key of the default tenant (``operator``), one of tenant B
    (``b_operator``: a tenant's operator, who may not move the fleet's traffic) and submitter keys of tenants A and
    B."""

    app: FastAPI
    broker: Broker
    store: ResultStore
    stores: Stores
    model: str
    outcomes: VersionOutcomes
    token: httpx.AsyncClient
    operator: httpx.AsyncClient
    b_operator: httpx.AsyncClient
    a: httpx.AsyncClient
    b: httpx.AsyncClient
    tenant_a: str
    tenant_b: str
    deliveries: dict[str, Delivery]  # job id -> the message the worker settled

    @property
    def traffic(self) -> TrafficPolicies:
        traffic: TrafficPolicies = self.app.state.gateway.traffic
        return traffic

    def client(self, key: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app)
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers, timeout=30)

    async def set_policy(self, **policy: Any) -> dict[str, Any]:
        response = await self.token.put(f"/v1/models/{self.model}/traffic", json={"policy": policy})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def submit(self, client: httpx.AsyncClient, value: dict[str, Any], **extra: Any) -> str:
        response = await client.post("/v1/jobs", json={"model": self.model, "input": value, **extra})
        assert response.status_code == 202, response.text
        job_id: str = response.json()["job_id"]
        return job_id

    async def done(self, client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
        response = await client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
        assert response.status_code == 200, response.text
        record: dict[str, Any] = response.json()
        assert record["state"] == "succeeded", record
        return record


def traffic_settings(urls: dict[str, str], repository: Path, model: str, pair: str = "nats+redis") -> FleetSettings:
    """Settings serving ``model`` from ``repository`` with API keys and the operator token ``TOKEN``."""
    return settings_for(pair, urls, models=[model], model_repository=repository, auth="keys", operator_token=TOKEN)


@contextlib.asynccontextmanager
async def traffic_env(
    settings: FleetSettings, broker: Broker, store: ResultStore, model: str
) -> AsyncIterator[TrafficEnv]:
    """The gateway and worker of ``model`` on ``broker`` / ``store`` (``settings`` names the repository)."""
    stores = Stores.beside(store)
    unique = model.rpartition("-")[2]
    tenant_a, tenant_b = f"a-{unique}", f"b-{unique}"
    keys = {
        "a": (await stores.keys.create(tenant_a, "submitter", None))[0],
        "b": (await stores.keys.create(tenant_b, "submitter", None))[0],
        "operator": (await stores.keys.create(c.DEFAULT_TENANT, "operator", None))[0],
        "b_operator": (await stores.keys.create(tenant_b, "operator", None))[0],
        "token": TOKEN,
    }
    app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS)
    outcomes = VersionOutcomes(store, stores.rollouts)
    deliveries: dict[str, Delivery] = {}

    async def observe(job: Job, record: JobRecord, won: bool) -> None:
        deliveries[record.job_id] = job.delivery

    cls = with_name(VersionedEcho, model)
    cls.spec = dataclasses.replace(cls.spec, version=DEFAULT_VERSION)
    pool = ModelPool(None)
    served = ServedVersions(model, DEFAULT_VERSION, lambda version: cls(version=version), lambda: list(VERSIONS))
    worker = Worker(
        cls(),
        broker,
        store,
        settings=WORKER_SETTINGS,
        worker_id=f"traffic-{unique}",
        max_wait_ms=2,
        on_settled=[outcomes.on_settled, observe],
        pool=pool,
        versions=served,
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(pool.close)
        await stack.enter_async_context(app.router.lifespan_context(app))
        await stack.enter_async_context(worker)
        clients = {}
        for name, key in keys.items():
            transport = httpx.ASGITransport(app=app)
            headers = {"Authorization": f"Bearer {key}"}
            clients[name] = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers, timeout=30)
            )
        yield TrafficEnv(
            app,
            broker,
            store,
            stores,
            model,
            outcomes,
            **clients,
            tenant_a=tenant_a,
            tenant_b=tenant_b,
            deliveries=deliveries,
        )


@pytest.fixture(name="env")
async def env_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TrafficEnv]:
    """A ``TrafficEnv`` on NATS + Redis, with its own model (three versions) in a repository of its own."""
    model = f"ab-{uuid.uuid4().hex[:10]}"
    repository = versioned_model(tmp_path / "models", model)
    urls = {"nats": request.getfixturevalue("nats_url"), "redis": request.getfixturevalue("redis_url")}
    settings = traffic_settings(urls, repository, model)
    async with connected_pair(settings) as (broker, store), traffic_env(settings, broker, store, model) as made:
        yield made


@contextlib.asynccontextmanager
async def without_lifespan(app: FastAPI) -> AsyncIterator[str]:
    """``app`` (whose lifespan the fixture runs already) served over HTTP by uvicorn on a free port."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws="websockets-sansio")
    server = QuietServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn stopped during start-up"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
