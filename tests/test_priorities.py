"""Priorities that order work: the weighting table, the names and integers on every entry point, and high jobs
overtaking a low backlog on the in-memory broker, NATS JetStream and Kafka (with Redis), pulled by workers and
assigned by a dispatcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.brokers.memory import MemoryBroker
from fleet.brokers.prioritized import PrioritySubscription, subscribe_priorities
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.worker import Worker
from fleet.dispatcher.service import Dispatcher
from fleet.errors import BrokerUnavailable, InvalidInput
from fleet.lag import read_lag, read_lag_by_priority
from fleet.priorities import check_weights, priority_of_subject, serve_cycle, serve_order
from fleet.producers.gateway.calls import message_priority
from fleet.producers.gateway.jobs.reconcile import Reconciler
from fleet.producers.publish import check_priority, prepare
from fleet.producers.sdk import FleetClient
from fleet.schemas.api import SubmitRequest
from fleet.schemas.export import all_schemas
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.models import BUILTIN_SPECS
from fleet.schemas.wire import PRIORITY_NAMES, RequestMessage, to_priority
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.gateway_helpers import FAST_LIMITS, asgi_gateway, error_of, model_refs
from tests.infra import PAIRS, connected_pair, eventually, settings_for, wait_terminal

# -- the weighting: a pure table -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "cycle"),
    [
        ((1, 1, 1), "high normal low"),
        ((6, 3, 1), "high normal high high normal high low high normal high"),
        ((2, 1, 1), "high normal low high"),
        ((1, 1, 2), "low high normal low"),
        ((3, 1, 1), "high normal high low high"),
    ],
)
def test_each_level_leads_its_weight_of_rounds_spread_over_the_cycle(weights: Any, cycle: str) -> None:
    assert serve_cycle(weights) == tuple(cycle.split())


@pytest.mark.parametrize(
    ("round_no", "order"),
    [
        (0, ("high", "normal", "low")),
        (1, ("normal", "high", "low")),
        (6, ("low", "high", "normal")),
        (16, ("low", "high", "normal")),  # the cycle repeats every 10 rounds
        (10, ("high", "normal", "low")),
    ],
)
def test_a_round_serves_its_lead_then_the_rest_highest_first(round_no: int, order: tuple[str, ...]) -> None:
    assert serve_order(round_no, (6, 3, 1)) == order


@pytest.mark.parametrize("bad", [(0, 1, 1), (1, 1), (1, 1, 1, 1), (True, 1, 1), (6, -3, 1)])
def test_weights_that_would_starve_a_level_or_do_not_fit_are_refused(bad: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="priority weight"):
        check_weights(bad)


def test_weights_come_from_the_environment_and_bad_ones_are_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_PRIORITY_WEIGHTS", "8, 2, 1")
    assert FleetSettings().priority_weights == (8, 2, 1)
    monkeypatch.setenv("FLEET_PRIORITY_WEIGHTS", "8,0,1")
    with pytest.raises(ValidationError, match="at least 1"):
        FleetSettings()


def serve_backlogs(weights: Any, start: int, rounds: int, backlog: dict[str, int]) -> dict[str, int]:
    """Serve one message a round from finite backlogs by ``serve_order``; how many of each level were served."""
    left, served = dict(backlog), dict.fromkeys(c.PRIORITIES, 0)
    for r in range(start, start + rounds):
        level = next((lv for lv in serve_order(r, weights) if left[lv] > 0), None)
        if level is not None:
            left[level] -= 1
            served[level] += 1
    return served


@given(
    weights=st.tuples(*[st.integers(1, 12)] * 3),
    start=st.integers(0, 10_000),
    cycles=st.integers(1, 4),
)
def test_no_level_starves_and_none_idles_while_work_waits(weights: Any, start: int, cycles: int) -> None:
    rounds = cycles * sum(weights)
    # Every level backlogged: each gets exactly its weight per cycle, whatever round we start at.
    everything = serve_backlogs(weights, start, rounds, dict.fromkeys(c.PRIORITIES, 10**6))
    assert everything == {lv: w * cycles for lv, w in zip(c.PRIORITIES, weights, strict=True)}
    # Only low has work: it gets every round (work-conserving); high work waiting takes the others' rounds.
    assert serve_backlogs(weights, start, rounds, {"high": 0, "normal": 0, "low": 10**6})["low"] == rounds
    lone = serve_backlogs(weights, start, rounds, {"high": 10**6, "normal": 0, "low": 10**6})
    assert lone == {"high": rounds - weights[2] * cycles, "normal": 0, "low": weights[2] * cycles}


def test_the_level_of_a_subject_and_the_names_on_the_wire() -> None:
    assert c.PRIORITIES == PRIORITY_NAMES
    assert c.request_subject("m") == "fleet.req.m" and c.consumer_name("m") == "fleet-m"
    assert c.request_subject("m", "high") == "fleet.req.m.high" and c.consumer_name("m", "low") == "fleet-m-low"
    assert c.inbox_subject("w", "low") == "fleet.inbox.w.low" and c.inbox_group("w", "high") == "fleet-inbox-w-high"
    for level in c.PRIORITIES:
        assert priority_of_subject(c.request_subject("m", level), "m") == level
        assert priority_of_subject(c.inbox_subject("m-w1", level), "m") == "normal"  # not a request subject of m
    with pytest.raises(ValueError, match="not one of"):
        c.request_subject("m", "urgent")


# -- names and integers on every entry point -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_", "level"),
    [("high", "high"), ("normal", "normal"), ("low", "low"), (0, "normal"), (1, "high"), (9, "high"), (-1, "low")],
)
def test_names_and_integers_map_to_a_level(given_: Any, level: str) -> None:
    assert to_priority(given_) == level
    assert SubmitRequest(model="m", input={}, priority=given_).priority == level
    message = RequestMessage(job_id="j", model="m", input={}, priority=given_)
    assert json.loads(message.model_dump_json())["priority"] == level  # names on the wire


@pytest.mark.parametrize("garbage", ["HIGH", "urgent", "", True, 1.5, 10, -10, None, [1], {"p": 1}])
def test_anything_else_is_refused_saying_what_is_accepted(garbage: Any) -> None:
    with pytest.raises(ValidationError, match="priority must be 'high', 'normal' or 'low'"):
        RequestMessage(job_id="j", model="m", input={}, priority=garbage)


def test_an_old_message_without_a_priority_is_normal_and_the_schema_says_names_or_integers() -> None:
    assert RequestMessage.model_validate({"job_id": "j", "model": "m", "input": {}}).priority == "normal"
    assert message_priority(b'{"priority": 4}') == "high" and message_priority(b"not json") == "normal"
    assert message_priority(b'{"priority": "low"}') == "low" and message_priority(b"[]") == "normal"
    schema = all_schemas({})["request-message.schema.json"]
    for ok in ("high", "low", 3, -2):
        jsonschema.validate({"job_id": "j", "model": "m", "input": {}, "priority": ok}, schema)
    for bad in ("urgent", 12):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"job_id": "j", "model": "m", "input": {}, "priority": bad}, schema)


def test_fleet_publish_puts_the_priority_on_input_lines() -> None:
    spec = BUILTIN_SPECS["echo"]
    prepared = prepare(['{"a": 1}'], spec, priority=check_priority("-3"))
    assert [m.priority for m in prepared.messages] == ["low"]
    with pytest.raises(InvalidInput, match="priority must be"):
        check_priority("urgent")


async def test_rest_and_sdk_accept_names_and_integers_and_refuse_garbage_with_422(unique: str) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for("memory", {}, models=refs)
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (app, client):
        for given_, level in (("high", "high"), ("low", "low"), (2, "high"), (0, "normal"), (-5, "low")):
            response = await client.post("/v1/jobs", json={"model": echo, "input": {}, "priority": given_})
            assert response.status_code == 202, response.text
            await expect_on_level(broker, echo, level, response.json()["job_id"])
        for garbage in ("urgent", 10, True, None):
            response = await client.post("/v1/jobs", json={"model": echo, "input": {}, "priority": garbage})
            assert response.status_code == 422, response.text
            assert "priority must be 'high', 'normal' or 'low'" in error_of(response)["message"]
        transport = httpx.ASGITransport(app=app)
        async with FleetClient("http://gateway", transport=transport) as fleet:
            job_id = await fleet.submit(echo, {}, priority="high")
            await expect_on_level(broker, echo, "high", job_id)
            job_id = await fleet.submit(echo, {}, priority=-1)
            await expect_on_level(broker, echo, "low", job_id)
            with pytest.raises(InvalidInput, match="priority must be 'high', 'normal' or 'low'"):
                await fleet.submit(echo, {}, priority="urgent")  # type: ignore[arg-type]
        assert await read_lag(broker, echo) == 7  # every level's backlog counts


async def expect_on_level(broker: Broker, model: str, level: str, job_id: str) -> None:
    """The job's message waits on its level's subject (taken with the workers' group and handed back)."""
    sub = await broker.subscribe(c.request_subject(model, level), c.consumer_name(model, level))
    try:
        got = await sub.fetch(100, 1.0)
        assert job_id in [json.loads(d.data)["job_id"] for d in got], f"{job_id} not on {level}"
        for delivery in got:
            await delivery.nak()
    finally:
        await sub.close()


# -- the combined subscription ---------------------------------------------------------------------------------


async def publish_level(broker: Broker, model: str, level: str, ids: list[str], mean_ms: float = 0.0) -> None:
    async def one(job_id: str) -> None:
        body = RequestMessage(job_id=job_id, model=model, input={"mean_ms": mean_ms}, priority=level)
        await broker.publish(c.request_subject(model, level), body.model_dump_json().encode(), msg_id=job_id)

    for start in range(0, len(ids), 50):  # a few publishes in flight at once: quick on every broker
        await asyncio.gather(*(one(job_id) for job_id in ids[start : start + 50]))


async def test_fetch_takes_higher_levels_first_and_gives_low_its_share() -> None:
    broker = MemoryBroker(ack_wait_s=30, dedup_window_s=60, max_message_bytes=1 << 20)
    await broker.connect()
    await broker.ensure_model("m")
    for level in c.PRIORITIES:
        await publish_level(broker, "m", level, [f"{level}-{i}" for i in range(40)])
    sub = await subscribe_priorities(broker, "m", (6, 3, 1))
    try:
        levels = []
        for _ in range(10):
            got = await sub.fetch(4, 1.0)
            assert len({d.subject for d in got}) == 1, "one fetch hands out one level's messages"
            levels.append(priority_of_subject(got[0].subject, "m"))
            for delivery in got:
                await delivery.ack()
        assert levels == list(serve_cycle((6, 3, 1)))
        assert sub.served == {"high": 24, "normal": 12, "low": 4}
        assert await read_lag_by_priority(broker, "m") == {"high": 16, "normal": 28, "low": 36}
    finally:
        await sub.close()
        await broker.close()


async def test_a_wait_on_an_empty_high_level_never_delays_other_work() -> None:
    broker = MemoryBroker(ack_wait_s=30, dedup_window_s=60, max_message_bytes=1 << 20)
    await broker.connect()
    await broker.ensure_model("m")
    sub = await subscribe_priorities(broker, "m")
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        fetching = asyncio.create_task(sub.fetch(8, 5.0))
        await asyncio.sleep(0.1)
        await publish_level(broker, "m", "low", ["l-1"])
        got = await fetching
        assert [d.msg_id for d in got] == ["l-1"] and loop.time() - t0 < 1.0
        await got[0].ack()
        # The waits on high and normal are still out; what they get goes out in the next rounds' order (round 1
        # leads with normal, round 2 with high).
        await publish_level(broker, "m", "normal", ["n-1"])
        await publish_level(broker, "m", "high", ["h-1"])
        await asyncio.sleep(0.05)
        first, second = await sub.fetch(8, 1.0), await sub.fetch(8, 1.0)
        assert serve_order(1)[0] == "normal"
        assert [d.msg_id for d in first + second] == ["n-1", "h-1"]
        for delivery in first + second:
            await delivery.nak()  # handed back on its own level, as without priorities
        again = [d for _ in range(2) for d in await sub.fetch(8, 1.0)]
        assert sorted((d.msg_id, d.delivery_count) for d in again) == [("h-1", 2), ("n-1", 2)]
    finally:
        await sub.close()
        await broker.close()
    assert isinstance(sub, PrioritySubscription) and not sub.partitioned


# -- 500 low jobs, then 20 high ones, on every broker -------------------------------------------------------


@pytest.fixture(params=PAIRS)
async def infra(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Broker, ResultStore, FleetSettings]]:
    pair: str = request.param
    urls = {kind: request.getfixturevalue(f"{kind}_url") for kind in ("nats", "kafka", "redis") if kind in pair}
    settings = settings_for(pair, urls, ack_wait_s=10.0)
    async with connected_pair(settings) as (broker, store):
        yield broker, store, settings


@contextlib.asynccontextmanager
async def running(*parts: Worker | Dispatcher) -> AsyncIterator[None]:
    try:
        await asyncio.gather(*(p.start() for p in parts))
        yield
    finally:
        await asyncio.gather(*(p.stop() for p in parts), return_exceptions=True)


BACKLOG, HIGH, MEAN_MS = 500, 20, 4.0


async def high_overtakes_the_backlog(
    broker: Broker, store: ResultStore, model: str, worker: Worker, unique: str
) -> tuple[float, int]:
    """Publish the low backlog, let the worker start on it, publish the high jobs; when all are done, return when
    the last high job finished and how many low jobs finished after it."""
    low = [f"{unique}-low-{i}" for i in range(BACKLOG)]
    high = [f"{unique}-high-{i}" for i in range(HIGH)]
    await broker.ensure_model(model)
    await publish_level(broker, model, "low", low, MEAN_MS)

    async def started() -> bool:
        return worker.stats.items >= 20

    await eventually(started, timeout_s=20, what="the worker working through the low backlog")
    await publish_level(broker, model, "high", high, MEAN_MS)
    high_records = await wait_terminal(store, high, timeout_s=30)
    low_records = await wait_terminal(store, low, timeout_s=60)
    assert {r.state.value for r in [*high_records.values(), *low_records.values()]} == {"succeeded"}
    last_high = max(r.finished_at or 0 for r in high_records.values())
    last_low = max(r.finished_at or 0 for r in low_records.values())
    assert last_high < last_low, "the backlog drained before the high jobs finished"
    return last_high, sum(1 for r in low_records.values() if (r.finished_at or 0) > last_high)


async def test_high_jobs_behind_a_low_backlog_finish_before_it_drains(infra, unique) -> None:
    broker, store, settings = infra
    model = f"prio-{unique}"
    worker = Worker(with_name(SleepHandler, model)(), broker, store, settings=settings, max_batch=8, max_wait_ms=2)
    async with running(worker):
        t0 = time.monotonic()
        _, low_after = await high_overtakes_the_backlog(broker, store, model, worker, unique)
    # The high jobs went ahead of most of the backlog, not merely ahead of its last job.
    assert low_after >= BACKLOG // 4, f"only {low_after} low jobs finished after the last high one"
    assert time.monotonic() - t0 < 30


async def test_the_dispatcher_assigns_higher_priorities_first(infra, unique) -> None:
    broker, store, settings = infra
    model = f"prio-d-{unique}"
    handler = with_name(SleepHandler, model)()
    worker = Worker(handler, broker, store, settings=settings, routing="dispatch", max_batch=8, max_wait_ms=2)
    dispatcher = Dispatcher(broker, store, model=model, settings=settings)
    async with running(dispatcher, worker):

        async def live() -> bool:
            return len(dispatcher.state.live) >= 1

        await eventually(live, timeout_s=20, what="the worker live at the dispatcher")
        _, low_after = await high_overtakes_the_backlog(broker, store, model, worker, unique)
    assert low_after >= BACKLOG // 4, f"only {low_after} low jobs finished after the last high one"
    assert dispatcher._sub is not None and dispatcher._sub.served["high"] >= HIGH  # type: ignore[attr-defined]


async def test_lag_counts_every_level_on_every_broker(infra, unique) -> None:
    broker, _, _ = infra
    model = f"prio-lag-{unique}"
    await broker.ensure_model(model)
    for level, count in (("high", 3), ("normal", 2), ("low", 1)):
        await publish_level(broker, model, level, [f"{unique}-{level}-{i}" for i in range(count)])

    async def counted() -> bool:
        return await read_lag_by_priority(broker, model) == {"high": 3, "normal": 2, "low": 1}

    await eventually(counted, timeout_s=10, what="the lag of each level")
    assert await read_lag(broker, model) == 6


async def test_a_reconcile_sweep_republishes_on_the_jobs_level(unique: str) -> None:
    settings = settings_for("memory", {})
    async with connected_pair(settings) as (broker, store):
        model = f"prio-rec-{unique}"
        await broker.ensure_model(model)
        for level in ("high", "low"):
            job_id = f"{unique}-{level}"
            data = RequestMessage(job_id=job_id, model=model, input={}, priority=level).model_dump_json().encode()
            await store.create(JobRecord(job_id=job_id, model=model, state=JobState.queued), data)
        await asyncio.sleep(0.3)
        assert await Reconciler(broker, store, FAST_LIMITS, after_s=0.2).sweep() >= 2
        assert await read_lag_by_priority(broker, model) == {"high": 1, "normal": 0, "low": 1}
        await expect_on_level(broker, model, "high", f"{unique}-high")
        await expect_on_level(broker, model, "low", f"{unique}-low")


class FailingLevel:
    """A level whose every fetch fails, as a NATS level whose consumer was deleted."""

    partitioned = False

    def __init__(self) -> None:
        self.fetches = 0

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Any]:
        self.fetches += 1
        raise BrokerUnavailable("pull from fleet.req.m.low failed: status 409 Consumer Deleted")

    async def close(self) -> None:
        return None


async def test_a_failing_level_rests_while_the_others_serve_and_its_error_is_raised_when_nothing_else_came() -> None:
    broker = MemoryBroker(ack_wait_s=30, dedup_window_s=60, max_message_bytes=1 << 20)
    await broker.connect()
    await broker.ensure_model("m")
    failing = FailingLevel()
    levels: dict[str, Any] = {
        lv: await broker.subscribe(c.request_subject("m", lv), c.consumer_name("m", lv)) for lv in ("high", "normal")
    }
    sub = PrioritySubscription({**levels, "low": failing})
    try:
        await publish_level(broker, "m", "normal", ["n-1", "n-2"])
        got = [d.msg_id for _ in range(2) for d in await sub.fetch(1, 1.0)]
        assert got == ["n-1", "n-2"]
        with pytest.raises(BrokerUnavailable, match="Consumer Deleted"):
            await sub.fetch(8, 0.3)
        assert failing.fetches == 1, "a failed level rests instead of being asked again at once"
        await publish_level(broker, "m", "high", ["h-1"])
        assert [d.msg_id for d in await sub.fetch(8, 1.0)] == ["h-1"]
    finally:
        await sub.close()
        await broker.close()
