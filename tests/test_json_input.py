"""Numbers and strings survive or are refused, never changed (``fleet.producers.gateway.client_json``,
``fleet.finite``).

On a real gateway (uvicorn) with a real echo worker, memory and NATS + Redis: a huge integer, NaN, -Infinity,
1e400, a lone surrogate and nesting 600 deep get a 4xx naming what was wrong (never a 500, never a job whose
output holds null) on ``POST /v1/jobs``, ``/v1/infer`` and a DAG run start, and an error frame on ``/v1/ws`` (the
socket stays open and answers the next frame); integers up to the limit, also past 64 bits, and nesting up to the
limit come back exactly. A worker's output holding NaN fails its job (``invalid_output``) instead of being stored
as null. The SDK refuses to send what JSON cannot carry; ``fleet publish`` lines and ``fleet dag run --input`` are
read by the same parser as the gateway's bodies (``fleet.strict_json``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from typer.testing import CliRunner
from websockets.asyncio.client import connect as ws_connect

from fleet import constants as c
from fleet import strict_json
from fleet.brokers.base import Broker
from fleet.cli import app as cli_app
from fleet.errors import InvalidInput
from fleet.producers.gateway import create_app
from fleet.producers.gateway.client_json import MAX_DEPTH, MAX_INT_DIGITS
from fleet.producers.publish import prepare
from fleet.producers.sdk import FleetClient, ws_url
from fleet.schemas.models import ECHO
from fleet.schemas.wire import RequestMessage
from fleet.store.base import ResultStore
from tests.gateway_helpers import FAST_LIMITS, ObservedWorker, model_refs, served, urls_for
from tests.infra import connected_pair, settings_for, wait_terminal

PAIRS = ["memory", "nats+redis"]  # the gateway parses before any broker sees a byte

# name -> the JSON text of a value inside ``input`` that must be refused, and the word the answer must name
REFUSED = {
    "huge_int": ("1" + "0" * (MAX_INT_DIGITS + 700), str(MAX_INT_DIGITS)),
    "nan": ("NaN", "NaN"),
    "minus_infinity": ("-Infinity", "-Infinity"),
    "overflowing_float": ("1e400", "1e400"),
    "lone_surrogate": ('"\\ud800x"', "Unicode"),
    "deep_600": ("[" * 600 + "1" + "]" * 600, str(MAX_DEPTH)),
    "deep_1000": ("[" * 1000 + "1" + "]" * 1000, str(MAX_DEPTH)),
}
# Values that must come back exactly: (JSON text, the Python value)
EXACT = {
    "int_past_64_bits": ("123456789012345678901234567890", 123456789012345678901234567890),
    "negative_int_past_64_bits": ("-18446744073709551617", -18446744073709551617),
    "int_at_the_limit": ("9" * MAX_INT_DIGITS, int("9" * MAX_INT_DIGITS)),
    "nesting_at_the_limit": ("[" * (MAX_DEPTH - 2) + "1" + "]" * (MAX_DEPTH - 2), None),
    "largest_float": ("1.7976931348623157e308", 1.7976931348623157e308),
    "astral_text": ('"\\ud83d\\ude00 \u00e9"', "\U0001f600 \u00e9"),
}


@dataclass
class Env:
    base: str
    broker: Broker
    store: ResultStore
    echo: str
    dag: str
    client: httpx.AsyncClient


@pytest.fixture(scope="module", params=PAIRS)
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    unique = uuid.uuid4().hex[:10]
    refs, (echo,) = model_refs(unique, "echo")
    pair = request.param
    settings = settings_for(pair, urls_for(request, pair), models=refs, max_body_bytes=1 << 20)
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
            dag = f"json-{unique}"
            steps = f"steps:\n  - id: one\n    model: {echo}\n    input: {{}}\n"
            spec = f"name: {dag}\n{steps}output: '${{steps.one.output}}'\n"
            registered = await client.post("/v1/dags", content=spec, headers={"content-type": "application/yaml"})
            assert registered.status_code == 201, registered.text
            async with ObservedWorker(broker, store, echo):
                yield Env(base, broker, store, echo, dag, client)


def body(env: Env, value_json: str) -> str:
    return f'{{"model": "{env.echo}", "input": {{"v": {value_json}}}}}'


async def post(env: Env, path: str, text: str) -> httpx.Response:
    return await env.client.post(path, content=text.encode("utf-8"), headers={"content-type": "application/json"})


@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_a_value_json_cannot_carry_exactly_is_a_4xx_naming_it(env: Env, case: str) -> None:
    value_json, named = REFUSED[case]
    for path, text in (
        ("/v1/jobs", body(env, value_json)),
        ("/v1/infer", body(env, value_json)),
        (f"/v1/dags/{env.dag}/runs", f'{{"input": {{"v": {value_json}}}}}'),
    ):
        response = await post(env, path, text)
        assert response.status_code in (400, 422), (path, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["type"] in ("malformed_json", "invalid_request") and named in error["message"], error
    assert (await env.client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("case", sorted(EXACT))
async def test_a_value_within_the_limits_comes_back_exactly(env: Env, case: str) -> None:
    value_json, value = EXACT[case]
    if value is None:
        value = json.loads(value_json)
    response = await post(env, "/v1/infer", body(env, value_json))
    assert response.status_code == 200, response.text[:300]
    output = json.loads(response.content)["output"]  # the standard parser: integers exact at any size
    assert output == {"v": value} and type(output["v"]) is type(value)
    record = await env.client.get(f"/v1/jobs/{response.json()['job_id']}")
    assert json.loads(record.content)["output"] == {"v": value}


async def test_ws_frames_with_such_values_get_an_error_frame_and_the_socket_answers_on(env: Env) -> None:
    done = await post(env, "/v1/jobs", body(env, '"for the socket"'))
    job_id = done.json()["job_id"]
    async with ws_connect(ws_url(env.base, "/v1/ws")) as ws:
        for case, (value_json, named) in sorted(REFUSED.items()):
            await ws.send(f'{{"subscribe": [{value_json}]}}')
            frame = json.loads(await ws.recv())
            assert frame["type"] == "error" and frame["job_id"] is None, (case, frame)
            assert frame["error"]["type"] == "invalid_frame" and named in frame["error"]["message"], (case, frame)
        await ws.send(json.dumps({"subscribe": [job_id]}))
        answer = json.loads(await ws.recv())
    assert answer["type"] == "result" and answer["job"]["output"] == {"v": "for the socket"}


async def test_a_worker_output_holding_nan_fails_its_job_instead_of_storing_null(env: Env) -> None:
    """A raw message (no gateway on the way) carries NaN; echo returns it; JSON would write null."""
    job_id = f"nan-{uuid.uuid4().hex[:8]}"
    message = RequestMessage(job_id=job_id, model=env.echo, input={"v": 0.5}).model_dump(mode="json")
    message["input"] = {"v": float("nan"), "w": [1.0, float("-inf")]}
    await env.broker.publish(c.request_subject(env.echo), json.dumps(message).encode(), msg_id=job_id)
    record = (await wait_terminal(env.store, [job_id]))[job_id]
    assert record.state == "failed" and record.output is None, record
    assert record.error is not None and record.error.type == "invalid_output" and "NaN" in record.error.message


async def test_the_sdk_refuses_to_send_what_json_cannot_carry(env: Env) -> None:
    async with FleetClient(env.base) as fleet:
        for value in (float("nan"), float("inf"), 10 ** (MAX_INT_DIGITS + 1)):
            with pytest.raises(InvalidInput, match="cannot be sent as JSON"):
                await fleet.submit(env.echo, {"v": value})
        assert (await fleet.infer(env.echo, {"v": 10**30}))["v"] == 10**30


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fleet_publish_lines_are_read_by_the_same_parser(case: str) -> None:
    value_json, named = REFUSED[case]
    prepared = prepare([f'{{"v": {value_json}}}', '{"v": 123456789012345678901234567890}'], ECHO)
    assert [e.line for e in prepared.errors] == [1] and named in prepared.errors[0].message, prepared.errors
    assert prepared.messages[0].input == {"v": 123456789012345678901234567890}


async def test_fleet_dag_run_input_is_read_by_the_same_parser(env: Env) -> None:
    for case, (value_json, named) in sorted(REFUSED.items()):
        args = ["dag", "run", env.dag, "--url", env.base, "--input", f'{{"v": {value_json}}}']
        result = await asyncio.to_thread(CliRunner().invoke, cli_app, args)
        assert result.exit_code == 2 and named in result.output, (case, result.output[-500:])
        assert "Traceback" not in result.output


# (text, the value it holds) or (text, (malformed?, words of the refusal)): the parser itself, as a table
TABLE: list[tuple[bytes, object]] = [
    (b'{"a": 1, "a": 2}', {"a": 2}),  # duplicate keys: the last wins, as everywhere
    (b"18446744073709551616", 18446744073709551616),  # past 64 bits: orjson would give a float
    (b"[-9223372036854775809, 0.1]", [-9223372036854775809, 0.1]),
    (b'"digits 12345678901234567890 in a string"', "digits 12345678901234567890 in a string"),
    (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)),
    (b'"caf\\u00e9 \\ud83d\\ude00"', "caf\u00e9 \U0001f600"),
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), (True, f"limit of {MAX_DEPTH}")),
    (b"[" * 100_000, (True, f"limit of {MAX_DEPTH}")),
    (b"{", (True, "not valid JSON")),
    (b"\xff", (True, "not valid")),
    (b"[NaN]", (False, "NaN")),
    (b"[-Infinity]", (False, "-Infinity")),
    (b"[1e400]", (False, "1e400")),
    (b"[" + b"1" * (MAX_INT_DIGITS + 1) + b"]", (False, f"limit of {MAX_INT_DIGITS} digits")),
    (b'"\\ud800x"', (False, "lone UTF-16 surrogate")),
    (b'{"\\udfff": 1}', (False, "lone UTF-16 surrogate")),
    (b'"\xed\xa0\x80"', (False, "lone UTF-16 surrogate")),  # a surrogate encoded as UTF-8 bytes
]


@pytest.mark.parametrize(("text", "expected"), TABLE, ids=[repr(t[:24]) for t, _ in TABLE])
def test_strict_json_table(text: bytes, expected: object) -> None:
    if not isinstance(expected, tuple):
        assert strict_json.loads(text) == expected
        return
    malformed, words = expected
    with pytest.raises(strict_json.JsonRefused) as refused:
        strict_json.loads(text)
    assert refused.value.malformed is malformed and words in refused.value.message, refused.value.message
