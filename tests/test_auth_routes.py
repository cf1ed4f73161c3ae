"""FLEET_AUTH=keys on every route of the app, table-driven over ``app.routes`` (a new route without an auth
dependency fails here): no key, a bad key, a revoked and an expired key answer 401 (WebSocket: 4401), a role too
low 403, the right role passes; the audit log records each operator action with its key; the OpenAPI declares the
bearer scheme and the 401/403 answers; a gateway on a non-loopback host refuses to start with FLEET_AUTH unset."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIWebSocketRoute
from starlette.routing import Mount
from typer.testing import CliRunner
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from fleet.cli import app as cli_app
from fleet.errors import ConfigError
from fleet.producers.gateway import create_app
from fleet.producers.gateway.app import check_auth
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from fleet.store.bundle import Stores
from tests.gateway_helpers import FAST_LIMITS, error_of, model_refs, served, urls_for
from tests.infra import connected_pair, eventually, settings_for

PAIRS = ["memory", "nats+redis"]  # Kafka adds nothing here: auth sits in front of the broker
TOKEN = "operator-token-for-tests"
OPEN = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
OPEN |= {"/dashboard", "/dashboard/", "/v1/operator/access"}  # the static page, and what it asks before login
OPERATOR_PREFIXES = ("/v1/operator", "/v1/scaling", "/v1/workers", "/v1/deadletters", "/v1/audit")
OPERATOR_MODEL_ROUTES = ("/traffic", "/comparisons", "/rollout", "/promote", "/rollback")
ROLE_OF = {
    "submitter": {"submitter"},
    "operator": {"submitter", "operator"},
    "admin": {"submitter", "operator", "admin"},
}
ROLE_OF["token"] = ROLE_OF["operator"] | {"fleet"}  # only it (or a default-tenant operator key) moves every tenant's


def needed_role(path: str) -> str | None:
    """What the table expects of a route: None for open ones; any route not listed needs a submitter."""
    if path in OPEN:
        return None
    if path.startswith("/v1/keys"):
        return "admin"
    if (path.startswith("/v1/models/") and path.endswith(OPERATOR_MODEL_ROUTES)) or path == "/v1/rollouts":
        return (
            "fleet"  # a model's traffic policy, rollout and shadow comparisons (its card is any key's): every tenant's
        )
    return "operator" if path.startswith(OPERATOR_PREFIXES) else "submitter"


def _walk(routes: list[Any]) -> Iterator[Any]:
    for route in routes:
        if hasattr(route, "effective_candidates"):  # FastAPI's included routers
            yield from _walk(route.effective_candidates())
        else:
            yield route


def app_routes(app: FastAPI) -> tuple[list[tuple[str, str]], list[str]]:
    """(method, path) of every HTTP route and the path of every WebSocket route of ``app`` (mounts are static)."""
    http, sockets = [], []
    for route in _walk(app.routes):
        if isinstance(route, Mount):
            continue
        original = getattr(route, "original_route", route)
        path = getattr(route, "path_format", None) or original.path
        if isinstance(original, APIWebSocketRoute):
            sockets.append(path)
            continue
        http += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return http, sockets


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "0a", path)


@dataclass
class Keys:
    submitter: str
    operator: str
    admin: str
    revoked: str
    expired: str
    operator_id: str
    admin_id: str

    def headers(self) -> dict[str, dict[str, str]]:
        bearer = {name: {"Authorization": f"Bearer {key}"} for name, key in vars(self).items() if "_id" not in name}
        return {
            **bearer,
            "token": {"Authorization": f"Bearer {TOKEN}"},
            "none": {},
            "unknown": {"Authorization": f"Bearer fleet_{'0' * 12}_{'x' * 43}"},
            "garbage": {"Authorization": "Bearer nonsense"},
            "basic": {"Authorization": f"Basic {self.admin}"},
        }


@dataclass
class Served:
    app: FastAPI
    base_url: str
    keys: Keys
    model: str
    store: Any


@contextlib.asynccontextmanager
async def keyed_gateway(request: Any, pair: str, unique: str) -> AsyncIterator[Served]:
    refs, (model,) = model_refs(unique, "echo")
    settings = settings_for(pair, urls_for(request, pair), models=refs, auth="keys", operator_token=TOKEN)
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        store_keys = stores.keys
        made = {}
        for role in ("submitter", "operator", "admin"):
            made[role] = await store_keys.create(unique, role, None)  # type: ignore[arg-type]
        revoked, info = await store_keys.create(unique, "admin", None)
        await store_keys.revoke(info.key_id)
        expired, _ = await store_keys.create(unique, "admin", time.time() - 1)
        keys = Keys(
            made["submitter"][0],
            made["operator"][0],
            made["admin"][0],
            revoked,
            expired,
            made["operator"][1].key_id,
            made["admin"][1].key_id,
        )
        app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS)
        async with served(app) as base_url:
            yield Served(app, base_url, keys, model, store)


REFUSED = {"none": "unauthorized", "unknown": "invalid_key", "garbage": "invalid_key", "basic": "unauthorized"}
REFUSED |= {"revoked": "key_revoked", "expired": "key_expired"}


OPENAI_CODES = {"invalid_key": "invalid_api_key", "unauthorized": "invalid_api_key"}


def refused_as(response: httpx.Response, fleet_type: str) -> bool:
    """Whether ``response`` is a refusal of ``fleet_type``: Fleet's error type, or on the OpenAI-compatible routes
    (errors in OpenAI's shape, ``fleet.producers.gateway.models``) the ``code`` OpenAI's shape gives that type."""
    error = response.json()["error"]
    if set(error) == {"message", "type", "param", "code"}:
        return bool(error["code"] == OPENAI_CODES.get(fleet_type, fleet_type))
    return bool(error_of(response)["type"] == fleet_type)


async def status_of(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    """The status (and error body, when refused) of one call; a stream that was allowed is not read."""
    body = {} if method in ("POST", "PUT") else None
    async with client.stream(method, path, json=body, headers=headers) as response:
        if response.status_code in (401, 403):
            await response.aread()
            return response.status_code, response
        return response.status_code, None


@pytest.mark.parametrize("pair", PAIRS)
async def test_every_http_route_by_credential(request: Any, pair: str, unique: str) -> None:
    async with (
        keyed_gateway(request, pair, unique) as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=15) as client,
    ):
        http, _ = app_routes(gw.app)
        assert len(http) >= 37, http
        checked = 0
        for method, path in http:
            role = needed_role(path)
            for name, headers in gw.keys.headers().items():
                status, refused = await status_of(client, method, concrete(path), headers)
                where = (method, path, name, status)
                if role is None:
                    assert status not in (401, 403), where
                elif name in REFUSED:
                    assert status == 401, where
                    assert refused.headers["www-authenticate"] == "Bearer", where
                    assert refused_as(refused, REFUSED[name]), where
                elif role in ROLE_OF[name]:
                    assert status not in (401, 403), where
                else:
                    assert status == 403, where
                    assert refused_as(refused, "forbidden"), where
                checked += 1
        assert checked == len(http) * len(gw.keys.headers())


async def ws_outcome(url: str, headers: dict[str, str], subprotocols: list[str] | None = None) -> tuple[Any, ...]:
    """(close code or 'open', the first frame's error type or None, the accepted subprotocol) of one connection.
    A socket still open after a moment (``/v1/ws``, waiting for frames) is sent a malformed frame, which it answers
    with an error frame of its own and stays open."""
    async with ws_connect(url, additional_headers=headers, subprotocols=subprotocols, open_timeout=10) as ws:  # type: ignore[arg-type]
        try:
            try:
                async with asyncio.timeout(0.5):
                    frame = json.loads(await ws.recv())
            except TimeoutError:
                await ws.send("{")
                frame = json.loads(await ws.recv())
        except ConnectionClosed:
            return ws.close_code, None, ws.subprotocol
        kind = (frame.get("error") or {}).get("type")
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            async with asyncio.timeout(0.3):
                await ws.recv()
        return ws.close_code or "open", kind, ws.subprotocol


@pytest.mark.parametrize("pair", PAIRS)
async def test_every_websocket_route_by_credential(request: Any, pair: str, unique: str) -> None:
    async with keyed_gateway(request, pair, unique) as gw:
        _, sockets = app_routes(gw.app)
        assert len(sockets) >= 3, sockets
        base = gw.base_url.replace("http://", "ws://")
        for path in sockets:
            url = base + concrete(path)
            headers = gw.keys.headers()
            for name in REFUSED:
                code, kind, _ = await ws_outcome(url, headers[name])
                assert (code, kind) == (4401, REFUSED[name]), (path, name, code, kind)
            # a submitter, by header and by subprotocol (browsers): past authentication (unknown ids are 4404)
            for chosen in (
                await ws_outcome(url, headers["submitter"]),
                await ws_outcome(url, {}, ["fleet", f"bearer.{gw.keys.submitter}"]),
            ):
                code, kind, _ = chosen
                assert code in (4404, "open", 1000) and kind not in REFUSED.values(), (path, chosen)
            assert (await ws_outcome(url, {}, ["fleet", f"bearer.{gw.keys.submitter}"]))[2] == "fleet"


@pytest.mark.parametrize("pair", PAIRS)
async def test_operator_actions_are_audited(request: Any, pair: str, unique: str) -> None:
    async with (
        keyed_gateway(request, pair, unique) as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=15) as client,
    ):
        op = {"Authorization": f"Bearer {gw.keys.operator}"}
        admin = {"Authorization": f"Bearer {gw.keys.admin}"}
        m = gw.model
        gw.app.state.gateway.beats.observe_worker(
            Heartbeat(worker_id=f"w-{unique}", model=m, device="cpu", pid=1, max_batch=1, max_wait_ms=0, state="ready")
        )
        calls = [
            ("PUT", f"/v1/scaling/{m}", {"paused": True}, op),
            ("POST", f"/v1/scaling/{m}/scale", {"replicas": 2, "ttl_s": 60}, op),
            ("DELETE", f"/v1/scaling/{m}/scale", None, op),
            ("POST", f"/v1/workers/w-{unique}/drain", None, op),
            ("POST", "/v1/deadletters/redrive", {"model": m, "all": True}, op),
            ("POST", "/v1/deadletters/purge", {"model": m, "all": True}, op),
        ]
        for method, path, body, headers in calls:
            response = await client.request(method, path, json=body, headers=headers)
            assert response.status_code < 300, (method, path, response.text)
        created = await client.post("/v1/keys", json={"tenant": unique, "role": "submitter"}, headers=admin)
        assert created.status_code == 201, created.text
        new_key, new_id = created.json()["key"], created.json()["info"]["key_id"]
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {new_key}"})).status_code == 200
        listed = await client.get("/v1/keys", headers=admin)
        assert new_id in listed.text and new_key not in listed.text
        assert (await client.post(f"/v1/keys/{new_id}/revoke", headers=admin)).status_code == 200
        gone = await client.get("/v1/models", headers={"Authorization": f"Bearer {new_key}"})
        assert gone.status_code == 401 and refused_as(gone, "key_revoked")

        entries = (await client.get("/v1/audit", params={"limit": 50}, headers=op)).json()["entries"]
        mine = [e for e in entries if e["target"] in (m, f"w-{unique}", new_id)]
        seen = {(e["action"], e["key_id"]) for e in mine}
        op_id, admin_id = gw.keys.operator_id, gw.keys.admin_id
        expected = {("scaling.update", op_id), ("scaling.scale", op_id), ("scaling.end_scale", op_id)}
        expected |= {("worker.drain", op_id), ("deadletters.redrive", op_id), ("deadletters.purge", op_id)}
        expected |= {("key.create", admin_id), ("key.revoke", admin_id)}
        assert expected <= seen, seen
        assert all(e["tenant"] == unique and e["actor"].startswith("key:") for e in mine)
        update = next(e for e in mine if e["action"] == "scaling.update")
        assert update["details"] == {"paused": True}
        assert [e["at"] for e in entries] == sorted((e["at"] for e in entries), reverse=True)


async def test_openapi_declares_bearer_and_its_errors(request: Any, unique: str) -> None:
    async with keyed_gateway(request, "memory", unique) as gw, httpx.AsyncClient(base_url=gw.base_url) as client:
        spec = (await client.get("/openapi.json")).json()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["bearer"]["description"],
    }
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            if needed_role(path) is None:
                assert "security" not in operation, (method, path)
                continue
            assert operation.get("security") == [{"bearer": []}], (method, path)
            assert {"401", "403"} <= set(operation["responses"]), (method, path)


def test_non_loopback_gateway_needs_an_explicit_auth_setting() -> None:
    with pytest.raises(ConfigError, match="FLEET_AUTH"):
        create_app(FleetSettings(host="0.0.0.0"))
    for settings, mode in [
        (FleetSettings(host="0.0.0.0", auth="off"), "off"),
        (FleetSettings(host="0.0.0.0", auth="keys"), "keys"),
        (FleetSettings(host="127.0.0.1"), "off"),
    ]:
        assert check_auth(settings) == mode
        create_app(settings)  # builds: the lifespan's authenticator takes that mode

    args = ["gateway", "--host", "0.0.0.0", "--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1/0"]
    result = CliRunner().invoke(cli_app, args, prog_name="fleet")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "FLEET_AUTH" in lines[0], result.stderr


async def test_the_sdk_sends_its_key(request: Any, unique: str) -> None:
    from fleet.producers.sdk import FleetClient, GatewayError

    async with keyed_gateway(request, "memory", unique) as gw:
        async with FleetClient(gw.base_url, api_key=gw.keys.submitter) as fleet:
            job_id = await fleet.submit(gw.model, {"n": 1})
            assert job_id
        async with FleetClient(gw.base_url) as anonymous:
            with pytest.raises(GatewayError) as refused:
                await anonymous.submit(gw.model, {"n": 1})
            assert refused.value.status == 401 and refused.value.type == "unauthorized"


async def test_the_dag_cli_sends_fleet_api_key(request: Any, unique: str) -> None:
    async with keyed_gateway(request, "memory", unique) as gw:

        def show(env: dict[str, str]) -> Any:
            args = ["dag", "show", f"nodag{unique}", "--url", gw.base_url]
            return CliRunner().invoke(cli_app, args, prog_name="fleet", env=env)

        anonymous = await asyncio.to_thread(show, {"FLEET_API_KEY": ""})
        keyed = await asyncio.to_thread(show, {"FLEET_API_KEY": gw.keys.submitter})
    assert anonymous.exit_code == 1 and "Authorization" in anonymous.stderr, anonymous.stderr
    assert keyed.exit_code == 1 and f"nodag{unique}" in keyed.stderr and "Authorization" not in keyed.stderr


@pytest.mark.parametrize("pair", PAIRS)
async def test_a_key_revoked_elsewhere_is_refused_within_the_cache_ttl(request: Any, pair: str, unique: str) -> None:
    """Another gateway or ``fleet keys revoke`` revoked it: this gateway's one-second cache lets it go quickly."""
    async with keyed_gateway(request, pair, unique) as gw, httpx.AsyncClient(base_url=gw.base_url) as client:
        key, info = await gw.app.state.gateway.stores.keys.create(unique, "submitter", None)
        headers = {"Authorization": f"Bearer {key}"}
        assert (await client.get("/v1/models", headers=headers)).status_code == 200
        await gw.app.state.gateway.stores.keys.revoke(info.key_id)

        async def refused() -> bool:
            return (await client.get("/v1/models", headers=headers)).status_code == 401

        await eventually(refused, timeout_s=10, what="the revoked key is refused")
