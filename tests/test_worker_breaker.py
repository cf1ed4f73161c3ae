"""A worker's circuit breaker (``fleet.consumers.breaker``): a sick worker stops taking its model's work, the healthy
one finishes every job, the sick one probes after its cool-down and closes once healed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.consumers.breaker import PROBE_BATCH, WorkerBreaker, outcome_of
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.lifecycle.breaker import BreakerConfig
from fleet.schemas.jobs import JobError, JobState
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items, Sick
from tests.infra import connected_pair, eventually, publish_requests, settings_for, wait_terminal

MODEL_ERROR = JobError(type="model_error", message="RuntimeError: CUDA error")
INVALID = JobError(type="invalid_input", message="too long", retriable=False)


@pytest.mark.parametrize(
    ("results", "outcome"),
    [
        ([MODEL_ERROR, MODEL_ERROR], "failure"),
        ([MODEL_ERROR, {"value": 1}], "success"),  # a poison item beside healthy ones: the model computes
        ([INVALID], "success"),  # a refused input says nothing about the worker
        ([INVALID, MODEL_ERROR], "failure"),
        ([{"value": 1}], "success"),
    ],
)
def test_a_run_fails_only_when_nothing_in_it_computed(results, outcome) -> None:
    assert outcome_of(results) == outcome


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_shell_opens_waits_probes_and_closes(caplog) -> None:
    clock = Clock()
    config = BreakerConfig(consecutive_failures=2, cool_down_s=5)
    breaker = WorkerBreaker(config, model="m-shell", worker_id="w1", clock=clock)
    gauge = {"model": "m-shell", "worker": "w1"}
    assert breaker.fetch_limit() is None and REGISTRY.get_sample_value("fleet_worker_breaker_state", gauge) == 0
    with caplog.at_level(logging.INFO, logger="fleet.consumers.breaker"):
        breaker.record("failure")
        breaker.record("failure")
    assert breaker.status == "open" and breaker.fetch_limit() == 0
    assert breaker.wait_s() == pytest.approx(5)
    assert REGISTRY.get_sample_value("fleet_worker_breaker_state", gauge) == 2
    assert "breaker of m-shell closed -> open (opened: 2 consecutive failures)" in caplog.text
    clock.now += 5
    assert breaker.fetch_limit() == PROBE_BATCH
    assert breaker.take_probe() and breaker.status == "half_open"
    assert breaker.fetch_limit() == 0, "one probe at a time"
    breaker.cancel_probe()  # its batch had nothing to run
    assert breaker.fetch_limit() == PROBE_BATCH and breaker.take_probe()
    breaker.record("failure")
    assert breaker.status == "open" and breaker.wait_s() == pytest.approx(10), "reopened with a longer cool-down"
    clock.now += 10
    assert breaker.take_probe()
    with caplog.at_level(logging.INFO, logger="fleet.consumers.breaker"):
        breaker.record("success")
    assert breaker.closed and breaker.fetch_limit() is None
    assert "half_open -> closed (closed: a probe succeeded)" in caplog.text
    before = REGISTRY.get_sample_value("fleet_worker_breaker_transitions_total", {"model": "m-shell", "to": "open"})
    assert before == 2
    breaker.close()
    assert REGISTRY.get_sample_value("fleet_worker_breaker_state", gauge) is None


def test_without_a_config_the_breaker_never_opens() -> None:
    breaker = WorkerBreaker(None, model="m-off", worker_id="w1")
    for _ in range(100):
        breaker.record("failure")
    assert breaker.closed and breaker.fetch_limit() is None and not breaker.take_probe()


@pytest.fixture
def settings(nats_url: str, redis_url: str) -> FleetSettings:
    config = BreakerConfig(consecutive_failures=2, cool_down_s=1.0, max_cool_down_s=2.0)
    return settings_for("nats+redis", {"nats": nats_url, "redis": redis_url}, worker_breaker=config)


@pytest.fixture
async def infra(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    async with connected_pair(settings) as pair:
        yield pair


async def test_a_sick_worker_opens_its_breaker_the_healthy_one_finishes_everything(infra, settings, unique) -> None:
    broker, store = infra
    model = f"breaker-{unique}"
    await broker.ensure_model(model)
    sick = Worker(with_name(Sick, model)(), broker, store, settings=settings, max_batch=4, worker_id=f"sick-{unique}")
    healthy = Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=4)
    opened = asyncio.Event()
    beats: list[str] = []

    async with sick:
        ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 5} for i in range(8)], unique)
        await eventually(lambda: _status_is(sick, "open"), timeout_s=20, what="the sick worker's breaker opens")
        opened.set()
        beats.append(sick.heartbeat().breaker)
        gauge = REGISTRY.get_sample_value("fleet_worker_breaker_state", {"model": model, "worker": sick.worker_id})
        failed_batches = len(sick.handler.calls)
        async with healthy:
            ids += await publish_requests(broker, model, [{"value": i} for i in range(8, 40)], f"{unique}-b")
            records = await wait_terminal(store, ids, timeout_s=40)
            assert {r.state for r in records.values()} == {JobState.succeeded}, "no healthy job fails for a sick worker"
            assert {r.worker_id for r in records.values()} == {healthy.worker_id}
            assert sick.handler.predicted == [], "the sick worker computed nothing"
            # It kept probing (one job at a time) and failing: every probe reopened it, no job was charged.
            assert all(len(call) == 0 for call in sick.handler.calls)
            sick.handler.sick.clear()  # healed: the next probe succeeds
            more = []
            for round_ in range(30):  # a probe needs a job to reach the sick worker: keep work flowing
                more += await publish_requests(broker, model, [{"value": 100 + round_}], f"{unique}-c{round_}")
                if await _status_is(sick, "closed"):
                    break
                await asyncio.sleep(0.5)
            assert sick.breaker.closed, f"the healed worker's breaker stays {sick.breaker.status}"
            records = await wait_terminal(store, more, timeout_s=20)
            assert {r.state for r in records.values()} == {JobState.succeeded}
    assert beats == ["open"] and gauge == 2
    assert failed_batches >= 2
    assert sick.breaker.state.reason == "closed: a probe succeeded"


async def _status_is(worker: Worker, status: str) -> bool:
    return worker.breaker.status == status


async def test_an_open_breaker_hands_back_held_work_unstarted_and_unblamed(infra, settings, unique) -> None:
    """A sick worker alone: its failed probes do not use up its jobs' runs (max_deliveries 3), so once healed every
    job succeeds, none dead-lettered."""
    broker, store = infra
    model = f"breaker-{unique}"
    await broker.ensure_model(model)
    ids = await publish_requests(broker, model, [{"value": i} for i in range(2)], unique)
    async with Worker(with_name(Sick, model)(), broker, store, settings=settings, max_batch=3) as sick:
        await eventually(lambda: _status_is(sick, "open"), timeout_s=20, what="the breaker opens")
        # two runs opened it; four more failed probes would have charged a job past its 3 runs
        await eventually(lambda: _calls_at_least(sick, 6), timeout_s=40, what="four probes")
        records = await store.get_many(ids)
        assert all(r is None or not r.terminal for r in records), "no job ended while the worker was sick"
        sick.handler.sick.clear()
        records_by_id = await wait_terminal(store, ids, timeout_s=40)
    assert {r.state for r in records_by_id.values()} == {JobState.succeeded}
    assert sorted(sick.handler.predicted) == [0, 1]


async def _calls_at_least(worker: Worker, n: int) -> bool:
    return len(worker.handler.calls) >= n  # type: ignore[attr-defined]


def test_an_open_breaker_offers_the_dispatchers_no_slot_and_a_half_open_one_a_single_item() -> None:
    settings = FleetSettings(worker_breaker=BreakerConfig(consecutive_failures=1, cool_down_s=60))
    broker, store = make_broker(settings), make_store(settings)
    worker = Worker(with_name(Items, "slots")(), broker, store, settings=settings, routing="dispatch", max_batch=8)
    clock = Clock()
    worker.breaker = WorkerBreaker(settings.worker_breaker, model="slots", worker_id=worker.worker_id, clock=clock)
    assert worker._free_slots() == 8
    worker.breaker.record("failure")
    assert worker._free_slots() == 0
    clock.now += 60
    assert worker._free_slots() == PROBE_BATCH
    assert worker.breaker.take_probe() and worker._free_slots() == 0, "the probe's place is taken"
