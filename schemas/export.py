"""JSON Schema export, so that producers in any language can build valid requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fleet.schemas.api import ErrorResponse, SubmitRequest, SubmitResponse
from fleet.schemas.dags import DagRegistered, DagSpec, RunStarted, RunView, StartRunRequest
from fleet.schemas.jobs import JobRecord
from fleet.schemas.models import ModelSpec
from fleet.schemas.operator import (
    DeadLetterList,
    DrainAccepted,
    LetterSelection,
    OperatorAccess,
    OperatorSnapshot,
    PurgeResult,
    RecentJobs,
    RedriveResult,
    ScaleRequest,
)
from fleet.schemas.wire import DagStartMessage, DeadLetter, DispatcherBeat, DrainRequest, Heartbeat, RequestMessage

WIRE_MODELS: dict[str, type[BaseModel]] = {
    "request-message": RequestMessage,
    "job-record": JobRecord,
    "heartbeat": Heartbeat,
    "dead-letter": DeadLetter,
    "submit-request": SubmitRequest,
    "submit-response": SubmitResponse,
    "error-response": ErrorResponse,
    "dag-spec": DagSpec,
    "dag-start-message": DagStartMessage,
    "dag-registered": DagRegistered,
    "start-run-request": StartRunRequest,
    "run-started": RunStarted,
    "run-view": RunView,
    "dispatcher-beat": DispatcherBeat,
    "drain-request": DrainRequest,
    "operator-access": OperatorAccess,
    "operator-snapshot": OperatorSnapshot,
    "scale-request": ScaleRequest,
    "drain-accepted": DrainAccepted,
    "dead-letter-list": DeadLetterList,
    "letter-selection": LetterSelection,
    "redrive-result": RedriveResult,
    "purge-result": PurgeResult,
    "recent-jobs": RecentJobs,
}


def all_schemas(specs: dict[str, ModelSpec]) -> dict[str, dict[str, Any]]:
    """File name (without directory) → JSON Schema."""
    out = {f"{name}.schema.json": model.model_json_schema() for name, model in WIRE_MODELS.items()}
    for spec in specs.values():
        out[f"models/{spec.name}.input.schema.json"] = spec.input_model.model_json_schema()
        out[f"models/{spec.name}.output.schema.json"] = spec.output_model.model_json_schema()
    return out


def export(directory: Path, specs: dict[str, ModelSpec]) -> list[Path]:
    written = []
    for name, schema in all_schemas(specs).items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(path)
    return written
