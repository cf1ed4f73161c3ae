"""``GET /v1/models`` and ``GET /v1/models/{model}``: the served models in OpenAI's list shape.

Each entry is OpenAI's model object (``id``, ``object: model``, ``created``, ``owned_by``) with Fleet's own fields
beside it: ``name`` (the same as ``id``), ``kind`` (``embeddings``, ``rerank`` or ``other``: which of the
OpenAI-compatible routes takes it), the description, the batch limits and the JSON Schemas of its input and output.
Any key of any tenant may read it (the submitter role, as every read route): the models are the gateway's, not a
tenant's. ``created`` is when this gateway process started (a model has no other date it could give).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from fleet.errors import UnknownModel
from fleet.producers.gateway.access import SUBMITTER_DEPS
from fleet.producers.gateway.models import kinds
from fleet.producers.gateway.models.openai_errors import OpenAIRoute, openai_responses
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.models import ModelSpec

STARTED_AT = int(time.time())

router = APIRouter(prefix="/v1", tags=["models"], dependencies=SUBMITTER_DEPS, route_class=OpenAIRoute)


class ModelCard(BaseModel):
    """One served model: OpenAI's model object and Fleet's fields."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when this gateway process started (unix seconds)")
    owned_by: str = "fleet"
    name: str = Field(description="the model's name, as `id`")
    kind: kinds.Kind = Field(
        description="embeddings: POST /v1/embeddings takes it; rerank: POST /v1/rerank; other: POST /v1/jobs only"
    )
    description: str
    max_batch: int
    max_wait_ms: float
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]


class ModelList(BaseModel):
    """OpenAI's list of models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def card(spec: ModelSpec) -> ModelCard:
    schemas = spec.json_schemas()
    return ModelCard(
        id=spec.name,
        created=STARTED_AT,
        name=spec.name,
        kind=kinds.kind_of(spec),
        description=spec.description,
        max_batch=spec.max_batch,
        max_wait_ms=spec.max_wait_ms,
        input_schema=schemas["input"],
        output_schema=schemas["output"],
    )


@router.get(
    "/models",
    response_model=ModelList,
    summary="List the served models (OpenAI-compatible)",
    responses=openai_responses(401, 403),
)
async def list_models(state: GatewayState = Depends(gateway_state)) -> ModelList:
    """The models this gateway accepts jobs for: OpenAI's list, each entry with its kind, batch limits and the
    JSON Schemas of its input and output."""
    return ModelList(data=[card(spec) for spec in state.specs.values()])


@router.get(
    "/models/{model}",
    response_model=ModelCard,
    summary="Show one served model (OpenAI-compatible)",
    responses=openai_responses(401, 403, 404),
)
async def show_model(model: str, state: GatewayState = Depends(gateway_state)) -> ModelCard:
    """One served model; 404 ``model_not_found`` for a model this gateway does not serve."""
    spec = state.specs.get(model)
    if spec is None:
        raise UnknownModel(model, list(state.specs))
    return card(spec)
