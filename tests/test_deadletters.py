"""Dead letters as an operator relies on them: the gateway's recorder stores each letter of ``fleet.dlq.<model>``
once (memory and NATS + Redis), ``GET /v1/deadletters`` lists them, a redriven letter's job runs again and ends
once (succeeded, one run counted), raw letters are purgeable but not redrivable, and hostile bodies get 4xx. The
dead-letter store's contract runs on Redis and in memory."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from fleet import constants as c
from fleet.consumers.handlers import with_name
from fleet.consumers.requests import Job
from fleet.consumers.worker import Worker
from fleet.dispatcher.service import Dispatcher
from fleet.errors import ModelError
from fleet.producers.gateway import create_app
from fleet.schemas.jobs import JobError, JobRecord
from fleet.schemas.operator import MAX_LETTER_IDS
from fleet.schemas.wire import DeadLetter
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.deadletters import StoredLetter
from tests.gateway_helpers import FAST_LIMITS, error_of, urls_for
from tests.handlers_for_tests import ItemIn, ItemOut, Items
from tests.infra import connected_pair, eventually, settings_for

PAIRS = ["memory", "nats+redis", "kafka+redis"]
WORKER_SETTINGS = FleetSettings.model_validate({"ack_wait_s": 5, "heartbeat_interval_s": 0.5, "drain_timeout_s": 5})


class Repairable(Items):
    """``Items`` that fails every item for good while ``broken`` (class-wide, so the test can repair it)."""

    broken: ClassVar[bool] = True

    def predict(self, batch: list[ItemIn]) -> list[ItemOut | Exception]:
        if type(self).broken:
            with self._lock:
                self.calls.append([item.value for item in batch])
            return [ModelError(f"item {item.value}: the model is broken", retriable=False) for item in batch]
        return super().predict(batch)


# -- the store contract -----------------------------------------------------------------------------------------
def letter(model: str, job_id: str | None, at: float, request: dict[str, Any] | None = None) -> DeadLetter:
    return DeadLetter(
        job_id=job_id,
        model=model,
        error=JobError(type="model_error", message="boom"),
        deliveries=1,
        worker_id="w",
        failed_at=at,
        request=request,
        raw=None if request else "garbage",
    )


@pytest.fixture(params=["memory", "redis"])
async def result_store(request: pytest.FixtureRequest) -> AsyncIterator[ResultStore]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else "memory://"
    store = make_store(FleetSettings(store_url=url))
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


async def test_store_adds_once_lists_newest_first_and_takes_once(result_store: ResultStore, unique: str) -> None:
    letters = Stores.beside(result_store).dead_letters
    model, other = f"a-{unique}", f"b-{unique}"
    now = time.time()
    for i in range(4):
        assert await letters.add(f"{unique}-{i}", letter(model, f"j{i}", now + i))
    assert not await letters.add(f"{unique}-0", letter(model, "j0", now))  # redelivered: nothing changes
    assert await letters.add(f"{unique}-x", letter(other, None, now))
    counts = await letters.counts()
    assert (counts[model], counts[other]) == (4, 1)
    assert [s.letter_id for s in await letters.latest(model, 2)] == [f"{unique}-3", f"{unique}-2"]
    assert await letters.ids(model, 10) == [f"{unique}-{i}" for i in (3, 2, 1, 0)]

    first, second = await asyncio.gather(
        letters.take([f"{unique}-1", f"{unique}-2"]), letters.take([f"{unique}-2", f"{unique}-1", "nope"])
    )
    assert sorted(s.letter_id for s in first + second) == [f"{unique}-1", f"{unique}-2"]  # each taken once
    assert (await letters.counts())[model] == 2
    await letters.put_back([StoredLetter(f"{unique}-1", letter(model, "j1", now + 1))])
    assert (await letters.counts())[model] == 3
    taken = await letters.take(await letters.ids(model, 10) + await letters.ids(other, 10))
    assert len(taken) == 4 and model not in await letters.counts()


# -- end to end -------------------------------------------------------------------------------------------------
@dataclass
class Env:
    settings: FleetSettings
    client: httpx.AsyncClient
    store: ResultStore
    broker: Any
    model: str
    handler: Repairable
    settled: list[tuple[str, str]] = field(default_factory=list)  # (job id, terminal state) per settle

    async def letters(self) -> dict[str, Any]:
        response = await self.client.get("/v1/deadletters", params={"model": self.model})
        assert response.status_code == 200, response.text
        return response.json()["models"][self.model]

    async def wait_letters(self, count: int) -> list[dict[str, Any]]:
        async def enough() -> bool:
            return (await self.letters())["count"] >= count

        await eventually(enough, 15, f"{count} dead letters recorded")
        return (await self.letters())["latest"]


@contextlib.asynccontextmanager
async def open_env(request: pytest.FixtureRequest, pair: str, unique: str, routing: str = "pull") -> AsyncIterator[Env]:
    model = f"items-{unique}"
    handler_cls = with_name(Repairable, model)
    handler_cls.broken = True
    settings = settings_for(pair, urls_for(request, pair), models=[f"{__name__}:items_{unique}"])
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=20) as client:
                handler = handler_cls()
                env = Env(settings, client, store, broker, model, handler)

                async def observe(job: Job, record: JobRecord, won: bool) -> None:
                    env.settled.append((job.job_id, record.state.value))

                worker = Worker(
                    handler,
                    broker,
                    store,
                    settings=WORKER_SETTINGS,
                    max_wait_ms=2,
                    on_settled=[observe],
                    routing="dispatch" if routing == "dispatch" else "pull",
                )
                async with contextlib.AsyncExitStack() as stack:
                    if routing == "dispatch":
                        dispatcher = Dispatcher(broker, store, model=model, settings=WORKER_SETTINGS)
                        await stack.enter_async_context(dispatcher)
                    await worker.start()
                    try:
                        yield env
                    finally:
                        await worker.stop()


def __getattr__(name: str) -> Any:
    """``tests.test_deadletters:items_<token>``: the spec of ``Repairable`` as model ``items-<token>``."""
    base, sep, token = name.partition("_")
    if base == "items" and sep:
        return with_name(Repairable, f"items-{token}").spec
    raise AttributeError(name)


@pytest.fixture(params=PAIRS)
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    async with open_env(request, request.param, unique) as e:
        yield e


async def submit(env: Env, value: int) -> str:
    response = await env.client.post("/v1/jobs", json={"model": env.model, "input": {"value": value}})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["job_id"]
    return job_id


async def final(env: Env, job_id: str) -> dict[str, Any]:
    record: dict[str, Any] = (await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 15})).json()
    return record


async def test_a_redriven_letter_runs_again_and_ends_once(env: Env) -> None:
    job_id = await submit(env, 21)
    assert (await final(env, job_id))["state"] == "failed"
    (view,) = await env.wait_letters(1)
    assert (view["job_id"], view["model"], view["redrivable"]) == (job_id, env.model, True)
    assert view["error"]["type"] == "model_error" and "broken" in view["error"]["message"]

    type(env.handler).broken = False
    calls_before = len(env.handler.predicted)
    response = await env.client.post("/v1/deadletters/redrive", json={"letter_ids": [view["letter_id"]]})
    assert response.status_code == 200, response.text
    assert response.json() == {"redriven": [view["letter_id"]], "missing": [], "not_redrivable": {}}

    async def succeeded() -> bool:
        return (await final(env, job_id))["state"] == "succeeded"

    await eventually(succeeded, 15, "the redriven job succeeded")
    record = await final(env, job_id)
    assert record["output"] == {"value": 42, "batch_size": 1}
    assert record["deliveries"] == 1  # a fresh attempt: one run counted
    await asyncio.sleep(1.0)  # nothing runs it a second time
    assert env.handler.predicted[calls_before:] == [21]
    assert [state for jid, state in env.settled if jid == job_id] == ["failed", "succeeded"]
    assert (await env.letters())["count"] == 0
    again = await env.client.post("/v1/deadletters/redrive", json={"letter_ids": [view["letter_id"]]})
    assert again.json() == {"redriven": [], "missing": [view["letter_id"]], "not_redrivable": {}}


@pytest.mark.services
async def test_a_redriven_letter_of_a_dispatched_model_runs_again(request: pytest.FixtureRequest, unique: str) -> None:
    """Behind a dispatcher too: its inbox assignment of the redriven request is not taken for a duplicate of the
    first one (same job, same worker)."""
    async with open_env(request, "nats+redis", unique, routing="dispatch") as env:
        job_id = await submit(env, 8)
        assert (await final(env, job_id))["state"] == "failed"
        (view,) = await env.wait_letters(1)
        type(env.handler).broken = False
        response = await env.client.post("/v1/deadletters/redrive", json={"letter_ids": [view["letter_id"]]})
        assert response.json()["redriven"] == [view["letter_id"]]

        async def succeeded() -> bool:
            return (await final(env, job_id))["state"] == "succeeded"

        await eventually(succeeded, 15, "the redriven job succeeded behind the dispatcher")
        assert (await final(env, job_id))["output"] == {"value": 16, "batch_size": 1}
        assert [state for jid, state in env.settled if jid == job_id] == ["failed", "succeeded"]


async def test_a_job_redriven_that_fails_again_gets_a_new_letter(env: Env) -> None:
    job_id = await submit(env, 5)
    (first,) = await env.wait_letters(1)
    response = await env.client.post("/v1/deadletters/redrive", json={"model": env.model, "all": True})
    assert response.json()["redriven"] == [first["letter_id"]]
    assert (await final(env, job_id))["state"] in ("queued", "running", "failed")
    (second,) = await env.wait_letters(1)  # the broker's de-duplication did not swallow it
    assert second["job_id"] == job_id and second["letter_id"] != first["letter_id"]


async def test_raw_letters_are_not_redrivable_but_purgeable(env: Env) -> None:
    await env.broker.publish(c.request_subject(env.model), b"\xffnot a request", msg_id=f"raw-{env.model}")
    (view,) = await env.wait_letters(1)
    assert view["redrivable"] is False
    response = await env.client.post("/v1/deadletters/redrive", json={"letter_ids": [view["letter_id"]]})
    body = response.json()
    assert body["redriven"] == [] and "raw" in body["not_redrivable"][view["letter_id"]]
    assert (await env.letters())["count"] == 1  # still there
    purged = await env.client.post("/v1/deadletters/purge", json={"letter_ids": [view["letter_id"], "unknown"]})
    assert purged.json() == {"purged": [view["letter_id"]], "missing": ["unknown"]}
    assert (await env.letters())["count"] == 0


async def test_garbage_on_the_dead_letter_subject_is_recorded_as_unreadable_and_recording_goes_on(env: Env) -> None:
    subject = c.dlq_subject(env.model)
    junk = [b"\xffnot json", b"[" * 100_000, b'{"job_id": 5, "model": []}', b'{"error": "x" }' + b" " * 200_000]
    for n, body in enumerate(junk):
        await env.broker.publish(subject, body, msg_id=f"junk-{env.model}-{n}")
    job_id = await submit(env, 3)  # a real letter after the garbage
    views = await env.wait_letters(len(junk) + 1)
    unreadable = [v for v in views if v["error"]["type"] == "unreadable_letter"]
    assert len(unreadable) == len(junk) and all(not v["redrivable"] for v in unreadable)
    assert [v["job_id"] for v in views if v["error"]["type"] == "model_error"] == [job_id]


async def test_purge_all_of_a_model(env: Env) -> None:
    ids = [await submit(env, v) for v in (1, 2, 3)]
    await env.wait_letters(3)
    response = await env.client.post("/v1/deadletters/purge", json={"model": env.model, "all": True})
    assert len(response.json()["purged"]) == 3
    assert (await env.letters())["count"] == 0
    assert [(await final(env, j))["state"] for j in ids] == ["failed"] * 3  # the records stay as they were


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 422),
        ({"letter_ids": "abc"}, 422),
        ({"letter_ids": [1, 2]}, 422),
        ({"letter_ids": ["a"], "model": "x", "all": True}, 422),
        ({"model": "x"}, 422),
        ({"all": True}, 422),
        ({"letter_ids": ["a"] * (MAX_LETTER_IDS + 1)}, 422),
        ({"letter_ids": ["a"], "surprise": 1}, 422),
        ([], 422),
        ({"model": "not-served", "all": True}, 404),
    ],
)
async def test_hostile_bodies(env: Env, body: object, status: int) -> None:
    for path in ("/v1/deadletters/redrive", "/v1/deadletters/purge"):
        response = await env.client.post(path, json=body)
        assert response.status_code == status, response.text
        assert error_of(response)["type"] in ("invalid_request", "unknown_model")


async def test_malformed_json_and_bad_queries(env: Env) -> None:
    response = await env.client.post(
        "/v1/deadletters/redrive", content=b'{"letter_ids": [', headers={"content-type": "application/json"}
    )
    assert 400 <= response.status_code < 500 and error_of(response)["type"] in ("malformed_json", "invalid_request")
    for params in ({"limit": 0}, {"limit": "ten"}, {"limit": 100_000}):
        assert (await env.client.get("/v1/deadletters", params=params)).status_code == 422
    assert (await env.client.get("/v1/deadletters", params={"model": "nope"})).status_code == 404


@given(ids=st.lists(st.text(max_size=40), max_size=30))
@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_unknown_ids_are_missing_never_an_error(env: Env, ids: list[str]) -> None:
    response = await env.client.post("/v1/deadletters/purge", json={"letter_ids": ids})
    assert response.status_code == 200
    assert response.json() == {"purged": [], "missing": list(dict.fromkeys(ids))}


async def test_dead_letter_routes_need_the_operator(request: pytest.FixtureRequest, unique: str) -> None:
    settings = FleetSettings(models=[f"{__name__}:items_{unique}"], operator_token="tok")
    app = create_app(settings, limits=FAST_LIMITS)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
            assert (await client.get("/v1/deadletters")).status_code == 401
            for path in ("/v1/deadletters/redrive", "/v1/deadletters/purge"):
                assert (await client.post(path, json={"letter_ids": ["a"]})).status_code == 401
            ok = await client.get("/v1/deadletters", headers={"Authorization": "Bearer tok"})
            assert ok.status_code == 200 and ok.json() == {"models": {}}
