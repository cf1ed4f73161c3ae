"""Per-stage timings on every terminal record, on every broker and store: queued <= fetched <= batch_started <=
computed <= stored, ``stored`` the instant the record was written; a message that never computed has only what it
passed; and ``fleet_job_stage_seconds`` counts each stage of each job (real brokers and stores, an in-process
worker)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from fleet import constants as c
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.stages import StageHistograms
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.dags.state import job_id
from fleet.schemas.jobs import JobRecord, JobState, StageTimings
from fleet.store import transitions
from fleet.store.base import Finish
from fleet.store.bundle import Stores
from fleet.store.memory import MemoryStore
from tests.dag_fixtures import urls_for
from tests.gateway_helpers import model_refs
from tests.infra import connected_pair, publish_requests, request_bytes, settings_for, wait_terminal

# every broker kind with every store kind
PAIRS = ["memory", "memory+redis", "nats", "nats+redis", "kafka", "kafka+redis"]
STAGES = ("queue", "batch_wait", "compute", "store")


def stage_count(model: str, stage: str) -> float:
    return REGISTRY.get_sample_value("fleet_job_stage_seconds_count", {"model": model, "stage": stage}) or 0.0


def assert_ordered(record: JobRecord, before: float, after: float) -> None:
    t = record.timings
    assert t is not None, record
    instants = [t.queued, t.fetched, t.batch_started, t.computed, t.stored]
    assert all(v is not None for v in instants), t
    assert instants == sorted(instants), t  # type: ignore[type-var]
    assert before <= t.queued and t.stored <= after  # type: ignore[operator]
    assert t.stored == record.finished_at  # the instant the terminal record was written
    assert t.hop_started is None and record.trace_id is None  # not a DAG step, tracing off


@pytest.mark.services
@pytest.mark.parametrize("pair", PAIRS)
async def test_every_record_carries_its_stage_timings_in_order(
    request: pytest.FixtureRequest, pair: str, unique: str
) -> None:
    settings = settings_for(pair, urls_for(request, pair))
    handler = with_name(EchoHandler, f"timed-{unique}")
    model = handler.spec.name
    async with connected_pair(settings) as (broker, store):
        worker = Worker(handler(), broker, store, settings=settings, max_batch=8, max_wait_ms=20)
        async with worker:
            before = time.time()
            ids = await publish_requests(broker, model, [{"text": f"t{i}"} for i in range(20)], f"tm-{unique}")
            bad = f"tm-{unique}-bad"  # names another model: rejected at admission, never computed
            data = request_bytes("another-model", bad, {"text": "x"})
            await broker.publish(c.request_subject(model), data, msg_id=bad)
            records = await wait_terminal(store, [*ids, bad])
            after = time.time()
        for job_id in ids:
            assert records[job_id].state is JobState.succeeded
            assert_ordered(records[job_id], before, after)
        rejected = records[bad].timings
        assert records[bad].state is JobState.failed and rejected is not None
        assert rejected.batch_started is None and rejected.computed is None  # it never reached a batch
        assert rejected.queued is None  # no valid request, so no submitted_at to trust
        assert rejected.fetched is not None and rejected.stored is not None and rejected.fetched <= rejected.stored
        # as read back by a fresh reader (REST and the SDK parse the same stored JSON)
        again = await store.get(ids[0])
        assert again is not None and again.timings == records[ids[0]].timings
    for stage in STAGES:
        assert stage_count(model, stage) == len(ids), stage
    assert stage_count(model, "hop") == 0


@pytest.mark.services
@pytest.mark.parametrize("pair", ["nats+redis", "memory"])
async def test_a_dag_steps_record_carries_its_hop_from_the_record_that_completed_its_inputs(
    request: pytest.FixtureRequest, pair: str, unique: str
) -> None:
    """A 2-step DAG: step b's record has hop_started (step a's record stored) <= queued (the runner published b) <=
    fetched <= ...; step a, a first step, has none; ``hop`` is counted once, for b."""
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for(pair, urls_for(request, pair), models=refs)
    handler = with_name(EchoHandler, echo)
    spec = {
        "name": f"hop-{unique}",
        "steps": [
            {"id": "a", "model": echo, "input": {"text": "${input.text}"}},
            {"id": "b", "model": echo, "input": {"text": "${steps.a.output.text}"}},
        ],
        "output": "${steps.b.output}",
    }
    async with connected_pair(settings) as (broker, store):
        runner = DagRunner(broker, store, Stores.beside(store).dags, {echo: handler.spec})
        worker = Worker(handler(), broker, store, settings=settings, max_wait_ms=2, on_settled=[runner.on_settled])
        async with worker:
            name, _, _ = await runner.register(spec)
            before = time.time()
            _, doc = await runner.start(name, {"text": "hi"}, f"hop-{unique}")
            doc = await runner.wait(f"hop-{unique}", 20)
            after = time.time()
        assert doc["finished_at"] is not None and doc["run"].get("error") is None, doc["run"]
        key = doc.get("key")
        a = await store.get(job_id(f"hop-{unique}", "a", 0, key))
        b = await store.get(job_id(f"hop-{unique}", "b", 0, key))
    assert a is not None and b is not None and a.timings is not None and b.timings is not None
    assert a.timings.hop_started is None  # a run's first step: no hop into it
    assert_ordered(a, before, after)
    t = b.timings
    assert t.hop_started == a.timings.stored  # the record that completed b's input
    instants = [t.hop_started, t.queued, t.fetched, t.batch_started, t.computed, t.stored]
    assert all(v is not None for v in instants) and instants == sorted(instants), t  # type: ignore[type-var]
    assert before <= t.hop_started and t.stored <= after  # type: ignore[operator]
    assert stage_count(echo, "hop") == 1  # b's hop; a had none
    assert stage_count(echo, "queue") == 2


async def test_the_store_stamps_stored_and_keeps_a_trace_id_and_an_answer_from_elsewhere_has_none() -> None:
    store = MemoryStore(job_ttl_s=60)
    timings = StageTimings(queued=1.0, fetched=2.0, batch_started=3.0, computed=4.0)
    trace = "0af7651916cd43dd8448eb211c80319c"
    ((won, record),) = await store.finish_many(
        [Finish("j1", JobState.succeeded, "echo", output=1, timings=timings, trace_id=trace)]
    )
    assert won and record.timings is not None and record.timings.stored == record.finished_at
    assert record.trace_id == trace
    read = await store.get("j1")
    assert read is not None and read.timings == record.timings and read.trace_id == trace
    # a cache answer or a cancel (no run): no timings at all
    plain = transitions.finished(
        None, "j2", JobState.cancelled, model="echo", output=None, error=None, worker_id=None, now=5.0
    )
    assert plain.timings is None and plain.trace_id is None
    assert b"timings" not in transitions.record_json(plain)


def test_a_batch_observed_at_once_counts_as_each_value_observed_alone(unique: str) -> None:
    """``StageHistograms`` adds a batch's values bucket by bucket; the buckets, counts and sums are those of
    ``Histogram.observe`` per value (its fallback), skewed clocks (a negative wait) counted as 0."""
    records = []
    for i, (queued, fetched) in enumerate([(1.0, 1.0004), (1.0, 1.3), (2.0, 1.5), (1.0, 61.0), (1.0, 1.0)]):
        timings = StageTimings(queued=queued, fetched=fetched, batch_started=fetched + 0.002 * i)
        timings.computed = timings.batch_started + 0.01 if i % 2 else None  # type: ignore[operator]
        record = transitions.finished(
            None,
            f"j{i}",
            JobState.succeeded,
            model="m",
            output=None,
            error=None,
            worker_id=None,
            now=70.0,
            timings=timings,
            trace_id="ab" * 16 if i == 1 else None,
        )
        records.append(record)
    bulk, alone = StageHistograms(f"bulk-{unique}"), StageHistograms(f"alone-{unique}")
    alone._bulk = False
    bulk.observe(records)
    alone.observe(records)
    samples = {
        s.name + repr(sorted((k, v) for k, v in s.labels.items() if k != "model")): s.value
        for metric in REGISTRY.collect()
        if metric.name == "fleet_job_stage_seconds"
        for s in metric.samples
        if s.labels.get("model") in (bulk.model, alone.model) and s.labels.get("model") == bulk.model
    }
    for name, value in samples.items():
        other = next(
            s.value
            for metric in REGISTRY.collect()
            if metric.name == "fleet_job_stage_seconds"
            for s in metric.samples
            if s.labels.get("model") == alone.model
            and s.name + repr(sorted((k, v) for k, v in s.labels.items() if k != "model")) == name
        )
        assert value == pytest.approx(other), name
    assert stage_count(bulk.model, "queue") == 5 and stage_count(bulk.model, "compute") == 2
    assert stage_count(bulk.model, "store") == 2  # only the records that computed
