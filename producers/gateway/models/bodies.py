"""Reading and documenting the JSON bodies of this feature's routes.

A body is read with the gateway's size limit (``413`` past ``FLEET_MAX_BODY_BYTES``) and its strict JSON reader
(``400`` for a body that is not JSON), then validated against the route's model: a refusal names at most
``SHOWN_ERRORS`` fields in one line, so a hostile body of ten thousand bad items answers as fast and as briefly as a
body with one. Bodies are documented in OpenAPI from the same model (``body_doc``), its nested models inlined,
since FastAPI does not read these bodies itself (it would read them without a size limit).
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from fleet.producers.gateway.client_json import parse_json
from fleet.producers.gateway.errors import validation_errors
from fleet.producers.gateway.limits import read_limited_body
from fleet.producers.gateway.models.openai_errors import Refused
from fleet.producers.gateway.state import GatewayState

SHOWN_ERRORS = 3
M = TypeVar("M", bound=BaseModel)


async def read_json_object(request: Request, state: GatewayState) -> dict[str, Any]:
    """The body as a JSON object. Raises 413, 400 ``malformed_json``, or ``Refused`` for another JSON value."""
    data = parse_json(await read_limited_body(request, state.settings.max_body_bytes))
    if not isinstance(data, dict):
        raise Refused("invalid_request", f"the request body must be a JSON object, not {type(data).__name__}", None)
    return data


def validated(model: type[M], data: dict[str, Any], hints: dict[str, str] | None = None) -> M:
    """``data`` as ``model``. Raises ``Refused`` naming the first fields at fault (``param``: the first one); where
    ``hints`` has a sentence for that field (what it takes), the message leads with it."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = validation_errors(exc)
        shown = "; ".join(f"{e['loc']}: {e['msg'][:200]}" for e in errors[:SHOWN_ERRORS])
        more = f" (and {len(errors) - SHOWN_ERRORS} more)" if len(errors) > SHOWN_ERRORS else ""
        param = str(errors[0]["loc"]).split(".")[0] if errors else None
        hint = (hints or {}).get(param or "")
        lead = f"{hint} ({shown}{more})" if hint else f"{shown}{more}"
        raise Refused("invalid_request", f"invalid request: {lead}", param) from None


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inlined(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inlined(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inlined(v, defs) for v in node]
    return node


def body_doc(model: type[BaseModel], examples: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` documenting a required JSON body of ``model`` with named ``examples`` (each a body)."""
    schema = model.model_json_schema()
    content = {
        "schema": _inlined(schema, schema.get("$defs", {})),
        "examples": {name: {"value": value} for name, value in examples.items()},
    }
    return {"requestBody": {"required": True, "content": {"application/json": content}}}
