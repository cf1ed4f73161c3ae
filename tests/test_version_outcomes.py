"""The settle hook of versioned jobs (``fleet.consumers.version_outcomes``) on memory and Redis stores, and the
rollouts store's batched outcomes and comparison list (memory, Redis, Redis Cluster): outcomes counted once per
job that names a version (a redelivery counts nothing), only verdicts (succeeded, failed) counted, a shadow pair
compared exactly once whichever side settles last, a failed side noted without a score, and a Redis that is gone
never raising into the settle path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleet import constants as c
from fleet.cli.compose import runtimes_of
from fleet.consumers.requests import Job
from fleet.consumers.version_outcomes import VersionOutcomes, compare, outcome_of
from fleet.repository.layout import Repository
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.manifest import ModelManifest
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.manifests import ManifestStore
from fleet.store.redis import RedisStore
from fleet.store.rollouts import ComparisonEntry, Outcome, RedisRolloutStore, RolloutStore
from tests.gateway_helpers import private_server
from tests.traffic_fixtures import versioned_model


class _Unused:
    """The delivery of a settled job: the hook never touches it."""

    subject, data, headers = "fleet.req.x", b"", {}


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResultStore]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    made = make_store(FleetSettings(store_url=url))
    await made.connect()
    try:
        yield made
    finally:
        await made.close()


def _record(job_id: str, model: str, state: JobState, version: str | None, **fields: Any) -> JobRecord:
    now = time.time()
    return JobRecord(
        job_id=job_id, model=model, state=state, created_at=now - 0.2, finished_at=now, version=version, **fields
    )


def _job(record: JobRecord, submitted_at: float | None = None) -> Job:
    message = RequestMessage(
        job_id=record.job_id, model=record.model, input={}, submitted_at=submitted_at or time.time() - 0.05
    )
    return Job(_Unused(), record.job_id, request=message)  # type: ignore[arg-type]


async def _settle(hook: VersionOutcomes, store: ResultStore, *settled: tuple[JobRecord, bool]) -> None:
    """Store each record terminal (as the settle path does), then run the hook for all of them together."""
    for record, _ in settled:
        await store.create(record)
    await asyncio.gather(*(hook.on_settled(_job(record), record, won) for record, won in settled))
    await hook.drain()


async def test_outcomes_are_counted_once_per_job_and_only_for_verdicts(store: ResultStore, unique: str) -> None:
    model, rollouts = f"m-{unique}", Stores.beside(store).rollouts
    hook = VersionOutcomes(store, rollouts)
    ok = _record(f"ok-{unique}", model, JobState.succeeded, "1")
    await _settle(
        hook,
        store,
        (ok, True),
        (_record(f"bad-{unique}", model, JobState.failed, "2"), True),
        (_record(f"exp-{unique}", model, JobState.expired, "2"), True),
        (_record(f"can-{unique}", model, JobState.cancelled, "1"), True),
        (_record(f"plain-{unique}", model, JobState.succeeded, None), True),
    )
    await hook.on_settled(_job(ok), ok, False)  # a redelivery of a job another write ended: counted already
    await hook.drain()
    window = await rollouts.window(model, ["1", "2"], 60)
    assert (window["1"].requests, window["1"].failures) == (1, 0)
    assert (window["2"].requests, window["2"].failures) == (1, 1)
    assert window["1"].p99_ms is not None and window["1"].p99_ms < 60_000


@pytest.mark.parametrize("order", ["primary first", "shadow first", "together"])
async def test_a_shadow_pair_is_compared_once_whichever_side_settles_last(
    store: ResultStore, unique: str, order: str
) -> None:
    model, rollouts = f"m-{unique}", Stores.beside(store).rollouts
    hook = VersionOutcomes(store, rollouts, lambda m, v: "classification")
    primary_id = f"job-{unique}"
    primary = _record(
        primary_id, model, JobState.succeeded, "1", arm="primary", output={"labels": [{"label": "pos", "score": 0.9}]}
    )
    shadow = _record(
        primary_id + c.SHADOW_JOB_SUFFIX,
        model,
        JobState.succeeded,
        "2",
        arm="shadow",
        shadow_of=primary_id,
        output={"labels": [{"label": "neg", "score": 0.6}]},
    )
    if order == "together":
        await _settle(hook, store, (primary, True), (shadow, True))
    else:
        first, second = (primary, shadow) if order == "primary first" else (shadow, primary)
        await _settle(hook, store, (first, True))
        assert await rollouts.comparisons(model) == []  # the other side is not there yet
        await _settle(hook, store, (second, True))
    await _settle(hook, store)  # nothing more
    await hook.on_settled(_job(shadow), shadow, False)  # a redelivery claims nothing new
    await hook.drain()
    entries = await rollouts.comparisons(model)
    assert len(entries) == 1, entries
    entry = entries[0]
    assert (entry.job_id, entry.shadow_job_id, entry.version, entry.shadow_version) == (
        primary_id,
        shadow.job_id,
        "1",
        "2",
    )
    assert (
        entry.score == 0.0 and entry.runtime == "classification" and entry.output_digest != entry.shadow_output_digest
    )
    window = await rollouts.window(model, ["1", "2"], 60)
    assert window["2"].agreement == 0.0 and window["2"].agreement_samples == 1
    assert window["1"].requests == 1 and window["2"].requests == 1


def test_a_failed_side_is_noted_without_a_score() -> None:
    primary = _record("p", "m", JobState.succeeded, "1", arm="primary", output={"x": 1})
    shadow = _record("p.shadow", "m", JobState.failed, "2", arm="shadow", shadow_of="p")
    entry = compare(primary, shadow, None)
    assert entry.score is None and entry.note is not None and "shadow failed" in entry.note
    odd = _record("p.shadow", "m", JobState.succeeded, "2", arm="shadow", shadow_of="p", output={"y": 2})
    assert compare(primary, odd, "classification").score is None  # not of the runtime's shape: noted
    assert compare(primary, odd, None).score == 0.0
    assert compare(primary, primary, None).score == 1.0


def test_only_verdicts_count_and_latency_is_end_to_end() -> None:
    record = _record("j", "m", JobState.succeeded, "1")
    outcome = outcome_of(record, record.finished_at - 0.25 if record.finished_at else None)
    assert outcome == Outcome("m", "1", True, pytest.approx(250.0))
    assert outcome_of(_record("j", "m", JobState.expired, "1"), None) is None
    assert outcome_of(_record("j", "m", JobState.succeeded, None), None) is None


@pytest.mark.services  # a private redis-server
async def test_a_redis_that_is_gone_never_raises_into_the_settle_path(
    caplog: pytest.LogCaptureFixture, unique: str
) -> None:
    results = make_store(FleetSettings(store_url="memory://"))
    await results.connect()
    with private_server("redis") as (url, proc):
        other = make_store(FleetSettings(store_url=url))
        assert isinstance(other, RedisStore)
        await other.connect()
        try:
            hook = VersionOutcomes(results, RedisRolloutStore(other))
            proc.terminate()
            proc.wait(10)
            record = _record(f"j-{unique}", "m", JobState.succeeded, "1", arm="primary")
            with caplog.at_level(logging.WARNING):
                started = time.monotonic()
                await hook.on_settled(_job(record), record, True)  # queued: returns at once
                assert time.monotonic() - started < 0.05
                await hook.drain()
            assert any("version outcomes" in r.getMessage() for r in caplog.records)
        finally:
            await other.close()
    await results.close()


# -- the stores -----------------------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis", "redis_cluster"])
async def rollouts(request: pytest.FixtureRequest) -> AsyncIterator[RolloutStore]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue(f"{request.param}_url")
    made = make_store(FleetSettings(store_url=url))
    await made.connect()
    try:
        yield Stores.beside(made).rollouts
    finally:
        await made.close()


async def test_outcomes_of_several_models_are_counted_in_one_call(rollouts: RolloutStore, unique: str) -> None:
    a, b = f"a-{unique}", f"b-{unique}"
    outcomes = [Outcome(a, "1", True, 12.0), Outcome(a, "1", False, 30.0), Outcome(b, "2", True, None)]
    await rollouts.record_outcomes(outcomes)
    await rollouts.record_outcomes([])
    assert (await rollouts.window(a, ["1"], 60))["1"].requests == 2
    assert (await rollouts.window(a, ["1"], 60))["1"].failures == 1
    assert (await rollouts.window(b, ["2"], 60))["2"].requests == 1


async def test_comparisons_are_kept_newest_first_and_capped(rollouts: RolloutStore, unique: str) -> None:
    model = f"m-{unique}"
    for i in range(3):
        entry = ComparisonEntry(
            at=float(i),
            model=model,
            job_id=f"j{i}",
            shadow_job_id=f"j{i}.shadow",
            version="1",
            shadow_version="2",
            runtime=None,
            output_digest="a",
            shadow_output_digest="b",
            score=0.5,
        )
        await rollouts.add_comparison(entry)
    listed = await rollouts.comparisons(model, limit=2)
    assert [e.job_id for e in listed] == ["j2", "j1"]
    assert await rollouts.comparisons(model, limit=0) == []
    assert await rollouts.comparisons(f"other-{unique}") == []


@pytest.fixture(params=["memory", "redis"])
async def manifests(request: pytest.FixtureRequest) -> AsyncIterator[ManifestStore]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    made = make_store(FleetSettings(store_url=url))
    await made.connect()
    try:
        yield Stores.beside(made).manifests
    finally:
        await made.close()


async def test_every_published_version_is_kept_beside_the_latest(manifests: ManifestStore, unique: str) -> None:
    name = f"m-{unique}"
    one = ModelManifest.model_validate({"runtime": "handler", "handler": "x.y:Z", "description": "one"})
    two = ModelManifest.model_validate({"runtime": "handler", "handler": "x.y:Z", "description": "two"})
    assert await manifests.versions(name) == [] and await manifests.read_version(name, "1") is None
    await manifests.publish(name, "1", one)
    await manifests.publish(name, "2", two)
    latest = await manifests.read(name)
    assert latest is not None and latest[0] == "2" and latest[1].description == "two"  # read(name) as before
    assert sorted(await manifests.versions(name)) == ["1", "2"]
    first = await manifests.read_version(name, "1")
    assert first is not None and first.description == "one"


def test_the_runtime_of_a_version_comes_from_its_repository_entry(tmp_path: Path) -> None:
    runtime_of = runtimes_of(Repository(versioned_model(tmp_path, "rt-model", ("1", "2"))))
    assert runtime_of("rt-model", "2") == "handler" and runtime_of("rt-model", None) == "handler"
    assert runtime_of("embed", "1") == "embeddings" and runtime_of("echo", None) is None
    assert runtime_of("nowhere", "1") is None and runtime_of("rt-model", "9") is None
