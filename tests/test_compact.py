"""Compact results (``encoding_format: base64``): the encoding itself, records serialised by orjson and still read
in their old form, and base64 outputs end to end (REST, SDK, WebSocket, SSE, the wire, the result caches) on every
broker/store pair, with hostile values refused.

The vector model is ``embed``'s handler with its model replaced by a deterministic one (``VecEmbed``: a float32
vector from each text's crc32, no weights), so the real output path (``EmbedHandler.output_json``) is what runs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.handlers.embed import EmbedHandler
from fleet.consumers.worker import Worker
from fleet.encoding import convert_output, decode_array, decode_output, decode_vector, encode_vector
from fleet.errors import InvalidInput
from fleet.producers.gateway import create_app
from fleet.producers.publish import prepare_line
from fleet.producers.sdk import FleetClient
from fleet.producers.sdk_sync import FleetSyncClient
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.schemas.models import ECHO, EMBED, EMBED_DIM, EmbedInput, EmbedOutput, ModelSpec
from fleet.settings import FleetSettings
from fleet.store import transitions
from fleet.store.base import ResultStore
from fleet.store.memory import MemoryStore
from fleet.store.packed import _text as packed_text
from fleet.store.redis import RedisStore
from tests.gateway_helpers import FAST_LIMITS, WORKER_SETTINGS, served, urls_for
from tests.infra import PAIRS, connected_pair, drain_subject, request_bytes, settings_for, wait_terminal
from tests.processes import run_fleet

FIELDS = EMBED.vector_fields


def __getattr__(name: str) -> ModelSpec:
    base, sep, token = name.partition("_")
    if sep and base == "vec":
        return dataclasses.replace(EMBED, name=f"vec-{token}")
    raise AttributeError(name)


def vector_of(text: str) -> list[float]:
    """The float32 values ``VecEmbed`` gives ``text`` (as Python floats)."""
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    values: list[float] = rng.standard_normal(EMBED_DIM).astype(np.float32).tolist()
    return values


class VecEmbed(EmbedHandler):
    """``embed`` with a deterministic vector per text instead of the network: no weights to load."""

    def load(self) -> None:
        """Nothing to load."""

    def predict(self, batch: list[EmbedInput]) -> list[EmbedOutput | Exception]:
        return [
            EmbedOutput.model_construct(dim=EMBED_DIM, embedding=vector_of(item.text))
            if item.text is not None
            else EmbedOutput.model_construct(dim=EMBED_DIM, embeddings=[vector_of(t) for t in item.items()])
            for item in batch
        ]

    def sample_input(self) -> None:  # type: ignore[override]
        return None


def openai_decode(text: str) -> list[float]:
    """How an OpenAI client reads a base64 embedding."""
    values: list[float] = np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()
    return values


# -- the encoding (pure) --------------------------------------------------------------------------------------
def test_base64_is_little_endian_float32_and_round_trips_exactly() -> None:
    vector = vector_of("hello")
    text = encode_vector(vector)
    assert len(text) == 4 * ((EMBED_DIM * 4 + 2) // 3)  # 2,048 characters for 384 floats
    assert base64.b64decode(text) == np.asarray(vector, dtype=np.float32).astype("<f4").tobytes()
    assert decode_vector(text) == vector == openai_decode(text)
    assert decode_array(text).dtype == np.dtype("<f4") and decode_array(text).tolist() == vector
    assert encode_vector(np.asarray(vector, dtype=">f4")) == text  # any byte order in, little-endian out


@pytest.mark.parametrize(
    "values",
    [
        [0.1, -2.5, 1e-45, 3.4e38],  # doubles that float32 rounds, a denormal, near the top of its range
        [1, 0, -7, True],  # whole numbers and a bool, as numpy takes them
        [1e39, -1e39, float("nan")],  # past float32's range: struct refuses, numpy gives +-inf
        ["1.5", 2.0],  # a numeric string: struct refuses, numpy parses it
        [],
    ],
)
def test_a_list_encodes_to_the_bytes_numpy_gives(values: list[object]) -> None:
    with np.errstate(over="ignore"):
        expected = np.asarray(values, dtype="<f4").tobytes()
        assert base64.b64decode(encode_vector(values)) == expected
        assert encode_vector(values) == encode_vector(np.asarray(values, dtype="<f4"))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 8))
def test_base64_text_is_the_standard_librarys_for_any_bytes(data: bytes, offset: int) -> None:
    # Vectors are written by pybase64 (SIMD), in the worker and when a packed record is read back: the text must be
    # what base64.b64encode writes, padding included, for every length and wherever the bytes start.
    expected = base64.b64encode(data).decode("ascii")
    assert packed_text(b"x" * offset + data + b"y", offset, len(data)) == expected
    vector = np.frombuffer(data[: len(data) - len(data) % 4], dtype="<f4")
    assert encode_vector(vector) == base64.b64encode(vector.tobytes()).decode("ascii")


def test_vectors_as_float32_rows_give_the_json_lists_give() -> None:
    """``EmbedHandler.predict`` keeps vectors as rows of its float32 array; the JSON must be what lists give."""
    handler = VecEmbed()
    texts = ["a", "b", "c"]
    matrix = np.asarray([vector_of(t) for t in texts], dtype=np.float32)
    pairs = [
        (EmbedOutput.model_construct(embedding=matrix[0]), EmbedOutput.model_construct(embedding=vector_of("a"))),
        (
            EmbedOutput.model_construct(embeddings=matrix[1:]),
            EmbedOutput.model_construct(embeddings=[vector_of("b"), vector_of("c")]),
        ),
        (
            EmbedOutput.model_construct(embeddings=[matrix[2], vector_of("a")]),  # rows and lists mixed
            EmbedOutput.model_construct(embeddings=[vector_of("c"), vector_of("a")]),
        ),
    ]
    for rows, lists in pairs:
        for encoding in ("float", "base64"):
            got, want = handler.output_json(rows, encoding), handler.output_json(lists, encoding)
            assert got == want, encoding
            assert transitions.record_json(record_with(got)) == transitions.record_json(record_with(want))
        floats = handler.output_json(rows, "float")
        values = floats["embedding"] or [x for v in floats["embeddings"] for x in v]
        assert all(type(x) is float for x in values)  # Python floats, not numpy scalars


def record_with(output: dict[str, Any]) -> JobRecord:
    return JobRecord(job_id="a" * 32, model="embed", state=JobState.succeeded, output=output, created_at=1.0)


class RowEmbed(VecEmbed):
    """``embed``'s own ``predict`` over a deterministic matrix (``vector_of`` per text)."""

    predict = EmbedHandler.predict

    def embed_with_tokens(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        return np.asarray([vector_of(t) for t in texts], dtype=np.float32), [2 + len(t) for t in texts]


def test_predict_builds_the_outputs_model_construct_builds() -> None:
    handler = RowEmbed()
    batch = [EmbedInput(text="a"), EmbedInput(texts=["b", "c"]), EmbedInput(text="d"), EmbedInput(texts=["e"])]
    outputs = handler.predict(batch)
    expected = [
        EmbedOutput.model_construct(dim=EMBED_DIM, embedding=vector_of("a"), tokens=3),
        EmbedOutput.model_construct(dim=EMBED_DIM, embeddings=[vector_of("b"), vector_of("c")], tokens=6),
        EmbedOutput.model_construct(dim=EMBED_DIM, embedding=vector_of("d"), tokens=3),
        EmbedOutput.model_construct(dim=EMBED_DIM, embeddings=[vector_of("e")], tokens=3),
    ]
    for got, want in zip(outputs, expected, strict=True):
        assert isinstance(got, EmbedOutput)
        assert got.model_fields_set == want.model_fields_set
        assert got.__pydantic_extra__ is None and got.__pydantic_private__ is None
        assert handler.output_json(got) == handler.output_json(want)  # the same floats, the same fields
        assert handler.output_json(got, "base64") == handler.output_json(want, "base64")
    ran = handler.run(batch)  # what the worker calls: its check of the output types passes them
    assert [type(out) for out in ran] == [EmbedOutput] * len(batch)


@pytest.mark.parametrize("bad", ["not base64!", "AAA", base64.b64encode(b"12345").decode()])
def test_a_bad_base64_vector_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="base64 vector"):
        decode_vector(bad)


def test_convert_output_goes_both_ways_and_leaves_other_fields_alone() -> None:
    one = {"dim": EMBED_DIM, "embedding": vector_of("a"), "embeddings": None}
    many = {"dim": EMBED_DIM, "embedding": None, "embeddings": [vector_of("a"), vector_of("b")]}
    for output in (one, many):
        packed = convert_output(output, FIELDS, "base64")
        assert packed is not output and output["dim"] == EMBED_DIM  # the input is not modified
        assert convert_output(packed, FIELDS, "base64") == packed  # already base64: unchanged
        assert convert_output(packed, FIELDS, "float") == output == decode_output(packed, FIELDS)
    assert isinstance(convert_output(one, FIELDS, "base64")["embedding"], str)
    assert all(isinstance(v, str) for v in convert_output(many, FIELDS, "base64")["embeddings"])
    assert convert_output({"text": "x"}, (), "base64") == {"text": "x"}


def test_a_model_without_vectors_keeps_the_default_and_fleet_publish_refuses_base64() -> None:
    handler = EchoHandler()
    assert handler.output_json(ECHO.output_model.model_validate({"a": [1.5]}), "float") == {"a": [1.5]}
    with pytest.raises(InvalidInput, match="has none"):
        prepare_line('{"a": 1}', ECHO, requests=False, encoding_format="base64")
    request = json.dumps({"job_id": "j1", "model": "echo", "input": {}, "encoding_format": "base64"})
    with pytest.raises(InvalidInput, match="has none"):
        prepare_line(request, ECHO, requests=True)
    assert prepare_line('{"text": "x"}', EMBED, requests=False, encoding_format="base64").encoding_format == "base64"


# -- records: orjson, the old form still reads -----------------------------------------------------------------
def _finished(output: Any, error: JobError | None = None) -> JobRecord:
    state = JobState.failed if error else JobState.succeeded
    return transitions.finished(None, "r1", state, model="m", output=output, error=error, worker_id="w", now=1.5)


def test_record_json_is_the_pydantic_document_without_its_nulls() -> None:
    for record in (
        _finished({"embedding": vector_of("x"), "n": 10**30, "nan": float("nan")}),  # 10**30: pydantic's fallback
        _finished(None, JobError(type="model_error", message="boom")),
    ):
        raw = transitions.record_json(record)
        full = json.loads(record.model_dump_json())
        written = json.loads(raw)
        assert {k: v for k, v in written.items() if v is not None} == {k: v for k, v in full.items() if v is not None}
        assert set(full) - set(written) <= {k for k, v in full.items() if v is None}
        assert JobRecord.model_validate_json(raw).model_dump(mode="json") == full
    array = np.asarray(vector_of("y"), dtype=np.float32)  # numpy passed through: float32 written as float32
    parsed = JobRecord.model_validate_json(transitions.record_json(_finished({"embedding": array})))
    assert np.array_equal(np.asarray(parsed.output["embedding"], dtype=np.float32), array)


async def _old_form_reads_and_finishes(store: ResultStore, write_raw: Any) -> None:
    old = JobRecord(job_id="old-1", model="m", state=JobState.running, deliveries=1, worker_id="w0")
    raw = old.model_dump_json()  # as every Fleet before orjson wrote it: every field, nulls included
    assert '"error":null' in raw
    await write_raw("old-1", raw)
    assert await store.get("old-1") == old
    assert (await store.get_many(["old-1"]))[0] == old
    won, done = await store.finish("old-1", JobState.succeeded, model="m", output={"embedding": "AAAAAA=="})
    assert won and done.deliveries == 1 and (await store.get("old-1")) == done


async def test_a_record_of_the_old_form_still_reads_on_redis(redis_url: str, unique: str) -> None:
    store = RedisStore(redis_url, job_ttl_s=60)
    await store.connect()
    try:

        async def write(job_id: str, raw: str) -> None:
            await store.redis.delete(c.job_key(job_id))
            await store.redis.set(c.job_key(job_id), raw, ex=60)

        await _old_form_reads_and_finishes(store, write)
    finally:
        await store.close()


async def test_a_record_of_the_old_form_still_reads_in_memory() -> None:
    store = MemoryStore(job_ttl_s=60)

    async def write(job_id: str, raw: str) -> None:
        store._write(job_id, raw.encode())

    await _old_form_reads_and_finishes(store, write)


# -- end to end, every pair -----------------------------------------------------------------------------------
@dataclass
class Served:
    base_url: str
    broker: Broker
    store: ResultStore
    vec: str
    echo: str
    settings: FleetSettings

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=15)


@contextlib.asynccontextmanager
async def serve(request: pytest.FixtureRequest, pair: str, unique: str, **overrides: Any) -> AsyncIterator[Served]:
    """A served gateway for a per-test vector model and echo model, and a real worker for each."""
    vec, echo = f"vec-{unique}", f"echo-{unique}"
    refs = [f"tests.test_compact:vec_{unique}", f"tests.gateway_helpers:echo_{unique}"]
    settings = settings_for(pair, urls_for(request, pair), models=refs, **overrides)
    async with connected_pair(settings) as (broker, store):
        workers = [
            Worker(with_name(VecEmbed, vec)(), broker, store, settings=WORKER_SETTINGS, max_wait_ms=2),
            Worker(with_name(EchoHandler, echo)(), broker, store, settings=WORKER_SETTINGS, max_wait_ms=2),
        ]
        async with contextlib.AsyncExitStack() as stack:
            for worker in workers:
                await stack.enter_async_context(worker)
            app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
            async with served(app) as base_url:
                yield Served(base_url, broker, store, vec, echo, settings)


@pytest.fixture(params=PAIRS)
async def fleet(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Served]:
    async with serve(request, request.param, unique, max_body_bytes=1 << 20) as served_:
        yield served_


async def _sse_result(http: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "result":
                result: dict[str, Any] = json.loads(line.removeprefix("data: "))
                return result
    raise AssertionError("no result event")


async def test_base64_round_trips_through_rest_websocket_and_sse(fleet: Served, unique: str) -> None:
    async with fleet.http() as http:
        one = await http.post(
            "/v1/jobs", json={"model": fleet.vec, "input": {"text": "hi"}, "encoding_format": "base64"}
        )
        texts = {"model": fleet.vec, "input": {"texts": ["a", "b"]}, "encoding_format": "base64"}
        many = await http.post("/v1/jobs", json=texts)
        plain = await http.post("/v1/jobs", json={"model": fleet.vec, "input": {"text": "hi"}})
        assert {one.status_code, many.status_code, plain.status_code} == {202}, one.text
        ids = [one.json()["job_id"], many.json()["job_id"], plain.json()["job_id"]]
        records = [(await http.get(f"/v1/jobs/{job_id}", params={"wait": 10})).json() for job_id in ids]
        sse = await _sse_result(http, ids[0])
        infer = await http.post(
            "/v1/infer", json={"model": fleet.vec, "input": {"text": "hi"}, "encoding_format": "base64"}
        )
    assert [r["state"] for r in records] == ["succeeded"] * 3, records
    packed, packed_many, floats = (r["output"] for r in records)
    assert isinstance(packed["embedding"], str) and openai_decode(packed["embedding"]) == vector_of("hi")
    assert [openai_decode(v) for v in packed_many["embeddings"]] == [vector_of("a"), vector_of("b")]
    assert floats["embedding"] == vector_of("hi")  # the default is unchanged: floats
    assert sse["output"] == packed and infer.status_code == 200 and infer.json()["output"] == packed
    async with FleetClient(fleet.base_url, timeout_s=10) as client:  # the WebSocket carries the same record
        got = [r async for r in client.subscribe(ids[:2], timeout_s=15)]
    assert {r.job_id: r.output["embedding"] or r.output["embeddings"] for r in got} == {
        ids[0]: vector_of("hi"),
        ids[1]: [vector_of("a"), vector_of("b")],
    }
    if isinstance(fleet.store, RedisStore):  # kept as its bytes in the store: under 30 % of the float record
        # (the 384 floats' bytes, 1.5 KB, then the record's fields: its stage timings and device-seconds ~190 bytes)
        sizes = [await fleet.store.redis.strlen(c.job_key(job_id)) for job_id in (ids[0], ids[2])]
        assert sizes[0] <= 2400 < 6000 < sizes[1] and sizes[0] < 0.3 * sizes[1], sizes


async def test_the_sdk_asks_for_base64_and_gives_floats_back(fleet: Served) -> None:
    async with FleetClient(fleet.base_url, timeout_s=10) as client:
        job_id = await client.submit(fleet.vec, {"text": "sdk"}, encoding_format="base64")
        record = await client.wait(job_id, timeout_s=10)
        assert record.output["embedding"] == vector_of("sdk")
        assert await client.result(job_id) == record.output
        out = await client.infer(fleet.vec, {"texts": ["x", "y"]}, encoding_format="base64")
        assert out["embeddings"] == [vector_of("x"), vector_of("y")]
        assert (await client.run(fleet.vec, {"text": "z"}))["embedding"] == vector_of("z")
    async with FleetClient(fleet.base_url, timeout_s=10, decode_vectors=False) as raw_client:
        kept = (await raw_client.get(job_id)).output["embedding"]
    assert isinstance(kept, str) and decode_vector(kept) == vector_of("sdk")

    def blocking() -> Any:
        with FleetSyncClient(fleet.base_url, timeout_s=10) as sync:
            return sync.infer(fleet.vec, {"text": "sync"}, encoding_format="base64")

    assert (await asyncio.to_thread(blocking))["embedding"] == vector_of("sync")


HOSTILE: list[Any] = [5, None, "BASE64", "b" * 200_000, ["base64"], {"x": 1}]


async def test_bad_encoding_format_gets_a_clear_422_and_the_gateway_keeps_serving(fleet: Served) -> None:
    async with fleet.http() as http:
        for value in HOSTILE:
            body = {"model": fleet.vec, "input": {"text": "x"}, "encoding_format": value}
            response = await http.post("/v1/jobs", json=body)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request" and "encoding_format" in error["message"], error
            assert len(response.content) < 4096  # the 200 KB value is not echoed back
        echo = await http.post("/v1/jobs", json={"model": fleet.echo, "input": {}, "encoding_format": "base64"})
        assert echo.status_code == 422 and echo.json()["error"]["type"] == "invalid_input", echo.text
        assert "has none" in echo.json()["error"]["message"]
        good = await http.post("/v1/infer", json={"model": fleet.echo, "input": {"ok": 1}})
    assert good.status_code == 200 and good.json()["output"] == {"ok": 1}


@pytest.mark.parametrize("pair", PAIRS)
async def test_bad_encoding_format_on_the_wire_is_dead_lettered_and_the_worker_keeps_serving(
    request: pytest.FixtureRequest, pair: str, unique: str
) -> None:
    vec, echo = f"vec-{unique}", f"echo-{unique}"
    settings = settings_for(pair, urls_for(request, pair))
    async with connected_pair(settings) as (broker, store):
        for model in (vec, echo):
            await broker.ensure_model(model)
        bad = {f"w{i}-{unique}": value for i, value in enumerate(HOSTILE)}
        for job_id, value in bad.items():
            body = json.dumps({"job_id": job_id, "model": vec, "input": {"text": "x"}, "encoding_format": value})
            await broker.publish(c.request_subject(vec), body.encode(), msg_id=job_id)
        wrong = f"echo64-{unique}"
        data = request_bytes(echo, wrong, {"a": 1}, encoding_format="base64")
        await broker.publish(c.request_subject(echo), data, msg_id=wrong)
        good = f"good-{unique}"
        data = request_bytes(vec, good, {"text": "ok"}, encoding_format="base64")
        await broker.publish(c.request_subject(vec), data, msg_id=good)
        async with (
            Worker(with_name(VecEmbed, vec)(), broker, store, settings=WORKER_SETTINGS, max_wait_ms=2),
            Worker(with_name(EchoHandler, echo)(), broker, store, settings=WORKER_SETTINGS, max_wait_ms=2),
        ):
            records = await wait_terminal(store, [*bad, wrong, good], timeout_s=30)
            letters = await drain_subject(broker, c.dlq_subject(vec), f"dlq-{unique}", timeout_s=10)
    lettered = {json.loads(d.data)["job_id"] for d in letters}
    assert lettered == set(bad), lettered
    for job_id in bad:
        assert records[job_id].state == JobState.failed, records[job_id]
        error = records[job_id].error
        assert error is not None and error.type == "invalid_request" and "encoding_format" in error.message
        assert len(error.message) < 1000
    wrong_error = records[wrong].error
    assert records[wrong].state == JobState.failed and wrong_error is not None and "has none" in wrong_error.message
    assert decode_vector(records[good].output["embedding"]) == vector_of("ok")


# -- result caches: one entry answers both encodings ------------------------------------------------------------
@pytest.mark.parametrize("pair", ["memory", "nats+redis"])
async def test_a_cached_answer_comes_back_in_the_encoding_asked_for(
    request: pytest.FixtureRequest, pair: str, unique: str
) -> None:
    vec = f"vec-{unique}"
    async with serve(request, pair, unique, cache={vec: ["l1", "l2"]}) as fleet, fleet.http() as http:

        async def answer(text: str, encoding: str | None) -> dict[str, Any]:
            body: dict[str, Any] = {"model": vec, "input": {"text": text}}
            if encoding is not None:
                body["encoding_format"] = encoding
            response = await http.post("/v1/infer", json=body)
            assert response.status_code == 200, response.text
            result: dict[str, Any] = response.json()
            return result

        filled_float = await answer("one", None)  # computed, then filled (floats)
        filled_b64 = await answer("two", "base64")  # computed, then filled (base64)
        assert filled_float["cache"] is None and filled_b64["cache"] is None
        await asyncio.sleep(0.2)  # the gateway fills right after the terminal notice
        hits = {
            ("one", "base64"): await answer("one", "base64"),
            ("one", "float"): await answer("one", "float"),
            ("two", "float"): await answer("two", None),
            ("two", "base64"): await answer("two", "base64"),
        }
        app = create_app(fleet.settings, broker=fleet.broker, store=fleet.store, limits=FAST_LIMITS)
        async with served(app) as second, httpx.AsyncClient(base_url=second, timeout=15) as http2:
            l2 = await http2.post(
                "/v1/infer", json={"model": vec, "input": {"text": "one"}, "encoding_format": "base64"}
            )
    assert {key: hit["cache"] for key, hit in hits.items()} == dict.fromkeys(hits, "l1")
    for (text, encoding), hit in hits.items():
        vector = hit["output"]["embedding"]
        if encoding == "base64":
            assert isinstance(vector, str) and openai_decode(vector) == vector_of(text), (text, encoding)
        else:
            assert vector == vector_of(text), (text, encoding)
    assert l2.status_code == 200 and l2.json()["cache"] == "l2", l2.text
    assert openai_decode(l2.json()["output"]["embedding"]) == vector_of("one")


@pytest.mark.parametrize(("model", "value", "named"), [("echo", "base64", "has none"), ("embed", "b" * 5000, "float")])
@pytest.mark.services
def test_fleet_publish_refuses_a_bad_encoding_format_in_one_line(model: str, value: str, named: str) -> None:
    argv = ["publish", "-", "--model", model, "--broker", "nats://127.0.0.1:1", "--encoding-format", value]
    result = run_fleet(*argv, stdin='{"text": "x"}\n', timeout_s=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and named in result.stderr and len(result.stderr) < 2000, result.stderr
