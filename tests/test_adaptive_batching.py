"""Cost-bounded batches and the batch controller in a real worker: the collector against a fake subscription,
then end to end over every broker/store pair (batches respect the budget and nothing is lost; the heartbeat
reports the knobs the controller put in force)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery
from fleet.consumers.batcher import BatchBounds, BatchCollector, collect_batch
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.schemas.jobs import JobState
from fleet.schemas.models import ModelSpec
from fleet.schemas.wire import Heartbeat
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.handlers_for_tests import ItemIn, ItemOut, Items
from tests.infra import PAIRS, connected_pair, publish_requests, settings_for, wait_terminal
from tests.test_worker import urls_for


@dataclass(eq=False)
class FakeDelivery:
    cost: int
    subject: str = "s"
    data: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    msg_id: str | None = None
    delivery_count: int = 1

    async def ack(self) -> None: ...
    async def nak(self, delay_s: float = 0.0) -> None: ...
    async def term(self) -> None: ...
    async def in_progress(self) -> None: ...


class FakeSubscription:
    """Hands out what is waiting (up to n), else waits ``timeout_s`` and returns nothing; records fetch sizes."""

    partitioned = False

    def __init__(self, costs: list[int]) -> None:
        self.waiting: list[Delivery] = [FakeDelivery(cost) for cost in costs]
        self.asked: list[int] = []

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]:
        self.asked.append(max_messages)
        if not self.waiting:
            await asyncio.sleep(timeout_s)
            return []
        got, self.waiting = self.waiting[:max_messages], self.waiting[max_messages:]
        return got

    async def close(self) -> None: ...


def cost_of(delivery: Delivery) -> int:
    assert isinstance(delivery, FakeDelivery)
    return delivery.cost


async def drain(collector: BatchCollector, bounds: BatchBounds) -> list[list[int]]:
    batches = []
    while batch := await collector.collect(bounds, idle_timeout_s=0.01):
        batches.append([cost_of(d) for d in batch])
    return batches


async def test_batches_fill_up_to_the_budget_and_hold_over_the_rest() -> None:
    costs = [3, 4, 2, 5, 1, 1, 30, 6, 6, 6]
    sub = FakeSubscription(costs)
    fetched: list[Delivery] = []
    collector = BatchCollector(sub, cost_of, on_fetch=fetched.extend)
    batches = await drain(collector, BatchBounds(max_batch=8, max_wait_s=0.05, max_cost=10))
    assert batches == [[3, 4, 2], [5, 1, 1], [30], [6], [6], [6]], "in order, each within budget, 30 alone"
    assert [cost for batch in batches for cost in batch] == costs, "nothing lost, nothing twice"
    assert len(fetched) == len(costs) and not collector.carry


async def test_a_held_over_message_is_held_from_its_fetch_and_starts_the_next_batch() -> None:
    sub = FakeSubscription([6, 6, 6])
    fetched: list[Delivery] = []
    collector = BatchCollector(sub, cost_of, on_fetch=fetched.extend)
    collector._mean_cost = 2.0  # it expects cheap items, so it fetches more than fit
    first = await collector.collect(BatchBounds(8, 0.05, max_cost=10), idle_timeout_s=0.01)
    assert [cost_of(d) for d in first] == [6]
    assert collector.closed_full, "a batch closed by its budget says so (work is waiting)"
    carried = collector.carried()
    assert carried and all(d in fetched for d in carried), "held over, and the worker was told at its fetch"
    second = await collector.collect(BatchBounds(8, 0.05, max_cost=10), idle_timeout_s=0.01)
    assert second[0] is carried[0]


async def test_under_a_budget_it_fetches_about_what_fits() -> None:
    sub = FakeSubscription([2] * 40)
    collector = BatchCollector(sub, cost_of)
    for _ in range(3):
        await collector.collect(BatchBounds(64, 0.05, max_cost=10), idle_timeout_s=0.01)
    assert sub.asked[-1] <= 6, f"asked for {sub.asked}: a budget of 10 at cost 2 holds 5"
    assert len(collector.carry) <= 1


async def test_without_a_budget_batches_are_bounded_by_count_only() -> None:
    sub = FakeSubscription([100] * 10)
    assert len(await collect_batch(sub, 4, 0.05, 0.01)) == 4
    collector = BatchCollector(sub)  # no cost function: costs are never asked for
    assert len(await collector.collect(BatchBounds(8, 0.0), idle_timeout_s=0.01)) == 6
    assert await collector.collect(BatchBounds(8, 0.0), idle_timeout_s=0.01) == []


# -- end to end ----------------------------------------------------------------------------------------------
class Costly(Items):
    """``Items`` whose item costs its ``value``; at most 10 per batch."""

    spec = ModelSpec("costly", ItemIn, ItemOut, max_batch=16, max_wait_ms=50, max_batch_cost=10)

    def cost(self, item: ItemIn) -> int:
        return item.value


class Targeted(Items):
    """``Items`` with a p99 target: the worker sizes its batches."""

    spec = ModelSpec("targeted", ItemIn, ItemOut, max_batch=16, max_wait_ms=50, p99_target_ms=2000)


@pytest.fixture(params=PAIRS)
def settings(request: pytest.FixtureRequest) -> FleetSettings:
    return settings_for(request.param, urls_for(request, request.param))


@pytest.fixture
async def infra(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    async with connected_pair(settings) as pair:
        yield pair


async def test_a_worker_keeps_batches_within_the_cost_budget(infra, settings, unique) -> None:
    broker, store = infra
    model = f"costly-{unique}"
    rng = random.Random(7)
    values = [rng.randint(1, 6) for _ in range(40)] + [25]  # 25 is over the budget on its own
    ids = await publish_requests(broker, model, [{"value": v} for v in values], unique)
    handler = with_name(Costly, model)()
    async with Worker(handler, broker, store, settings=settings) as worker:
        records = await wait_terminal(store, ids, timeout_s=30)
        assert worker.heartbeat().max_batch_cost == 10
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert all(r.deliveries == 1 for r in records.values()), "held-over messages were not redelivered"
    assert sorted(r.output["value"] for r in records.values()) == sorted(2 * v for v in values)
    calls = handler.calls
    assert sorted(v for call in calls for v in call) == sorted(values), "each item computed once"
    assert all(sum(call) <= 10 for call in calls if len(call) > 1), f"over the budget: {calls}"
    assert [25] in calls, "an item over the budget runs alone"
    assert max(len(call) for call in calls) > 1, "items still share batches"


async def test_the_heartbeat_reports_the_knobs_the_controller_set(infra, settings, unique) -> None:
    broker, store = infra
    model = f"targeted-{unique}"
    await broker.ensure_model(model)
    beats: list[Heartbeat] = []
    events = await broker.listen(c.heartbeat_subject(model))

    async def listen() -> None:
        async for _, data in events:
            beats.append(Heartbeat.model_validate(json.loads(data)))

    reader = asyncio.create_task(listen())
    try:
        # A backlog keeps the device busy: the wait rises from 0 to about the batch compute time (16 x 12 ms).
        ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 12} for i in range(192)], unique)
        handler = with_name(Targeted, model)()
        worker = Worker(handler, broker, store, settings=settings, max_wait_ms=400)
        assert (worker.max_batch, worker.max_wait_ms) == (16, 0.0), "largest batch, no wait to begin with"
        async with worker:
            await wait_terminal(store, ids, timeout_s=30)
            await asyncio.sleep(3 * settings.heartbeat_interval_s)
        waits = [beat.max_wait_ms for beat in beats]
        assert waits[0] == 0.0
        assert any(100 < wait < 400 for wait in waits), f"heartbeats should show the wait following compute: {waits}"
        assert (beats[-1].max_wait_ms, beats[-1].max_batch) == (worker.max_wait_ms, worker.max_batch)
        assert beats[-1].p99_target_ms == 2000
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await events.close()


def test_fixed_batches_without_a_target() -> None:
    settings = FleetSettings(adaptive_batching=False)
    worker = Worker(with_name(Targeted, "targeted-off")(), broker=None, store=None, settings=settings)  # type: ignore[arg-type]
    assert worker.batch_limits is None and worker.heartbeat().p99_target_ms is None
    on = Worker(with_name(Targeted, "targeted-on")(), None, None, settings=FleetSettings())  # type: ignore[arg-type]
    assert on.batch_limits is not None and on.batch_limits.p99_target_ms == 2000


def test_embed_weighs_a_request_in_estimated_tokens_without_its_tokenizer() -> None:
    from fleet.consumers.handlers.embed import EmbedHandler
    from fleet.schemas.models import EMBED, EmbedInput

    handler = EmbedHandler()  # not loaded: the estimate needs no tokenizer
    assert handler.cost(EmbedInput(text="word " * 8)) == 2 + 10
    assert handler.cost(EmbedInput(text="x" * 5000)) == 256, "one text is capped at truncation too"
    assert handler.cost(EmbedInput(texts=["abcd" * 10, "x" * 5000])) == (2 + 10) + 256, "capped at truncation"
    biggest = EmbedInput(texts=["x" * 5000] * 64)
    assert EMBED.max_batch_cost is not None and handler.cost(biggest) <= EMBED.max_batch_cost
