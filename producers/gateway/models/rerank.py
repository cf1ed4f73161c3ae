"""``POST /v1/rerank``: score passages against a query with a rerank model, in TEI's shape or in Cohere's.

The shape is told by the passages' field, and the answer follows it:

* TEI (``texts``, with ``return_text``, ``raw_scores``, ``truncate``, ``truncation_direction``): a list
  ``[{index, score, text?}]``, best first;
* Cohere (``documents``: strings or ``{"text": ...}``, with ``top_n`` and ``return_documents``): ``{id, results:
  [{index, relevance_score, document?: {text}}], meta, usage}``, best first.

``model`` may be left out when the gateway serves exactly one rerank model (``kinds.is_rerank``). ``top_n`` keeps
the N best in either shape. The passages go to the model in jobs of ``fleet.schemas.runtimes.RerankInput`` (as
many as its input takes each, their results merged), with the same keys, limits and caches as ``POST /v1/infer``.
Scores are the model's, a sigmoid in 0..1: ``raw_scores: true`` (TEI's logits) answers 400, and so does
``truncation_direction: left``; inputs are always truncated on the right to the model's maximum length, so
``truncate`` is accepted either way.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from fleet.errors import UnknownModel
from fleet.producers.gateway.access import SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.models import kinds
from fleet.producers.gateway.models.bodies import body_doc, read_json_object, validated
from fleet.producers.gateway.models.openai_errors import OpenAIRoute, Refused, openai_responses
from fleet.producers.gateway.models.runner import estimated_tokens, run_jobs
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import SubmitRequest
from fleet.schemas.models import ModelSpec
from fleet.schemas.runtimes import MAX_CHARS
from fleet.schemas.wire import Priority

MAX_DOCUMENTS = 1000  # Cohere's bound on the documents of one request

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=SUBMITTER_DEPS, route_class=OpenAIRoute)


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str


class RerankRequest(BaseModel):
    """TEI's ``/rerank`` body (``texts``) or Cohere's (``documents``): exactly one of the two."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=200, description="a rerank model; optional when only one is served")
    query: str = Field(min_length=1, max_length=MAX_CHARS)
    texts: list[str] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS, description="TEI: the passages")
    documents: list[str | Document] | None = Field(
        None, min_length=1, max_length=MAX_DOCUMENTS, description="Cohere: the passages, strings or {text}"
    )
    top_n: int | None = Field(None, ge=1, le=MAX_DOCUMENTS, description="keep the N best (default: all)")
    return_text: bool = Field(False, description="TEI: each result carries its passage's text")
    return_documents: bool = Field(False, description="Cohere: each result carries its document")
    raw_scores: bool = Field(False, description="TEI: logits instead of scores (not supported: 400)")
    truncate: bool | None = Field(None, description="TEI: accepted; inputs are always truncated to the model's max")
    truncation_direction: Literal["right", "Right", "left", "Left"] | None = Field(None, description="TEI: right only")
    max_chunks_per_doc: int | None = Field(None, ge=1, description="Cohere (v1): accepted and not used")
    priority: Priority = Field("normal", description="Fleet's extension: the jobs' priority, as in POST /v1/jobs")


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class CohereResult(BaseModel):
    index: int
    relevance_score: float
    document: Document | None = None


class CohereResponse(BaseModel):
    id: str
    results: list[CohereResult]
    meta: dict[str, Any] = Field(description="Cohere's meta: api_version and billed_units")
    usage: dict[str, int] = Field(description="total_tokens: what the model read (an estimate when unreported)")


class RerankResponse(RootModel[CohereResponse | list[TeiRank]]):
    """Cohere's object for a Cohere-shaped request, TEI's list for a TEI-shaped one."""


EXAMPLES = {
    "TEI": {"query": "What is Deep Learning?", "texts": ["Deep Learning is ...", "Cheese is ..."]},
    "Cohere": {
        "model": "rerank",
        "query": "What is the capital of the United States?",
        "documents": ["Carson City is the capital city of Nevada.", "Washington, D.C. is the capital."],
        "top_n": 1,
        "return_documents": True,
    },
}
COHERE_EXAMPLE = {
    "id": "6c1c0c2a4b3b4f0e9c1d2e3f4a5b6c7d",
    "results": [{"index": 1, "relevance_score": 0.98, "document": {"text": "Washington, D.C. is the capital."}}],
    "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
    "usage": {"total_tokens": 31},
}


def rerank_model(state: GatewayState, name: str | None) -> ModelSpec:
    """The rerank model ``name``, or the only one served when ``name`` is None.

    Raises:
        UnknownModel: no such model (404). Refused: a model of another kind, or no name with not exactly one.
    """
    served = sorted(n for n, s in state.specs.items() if kinds.is_rerank(s))
    if name is None:
        if len(served) != 1:
            why = "no rerank model is served" if not served else f"several are served ({', '.join(served)})"
            raise Refused("invalid_request", f"name the rerank model in 'model': {why}", "model")
        return state.specs[served[0]]
    spec = state.specs.get(name)
    if spec is None:
        raise UnknownModel(name, list(state.specs))
    if not kinds.is_rerank(spec):
        raise Refused(
            "model_not_supported",
            f"model {name!r} is not a rerank model (it does not take 'query' and 'texts' and answer 'results'); "
            f"rerank models here: {', '.join(served) or 'none'}",
            "model",
        )
    return spec


def passages_of(body: RerankRequest) -> tuple[list[str], bool]:
    """(the passages, whether the request is Cohere-shaped). Raises ``Refused`` for a mix of the shapes or an
    option this gateway cannot honour."""
    if (body.texts is None) == (body.documents is None):
        raise Refused("invalid_request", "give exactly one of 'texts' (TEI's shape) or 'documents' (Cohere's)", None)
    if body.raw_scores:
        raise Refused(
            "unsupported_option", "raw_scores is not supported: scores are the model's, in 0..1", "raw_scores"
        )
    if body.truncation_direction in {"left", "Left"}:
        raise Refused("unsupported_option", "only truncation_direction 'right' is supported", "truncation_direction")
    if body.documents is not None:
        if body.return_text:
            raise Refused(
                "invalid_request", "return_text is TEI's: with 'documents' use return_documents", "return_text"
            )
        return [d if isinstance(d, str) else d.text for d in body.documents], True
    if body.return_documents:
        raise Refused(
            "invalid_request", "return_documents is Cohere's: with 'texts' use return_text", "return_documents"
        )
    return list(body.texts or []), False


def job_inputs(spec: ModelSpec, body: RerankRequest, passages: list[str], wants_text: bool) -> list[dict[str, Any]]:
    """One ``RerankInput`` per run of ``kinds.max_texts(spec)`` passages, each checked against the model's input."""
    inputs = []
    for start, run in kinds.chunks(passages, kinds.max_texts(spec)):
        value: dict[str, Any] = {"query": body.query, "texts": run, "return_text": wants_text}
        if body.top_n is not None:
            value["top_n"] = min(body.top_n, len(run))
        try:
            spec.input_model.model_validate(value)
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = [str(p) for p in error["loc"]]
            where = f"passage {start + int(loc[1])}" if loc[:1] == ["texts"] and len(loc) > 1 else ".".join(loc)
            message = f"model {spec.name!r} refuses {where}: {str(error['msg'])[:300]}"
            raise Refused("invalid_request", message, None) from None
        inputs.append(value)
    return inputs


def merged(outputs: list[Any], starts: list[int], top_n: int | None) -> tuple[list[dict[str, Any]], int | None]:
    """The jobs' results as one list, indices into the request's passages, best first (at most ``top_n``), and the
    tokens they report (None when one does not)."""
    results: list[dict[str, Any]] = []
    tokens: int | None = 0
    for output, start in zip(outputs, starts, strict=True):
        results += [{**r, "index": r["index"] + start} for r in output["results"]]
        reported = output.get("tokens")
        tokens = tokens + reported if isinstance(reported, int) and tokens is not None else None
    results.sort(key=lambda r: (-r["score"], r["index"]))
    return results[:top_n] if top_n is not None else results, tokens


@router.post(
    "/rerank",
    response_model=RerankResponse,
    summary="Rerank passages against a query (TEI- or Cohere-shaped)",
    description=(
        "Scores `texts` (TEI's shape, answered with TEI's list) or `documents` (Cohere's, answered with Cohere's "
        "object) against `query` with a rerank model, best first; `model` is optional when one rerank model is "
        "served. Runs ordinary jobs, with the same keys, limits and caches as `POST /v1/infer`. Errors answer in "
        "OpenAI's shape."
    ),
    responses={
        200: {"content": {"application/json": {"example": COHERE_EXAMPLE}}},
        **openai_responses(400, 401, 403, 404, 409, 413, 429, 500, 503, 504),
    },
    openapi_extra=body_doc(RerankRequest, EXAMPLES),
)
async def rerank(
    request: Request,
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> JSONResponse:
    body = validated(RerankRequest, await read_json_object(request, state))
    spec = rerank_model(state, body.model)
    passages, cohere = passages_of(body)
    wants_text = body.return_documents if cohere else body.return_text
    inputs = job_inputs(spec, body, passages, wants_text)
    jobs = [SubmitRequest(model=spec.name, input=value, priority=body.priority) for value in inputs]
    outputs = await run_jobs(request, state, principal, jobs)
    starts = [start for start, _ in kinds.chunks(passages, kinds.max_texts(spec))]
    results, tokens = merged(outputs, starts, body.top_n)
    if tokens is None:
        tokens = estimated_tokens([body.query] * len(passages) + passages)
    if not cohere:
        return JSONResponse([{k: v for k, v in r.items() if v is not None} for r in results])
    answer = {
        "id": uuid.uuid4().hex,
        "results": [_cohere_result(r, wants_text) for r in results],
        "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": len(inputs)}},
        "usage": {"total_tokens": tokens},
    }
    return JSONResponse(answer)


def _cohere_result(result: dict[str, Any], wants_text: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"index": result["index"], "relevance_score": result["score"]}
    if wants_text and result.get("text") is not None:
        out["document"] = {"text": result["text"]}
    return out
