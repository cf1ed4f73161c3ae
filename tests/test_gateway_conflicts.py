"""``job_id`` reuse: the same model and input (key order aside) is idempotent, anything else is 409."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fleet.schemas.jobs import input_digest
from tests.gateway_helpers import error_of
from tests.test_gateway import Env, open_env


@pytest.fixture(params=["memory", "nats+redis"])
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    async with open_env(request, request.param, unique) as e:
        yield e


def test_the_digest_ignores_key_order_and_sees_every_value() -> None:
    assert input_digest({"a": 1, "b": {"x": [1, 2], "y": "é"}}) == input_digest({"b": {"y": "é", "x": [1, 2]}, "a": 1})
    assert input_digest({"a": 1}) != input_digest({"a": 2})
    assert input_digest({"a": [1, 2]}) != input_digest({"a": [2, 1]})
    assert len(input_digest({})) == 64


async def test_same_input_in_another_key_order_is_the_same_job(env: Env, unique: str) -> None:
    job_id = f"same-{unique}"
    first = await env.submit(model=env.echo, input={"a": 1, "b": {"c": [1, 2], "d": "x"}}, job_id=job_id)
    again = await env.client.post(
        "/v1/jobs",
        content=f'{{"job_id": "{job_id}", "input": {{"b": {{"d": "x", "c": [1, 2]}}, "a": 1}}, "model": "{env.echo}"}}',
        headers={"content-type": "application/json"},
    )
    assert first.status_code == again.status_code == 202, again.text
    assert again.json() == {"job_id": job_id, "status": "queued"}
    record = await env.store.get(job_id)
    assert record is not None and record.input_digest == input_digest({"a": 1, "b": {"c": [1, 2], "d": "x"}})


async def test_another_input_under_the_same_id_is_409_naming_the_job(env: Env, unique: str) -> None:
    job_id = f"other-input-{unique}"
    assert (await env.submit(model=env.echo, input={"n": 1}, job_id=job_id)).status_code == 202
    conflict = await env.submit(model=env.echo, input={"n": 2}, job_id=job_id)
    assert conflict.status_code == 409, conflict.text
    error = error_of(conflict)
    assert error["type"] == "job_id_conflict" and job_id in error["message"]
    assert error["details"] == {"job_id": job_id}, "nothing of the job that holds the id"
    record = await env.store.get(job_id)
    assert record is not None and record.input_digest == input_digest({"n": 1}), "the first job is left as it was"


async def test_another_model_under_the_same_id_is_409(env: Env, unique: str) -> None:
    job_id = f"other-model-{unique}"
    assert (await env.submit(model=env.echo, input={}, job_id=job_id)).status_code == 202
    conflict = await env.submit(model=env.sleep, input={}, job_id=job_id)
    assert conflict.status_code == 409
    error = error_of(conflict)
    assert error["type"] == "job_id_conflict" and job_id in error["message"]
    assert env.echo not in error["message"] and error["details"] == {"job_id": job_id}


async def test_a_record_without_digest_accepts_a_resubmit(env: Env, unique: str) -> None:
    """A job published straight to the topic has a record the worker wrote, with no digest to compare."""
    job_id = f"direct-{unique}"
    await env.store.start(job_id, model=env.echo, worker_id="w", deliveries=1)
    again = await env.submit(model=env.echo, input={"any": "thing"}, job_id=job_id)
    assert again.status_code == 202 and again.json()["status"] == "running"


async def test_a_body_nested_too_deeply_is_400(env: Env) -> None:
    nested = "[" * 100_000 + "1" + "]" * 100_000
    deep = f'{{"model": "{env.echo}", "input": {{"a": {nested}}}}}'
    response = await env.client.post("/v1/jobs", content=deep, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "malformed_json" and "nests arrays and objects more than 100 levels" in error["message"]
    assert error["details"] == {"limit": 100}
