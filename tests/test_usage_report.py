"""The pure parts of usage accounting: a batch's time shared by cost, a settled batch's usage rows, the report's
grouping and pricing, the query window, the price settings, the usage store in memory, and the worker's buffer that
writes many settled batches in one call."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from pydantic import ValidationError

from fleet import constants as c
from fleet.consumers.requests import Job
from fleet.consumers.usage import device_kind, share_device_seconds, usage_of
from fleet.consumers.usage_buffer import UsageBuffer
from fleet.producers.gateway.errors import ApiError
from fleet.producers.gateway.usage.report import grouped
from fleet.producers.gateway.usage.window import group_fields, window
from fleet.schemas.jobs import JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store.usage import MemoryUsageStore, UsageCount, UsageKey, buckets


def job(cost: int | None) -> Job:
    return Job(delivery=None, job_id="j", cost=cost)  # type: ignore[arg-type]  # no delivery is read here


@pytest.mark.parametrize(
    ("costs", "seconds", "shares"),
    [
        ([1, 1, 2], 4.0, [1.0, 1.0, 2.0]),
        ([None, None], 1.0, [0.5, 0.5]),  # not weighed: equal shares
        ([3, None], 2.0, [1.5, 0.5]),  # a job not weighed counts 1
        ([0, 0, 0], 3.0, [1.0, 1.0, 1.0]),  # nothing tells them apart
        ([5], 0.25, [0.25]),
    ],
)
def test_a_batch_time_is_shared_by_cost(costs: list[int | None], seconds: float, shares: list[float]) -> None:
    jobs = [job(cost) for cost in costs]
    share_device_seconds(jobs, seconds)
    assert [j.device_seconds for j in jobs] == pytest.approx(shares)
    assert sum(j.device_seconds or 0 for j in jobs) == pytest.approx(seconds)


def record(tenant: str | None, version: str | None, seconds: float | None) -> JobRecord:
    return JobRecord(
        job_id="j",
        model="m",
        state=JobState.succeeded,
        created_at=0,
        tenant=tenant,
        version=version,
        device_seconds=seconds,
    )


def test_a_settled_batch_counts_the_computed_records_it_won() -> None:
    settled = [
        (job(2), record(None, "1", 1.0), True),
        (job(3), record(None, "1", 2.0), True),
        (job(1), record("t", "1", 0.5), True),
        (job(7), record("t", "1", 9.0), False),  # a duplicate: stored by another run
        (job(None), record("t", "1", None), True),  # rejected or expired: never computed
    ]
    counts = usage_of(settled, "cuda:1")
    assert counts == {
        UsageKey(c.DEFAULT_TENANT, "m", "1", "cuda"): UsageCount(jobs=2, items=5, device_seconds=3.0),
        UsageKey("t", "m", "1", "cuda"): UsageCount(jobs=1, items=1, device_seconds=0.5),
    }
    assert (device_kind("cpu"), device_kind("cuda:0"), device_kind("mps")) == ("cpu", "cuda", "mps")


COUNTS = {
    UsageKey("a", "m", "1", "cpu"): UsageCount(4, 40, 7200.0),
    UsageKey("a", "m", "1", "cuda"): UsageCount(6, 60, 3600.0),
    UsageKey("b", "n", "2", "tpu"): UsageCount(1, 1, 360.0),  # no price: costs nothing
}
PRICES = {"cpu": 0.05, "cuda": 2.5}


def test_rows_are_grouped_priced_per_kind_and_filtered_to_a_tenant() -> None:
    rows, total = grouped(COUNTS, ["model"], PRICES)
    assert [(r.model, r.jobs, r.items, r.device_seconds) for r in rows] == [("m", 10, 100, 10800.0), ("n", 1, 1, 360.0)]
    assert [r.cost for r in rows] == pytest.approx([2.6, 0.0])
    assert rows[0].cost_per_1k_requests == pytest.approx(260.0) and rows[0].tenant is None
    assert (total.jobs, total.cost) == (11, pytest.approx(2.6))
    rows, total = grouped(COUNTS, ["tenant", "device"], PRICES, tenant="b")
    assert [(r.tenant, r.device, r.cost) for r in rows] == [("b", "tpu", 0.0)]
    assert total.jobs == 1
    rows, total = grouped({}, ["tenant"], PRICES)
    assert rows == [] and total.cost_per_1k_requests is None


NOW = 1_800_000_000.0


def test_the_window_reads_unix_seconds_iso_and_times_ago() -> None:
    assert window(None, None, NOW) == (NOW - 86400, NOW)
    assert window("90m", None, NOW) == (NOW - 5400, NOW)
    assert window("1700000000", "1700003600.5", NOW) == (1_700_000_000.0, 1_700_003_600.5)
    assert window("2026-01-01T00:00:00Z", "2026-01-01T01:00:00+00:00", NOW) == (1767225600.0, 1767229200.0)
    assert window("2026-01-01T00:00:00", "2026-01-02", NOW)[0] == 1767225600.0  # no zone: UTC
    assert group_fields(None) == ["model"] and group_fields(" tenant, device ") == ["tenant", "device"]


@pytest.mark.parametrize(
    ("start", "end", "words"),
    [
        ("2d", "3d", "is after to"),
        ("32d", None, "longer than 31 days"),
        ("1e400", None, "is not a time"),
        ("0x10", None, "is not a time"),
        (None, "tomorrow", "is not a time"),
    ],
)
def test_a_bad_window_is_a_422_naming_it(start: str | None, end: str | None, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        window(start, end, NOW)
    assert caught.value.status == 422 and words in caught.value.message


def test_buckets_cover_the_range() -> None:
    hour = c.USAGE_BUCKET_S
    assert list(buckets(10 * hour, 12 * hour)) == [10, 11]
    assert list(buckets(10 * hour + 1, 12 * hour + 1)) == [10, 11, 12]
    assert list(buckets(10 * hour, 10 * hour)) == []


async def test_the_memory_usage_store_sums_buckets_and_forgets_past_retention() -> None:
    store = MemoryUsageStore()
    key = UsageKey("a", "m", "1", "cpu")
    await store.add({key: UsageCount(1, 2, 0.5)}, now=NOW)
    await store.add({key: UsageCount(1, 3, 0.25)}, now=NOW + 10)
    await store.add({key: UsageCount(5, 5, 5.0)}, now=NOW - 2 * c.USAGE_BUCKET_S)
    assert await store.read(NOW - 1, NOW + 11) == {key: UsageCount(2, 5, 0.75)}
    assert (await store.read(NOW - 3 * c.USAGE_BUCKET_S, NOW + 11))[key] == UsageCount(7, 10, 5.75)
    await store.add({key: UsageCount(1, 1, 1.0)}, now=NOW + c.USAGE_TTL_S + c.USAGE_BUCKET_S)
    assert await store.read(NOW - 3 * c.USAGE_BUCKET_S, NOW + 11) == {}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("cpu=-1", "greater than or equal to 0"),
        ("GPU=1", "is not a device kind"),
        ("cpu=cheap", "valid number"),
        ("cpu", "DEVICE=PRICE"),
        ('{"cpu": 1', "not a JSON object"),
    ],
)
def test_prices_are_checked_with_a_clear_error(value: str, words: str) -> None:
    with pytest.raises(ValidationError) as caught:
        FleetSettings(price_per_device_hour=value)
    assert words in str(caught.value) and "price_per_device_hour" in str(caught.value)
    assert FleetSettings(price_per_device_hour="cpu=0.05, cuda=2.5").price_per_device_hour == {"cpu": 0.05, "cuda": 2.5}


class CountingUsageStore(MemoryUsageStore):
    """The memory usage store, counting its writes; ``hold`` makes a write wait until it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.hold: asyncio.Event | None = None

    async def add(self, counts: Mapping[UsageKey, UsageCount], now: float | None = None) -> None:
        self.writes += 1
        if self.hold is not None:
            await self.hold.wait()
        await super().add(counts, now)


async def test_the_buffer_writes_many_batches_in_one_call_and_keeps_counts_a_cancelled_write_carried() -> None:
    store = CountingUsageStore()
    buffer = UsageBuffer(store, "m", "w1")
    key = UsageKey("a", "m", "1", "cpu")
    for _ in range(100):  # a hundred settled batches within one interval
        buffer.add({key: UsageCount(2, 3, 0.01)})
    await buffer.flush()
    await buffer.flush()  # nothing gathered since: no call
    assert store.writes == 1
    assert (await store.read(0, 4e9))[key] == UsageCount(200, 300, pytest.approx(1.0))

    store.hold = asyncio.Event()
    buffer.add({key: UsageCount(1, 1, 0.5)})
    writing = asyncio.create_task(buffer.flush())
    await asyncio.sleep(0.01)
    writing.cancel()  # the worker stopping while the flusher writes
    with pytest.raises(asyncio.CancelledError):
        await writing
    store.hold = None
    buffer.add({key: UsageCount(1, 1, 0.25)})
    await buffer.flush()
    assert (await store.read(0, 4e9))[key] == UsageCount(202, 302, pytest.approx(1.75))


async def test_the_flusher_writes_every_interval_until_stopped() -> None:
    store = CountingUsageStore()
    buffer = UsageBuffer(store, "m", "w1", interval_s=0.05)
    stop = asyncio.Event()
    flusher = asyncio.create_task(buffer.run(stop))
    buffer.add({UsageKey("a", "m", "1", "cpu"): UsageCount(1, 1, 1.0)})
    for _ in range(100):
        if store.writes:
            break
        await asyncio.sleep(0.01)
    assert store.writes == 1
    stop.set()
    await asyncio.wait_for(flusher, 1.0)
