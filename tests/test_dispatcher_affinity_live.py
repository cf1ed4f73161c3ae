"""Affinity routing live, on NATS JetStream + Redis with a real dispatcher and real workers: each request goes to
the worker that announces its model version loaded; a version loaded nowhere makes one cold load, and the next
request for it follows the first to the worker now loading it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.dispatcher.policies import make_policy
from fleet.dispatcher.service import Dispatcher
from fleet.schemas.jobs import JobState
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items
from tests.infra import connected_pair, eventually, request_bytes, settings_for, wait_terminal
from tests.test_dispatcher import running


class AnnouncingWorker(Worker):
    """A dispatch-routing worker whose heartbeats name ``announced`` as its loaded versions (what a multi-model
    worker reports); everything else is the real worker."""

    def __init__(self, *args: Any, announced: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.announced = announced

    def heartbeat(self) -> Heartbeat:
        return super().heartbeat().model_copy(update={"loaded": self.announced})


@pytest.fixture
async def infra(nats_url: str, redis_url: str) -> AsyncIterator[tuple[Broker, ResultStore, FleetSettings]]:
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url}, affinity_wait_s=30.0)
    async with connected_pair(settings) as (broker, store):
        yield broker, store, settings


def announcing(infra: tuple[Broker, ResultStore, FleetSettings], model: str, announced: list[str]) -> Worker:
    broker, store, settings = infra
    handler = with_name(Items, model)()
    return AnnouncingWorker(
        handler, broker, store, settings=settings, routing="dispatch", max_batch=1, max_wait_ms=0, announced=announced
    )


async def publish(broker: Broker, model: str, job_id: str, version: str, *, in_header: bool) -> str:
    """A request for ``version``, named in the ``fleet-version`` header or only in the body."""
    if in_header:
        data = request_bytes(model, job_id, {"value": 1, "sleep_ms": 40})
        headers = {c.HEADER_VERSION: version}
    else:
        data, headers = request_bytes(model, job_id, {"value": 1, "sleep_ms": 40}, version=version), {}
    await broker.publish(c.request_subject(model), data, msg_id=job_id, headers=headers)
    return job_id


async def test_requests_go_to_the_worker_with_their_version_warm_and_a_cold_load_happens_once(infra, unique) -> None:
    broker, store, settings = infra
    model = f"aff-{unique}"
    one, two, empty = (announcing(infra, model, v) for v in (["1"], ["2"], []))
    dispatcher = Dispatcher(broker, store, model=model, settings=settings, policy=make_policy("jiq-amnesia"))
    async with running(dispatcher, one, two, empty):

        async def reported() -> bool:
            return dispatcher.loaded.is_warm(one.worker_id, "1") and dispatcher.loaded.is_warm(two.worker_id, "2")

        await eventually(reported, timeout_s=20, what="loaded versions from the heartbeats")
        await broker.ensure_model(model)
        # A burst: more jobs per version than one worker runs at once, so they queue at the warm worker
        # (within the 30 s budget) rather than spill over to the idle ones.
        ids = {
            version: [
                await publish(broker, model, f"{unique}-v{version}-{i}", version, in_header=version == "1")
                for i in range(10)
            ]
            for version in ("1", "2")
        }
        records = await wait_terminal(store, ids["1"] + ids["2"], timeout_s=60)
        assert {records[j].worker_id for j in ids["1"]} == {one.worker_id}, "version 1 (in the header) stayed warm"
        assert {records[j].worker_id for j in ids["2"]} == {two.worker_id}, "version 2 (in the body) stayed warm"
        assert dispatcher.cold_assignments == 0
        assert dispatcher.routes.get("warm", 0) > 0, dispatcher.routes

        first = await publish(broker, model, f"{unique}-v3-a", "3", in_header=True)
        cold = (await wait_terminal(store, [first], timeout_s=30))[first]
        assert cold.state is JobState.succeeded and dispatcher.cold_assignments == 1
        assert dispatcher.loaded.is_warm(cold.worker_id, "3"), "the worker is loading version 3"
        second = await publish(broker, model, f"{unique}-v3-b", "3", in_header=True)
        warm = (await wait_terminal(store, [second], timeout_s=30))[second]
        assert warm.worker_id == cold.worker_id and dispatcher.cold_assignments == 1, "one load, not two"
        status = dispatcher.status()
    assert status["cold_assignments"] == 1
    by_worker = {w["worker_id"]: w["loaded"] for w in status["workers"]}
    assert by_worker[one.worker_id][:1] == ["1"] and "3" in by_worker[cold.worker_id]
