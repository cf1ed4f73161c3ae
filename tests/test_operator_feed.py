"""The operator feed: ``GET /v1/operator/snapshot`` and ``GET /v1/operator/stream`` on a real gateway with a real
worker (in memory and on NATS + Redis), the fan-out rules (one encoding for every stream, a slow stream gets a full
snapshot instead of a queue), the beat bookkeeping, and the DAG store's recent-runs index (memory and Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from fleet.brokers import make_broker
from fleet.producers.gateway import create_app
from fleet.producers.gateway.operator.beats import Beats
from fleet.producers.gateway.operator.feed import BACKLOG_EVENTS, OperatorFeed, unheard_replicas
from fleet.scaling import MemoryScalingStore
from fleet.schemas.operator import OperatorSnapshot
from fleet.schemas.scaling import DecisionRecord, ScalingStatus
from fleet.schemas.wire import DispatcherBeat, Heartbeat
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from tests.gateway_helpers import FAST_LIMITS, ObservedWorker, model_refs, served, urls_for
from tests.infra import connected_pair, eventually, settings_for

PAIRS = ["memory", "nats+redis"]


def heartbeat(worker_id: str, model: str, **fields: Any) -> Heartbeat:
    values: dict[str, Any] = {"device": "cpu", "pid": 1, "max_batch": 8, "max_wait_ms": 5.0, "state": "ready"}
    return Heartbeat(worker_id=worker_id, model=model, **{**values, **fields})


# -- beats ------------------------------------------------------------------------------------------------------
def test_beats_count_completions_from_a_baseline_and_forget_stopped_and_silent_workers() -> None:
    now = [100.0]
    beats = Beats(heartbeat_interval_s=1.0, clock=lambda: now[0])
    beats.observe_worker(heartbeat("w1", "echo", items=50, failures=2))  # baseline: the past is not counted
    assert beats.counters.get("echo") is None
    beats.observe_worker(heartbeat("w1", "echo", items=58, failures=3))
    assert (beats.counters["echo"].completed, beats.counters["echo"].failed) == (8, 1)
    beats.observe_worker(heartbeat("w1", "echo", items=3))  # restarted under the same id: a new baseline
    assert beats.counters["echo"].completed == 8
    beats.observe_worker(heartbeat("w2", "echo", state="starting"))
    assert [w.state for w in beats.worker_views()] == ["ready", "starting"]
    beats.observe_worker(heartbeat("w2", "echo", state="stopped"))
    assert not beats.knows_worker("w2") and beats.knows_worker("w1")
    now[0] += 3.5  # three intervals of silence
    assert not beats.knows_worker("w1") and beats.worker_views() == []


def test_a_worker_view_carries_its_loaded_versions_replicas_and_breaker() -> None:
    beats = Beats(heartbeat_interval_s=1.0)
    beats.observe_worker(heartbeat("w1", "embed", loaded=["1", "2"], replicas=4, breaker="open"))
    beats.observe_worker(heartbeat("w2", "embed"))
    views = {v.worker_id: v for v in beats.worker_views()}
    assert (views["w1"].loaded, views["w1"].replicas, views["w1"].breaker) == (["1", "2"], 4, "open")
    assert (views["w2"].loaded, views["w2"].replicas, views["w2"].breaker) == ([], 1, "closed")


def test_dispatcher_views() -> None:
    beats = Beats(heartbeat_interval_s=1.0)
    beats.observe_dispatcher(
        DispatcherBeat(
            dispatcher_id="d1", model="sleep", policy="jiq-amnesia", announce="sq", idle_length=3, outstanding=7
        )
    )
    (view,) = beats.dispatcher_views()
    assert (view.policy, view.idle_queue_length, view.outstanding_total) == ("jiq-amnesia", 3, 7)


# -- fan-out ----------------------------------------------------------------------------------------------------
async def bare_feed(models: list[str], interval_s: float = 60.0) -> OperatorFeed:
    broker = make_broker(FleetSettings())
    await broker.connect()
    for model in models:
        await broker.ensure_model(model)
    return OperatorFeed(
        settings=FleetSettings(),
        models=models,
        broker=broker,
        scaling=MemoryScalingStore(),
        beats=Beats(1.0),
        interval_s=interval_s,
        window_s=5 * interval_s,
    )


async def test_streams_share_one_encoding_and_a_slow_one_gets_a_full_snapshot() -> None:
    feed = await bare_feed(["echo"], interval_s=1.0)
    await feed.sample()
    seq_a, _ = feed.full_event()
    seq_b = seq_a
    await feed.sample()
    seq_a, events_a = await feed.events_after(seq_a, 0.1)
    seq_b, events_b = await feed.events_after(seq_b, 0.1)
    assert events_a[0] is events_b[0]  # the same bytes object: encoded once
    delta = json.loads(events_a[0].split(b"data: ", 1)[1])
    assert len(delta["series"]["echo"]) == 1
    slow = seq_a
    for _ in range(BACKLOG_EVENTS + 3):
        await feed.sample()
    assert len(feed._backlog) == BACKLOG_EVENTS  # bounded whatever the readers do
    _, caught_up = await feed.events_after(slow, 0.1)
    assert len(caught_up) == 1
    full = json.loads(caught_up[0].split(b"data: ", 1)[1])
    assert len(full["series"]["echo"]) == 5  # the ring (window 5 s at 1 s), not the missed deltas
    _, none = await feed.events_after(feed.seq, 0.05)
    assert none == []  # nothing new: the stream says keep-alive


async def test_a_waiting_stream_wakes_on_the_next_sampling() -> None:
    feed = await bare_feed(["echo"])
    seq, _ = feed.full_event()
    waiter = asyncio.create_task(feed.events_after(seq, 10))
    await asyncio.sleep(0.05)
    await feed.sample()
    new_seq, events = await asyncio.wait_for(waiter, 2)
    assert new_seq == seq + 1 and len(events) == 1


# -- the gateway ------------------------------------------------------------------------------------------------
@dataclass
class Env:
    settings: FleetSettings
    base: str
    client: httpx.AsyncClient
    model: str
    app: Any


@contextlib.asynccontextmanager
async def open_env(request: pytest.FixtureRequest, pair: str, unique: str) -> AsyncIterator[Env]:
    refs, (model,) = model_refs(unique, "echo")
    settings = settings_for(pair, urls_for(request, pair), models=refs, operator_interval_s=0.2)
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
            async with ObservedWorker(broker, store, model):
                yield Env(settings, base, client, model, app)


@pytest.fixture(params=PAIRS)
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    async with open_env(request, request.param, unique) as e:
        yield e


async def snapshot_of(env: Env) -> OperatorSnapshot:
    response = await env.client.get("/v1/operator/snapshot")
    assert response.status_code == 200, response.text
    return OperatorSnapshot.model_validate(response.json())


async def test_snapshot_shows_the_model_its_worker_and_the_completions(env: Env) -> None:
    async def worker_ready() -> bool:
        return any(w.model == env.model and w.state == "ready" for w in (await snapshot_of(env)).workers)

    await eventually(worker_ready, 10, "the worker in the snapshot")
    (idle,) = [w for w in (await snapshot_of(env)).workers if w.model == env.model]
    assert (idle.items, idle.latency_ewma_ms, idle.latency_p99_ms) == (0, None, None), "idle: no latency, not 0 ms"
    assert (await snapshot_of(env)).models[0].ready_workers == 1
    ids = []
    for i in range(20):
        response = await env.client.post("/v1/jobs", json={"model": env.model, "input": {"data": {"i": i}}})
        assert response.status_code == 202, response.text
        ids.append(response.json()["job_id"])
    for job_id in ids:
        record = (await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 10})).json()
        assert record["state"] == "succeeded", record

    async def throughput_seen() -> bool:
        snap = await snapshot_of(env)
        return any((s.throughput_per_s or 0) > 0 for s in snap.series[env.model])

    await eventually(throughput_seen, 10, "throughput in the series")

    async def drained() -> bool:  # a sample may have read the lag before the last acks
        return (await snapshot_of(env)).models[0].lag == 0

    await eventually(drained, 10, "lag 0 once every job is done")
    snap = await snapshot_of(env)
    (panel,) = snap.models
    assert panel.model == env.model and panel.lag == 0 and panel.dead_letters == 0
    assert panel.min_replicas == env.settings.autoscale_min_replicas and panel.pinned is None
    (worker,) = [w for w in snap.workers if w.model == env.model]
    assert worker.heartbeat_age_s < 2 and worker.device == "cpu"
    assert len(snap.series[env.model]) >= 2
    assert all(a.at < b.at for a, b in zip(snap.series[env.model], snap.series[env.model][1:], strict=False))


async def test_decisions_of_the_last_15_minutes_show_newest_first(env: Env) -> None:
    scaling = env.app.state.gateway.scaling
    now = time.time()
    for at, reason in [(now - 3600, "an hour ago"), (now - 60, "a minute ago"), (now - 1, "just now")]:
        await scaling.record(
            DecisionRecord(
                at=at,
                model=env.model,
                current_replicas=1,
                desired_replicas=2,
                replicas=2,
                lag=5,
                arrival_rate=1.0,
                throughput_per_replica=1.0,
                reason=reason,
                changed=True,  # alike no-change decisions would be one line (tests/test_operator_words.py)
            )
        )
    await scaling.put_status(
        ScalingStatus(
            model=env.model,
            current_replicas=2,
            desired_replicas=3,
            lag=5,
            arrival_rate=1.0,
            min_replicas=1,
            max_replicas=4,
            paused=False,
        )
    )

    async def shown() -> bool:
        return bool((await snapshot_of(env)).decisions.get(env.model))

    await eventually(shown, 5, "decisions in the snapshot")
    snap = await snapshot_of(env)
    assert [d.reason for d in snap.decisions[env.model]] == ["just now", "a minute ago"]
    (panel,) = snap.models
    assert (panel.current_replicas, panel.desired_replicas) == (2, 3)
    assert panel.wanted_replicas == 2, "the newest decision's recommendation"
    assert panel.reason.startswith("no autoscaler has reported"), panel.reason  # this status names no backend


async def test_recent_jobs_lists_this_gateways_jobs_newest_first_with_their_state(env: Env) -> None:
    ids = []
    for i in range(3):
        response = await env.client.post("/v1/jobs", json={"model": env.model, "input": {"data": {"i": i}}})
        ids.append(response.raise_for_status().json()["job_id"])
    for job_id in ids:
        await env.client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
    answer = (await env.client.get("/v1/operator/jobs", params={"limit": 2})).raise_for_status().json()
    assert [j["job_id"] for j in answer["jobs"]] == ids[::-1][:2]
    assert {j["state"] for j in answer["jobs"]} == {"succeeded"} and answer["jobs"][0]["finished_at"] is not None
    assert "this gateway process" in answer["scope"] and answer["kept"] == 200


def test_replicas_the_autoscaler_runs_without_a_heartbeat_count_as_starting() -> None:
    def status(backend: str | None, current: int) -> ScalingStatus:
        return ScalingStatus(
            model="m", current_replicas=current, desired_replicas=current, lag=0, arrival_rate=0.0,
            min_replicas=0, max_replicas=4, paused=False, backend=backend, updated_at=1.0,
        )  # fmt: skip

    assert unheard_replicas(status("process", 4), heard=1) == 3
    assert unheard_replicas(status("process", 1), heard=2) == 0  # a worker started by hand as well
    assert unheard_replicas(status("dry-run", 4), heard=0) == 0  # a dry run's replicas are on paper only
    assert unheard_replicas(status(None, 4), heard=0) == 0


async def read_events(response: httpx.Response, count: int) -> list[tuple[str, str]]:
    """The first ``count`` events or comments of an SSE response: ('snapshot', data) or (':', comment)."""
    out: list[tuple[str, str]] = []
    event = ""
    async for line in response.aiter_lines():
        if line.startswith(":"):
            out.append((":", line))
        elif line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((event, line[len("data: ") :]))
        if len(out) >= count:
            break
    return out


async def test_stream_sends_the_ring_then_one_sample_per_model_per_sampling(env: Env) -> None:
    await asyncio.sleep(0.7)  # a few samplings in the ring
    async with env.client.stream("GET", "/v1/operator/stream") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await asyncio.wait_for(read_events(response, 4), 10)
    kinds = [kind for kind, _ in events]
    assert kinds == ["snapshot"] * 4
    first = OperatorSnapshot.model_validate_json(events[0][1])
    assert len(first.series[env.model]) >= 3
    deltas = [OperatorSnapshot.model_validate_json(data) for _, data in events[1:]]
    assert all(len(d.series[env.model]) == 1 for d in deltas)
    times = [first.series[env.model][-1].at] + [d.series[env.model][0].at for d in deltas]
    assert times == sorted(times) and len(set(times)) == 4  # no sample twice, none skipped


async def test_many_streams_cost_one_sampling(env: Env) -> None:
    feed: OperatorFeed = env.app.state.gateway.operator_feed

    async def one() -> list[tuple[str, str]]:
        async with env.client.stream("GET", "/v1/operator/stream") as response:
            return await read_events(response, 3)

    before = feed.samplings
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(20))), 20)
    elapsed = time.monotonic() - started
    assert all(len(r) == 3 for r in results)
    assert feed.samplings - before <= elapsed / env.settings.operator_interval_s + 2


async def test_a_stalled_stream_does_not_hold_up_the_others(env: Env) -> None:
    """One client opens a stream and never reads; another keeps receiving every sampling."""
    stalled = env.client.stream("GET", "/v1/operator/stream")
    async with stalled as never_read:
        assert never_read.status_code == 200
        async with httpx.AsyncClient(base_url=env.base, timeout=10) as other:
            async with other.stream("GET", "/v1/operator/stream") as response:
                events = await asyncio.wait_for(read_events(response, 6), 10)
    assert len(events) == 6


async def test_operator_routes_need_the_token_when_one_is_set(request: pytest.FixtureRequest, unique: str) -> None:
    refs, _ = model_refs(unique, "echo")
    settings = FleetSettings(models=refs, operator_token="tok", operator_interval_s=0.2)
    app = create_app(settings, limits=FAST_LIMITS)
    async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        for path in ("/v1/operator/snapshot", "/v1/operator/stream"):
            assert (await client.get(path)).status_code == 401
            assert (await client.get(path, headers={"Authorization": "Bearer nope"})).status_code == 403
        ok = await client.get("/v1/operator/snapshot", headers={"Authorization": "Bearer tok"})
        assert ok.status_code == 200


# -- recent DAG runs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store_kind", ["memory", "redis"])
async def test_recent_runs_index_keeps_the_newest_runs(
    request: pytest.FixtureRequest, store_kind: str, unique: str
) -> None:
    url = request.getfixturevalue("redis_url") if store_kind == "redis" else "memory://"
    store = make_store(FleetSettings(store_url=url))
    await store.connect()
    try:
        dags = Stores.beside(store).dags
        for i in range(5):
            doc = {"run": {"run_id": f"{unique}-{i}", "dag": "d", "state": "running"}, "created_at": time.time()}
            assert (await dags.create_run(f"{unique}-{i}", doc))[0]
            await asyncio.sleep(0.002)
        again = {"run": {"run_id": f"{unique}-0", "dag": "d"}, "created_at": time.time()}
        assert not (await dags.create_run(f"{unique}-0", again))[0]  # a repeat does not move it up
        recent = await dags.recent_runs(3)
        assert [run_id for run_id, _ in recent] == [f"{unique}-{i}" for i in (4, 3, 2)]
    finally:
        await store.close()


def test_schema_export_has_the_operator_models() -> None:
    from fleet.schemas.export import all_schemas

    schemas = all_schemas({})
    snapshot = schemas["operator-snapshot.schema.json"]
    assert {"models", "series", "decisions", "workers", "dispatchers", "dead_letters", "runs"} <= set(
        snapshot["properties"]
    )
    for name in ("operator-access", "scale-request", "letter-selection", "redrive-result", "drain-request"):
        assert f"{name}.schema.json" in schemas


async def test_closing_the_streams_ends_them_so_a_shutdown_is_not_held_up(unique: str) -> None:
    from fleet.producers.gateway.app import close_operator_streams

    refs, _ = model_refs(unique, "echo")
    app = create_app(FleetSettings(models=refs, operator_interval_s=0.2), limits=FAST_LIMITS)
    async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        async with client.stream("GET", "/v1/operator/stream") as response:
            lines = response.aiter_lines()
            events = 0
            async for line in lines:
                events += line.startswith("event: ")
                if events == 2:
                    break
            close_operator_streams(app)

            async def rest() -> list[str]:
                return [line async for line in lines]

            left = await asyncio.wait_for(rest(), 5)  # the response ends
            assert sum(line.startswith("event: ") for line in left) <= 2
