"""The model pool's pure logic (``fleet.consumers.pool``): LRU eviction order and budget arithmetic as tables, then
the pool itself with handlers that count their loads: single-flight, eviction of idle models only, refusal of a
model larger than the budget, the back-off after a failed load and the retry after it, and the budget's parsing;
last, a worker of two versions on the in-memory broker and store runs one batch's version groups on their own
handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel

from fleet import constants as c
from fleet.consumers import metrics
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.pool import ModelPool, ServedVersions, by_version, parse_budget
from fleet.consumers.pool.budget import budget_bytes, declared_bytes, handler_bytes, module_bytes
from fleet.consumers.pool.lru import evictions
from fleet.consumers.worker import Worker
from fleet.errors import ConfigError, ModelUnavailable
from fleet.schemas.jobs import JobState
from fleet.schemas.models import ModelSpec
from tests.infra import connected_pair, request_bytes, settings_for, wait_terminal

# -- LRU and budget arithmetic --------------------------------------------------------------------------------
S = {"a": 4, "b": 3, "c": 2}


@pytest.mark.parametrize(
    ("order", "busy", "needed", "budget", "expected"),
    [
        (["a", "b", "c"], set(), 1, 10, []),  # 9 + 1 fits as is
        (["a", "b", "c"], set(), 2, 10, ["a"]),  # least recently used first, and no more than needed
        (["c", "b", "a"], set(), 2, 10, ["c"]),  # order is recency, not size
        (["a", "b", "c"], {"a"}, 2, 10, ["b"]),  # a busy model is never evicted: the next one goes
        (["a", "b", "c"], set(), 7, 10, ["a", "b"]),
        (["a", "b", "c"], set(), 10, 10, ["a", "b", "c"]),  # everything, exactly to the byte
        (["a", "b", "c"], {"c"}, 9, 10, None),  # only busy ones stand in the way: wait for them
        (["a", "b", "c"], set(), 11, 10, None),  # more than the whole budget
        (["a", "b", "c"], set(), 100, None, []),  # no budget: nothing is evicted
        ([], set(), 10, 10, []),
    ],
)
def test_evictions_take_idle_models_least_recently_used_first(
    order: list[str], busy: set[str], needed: int, budget: int | None, expected: list[str] | None
) -> None:
    assert evictions(order, S, busy, needed, budget) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1048576),
        ("2GiB", 2 << 30),
        ("2 gib", 2 << 30),
        ("500MB", 500_000_000),
        ("1.5KiB", 1536),
        ("0.5", 0.5),
        ("1.0", 1.0),
    ],
)
def test_a_budget_is_bytes_or_a_fraction(text: str, expected: float) -> None:
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-1", "0", "1.5", "0.0", "2GiB2", "1e9", "0MB"])
def test_a_budget_that_does_not_parse_is_one_line_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_budget(text)
    assert "--memory-budget" in info.value.message and repr(text) in info.value.message
    assert "\n" not in info.value.message


def test_a_fraction_is_of_the_machines_memory_on_cpu() -> None:
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert budget_bytes(0.25, "cpu") == int(total * 0.25)
    assert budget_bytes(123, "cpu") == 123


def test_sizes_prefer_a_declared_size_then_module_bytes_then_resident_growth() -> None:
    import torch

    class Holder:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(10, 10)  # 110 float32 parameters
            self.model.register_buffer("scale", torch.ones(5))
            self.alias = self.model  # the same weights twice are counted once

    holder = Holder()
    assert module_bytes(holder) == (110 + 5) * 4
    assert handler_bytes(holder, 10**9) == (110 + 5) * 4
    holder.memory_bytes = 777  # type: ignore[attr-defined]
    assert declared_bytes(holder) == 777 and handler_bytes(holder, 10**9) == 777
    assert handler_bytes(object(), 5000) == 5000
    assert handler_bytes(object(), -5) == 0 and handler_bytes(object(), None) == 0


# -- the pool -------------------------------------------------------------------------------------------------
class In(BaseModel):
    x: int = 0


class Out(BaseModel):
    y: int = 0


class Counting(ModelHandler[In, Out]):
    """A handler of a declared size whose loads are counted (and can be made slow or failing)."""

    spec = ModelSpec("counting", In, Out)
    loads: ClassVar[list[str]] = []
    closes: ClassVar[list[str]] = []

    def __init__(self, tag: str, size: int, *, delay_s: float = 0.0, fail: bool = False) -> None:
        super().__init__()
        self.tag, self.memory_bytes, self.delay_s, self.fail = tag, size, delay_s, fail
        self.loop_thread = threading.get_ident()

    def load(self) -> None:
        assert threading.get_ident() != MAIN_THREAD, "load ran on the event loop's thread"
        time.sleep(self.delay_s)
        if self.fail:
            raise ConfigError(f"weight file model.safetensors does not match its sha256 ({self.tag})")
        Counting.loads.append(self.tag)

    def predict(self, batch: list[In]) -> list[Out | Exception]:
        return [Out(y=item.x) for item in batch]

    def close(self) -> None:
        Counting.closes.append(self.tag)


MAIN_THREAD = threading.get_ident()


@pytest.fixture(autouse=True)
def _reset() -> None:
    Counting.loads.clear()
    Counting.closes.clear()


def maker(tag: str, size: int = 10, **kw: Any) -> Any:
    return lambda: Counting(tag, size, **kw)


async def use(pool: ModelPool, key: tuple[str, str], size: int = 10, **kw: Any) -> str:
    async with pool.use(key, maker(f"{key[0]}@{key[1]}", size, **kw)) as handler:
        return handler.tag  # type: ignore[attr-defined,no-any-return]


async def test_concurrent_demands_share_one_load() -> None:
    pool = ModelPool(100)
    tags = await asyncio.gather(*(use(pool, ("m", "1"), delay_s=0.2) for _ in range(8)))
    assert tags == ["m@1"] * 8
    assert Counting.loads == ["m@1"] and pool.loads == 1
    assert pool.loaded("m") == ["1"] and pool.used_bytes == 10


async def test_a_load_over_the_budget_evicts_the_least_recently_used_idle_model() -> None:
    pool = ModelPool(25)
    before = metrics.MODEL_UNLOADS.labels("a", "1")._value.get()
    for key in [("a", "1"), ("b", "1"), ("a", "1")]:  # a used last: b is the least recently used
        await use(pool, key)
    await use(pool, ("c", "1"))
    assert pool.keys() == [("a", "1"), ("c", "1")] and Counting.closes == ["b@1"]
    await use(pool, ("b", "1"))  # reloads, evicting a (now the least recently used)
    assert pool.keys() == [("c", "1"), ("b", "1")]
    assert Counting.loads == ["a@1", "b@1", "c@1", "b@1"] and (pool.loads, pool.unloads) == (4, 2)
    assert metrics.MODEL_UNLOADS.labels("a", "1")._value.get() == before + 1
    assert pool.used_bytes <= 25


async def test_a_busy_model_is_not_evicted_a_load_waits_for_it() -> None:
    pool = ModelPool(15)
    release = asyncio.Event()
    loaded_b = asyncio.Event()

    async def hold_a() -> None:
        async with pool.use(("a", "1"), maker("a@1")):
            await release.wait()

    async def load_b() -> None:
        await use(pool, ("b", "1"))
        loaded_b.set()

    holder = asyncio.create_task(hold_a())
    await asyncio.sleep(0.05)
    loader = asyncio.create_task(load_b())
    await asyncio.sleep(0.2)
    # b's first load is measured after it loaded (unknown size), then waits for room: a is computing
    assert not loaded_b.is_set() and Counting.closes == []
    release.set()
    await asyncio.gather(holder, loader)
    assert pool.keys() == [("b", "1")] and Counting.closes == ["a@1"]


async def test_a_model_larger_than_the_budget_is_refused_and_the_others_stay() -> None:
    pool = ModelPool(50)
    await use(pool, ("small", "1"))
    with pytest.raises(ModelUnavailable) as info:
        await use(pool, ("huge", "1"), size=51)
    assert "more than the worker's whole memory budget" in info.value.message
    assert "'huge' version '1'" in info.value.message
    assert pool.keys() == [("small", "1")] and "huge@1" in Counting.closes and pool.failures == 1


async def test_a_failed_load_fails_fast_during_the_back_off_and_is_retried_after_it() -> None:
    now = [1000.0]
    pool = ModelPool(100, retry_after_s=30, clock=lambda: now[0])
    await use(pool, ("good", "1"))
    for _ in range(5):
        with pytest.raises(ModelUnavailable) as info:
            await use(pool, ("bad", "2"), fail=True)
    message = info.value.message
    assert message.startswith("model 'bad' version '2' cannot be loaded: ConfigError: weight file")
    assert "again in 30 s" in message and not info.value.retriable
    assert pool.failures == 1  # one load tried; the other four failed at once
    assert await use(pool, ("good", "1")) == "good@1"  # the others keep serving
    now[0] += 31
    assert await use(pool, ("bad", "2")) == "bad@2"  # retried after the back-off (fixed meanwhile)
    assert pool.loaded("bad") == ["2"]


async def test_a_cancelled_waiter_does_not_cancel_the_load_others_wait_for() -> None:
    pool = ModelPool(100)
    first = asyncio.create_task(use(pool, ("m", "1"), delay_s=0.3))
    second = asyncio.create_task(use(pool, ("m", "1"), delay_s=0.3))
    await asyncio.sleep(0.05)
    first.cancel()
    assert await second == "m@1"
    assert Counting.loads == ["m@1"]


async def test_close_unloads_everything() -> None:
    pool = ModelPool(None)
    for name in "abc":
        await use(pool, (name, "1"))
    await pool.close()
    assert pool.keys() == [] and sorted(Counting.closes) == ["a@1", "b@1", "c@1"]
    with pytest.raises(ModelUnavailable, match="stopping"):
        await use(pool, ("d", "1"))


def test_jobs_are_grouped_by_the_version_they_ask_for() -> None:
    from fleet.brokers.base import Delivery
    from fleet.consumers.requests import Job
    from fleet.schemas.wire import RequestMessage

    def job(version: str | None) -> Job:
        request = RequestMessage(job_id="j", model="m", input={}, version=version)
        return Job(Delivery.__new__(Delivery), "j", request=request)

    jobs = [job(None), job("2"), job("1"), job(None), job("2")]
    groups = by_version(jobs, "1")
    assert list(groups) == ["1", "2"]
    assert groups["1"] == [jobs[0], jobs[2], jobs[3]] and groups["2"] == [jobs[1], jobs[4]]


def test_served_versions_name_what_they_serve() -> None:
    pinned = ServedVersions("m", "2", lambda v: Counting(v, 1))
    assert pinned.serves("2") and not pinned.serves("1")
    error = pinned.unserved("1")
    assert error.type == "unserved_version" and not error.retriable
    assert error.message == "model 'm' has no version '1' on this worker; it serves version(s) 2"
    listed = ServedVersions("m", "2", lambda v: Counting(v, 1), lambda: ["1", "2", "3"])
    assert listed.serves("3") and not listed.serves("4") and "1, 2, 3" in listed.unserved("4").message


# -- a worker of two versions on the in-memory broker and store -----------------------------------------------
class Tagged(ModelHandler[In, Out]):
    """Answers with its version's number, so a record shows which version computed it."""

    spec = ModelSpec("tagged", In, Out, max_batch=16, max_wait_ms=50)
    computed: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, version: str) -> None:
        super().__init__()
        self.version = version

    def predict(self, batch: list[In]) -> list[Out | Exception]:
        Tagged.computed.append((self.version, len(batch)))
        return [Out(y=int(self.version) * 1000 + item.x) for item in batch]


async def test_one_batch_of_two_versions_runs_each_group_on_its_handler(unique: str) -> None:
    Tagged.computed.clear()
    name = f"tagged-{unique}"
    cls = with_name(Tagged, name)
    cls.spec = dataclasses.replace(cls.spec, version="2")
    served = ServedVersions(name, "2", lambda v: cls(v), lambda: ["1", "2"])
    pool = ModelPool(None)
    settings = settings_for("memory", {})
    async with connected_pair(settings) as (broker, store):
        await broker.ensure_model(name)
        versions = [None, "1", "2", "1", "3", None]
        for i, version in enumerate(versions):  # all published before the worker fetches: one batch
            data = request_bytes(name, f"{unique}-{i}", {"x": i}, version=version)
            await broker.publish(c.request_subject(name), data, msg_id=f"{unique}-{i}")
        async with Worker(cls("2"), broker, store, settings=settings, pool=pool, versions=served) as worker:
            records = await wait_terminal(store, [f"{unique}-{i}" for i in range(len(versions))])
            assert worker.heartbeat().loaded == ["1", "2"]
    got = [records[f"{unique}-{i}"] for i in range(len(versions))]
    assert [r.version for r in got] == ["2", "1", "2", "1", None, "2"]
    assert [r.output for r in got if r.state is JobState.succeeded] == [
        {"y": 2000},
        {"y": 1001},
        {"y": 2002},
        {"y": 1003},
        {"y": 2005},
    ]
    assert got[4].state is JobState.failed and got[4].error is not None
    assert got[4].error.type == "unserved_version" and "serves version(s) 1, 2" in got[4].error.message
    assert sorted(Tagged.computed) == [("1", 2), ("2", 3)]  # one run per version group of the batch
    await pool.close()
