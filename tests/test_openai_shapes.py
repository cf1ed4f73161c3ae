"""The pure parts of the OpenAI-compatible and rerank routes, with no server: which models they take, how texts are
cut into jobs and refused by index, how rerank results merge across jobs, and the OpenAI error shape of every kind
of error the gateway raises."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from fleet.errors import PayloadTooLarge, QueueFull, StoreError, UnknownModel
from fleet.producers.gateway.errors import ApiError
from fleet.producers.gateway.models import embeddings, kinds, rerank
from fleet.producers.gateway.models.openai_errors import Refused, openai_error
from fleet.producers.gateway.models.runner import estimated_tokens
from fleet.schemas.models import ECHO, EMBED, SLEEP
from tests.openai_handlers import TOY_MAX_TEXTS, Overlap, ToyEmbed


def test_the_kinds_come_from_the_schemas() -> None:
    assert [kinds.kind_of(s) for s in (EMBED, ToyEmbed.spec, Overlap.spec, ECHO, SLEEP)] == [
        "embeddings",
        "embeddings",
        "rerank",
        "other",
        "other",
    ]
    assert (kinds.max_texts(EMBED), kinds.max_texts(ToyEmbed.spec), kinds.max_texts(Overlap.spec)) == (
        64,
        TOY_MAX_TEXTS,
        256,
    )
    assert kinds.takes_dimensions(ToyEmbed.spec) and kinds.takes_dimensions(EMBED)  # embed's worker checks the size
    assert not kinds.takes_dimensions(Overlap.spec)


def test_texts_are_cut_into_jobs_in_order() -> None:
    texts = [str(i) for i in range(TOY_MAX_TEXTS * 2 + 1)]
    inputs = embeddings.job_inputs(ToyEmbed.spec, texts, 4)
    assert [value["texts"] for value in inputs] == [texts[:8], texts[8:16], texts[16:]]
    assert all(value["dimensions"] == 4 for value in inputs)
    assert kinds.chunks([], 3) == []


def test_a_refused_text_is_named_by_its_index_in_the_request() -> None:
    texts = ["ok", "fine"]
    with pytest.raises(Refused) as refused:
        embeddings.job_inputs(EMBED, ["ok"] * 70 + ["x" * 20_001], None)  # the second job's seventh text
    assert "input[64:71]" in refused.value.message and "20001 characters" in refused.value.message
    assert all(value["dimensions"] == 128 for value in embeddings.job_inputs(EMBED, texts, 128))  # the worker says


def test_rerank_results_merge_across_jobs_best_first() -> None:
    outputs = [
        {"results": [{"index": 1, "score": 0.9}, {"index": 0, "score": 0.1}], "tokens": 5},
        {"results": [{"index": 0, "score": 0.5}, {"index": 1, "score": 0.9}], "tokens": 7},
    ]
    results, tokens = rerank.merged(outputs, [0, 2], top_n=3)
    assert [(r["index"], r["score"]) for r in results] == [(1, 0.9), (3, 0.9), (2, 0.5)]
    assert tokens == 12
    _, unknown = rerank.merged([{"results": []}, outputs[0]], [0, 2], None)
    assert unknown is None


def test_the_usage_estimate_is_a_token_per_four_characters() -> None:
    assert estimated_tokens(["", "abcd", "abcde"]) == 1 + 1 + 2


def _request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [], "query_string": b""})


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (UnknownModel("gpt-4", ["embed"]), 404, "invalid_request_error", "model_not_found"),
        (ApiError(401, "invalid_key", "bad key"), 401, "invalid_request_error", "invalid_api_key"),
        (ApiError(403, "forbidden", "no role"), 403, "permission_error", "forbidden"),
        (ApiError(429, "rate_limited", "slow down", headers={"Retry-After": "3"}), 429, "rate_limit_error", None),
        (QueueFull("embed", 10, depth=10, retry_after_s=2.0), 429, "rate_limit_error", "queue_full"),
        (PayloadTooLarge(2, 1, what="request body"), 413, "invalid_request_error", "payload_too_large"),
        (ApiError(422, "invalid_input", "refused"), 400, "invalid_request_error", "invalid_input"),
        (RequestValidationError([]), 400, "invalid_request_error", "invalid_request"),
        (StoreError("down"), 503, "server_error", "store_unavailable"),
        (ApiError(504, "infer_timeout", "still running"), 504, "server_error", "infer_timeout"),
        (RuntimeError("bug"), 500, "server_error", "internal_error"),
    ],
)
def test_every_error_answers_in_openai_shape(exc: Exception, status: int, type_: str, code: str | None) -> None:
    response = openai_error(_request(), exc)
    body = json.loads(bytes(response.body))
    assert response.status_code == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_ and body["error"]["code"] == (code or "rate_limited")
    if status in {429, 503}:
        assert int(response.headers["retry-after"]) >= 1


def test_the_rerank_model_may_go_unnamed_only_when_one_is_served() -> None:
    one: Any = SimpleNamespace(specs={"overlap": Overlap.spec, "echo": ECHO})
    assert rerank.rerank_model(one, None) is Overlap.spec
    for specs in ({"echo": ECHO}, {"a": Overlap.spec, "b": Overlap.spec}):
        with pytest.raises(Refused) as unnamed:
            rerank.rerank_model(SimpleNamespace(specs=specs), None)  # type: ignore[arg-type]
        assert unnamed.value.param == "model"
    with pytest.raises(UnknownModel):
        rerank.rerank_model(one, "nope")


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ([101, 2023], "unsupported_input"),
        ([[101], [2023, 102]], "unsupported_input"),
        ([[["x"]], {"a": [1]}] * 1000, "invalid_request"),
        ([True, False], "invalid_request"),
        (["x", 1], "invalid_request"),
        ({"text": "x"}, "invalid_request"),
        (None, "invalid_request"),
        (["x"] * 2049, "invalid_request"),
    ],
)
def test_input_that_is_not_text_is_refused_before_validation(value: Any, code: str) -> None:
    with pytest.raises(Refused) as refused:
        embeddings.check_input({"model": "toy-embed", "input": value})
    assert refused.value.type == code and refused.value.param == "input"
    assert len(refused.value.message) < 200


def test_text_input_passes_the_shape_check() -> None:
    for value in ("x", ["x", "y"], [], ["x"] * 2048):
        embeddings.check_input({"input": value})


def test_param_names_the_request_field_at_fault() -> None:
    fastapi_error = RequestValidationError([{"loc": ("body", "model"), "msg": "Field required", "type": "missing"}])
    jobs_error = ApiError(422, "invalid_input", "bad", [{"loc": "input.texts.3", "msg": "too long", "type": "x"}])
    params = [
        json.loads(bytes(openai_error(_request(), e).body))["error"]["param"] for e in (fastapi_error, jobs_error)
    ]
    assert params == ["model", "input"]
