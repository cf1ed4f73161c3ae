"""Operator access: ``FLEET_OPERATOR_TOKEN`` as a bearer token on every operator route (401 without, 403 wrong),
open on a loopback bind without a token, off (403 ``operator_disabled``) on another bind without one, and
``GET /v1/operator/access`` telling the page which case it is in."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from fleet.producers.gateway import create_app
from fleet.producers.gateway.access.gate import OperatorGate, is_loopback
from fleet.producers.gateway.errors import ApiError
from fleet.settings import FleetSettings
from tests.gateway_helpers import FAST_LIMITS, error_of, model_refs

TOKEN = "s3cret-operator-token"


@contextlib.asynccontextmanager
async def gateway(unique: str, **values: Any) -> AsyncIterator[httpx.AsyncClient]:
    refs, _ = model_refs(unique, "echo")
    settings = FleetSettings(models=refs, **values)
    app = create_app(settings, limits=FAST_LIMITS)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


def scale_put(client: httpx.AsyncClient, unique: str, **headers: str) -> Any:
    return client.put(f"/v1/scaling/echo-{unique}", json={"paused": True}, headers=headers)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("gateway.example", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


async def test_loopback_without_token_is_open(unique: str) -> None:
    async with gateway(unique, host="127.0.0.1") as client:
        access = (await client.get("/v1/operator/access")).json()
        assert access == {"token_required": False, "enabled": True, "reason": None, "auth": "off"}
        response = await scale_put(client, unique)
        assert response.status_code == 200, response.text
        assert response.json()["paused"] is True


async def test_other_bind_without_token_refuses_and_says_why(unique: str) -> None:
    async with gateway(unique, host="0.0.0.0", auth="off") as client:
        access = (await client.get("/v1/operator/access")).json()
        assert access["enabled"] is False and access["token_required"] is False
        assert "FLEET_OPERATOR_TOKEN" in access["reason"]
        response = await scale_put(client, unique)
        assert response.status_code == 403
        error = error_of(response)
        assert error["type"] == "operator_disabled" and "FLEET_OPERATOR_TOKEN" in error["message"]
        # reading the scaling state is an operator call too (submitters must not see it)
        assert (await client.get("/v1/scaling")).status_code == 403


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_token_is_required_on_any_bind(unique: str, host: str) -> None:
    async with gateway(unique, host=host, operator_token=TOKEN, auth="off") as client:
        access = (await client.get("/v1/operator/access")).json()
        assert access == {"token_required": True, "enabled": True, "reason": None, "auth": "off"}

        missing = await scale_put(client, unique)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert error_of(missing)["type"] == "unauthorized"

        wrong = await scale_put(client, unique, Authorization="Bearer not-the-token")
        assert wrong.status_code == 403 and error_of(wrong)["type"] == "forbidden"

        basic = await scale_put(client, unique, Authorization=f"Basic {TOKEN}")
        assert basic.status_code == 401

        right = await scale_put(client, unique, Authorization=f"Bearer {TOKEN}")
        assert right.status_code == 200, right.text
        scaling = await client.get("/v1/scaling", headers={"Authorization": f"Bearer {TOKEN}"})
        assert scaling.json()[0]["paused"] is True


async def test_auth_comes_before_body_validation(unique: str) -> None:
    """A caller without the token learns nothing about the body's shape."""
    async with gateway(unique, operator_token=TOKEN) as client:
        response = await client.put(f"/v1/scaling/echo-{unique}", content=b"{not json")
        assert response.status_code == 401


def test_the_token_is_not_in_the_settings_repr() -> None:
    settings = FleetSettings(operator_token=TOKEN)
    assert TOKEN not in repr(settings)
    assert OperatorGate.from_settings(settings).token == TOKEN


@given(header=st.text(max_size=300))
@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_authorization_header_is_401_or_403(header: str) -> None:
    scheme, _, presented = header.partition(" ")
    assume(not (scheme.lower() == "bearer" and presented.strip() == TOKEN))
    gate = OperatorGate(token=TOKEN, loopback=True, host="127.0.0.1")
    with pytest.raises(ApiError) as caught:
        gate.authenticate(header)
    assert caught.value.status in (401, 403)


async def test_openapi_documents_the_operator_errors(unique: str) -> None:
    async with gateway(unique) as client:
        spec = (await client.get("/openapi.json")).json()
        put = spec["paths"]["/v1/scaling/{model}"]["put"]
        assert {"401", "403"} <= set(put["responses"])
        assert spec["paths"]["/v1/operator/access"]["get"]["summary"]


def operator_calls(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(method, path) of every operator route in the OpenAPI document, plus the mutating scaling route."""
    calls = []
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            tags = operation.get("tags", [])
            if path == "/v1/operator/access":
                continue
            if "operator" in tags or (path.startswith("/v1/scaling/") and method != "get"):
                calls.append((method.upper(), path.replace("{model}", "m").replace("{worker_id}", "w")))
    return calls


@pytest.mark.parametrize(
    ("values", "status", "kind"),
    [({"operator_token": TOKEN}, 401, "unauthorized"), ({"host": "0.0.0.0", "auth": "off"}, 403, "operator_disabled")],
)
async def test_every_operator_route_is_gated(unique: str, values: dict[str, Any], status: int, kind: str) -> None:
    async with gateway(unique, **values) as client:
        calls = operator_calls((await client.get("/openapi.json")).json())
        assert len(calls) >= 9, calls  # snapshot, stream, scale x2, drain, dead letters x3, PUT scaling
        for method, path in calls:
            response = await client.request(method, path, json={})
            assert response.status_code == status, (method, path, response.text)
            assert error_of(response)["type"] == kind
