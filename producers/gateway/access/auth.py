"""Who is calling: API keys, roles and the operator token, as FastAPI dependencies of every route.

``FLEET_AUTH`` (``settings.auth``) picks the mode, fixed at start-up:

* ``keys``: every route but ``/healthz``, ``/readyz``, ``/metrics``, the docs and the dashboard's static page
  needs ``Authorization: Bearer <key>``. A key (``fleet keys create``) gives a ``Principal`` with its tenant, its
  key id and the roles its role holds (submitter < operator < admin). ``FLEET_OPERATOR_TOKEN``, when set, still
  works as a bearer: it gives the operator role (no tenant). No bearer, a malformed, unknown, expired or revoked
  key: 401 with ``WWW-Authenticate: Bearer``; a role too low for the route: 403.
* ``off``: submit, read and push routes are open (the principal is the ``default`` tenant); the operator and admin
  routes keep the operator gate of ``fleet.producers.gateway.access.gate`` (the token, or open on a loopback bind).

WebSockets take the key from the ``Authorization`` header, or (browsers cannot set headers on a WebSocket) from
the subprotocols ``["fleet", "bearer.<key>"]``: the server then answers with the subprotocol ``fleet``. A refused
socket gets an error frame and the close code 4401 or 4403.

Routes that read by id take the principal (``Depends(require_submitter)``: FastAPI runs the dependency once per
request) and pass ``Principal.tenant`` on as the viewer of ``fleet.tenancy``: another tenant's job or run is an
unknown one; the operator token (tenant None) reads every tenant's.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, Request, WebSocket
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from fleet import constants as c
from fleet.errors import FleetError
from fleet.producers.gateway.access.gate import OperatorGate
from fleet.producers.gateway.access.principals import (
    ADMIN,
    ANONYMOUS,
    OPERATOR,
    SUBMITTER,
    Principal,
    roles_of,
)
from fleet.producers.gateway.errors import ApiError, describe_fleet_error, error_json, error_responses
from fleet.schemas.keys import KeyInfo
from fleet.store.keys import KeyStore, digest

log = logging.getLogger(__name__)

WS_SUBPROTOCOL = "fleet"
WS_BEARER_PREFIX = "bearer."

BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API key from `fleet keys create` (FLEET_AUTH=keys), or FLEET_OPERATOR_TOKEN for operator calls",
)


def bearer_of(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, presented = (authorization or "").partition(" ")
    presented = presented.strip()
    return presented if scheme.lower() == "bearer" and presented else None


def unauthorized(type_: str, message: str) -> ApiError:
    return ApiError(401, type_, message, headers={"WWW-Authenticate": "Bearer"})


@dataclass(slots=True)
class Authenticator:
    """The access rule of one gateway: its mode, its operator gate and its key store (None with keys off)."""

    mode: str
    gate: OperatorGate
    keys: KeyStore | None = None
    clock: Any = field(default=time.time)
    cache_ttl_s: float = c.KEY_CACHE_TTL_S
    # sha256 of a key -> (monotonic time read, its record): one store read per key and second, not per request.
    _cache: dict[str, tuple[float, KeyInfo]] = field(default_factory=dict)
    _reading: dict[str, asyncio.Future[KeyInfo | None]] = field(default_factory=dict)  # digest -> its read

    async def authenticate(self, authorization: str | None, role: str) -> Principal:
        """The caller's principal holding ``role``; raises ``ApiError`` 401/403 as the module docstring says."""
        if self.mode != "keys":
            return ANONYMOUS if role == SUBMITTER else self.gate.authenticate(authorization)
        presented = bearer_of(authorization)
        if presented is None:
            raise unauthorized("unauthorized", "this call needs 'Authorization: Bearer <API key>'")
        principal = self._operator_token(presented) or await self._key(presented)
        if role not in principal.roles:
            raise ApiError(403, "forbidden", f"{principal.subject} does not have the {role!r} role this call needs")
        return principal

    def _operator_token(self, presented: str) -> Principal | None:
        token = self.gate.token
        if token is None or not hmac.compare_digest(presented.encode(), token.encode()):
            return None
        return Principal("operator-token", frozenset({SUBMITTER, OPERATOR}))

    async def _key(self, presented: str) -> Principal:
        info = await self._read(presented)
        if info is None:
            raise unauthorized("invalid_key", "the API key is not valid (malformed, unknown or wrong)")
        status = info.status(self.clock())
        if status != "active":
            raise unauthorized(f"key_{status}", f"the API key {info.key_id} is {status}; ask an admin for a new one")
        return principal_of(info)

    async def _read(self, presented: str) -> KeyInfo | None:
        """The key's record, from the cache when it was read less than ``cache_ttl_s`` ago (unknown keys are not
        cached, so a key is usable as soon as it is created)."""
        name, now = digest(presented), time.monotonic()
        cached = self._cache.get(name)
        if cached is not None and now - cached[0] < self.cache_ttl_s:
            return cached[1]
        # One read per key at a time: when an entry expires under load, the requests that miss it together share
        # the read instead of each sending its own (shielded: a request that gives up does not cancel the others').
        reading = self._reading.get(name)
        if reading is None:
            reading = self._reading[name] = asyncio.ensure_future(self._check(presented, name, now))
            reading.add_done_callback(functools.partial(self._read_done, name))
        return await asyncio.shield(reading)

    def _read_done(self, name: str, done: asyncio.Future[KeyInfo | None]) -> None:
        self._reading.pop(name, None)
        if not done.cancelled():
            done.exception()  # seen: every request that awaited it may have given up

    async def _check(self, presented: str, name: str, now: float) -> KeyInfo | None:
        info = await self.keys.check(presented) if self.keys is not None else None
        if info is not None:
            if len(self._cache) >= c.KEY_CACHE_MAX_ENTRIES:
                self._cache.clear()
            self._cache[name] = (now, info)
        return info

    def forget(self, key_id: str) -> None:
        """Drop a key from the cache (this gateway revoked it: effective here at once)."""
        for name in [n for n, (_, info) in self._cache.items() if info.key_id == key_id]:
            del self._cache[name]


def principal_of(info: KeyInfo) -> Principal:
    return Principal(f"key:{info.key_id}", roles_of(info.role), tenant=info.tenant, key_id=info.key_id)


def authenticator(connection: HTTPConnection) -> Authenticator:
    """This gateway's authenticator (``GatewayState.authenticator``, read without importing the state, which holds
    this module's type)."""
    auth: Authenticator = connection.app.state.gateway.authenticator
    return auth


async def require_submitter(
    request: Request, _bearer: HTTPAuthorizationCredentials | None = Depends(BEARER)
) -> Principal:
    """FastAPI dependency of submit, read, push and DAG routes: a principal with the submitter role."""
    return await authenticator(request).authenticate(request.headers.get("authorization"), SUBMITTER)


async def require_operator(
    request: Request, _bearer: HTTPAuthorizationCredentials | None = Depends(BEARER)
) -> Principal:
    """FastAPI dependency of every operator route: a principal with the operator role."""
    return await authenticator(request).authenticate(request.headers.get("authorization"), OPERATOR)


async def require_fleet_operator(principal: Principal = Depends(require_operator)) -> Principal:
    """FastAPI dependency of the routes that read or move what is every tenant's (a model's traffic policy, its
    rollout, its comparisons): the operator token or an operator key of the default tenant; 403 for an operator key
    bound to another tenant."""
    if principal.tenant is not None and principal.tenant != c.DEFAULT_TENANT:
        raise ApiError(
            403,
            "forbidden",
            f"{principal.subject} belongs to tenant {principal.tenant!r}; a model's traffic is every tenant's: use "
            "the operator token or an operator key of the default tenant",
        )
    return principal


async def require_admin(request: Request, _bearer: HTTPAuthorizationCredentials | None = Depends(BEARER)) -> Principal:
    """FastAPI dependency of the key management routes: a principal with the admin role."""
    return await authenticator(request).authenticate(request.headers.get("authorization"), ADMIN)


SUBMITTER_DEPS = [Depends(require_submitter)]  # ``dependencies=`` of a router or route for submitters
AUTH_RESPONSES = error_responses(401, 403)  # ``responses=`` of every authenticated route


def ws_authorization(websocket: WebSocket) -> str | None:
    """The ``Authorization`` header of a WebSocket, or the ``bearer.<key>`` subprotocol as one."""
    header = websocket.headers.get("authorization")
    if header:
        return header
    for offered in websocket.scope.get("subprotocols", []):
        if offered.startswith(WS_BEARER_PREFIX):
            return f"Bearer {offered[len(WS_BEARER_PREFIX) :]}"
    return None


def ws_subprotocol(websocket: WebSocket) -> str | None:
    """The subprotocol to accept: ``fleet`` when the client offered it (a browser sending its key that way)."""
    return WS_SUBPROTOCOL if WS_SUBPROTOCOL in websocket.scope.get("subprotocols", []) else None


async def websocket_principal(websocket: WebSocket, role: str = SUBMITTER) -> Principal | None:
    """The caller of a WebSocket; None after refusing it (an error frame, then close 4401/4403, or 1011 when the
    key store cannot be read)."""
    try:
        return await authenticator(websocket).authenticate(ws_authorization(websocket), role)
    except ApiError as exc:
        status, body = exc.status, error_json(exc.type, exc.message, exc.details)
    except FleetError as exc:
        status, type_, details = describe_fleet_error(exc)
        body = error_json(type_, exc.message, details)
    await websocket.accept(subprotocol=ws_subprotocol(websocket))
    await websocket.send_text(json.dumps(body))
    await websocket.close(4000 + status if status < 500 else 1011)
    return None
