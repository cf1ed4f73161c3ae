"""The client SDK against a real gateway (uvicorn on a free port) over real brokers and stores."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fleet.errors import (
    BrokerUnavailable,
    FleetError,
    InvalidInput,
    JobNotFound,
    PayloadTooLarge,
    StoreError,
    UnknownModel,
)
from fleet.producers.gateway import create_app
from fleet.producers.sdk import FleetClient, GatewayError, GatewayUnreachable, JobFailed, error_from_response
from fleet.schemas.jobs import JobState
from fleet.settings import FleetSettings
from tests import services
from tests.gateway_helpers import EchoSleepGateway, echo_sleep_gateway, model_refs
from tests.infra import PAIRS


class Gateway(EchoSleepGateway):
    def client(self, **kwargs: Any) -> FleetClient:
        return FleetClient(self.base_url, timeout_s=10, **kwargs)


@contextlib.asynccontextmanager
async def open_gateway(request: pytest.FixtureRequest, pair: str, unique: str) -> AsyncIterator[Gateway]:
    async with echo_sleep_gateway(request, pair, unique) as g:
        yield Gateway(g.base_url, g.broker, g.store, g.echo, g.sleep)


@pytest.fixture(params=PAIRS)
async def gateway(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Gateway]:
    async with open_gateway(request, request.param, unique) as g:
        yield g


@pytest.fixture
async def mgateway(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Gateway]:
    async with open_gateway(request, "memory", unique) as g:
        yield g


# -- round trips over every pair ------------------------------------------------------------------------------
async def test_submit_wait_and_result_round_trip(gateway: Gateway, unique: str) -> None:
    async with gateway.client() as fleet, gateway.worker():
        job_id = await fleet.submit(gateway.echo, {"hello": "world"}, job_id=f"sdk-{unique}", timeout_s=60)
        assert job_id == f"sdk-{unique}"
        record = await fleet.wait(job_id, timeout_s=10)
        assert record.state == JobState.succeeded and record.output == {"hello": "world"}
        assert await fleet.result(job_id) == {"hello": "world"}
        assert await fleet.run(gateway.echo, {"n": 2}) == {"n": 2}
        assert (await fleet.get(job_id)).finished_at is not None


async def test_subscribe_yields_each_terminal_record_once(gateway: Gateway) -> None:
    async with gateway.client() as fleet:
        ids = [await fleet.submit(gateway.echo, {"i": i}) for i in range(4)]
        got = []
        async with gateway.worker():
            async for record in fleet.subscribe([*ids, ids[0]], timeout_s=15):
                got.append(record)
    assert sorted(r.job_id for r in got) == sorted(ids)
    assert {r.job_id: r.output["i"] for r in got} == {job_id: i for i, job_id in enumerate(ids)}


# -- errors and timeouts (in-memory pair) ---------------------------------------------------------------------
async def test_http_errors_become_fleet_errors_with_the_server_message(mgateway: Gateway) -> None:
    async with mgateway.client() as fleet:
        with pytest.raises(UnknownModel) as unknown:
            await fleet.submit("nope", {})
        assert unknown.value.known == sorted([mgateway.echo, mgateway.sleep]) and "nope" in unknown.value.message
        with pytest.raises(InvalidInput) as invalid:
            await fleet.submit(mgateway.sleep, {"mean_ms": "slow"})
        assert "input.mean_ms" in invalid.value.message and invalid.value.errors[0]["loc"] == "input.mean_ms"
        with pytest.raises(PayloadTooLarge) as large:
            await fleet.submit(mgateway.echo, {"pad": "x" * 5000})
        assert large.value.limit == 4096 and large.value.size > 4096 and "4096" in str(large.value)
        with pytest.raises(JobNotFound) as missing:
            await fleet.get("missing-job")
        assert missing.value.job_id == "missing-job" and "missing-job" in str(missing.value)


async def test_wait_times_out_and_result_raises_job_failed(mgateway: Gateway) -> None:
    async with mgateway.client() as fleet:
        job_id = await fleet.submit(mgateway.echo, {})
        with pytest.raises(TimeoutError, match="still queued"):
            await fleet.wait(job_id, timeout_s=0.3)
        cancelled = await fleet.cancel(job_id)
        assert cancelled.state == JobState.cancelled
        with pytest.raises(JobFailed) as failed:
            await fleet.result(job_id, timeout_s=5)
        assert failed.value.record.state == JobState.cancelled and "cancelled" in failed.value.message
        with pytest.raises(GatewayError) as conflict:
            await fleet.cancel(job_id)
        assert conflict.value.status == 409 and conflict.value.type == "job_terminal"


async def test_subscribe_unknown_job_and_timeout(mgateway: Gateway) -> None:
    async with mgateway.client() as fleet:
        with pytest.raises(JobNotFound):
            async for _ in fleet.subscribe(["never-submitted"], timeout_s=5):
                pass
        job_id = await fleet.submit(mgateway.echo, {})
        with pytest.raises(TimeoutError, match="1 job"):
            async for _ in fleet.subscribe([job_id], timeout_s=0.3):
                pass


async def test_models_and_in_process_transport(mgateway: Gateway, unique: str) -> None:
    async with mgateway.client() as fleet:
        names = [m["name"] for m in await fleet.models()]
    assert sorted(names) == sorted([mgateway.echo, mgateway.sleep])
    refs, (echo,) = model_refs(unique, "echo")
    app = create_app(FleetSettings.model_validate({"models": refs}))
    async with app.router.lifespan_context(app):
        async with FleetClient("http://in-process", transport=httpx.ASGITransport(app=app)) as fleet:
            job_id = await fleet.submit(echo, {"a": 1})
            assert (await fleet.get(job_id)).state == JobState.queued


async def test_an_unreachable_gateway_is_a_retriable_error() -> None:
    async with FleetClient(f"http://127.0.0.1:{services.free_port()}", timeout_s=2) as fleet:
        with pytest.raises(GatewayUnreachable) as unreachable:
            await fleet.submit("echo", {})
    assert unreachable.value.retriable


@pytest.mark.parametrize(
    ("status", "error", "exc_type"),
    [
        (503, {"type": "broker_unavailable", "message": "broker down", "details": None}, BrokerUnavailable),
        (503, {"type": "store_unavailable", "message": "store down", "details": None}, StoreError),
        (400, {"type": "malformed_json", "message": "not JSON", "details": None}, InvalidInput),
        (500, {"type": "internal_error", "message": "bug", "details": None}, GatewayError),
    ],
)
def test_error_types_map_to_exceptions(status: int, error: dict[str, Any], exc_type: type[FleetError]) -> None:
    exc = error_from_response(status, {"error": error})
    assert type(exc) is exc_type and exc.message == error["message"] and str(exc) == error["message"]
    assert exc.retriable == (status >= 500)


async def test_wait_long_polls_in_steps_until_the_job_ends(mgateway: Gateway) -> None:
    async with mgateway.client(long_poll_s=0.2) as fleet:
        job_id = await fleet.submit(mgateway.echo, {"slow": True})

        async def finish_later() -> None:
            await asyncio.sleep(0.5)
            async with mgateway.worker() as worker:
                await worker.handled()

        finisher = asyncio.create_task(finish_later())
        record = await fleet.wait(job_id, timeout_s=10)
        await finisher
    assert record.state == JobState.succeeded
