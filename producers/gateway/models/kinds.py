"""Which served models the OpenAI-compatible and rerank routes take, told from their schemas alone (no weights).

An embeddings model takes ``texts`` (a list of strings) and answers ``embeddings`` (a vector per text): the
``embeddings`` runtime (``fleet.schemas.runtimes.EmbeddingsInput``) and the built-in ``embed``. A rerank model takes
``query`` and ``texts`` and answers ``results`` (``RerankInput`` / ``RerankOutput``). A model's jobs take at most
``max_texts(spec)`` texts each (its input schema's bound on ``texts``); a request with more runs several jobs.
"""

from __future__ import annotations

from typing import Literal

from annotated_types import MaxLen

from fleet.schemas.models import ModelSpec
from fleet.schemas.runtimes import MAX_TEXTS

Kind = Literal["embeddings", "rerank", "other"]


def _fields(spec: ModelSpec) -> tuple[set[str], set[str]]:
    return set(spec.input_model.model_fields), set(spec.output_model.model_fields)


def is_embeddings(spec: ModelSpec) -> bool:
    inputs, outputs = _fields(spec)
    return "texts" in inputs and "embeddings" in outputs and "embeddings" in spec.vector_fields


def is_rerank(spec: ModelSpec) -> bool:
    inputs, outputs = _fields(spec)
    return {"query", "texts"} <= inputs and "results" in outputs


def takes_dimensions(spec: ModelSpec) -> bool:
    """Whether the model's input has ``dimensions`` (its runtime checks the value against its Matryoshka sizes)."""
    return "dimensions" in spec.input_model.model_fields


def max_texts(spec: ModelSpec) -> int:
    """How many texts one job of ``spec`` takes: its input schema's ``max_length`` on ``texts`` (default 64)."""
    field = spec.input_model.model_fields.get("texts")
    bounds = [m.max_length for m in (field.metadata if field else []) if isinstance(m, MaxLen)]
    return min(bounds) if bounds else MAX_TEXTS


def kind_of(spec: ModelSpec) -> Kind:
    """``embeddings``, ``rerank`` or ``other``: what ``GET /v1/models`` reports."""
    if is_embeddings(spec):
        return "embeddings"
    return "rerank" if is_rerank(spec) else "other"


def chunks(items: list[str], size: int) -> list[tuple[int, list[str]]]:
    """``items`` cut into runs of at most ``size``, each with the index of its first item, in order."""
    return [(start, items[start : start + size]) for start in range(0, len(items), size)]
