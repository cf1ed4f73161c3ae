"""``/v1/keys`` (admin): create, list and revoke API keys; ``/v1/audit`` (operator): the audit log.

The same operations as ``fleet keys``, for a gateway on the embedded store (``fleet up``), whose keys live in its
process. Creating and revoking a key are audited like every operator action.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import ValidationError

from fleet.errors import ConfigError
from fleet.producers.gateway.access.audit import record_action
from fleet.producers.gateway.access.auth import require_admin, require_operator
from fleet.producers.gateway.access.principals import Principal
from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import ApiError, error_responses, validation_errors, validation_message
from fleet.producers.gateway.limits import read_limited_body
from fleet.producers.gateway.state import state_of
from fleet.schemas.keys import AuditList, CreateKeyRequest, KeyCreated, KeyInfo, KeyList
from fleet.store.audit import AuditLog
from fleet.store.keys import KeyStore, parse_expiry

router = APIRouter(tags=["keys"])

KEY_ID_PATTERN = r"^[0-9a-f]{1,64}$"
CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": CreateKeyRequest.model_json_schema()}},
    }
}


async def key_store(request: Request) -> KeyStore:
    """FastAPI dependency: the key store of this gateway's stores."""
    return state_of(request).stores.keys


async def audit_log(request: Request) -> AuditLog:
    """FastAPI dependency: the audit log of this gateway's stores."""
    return state_of(request).stores.audit


def parse_create(raw: bytes) -> CreateKeyRequest:
    """The body of ``POST /v1/keys``; 400 ``malformed_json`` or 422 ``invalid_request`` naming each bad field."""
    data = parse_json(raw)
    try:
        return CreateKeyRequest.model_validate(data)
    except ValidationError as exc:
        errors = validation_errors(exc, prefix="body")
        raise ApiError(422, "invalid_request", validation_message(errors, "invalid request"), errors) from None


@router.post(
    "/v1/keys",
    status_code=201,
    summary="Create an API key (admin)",
    response_model=KeyCreated,
    responses=error_responses(400, 401, 403, 413, 422, 503),
    openapi_extra=CREATE_BODY,
)
async def create_key(
    request: Request, keys: KeyStore = Depends(key_store), admin: Principal = Depends(require_admin)
) -> KeyCreated:
    """A new random key for ``tenant`` with ``role``; ``key`` is in this answer only (it is stored hashed)."""
    body = parse_create(await read_limited_body(request, request.app.state.gateway.settings.max_body_bytes))
    try:
        expires_at = parse_expiry(body.expires, time.time())
    except ConfigError as exc:
        raise ApiError(422, "invalid_request", exc.message, [{"loc": "body.expires", "msg": exc.message}]) from None
    key, info = await keys.create(body.tenant, body.role, expires_at)
    await record_action(request, admin, "key.create", info.key_id, {"tenant": info.tenant, "role": info.role})
    return KeyCreated(key=key, info=info)


@router.get(
    "/v1/keys",
    summary="List API keys (admin; never the keys themselves)",
    response_model=KeyList,
    responses=error_responses(401, 403, 503),
)
async def list_keys(keys: KeyStore = Depends(key_store), _admin: Principal = Depends(require_admin)) -> KeyList:
    """Every key's id, prefix, tenant, role, and created, expiry and revocation times, oldest first."""
    return KeyList(keys=await keys.list())


@router.post(
    "/v1/keys/{key_id}/revoke",
    summary="Revoke an API key (admin)",
    response_model=KeyInfo,
    responses=error_responses(401, 403, 404, 422, 503),
)
async def revoke_key(
    request: Request,
    key_id: str = Path(pattern=KEY_ID_PATTERN, description="the id 'fleet keys list' shows"),
    keys: KeyStore = Depends(key_store),
    admin: Principal = Depends(require_admin),
) -> KeyInfo:
    """From now on the key answers 401 ``key_revoked``; revoking it again changes nothing."""
    info = await keys.revoke(key_id)
    if info is None:
        raise ApiError(404, "key_not_found", f"no API key with id {key_id!r}", {"key_id": key_id})
    state_of(request).authenticator.forget(key_id)
    await record_action(request, admin, "key.revoke", key_id, {"tenant": info.tenant, "role": info.role})
    return info


@router.get(
    "/v1/audit",
    summary="The audit log of operator actions (operator)",
    response_model=AuditList,
    tags=["operator"],
    responses=error_responses(401, 403, 422, 503),
)
async def read_audit(
    limit: int = Query(100, ge=1, le=1000, description="newest entries first"),
    log: AuditLog = Depends(audit_log),
    _operator: Principal = Depends(require_operator),
) -> AuditList:
    """Who scaled, paused, drained, redrove, purged, created or revoked a key; when; from which key."""
    return AuditList(entries=await log.latest(limit))
