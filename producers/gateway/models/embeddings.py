"""``POST /v1/embeddings``: OpenAI's embeddings request and response, computed as ordinary jobs.

The request names an embeddings model (``kinds.is_embeddings``: its input takes ``texts``, its output answers
``embeddings``) and gives ``input`` as one string or a list of at most ``MAX_INPUTS`` strings. The texts go to the
model in jobs of ``{"texts": [...]}``, as many texts per job as its input schema takes (``kinds.max_texts``), in
order; ``encoding_format`` is the jobs' own (``base64``: little-endian float32, as OpenAI sends it) and
``dimensions`` goes into each job's input for a model whose input takes it (its runtime checks it against the
Matryoshka sizes its ``model.yaml`` declares); any other model answers 400 for it.

Token-id input (a list of integers, or of lists of integers) answers 400 ``unsupported_input``: the gateway holds
no tokenizer and the runtimes take text, so ids cannot be honoured exactly. ``user`` is accepted and not used.
Fleet's own extension: ``priority`` (as ``POST /v1/jobs``).

``usage`` sums the jobs' ``tokens`` (the tokens each model read, after truncation) when every output reports
them, else estimates them (``runner.estimated_tokens``: one token per 4 characters, at least one per text).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.errors import UnknownModel
from fleet.producers.gateway.access import SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.models import kinds
from fleet.producers.gateway.models.bodies import body_doc, read_json_object, validated
from fleet.producers.gateway.models.openai_errors import OpenAIRoute, Refused, openai_responses
from fleet.producers.gateway.models.runner import estimated_tokens, run_jobs
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import SubmitRequest
from fleet.schemas.models import ModelSpec
from fleet.schemas.wire import Priority

MAX_INPUTS = 2048  # OpenAI's own bound on the inputs of one request
INPUT_HINT = "input must be a string or a list of strings (token-id arrays are refused: send text)"

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=SUBMITTER_DEPS, route_class=OpenAIRoute)


class EmbeddingsRequest(BaseModel):
    """OpenAI's ``POST /v1/embeddings`` body."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"a text, or a list of at most {MAX_INPUTS} texts (token-id arrays are refused: send text)"
    )
    model: str = Field(max_length=200, description="an embeddings model served here (GET /v1/models)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as base64 of its little-endian float32 bytes"
    )
    dimensions: int | None = Field(
        None, ge=1, le=65_536, description="one of the Matryoshka sizes the model declares (else 400)"
    )
    user: str | None = Field(None, max_length=1024, description="accepted and not used")
    priority: Priority = Field("normal", description="Fleet's extension: the jobs' priority, as in POST /v1/jobs")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the vector; base64 of float32 bytes with encoding_format base64")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    """OpenAI's embeddings list."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


EXAMPLES = {
    "one text": {"model": "embed", "input": "The food was delicious"},
    "texts, base64": {"model": "embed", "input": ["a cat", "a dog"], "encoding_format": "base64"},
}
RESPONSE_EXAMPLE = {
    "object": "list",
    "data": [{"object": "embedding", "index": 0, "embedding": [0.0123, -0.0456, 0.0789]}],
    "model": "embed",
    "usage": {"prompt_tokens": 7, "total_tokens": 7},
}


def embeddings_model(state: GatewayState, name: str) -> ModelSpec:
    """The served embeddings model ``name``. Raises UnknownModel (404), or ``Refused`` for another kind."""
    spec = state.specs.get(name)
    if spec is None:
        raise UnknownModel(name, list(state.specs))
    if not kinds.is_embeddings(spec):
        served = sorted(n for n, s in state.specs.items() if kinds.is_embeddings(s)) or ["none"]
        raise Refused(
            "model_not_supported",
            f"model {name!r} is not an embeddings model (it does not take 'texts' and answer 'embeddings'); "
            f"embeddings models here: {', '.join(served)}",
            "model",
        )
    return spec


def check_input(data: dict[str, Any]) -> None:
    """Refuse an ``input`` that is not text before the body is validated: a list over ``MAX_INPUTS``, token ids
    (``unsupported_input``) or anything else that is not a string or a list of strings. Plain loops over at most
    ``MAX_INPUTS`` items, so a hostile list is refused in microseconds rather than validated item by item."""
    value = data.get("input")
    if isinstance(value, str) or "input" not in data:
        return
    if not isinstance(value, list):
        raise Refused("invalid_request", f"invalid request: {INPUT_HINT}", "input")
    if len(value) > MAX_INPUTS:
        raise Refused("invalid_request", f"input has {len(value)} items, over the limit of {MAX_INPUTS}", "input")
    if all(type(v) is str for v in value):
        return
    if _token_ids(value):
        model = data.get("model")
        named = f"model {model!r}" if isinstance(model, str) else "this model"
        raise Refused(
            "unsupported_input",
            f"token-id input is not supported by {named}: this gateway has no tokenizer; send the text itself (a "
            "string or a list of strings)",
            "input",
        )
    raise Refused("invalid_request", f"invalid request: {INPUT_HINT}", "input")


def _token_ids(value: list[Any]) -> bool:
    """Whether ``value`` is OpenAI's token-id input: a list of integers, or a list of lists of integers."""
    if all(type(v) is int for v in value):
        return True
    return all(type(v) is list and all(type(t) is int for t in v) for v in value)


def texts_of(body: EmbeddingsRequest) -> list[str]:
    """The request's texts (``check_input`` let only text through). Raises ``Refused`` for an empty input."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise Refused("invalid_request", "input is empty: give a text or a list of texts", "input")
    for i, text in enumerate(texts):
        if not text:
            raise Refused("invalid_request", f"input[{i}] is an empty string", "input")
    return [str(t) for t in texts]


def job_inputs(spec: ModelSpec, texts: list[str], dimensions: int | None) -> list[dict[str, Any]]:
    """One job input per run of ``kinds.max_texts(spec)`` texts, each checked against the model's input schema.

    Raises:
        Refused: ``dimensions`` for a model that does not take it, or a text the model refuses (named by its index
            in the request's ``input``).
    """
    extra: dict[str, Any] = {}
    if dimensions is not None:
        if not kinds.takes_dimensions(spec):
            raise Refused(
                "dimensions_not_supported",
                f"model {spec.name!r} does not take 'dimensions': it declares no Matryoshka sizes; leave it out",
                "dimensions",
            )
        extra["dimensions"] = dimensions
    inputs = []
    for start, run in kinds.chunks(texts, kinds.max_texts(spec)):
        value = {"texts": run, **extra}
        try:
            spec.input_model.model_validate(value)
        except ValidationError as exc:
            raise _refused_text(spec, exc, start, len(run)) from None
        inputs.append(value)
    return inputs


def _refused_text(spec: ModelSpec, exc: ValidationError, start: int, count: int) -> Refused:
    """The refusal of the run of ``count`` texts from ``input[start]``, naming the text at fault where the model's
    schema names it (a check over the whole run names its place in the run: the message says which run)."""
    error = exc.errors()[0]
    loc = [str(p) for p in error["loc"]]
    if loc[:1] == ["texts"] and len(loc) > 1:
        where = f"input[{start + int(loc[1])}]"
    elif loc:
        where = ".".join(loc)
    else:
        where = "input" if start == 0 and count == 1 else f"input[{start}:{start + count}]"
    param = "dimensions" if loc[:1] == ["dimensions"] else "input"
    return Refused("invalid_request", f"model {spec.name!r} refuses {where}: {str(error['msg'])[:300]}", param)


def usage_of(outputs: list[Any], texts: list[str]) -> int:
    """The tokens the jobs report, or the estimate when one of them reports none."""
    reported = [o.get("tokens") if isinstance(o, dict) else None for o in outputs]
    if all(isinstance(t, int) for t in reported):
        return sum(t for t in reported if isinstance(t, int))
    return estimated_tokens(texts)


def vectors_of(outputs: list[Any]) -> list[Any]:
    return [vector for output in outputs for vector in output["embeddings"]]


@router.post(
    "/embeddings",
    response_model=EmbeddingsResponse,
    summary="Create embeddings (OpenAI-compatible)",
    description=(
        "OpenAI's embeddings API over ordinary jobs of an embeddings model: the texts go in jobs of as many texts "
        "as the model's input takes, with the tenant's keys, rate limits, quotas, priorities and result caches as "
        "`POST /v1/infer`. Errors answer in OpenAI's shape. Token-id input is refused (400 `unsupported_input`); "
        "`dimensions` only for a model that declares Matryoshka sizes."
    ),
    responses={
        200: {"content": {"application/json": {"example": RESPONSE_EXAMPLE}}},
        **openai_responses(400, 401, 403, 404, 409, 413, 429, 500, 503, 504),
    },
    openapi_extra=body_doc(EmbeddingsRequest, EXAMPLES),
)
async def create_embeddings(
    request: Request,
    state: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> JSONResponse:
    data = await read_json_object(request, state)
    check_input(data)
    body = validated(EmbeddingsRequest, data, {"input": INPUT_HINT})
    spec = embeddings_model(state, body.model)
    texts = texts_of(body)
    inputs = job_inputs(spec, texts, body.dimensions)
    jobs = [
        SubmitRequest(model=spec.name, input=value, encoding_format=body.encoding_format, priority=body.priority)
        for value in inputs
    ]
    outputs = await run_jobs(request, state, principal, jobs)
    tokens = usage_of(outputs, texts)
    data_out = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors_of(outputs))]
    answer = {
        "object": "list",
        "data": data_out,
        "model": spec.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONResponse(answer)
