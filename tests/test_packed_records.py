"""Packed job records (``fleet.store.packed``): base64 vectors kept as their bytes in the store, read back as the
same text, and a damaged packed value answered with a clear error, never with another exception."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet import constants as c
from fleet.encoding import Base64Vector, encode_vector
from fleet.errors import StoreError
from fleet.schemas.jobs import JobRecord, JobState
from fleet.store import transitions
from fleet.store.packed import parse_record
from fleet.store.redis import RedisStore


def done(output: object) -> JobRecord:
    return transitions.finished(
        None, "job-1", JobState.succeeded, model="embed", output=output, error=None, worker_id="w", now=1.5
    )


def test_an_embed_record_of_384_floats_is_under_2_2_kb_and_reads_back_exactly() -> None:
    vector = encode_vector(np.linspace(-1, 1, 384, dtype=np.float32))
    record = transitions.finished(
        None,
        uuid.uuid4().hex,
        JobState.succeeded,
        model="embed",
        output={"dim": 384, "embedding": vector, "embeddings": None},
        error=None,
        worker_id=f"embed-{uuid.uuid4().hex[:6]}-host-12345-abcdef",
        now=1796214244.7350543,
    )
    raw = transitions.record_json(record)
    assert raw[:1] == b"\x00" and len(raw) <= 2200, len(raw)
    back = parse_record(raw)
    assert back == record and back.output["embedding"] == vector and back.model_dump() == record.model_dump()


def test_only_vectors_fleet_encoded_are_packed() -> None:
    text = str(encode_vector([1.0, 2.0]))  # the same base64, but as a client or a cache would hand it over
    bare = Base64Vector(text)  # made without its bytes
    for output in ({"embedding": text}, {"embedding": bare}, {"embeddings": [encode_vector([1.0]), text]}, [text]):
        raw = transitions.record_json(done(output))
        assert raw[:1] == b"{" and parse_record(raw).output == output


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"\x00{}", "without the NUL"),
        (b"\x00{not json\x00", "does not parse"),
        (b"\x00[]\x00", "'output' object and a 'packed' list"),
        (b'\x00{"output":{},"packed":[["embedding"]]}\x00', "must be [field, length]"),
        (b'\x00{"output":{},"packed":[["embedding","4"]]}\x00abcd', "an integer or a list"),
        (b'\x00{"output":{},"packed":[["embedding",[true]]]}\x00abcd', "must be integers"),
        (b'\x00{"output":{},"packed":[["embedding",8]]}\x00abcd', "runs past"),
        (b'\x00{"output":{},"packed":[["embedding",-1]]}\x00abcd', "runs past"),
        (b'\x00{"output":{},"packed":[["embedding",2]]}\x00abcd', "holds 4 bytes of vectors, its layout says 2"),
        (b'\x00{"output":{"embedding":null},"packed":[]}\x00', "job_id"),  # not a record: pydantic says what lacks
    ],
)
def test_a_damaged_packed_record_raises_a_value_error_that_says_what_is_wrong(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_record(raw)
    assert says in str(caught.value)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_LAYOUT = st.lists(st.lists(st.text(max_size=10) | st.integers(-4, 40) | st.lists(st.integers(-4, 40)), max_size=3))
_HEAD = _JSON | st.fixed_dictionaries(
    {"job_id": st.just("j"), "model": st.just("m"), "state": st.sampled_from(["succeeded", "nope"])},
    optional={"output": st.dictionaries(st.text(max_size=10), _JSON, max_size=3), "packed": _LAYOUT},
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=_HEAD, tail=st.binary(max_size=64))
def test_garbage_after_the_mark_is_a_value_error_or_a_record(head: object, tail: bytes) -> None:
    for raw in (b"\x00" + json.dumps(head).encode() + b"\x00" + tail, b"\x00" + tail):
        try:
            assert isinstance(parse_record(raw), JobRecord)
        except ValueError as exc:
            assert str(exc)  # says something


async def test_a_damaged_packed_record_in_redis_is_a_store_error_naming_the_job(redis_url: str) -> None:
    store = RedisStore(redis_url, job_ttl_s=60)
    await store.connect()
    job_id = f"packed-{uuid.uuid4().hex}"
    try:
        await store.redis.set(c.job_key(job_id), b'\x00{"output":{},"packed":[["embedding",8]]}\x00abcd', ex=60)
        with pytest.raises(StoreError, match=f"record of job '{job_id}'.*runs past") as caught:
            await store.get(job_id)
        assert not caught.value.retriable
        assert await store.get("another-" + job_id) is None  # the store keeps serving
    finally:
        await store.close()
