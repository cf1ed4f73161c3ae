"""The gateway's OpenAPI document, told truthfully: what FastAPI cannot know from the route signatures alone.

* Every operation with a JSON body documents ``400 malformed_json`` (a body that is not JSON), which the error
  handlers answer on every route (``fleet.producers.gateway.errors``).
* ``?wait`` says its bounds: ``0 < wait <= FLEET_MAX_LONG_POLL_S`` (the gateway's ``check_wait``).
* ``POST /v1/jobs`` and ``POST /v1/infer`` take one body per served model (``oneOf``, discriminated by ``model``),
  each with that model's own input schema instead of an untyped ``input`` object. The models are known once the
  gateway has started (its lifespan resolves them); a document asked for before then has the generic body.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fleet.schemas.api import SubmitRequest
from fleet.schemas.models import ModelSpec

SUBMIT_PATHS = ("/v1/jobs", "/v1/infer")
MALFORMED_JSON_RESPONSE = {
    "description": "malformed_json: the request body is not valid JSON",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_REF_TEMPLATE = "#/components/schemas/{model}"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def install_openapi(app: FastAPI, max_wait_s: float) -> None:
    """Replace ``app.openapi`` with a builder of the refined document (cached once the models are known)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
            tags=app.openapi_tags,
        )
        _document_malformed_json(schema)
        _document_wait_bounds(schema, max_wait_s)
        state = getattr(app.state, "gateway", None)
        if state is not None:
            _document_model_inputs(schema, state.specs)
            app.openapi_schema = schema  # complete: keep it
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, operation)
        for path, operations in schema.get("paths", {}).items()
        for method, operation in operations.items()
        if isinstance(operation, dict)
    ]


def _document_malformed_json(schema: dict[str, Any]) -> None:
    for _, _, operation in _operations(schema):
        if "application/json" in operation.get("requestBody", {}).get("content", {}):
            operation.setdefault("responses", {}).setdefault("400", MALFORMED_JSON_RESPONSE)


def _document_wait_bounds(schema: dict[str, Any], max_wait_s: float) -> None:
    for _, _, operation in _operations(schema):
        for parameter in operation.get("parameters", []):
            if parameter.get("name") != "wait" or parameter.get("in") != "query":
                continue
            bounded = {"type": "number", "exclusiveMinimum": 0, "maximum": max_wait_s}
            parameter["schema"] = {"anyOf": [bounded, {"type": "null"}], "title": "Wait"}


def _document_model_inputs(schema: dict[str, Any], specs: dict[str, ModelSpec]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    base = _hoisted(SubmitRequest.model_json_schema(ref_template=_REF_TEMPLATE), components)
    variants: dict[str, str] = {}
    for name, spec in sorted(specs.items()):
        safe = _UNSAFE.sub("_", name)
        input_name, body_name = f"Input_{safe}", f"SubmitRequest_{safe}"
        components[input_name] = _hoisted(spec.input_model.model_json_schema(ref_template=_REF_TEMPLATE), components)
        body = copy.deepcopy(base)
        body["title"] = f"SubmitRequest ({name})"
        body["properties"]["model"] = {"type": "string", "const": name, "title": "Model"}
        body["properties"]["input"] = {"$ref": f"#/components/schemas/{input_name}"}
        components[body_name] = body
        variants[name] = f"#/components/schemas/{body_name}"
    if not variants:
        return
    body_schema = {
        "oneOf": [{"$ref": ref} for ref in variants.values()],
        "discriminator": {"propertyName": "model", "mapping": variants},
    }
    for path, method, operation in _operations(schema):
        if method == "post" and path in SUBMIT_PATHS:
            operation["requestBody"]["content"]["application/json"]["schema"] = body_schema


def _hoisted(model_schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``model_schema`` without its ``$defs``, which move into the document's components."""
    for name, definition in model_schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    return model_schema
