"""``POST /v1/infer`` (one request: submit and wait) and the SDK's ``infer`` and synchronous client, against a real
gateway (uvicorn on a free port) over real brokers and stores."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.errors import InvalidInput, UnknownModel
from fleet.producers.sdk import FleetClient, InferTimeout, JobFailed
from fleet.producers.sdk_sync import FleetSyncClient
from fleet.schemas.jobs import JobError, JobState
from fleet.store.base import ResultStore
from tests.gateway_helpers import WORKER_SETTINGS, EchoSleepGateway, echo_sleep_gateway, error_of
from tests.handlers_for_tests import Items
from tests.infra import PAIRS, eventually

Gateway = EchoSleepGateway
open_gateway = echo_sleep_gateway


@pytest.fixture(params=PAIRS)
async def gateway(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Gateway]:
    async with open_gateway(request, request.param, unique) as g:
        yield g


@pytest.fixture
async def mgateway(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Gateway]:
    async with open_gateway(request, "memory", unique) as g:
        yield g


async def test_infer_answers_the_output_in_one_request(gateway: Gateway, unique: str) -> None:
    body = {"model": gateway.echo, "input": {"hello": "world"}, "job_id": f"inf-{unique}"}
    async with gateway.http() as http, gateway.worker():
        response = await http.post("/v1/infer", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["job_id"] == f"inf-{unique}" and answer["model"] == gateway.echo
        assert answer["output"] == {"hello": "world"} and answer["worker_id"]
        assert answer["finished_at"] >= answer["started_at"]
        record = (await http.get(f"/v1/jobs/inf-{unique}")).json()  # an ordinary job, with a record
        assert record["state"] == "succeeded" and record["output"] == {"hello": "world"}
        again = await http.post("/v1/infer", json=body)  # the same id again: the same job, not a second one
        assert again.status_code == 200 and again.json() == answer


async def test_infer_answers_504_with_the_job_id_when_the_wait_ends_first_and_the_job_goes_on(
    gateway: Gateway,
) -> None:
    async with gateway.http() as http:
        response = await http.post("/v1/infer", params={"wait": "0.3"}, json={"model": gateway.echo, "input": {"n": 1}})
        assert response.status_code == 504, response.text
        error = error_of(response)
        job_id = error["details"]["job_id"]
        assert error["type"] == "infer_timeout" and error["details"]["state"] == "queued"
        assert job_id in error["message"] and response.headers["location"] == f"/v1/jobs/{job_id}"
        async with gateway.worker():
            record = (await http.get(f"/v1/jobs/{job_id}", params={"wait": "10"})).json()
        assert record["state"] == "succeeded" and record["output"] == {"n": 1}


async def test_infer_refuses_bad_requests_as_submit_does(mgateway: Gateway) -> None:
    async with mgateway.http() as http:
        unknown = await http.post("/v1/infer", json={"model": "nope", "input": {}})
        assert unknown.status_code == 404 and error_of(unknown)["type"] == "unknown_model"
        invalid = await http.post("/v1/infer", json={"model": mgateway.sleep, "input": {"mean_ms": "slow"}})
        assert invalid.status_code == 422 and "input.mean_ms" in error_of(invalid)["message"]
        malformed = await http.post("/v1/infer", content=b'{"model": ', headers={"content-type": "application/json"})
        assert malformed.status_code == 400 and error_of(malformed)["type"] == "malformed_json"
        large = await http.post("/v1/infer", json={"model": mgateway.echo, "input": {"pad": "x" * 5000}})
        assert large.status_code == 413 and error_of(large)["type"] == "payload_too_large"
        for wait in ("0", "-1", "61", "soon"):
            bad_wait = await http.post("/v1/infer", params={"wait": wait}, json={"model": mgateway.echo, "input": {}})
            assert bad_wait.status_code == 422, (wait, bad_wait.text)
            assert "wait" in error_of(bad_wait)["message"]
        assert (await http.get("/healthz")).status_code == 200  # and it keeps serving


async def _exists(store: ResultStore, job_id: str) -> bool:
    return await store.get(job_id) is not None


@pytest.mark.parametrize(
    ("state", "error_type", "status", "answer_type"),
    [
        (JobState.failed, "model_error", 500, "job_failed"),
        (JobState.failed, "invalid_input", 422, "invalid_input"),
        (JobState.cancelled, "cancelled", 409, "job_cancelled"),
        (JobState.expired, "expired", 504, "job_expired"),
    ],
)
async def test_infer_answers_a_job_that_ended_without_output_with_its_record(
    mgateway: Gateway, unique: str, state: JobState, error_type: str, status: int, answer_type: str
) -> None:
    job_id = f"end-{unique}"
    async with mgateway.http() as http:
        body = {"model": mgateway.echo, "input": {}, "job_id": job_id}
        pending = asyncio.create_task(http.post("/v1/infer", json=body))
        await eventually(lambda: _exists(mgateway.store, job_id), what="the job's record")
        error = JobError(type=error_type, message=f"the {error_type} reason")
        await mgateway.store.finish(job_id, state, model=mgateway.echo, error=error)  # as a worker or a cancel does
        response = await pending
    assert response.status_code == status, response.text
    answer = error_of(response)
    assert answer["type"] == answer_type and f"the {error_type} reason" in answer["message"]
    assert answer["details"]["job_id"] == job_id and answer["details"]["record"]["state"] == state.value


async def test_a_model_that_fails_on_the_input_is_a_500_with_the_model_error(mgateway: Gateway) -> None:
    failing = with_name(Items, mgateway.echo)()  # the echo model's name, served by a handler that fails "bad" items
    worker = Worker(failing, mgateway.broker, mgateway.store, settings=WORKER_SETTINGS, worker_id="w-fail")
    await worker.start()
    try:
        async with mgateway.http() as http:
            response = await http.post("/v1/infer", json={"model": mgateway.echo, "input": {"value": 1, "bad": True}})
            good = await http.post("/v1/infer", json={"model": mgateway.echo, "input": {"value": 4}})
    finally:
        await worker.stop()
    assert response.status_code == 500, response.text
    error = error_of(response)
    assert error["type"] == "job_failed" and "item 1 is bad" in error["message"]
    assert error["details"]["record"]["error"]["type"] == "model_error"
    assert good.status_code == 200 and good.json()["output"] == {"value": 8, "batch_size": 1}


# -- the SDK ----------------------------------------------------------------------------------------------------
async def test_sdk_infer_returns_the_output_and_raises_for_the_other_ends(gateway: Gateway) -> None:
    async with FleetClient(gateway.base_url, timeout_s=10) as fleet:
        with pytest.raises(InferTimeout) as late:
            await fleet.infer(gateway.echo, {"late": True}, wait_s=0.3)
        assert late.value.job_id and late.value.state == "queued" and late.value.retriable
        async with gateway.worker():
            assert await fleet.infer(gateway.echo, {"x": [1, 2]}) == {"x": [1, 2]}
            assert (await fleet.wait(late.value.job_id, timeout_s=10)).output == {"late": True}
        with pytest.raises(UnknownModel):
            await fleet.infer("nope", {})
        job_id = await fleet.submit(gateway.echo, {}, job_id="sdk-cancelled-" + gateway.echo)
        await fleet.cancel(job_id)
        with pytest.raises(JobFailed) as cancelled:
            await fleet.infer(gateway.echo, {}, job_id=job_id)
        assert cancelled.value.record.state == JobState.cancelled


async def test_the_sync_client_works_from_plain_threads(gateway: Gateway) -> None:
    def use_it() -> tuple[object, ...]:
        with FleetSyncClient(gateway.base_url, timeout_s=10) as fleet:
            output = fleet.infer(gateway.echo, {"sync": 1})
            ids = [fleet.submit(gateway.echo, {"i": i}) for i in range(3)]
            ended = sorted(record.output["i"] for record in fleet.subscribe(ids, timeout_s=10))
            waited = fleet.wait(ids[0], timeout_s=10)
            names = sorted(m["name"] for m in fleet.models())
            with pytest.raises(InvalidInput):
                fleet.infer(gateway.sleep, {"mean_ms": "slow"})
        with pytest.raises(RuntimeError, match="closed"):
            fleet.get(ids[0])
        return output, ended, waited.state, names

    async with gateway.worker():
        output, ended, waited, names = await asyncio.to_thread(use_it)
    assert output == {"sync": 1} and ended == [0, 1, 2] and waited == JobState.succeeded
    assert names == sorted([gateway.echo, gateway.sleep])
