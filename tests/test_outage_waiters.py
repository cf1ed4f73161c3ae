"""Every waiter gets its terminal record through a Redis outage (issue 9, item 2, the waiters' half).

A real gateway (uvicorn, in-process) and three real workers of the ``sleep`` model on the session's NATS, over a
redis-server of this test's own that persists to an append-only file. N jobs are submitted and every kind of
waiter is held on each: a WebSocket per job, one multiplexed ``/v1/ws`` for all, an event stream per job, a
long-poll per job (wait up to the gateway's maximum) and the SDK's ``wait`` (with its default long-polls, and with
0.5 s long-polls that end inside the outage). While jobs still run, redis-server is
SIGKILLed, kept down for a few seconds and restarted from its AOF on the same port; completion notices published
around the outage are lost with it. Every accepted job must end terminal, every waiter must answer with the job's
terminal record (the one in the store), none with an error, and no job may end ``failed``. An event stream
requested while Redis is down opens and waits too (issue 26 item 6: it answered ``503``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from fleet.brokers import make_broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.consumers.worker import Worker
from fleet.producers.gateway import create_app
from fleet.producers.sdk import FleetClient, ws_url
from fleet.schemas.jobs import JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store.redis import RedisStore
from tests.aof_redis import AofRedis, aof_redis
from tests.gateway_helpers import FAST_LIMITS, asgi_gateway, model_refs, served
from tests.infra import connected_pair

JOBS = 30
SERVICE_MS = 800  # per job; 3 workers take ~8 s for all, so the outage falls early in the run
OUTAGE_S = 2.5
WORKERS = 3
ANSWER_TIMEOUT_S = 90
KINDS = ("ws", "mux", "sse", "long_poll", "sdk", "sdk_short")


@pytest.fixture
def redis_aof() -> Iterator[AofRedis]:
    with aof_redis() as server:
        yield server


class Waiters:
    """What each waiter answered, per kind and job id; anything else it said is an error.

    The HTTP waiters share one client per kind (building a client costs an SSL context: tens of milliseconds of a
    loop that also serves the gateway).
    """

    def __init__(self, base: str, job_ids: list[str], http: httpx.AsyncClient, sdks: list[FleetClient]) -> None:
        self.base = base
        self.job_ids = job_ids
        self.http = http
        self.sdk, self.sdk_short = sdks
        self.results: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in KINDS}
        self.errors: list[str] = []

    def tasks(self) -> dict[tuple[str, str], asyncio.Task[None]]:
        """One task per waiter, by (kind, job id); the multiplexed socket's job id is ``*``."""
        per_job = {
            "ws": self._ws,
            "sse": self._sse,
            "long_poll": self._long_poll,
            "sdk": self._sdk,
            "sdk_short": self._sdk_short,
        }
        tasks = {("mux", "*"): asyncio.create_task(self._guard("mux", "*", self._mux()))}
        for job_id in self.job_ids:
            for kind, waiter in per_job.items():
                tasks[kind, job_id] = asyncio.create_task(self._guard(kind, job_id, waiter(job_id)))
        return tasks

    async def _guard(self, kind: str, job_id: str, waiter: Any) -> None:
        try:
            await waiter
        except Exception as exc:
            self.errors.append(f"{kind} {job_id}: {exc!r}")

    async def _ws(self, job_id: str) -> None:
        async with ws_connect(ws_url(self.base, f"/v1/jobs/{job_id}/ws")) as ws:
            self.results["ws"][job_id] = json.loads(await ws.recv())
            await ws.wait_closed()
            if ws.close_code != 1000:
                self.errors.append(f"ws {job_id}: closed with {ws.close_code}")

    async def _mux(self) -> None:
        async with ws_connect(ws_url(self.base, "/v1/ws")) as ws:
            await ws.send(json.dumps({"subscribe": self.job_ids}))
            while len(self.results["mux"]) < len(self.job_ids):
                frame = json.loads(await ws.recv())
                if frame.get("type") != "result":
                    self.errors.append(f"mux: {frame}")
                    continue
                self.results["mux"][frame["job"]["job_id"]] = frame["job"]

    async def _sse(self, job_id: str) -> None:
        async with self.http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            if response.status_code != 200:
                self.errors.append(f"sse {job_id}: {response.status_code}")
                return
            async for name, data in sse_events(response.aiter_lines()):
                if name == "result":
                    self.results["sse"][job_id] = data
                elif name not in ("job", "comment"):
                    self.errors.append(f"sse {job_id}: {name} {data}")

    async def _long_poll(self, job_id: str) -> None:
        while job_id not in self.results["long_poll"]:
            response = await self.http.get(f"/v1/jobs/{job_id}", params={"wait": 60})
            if response.status_code != 200:
                self.errors.append(f"long_poll {job_id}: {response.status_code} {response.text}")
                return
            if response.json()["state"] in ("queued", "running"):
                continue  # its 60 s passed: poll again (not expected in this run)
            self.results["long_poll"][job_id] = response.json()

    async def _sdk(self, job_id: str) -> None:
        record = await self.sdk.wait(job_id, timeout_s=ANSWER_TIMEOUT_S)
        self.results["sdk"][job_id] = record.model_dump(mode="json")

    async def _sdk_short(self, job_id: str) -> None:
        """Long-polls of 0.5 s: some end inside the outage with a 503, which ``wait`` must retry, not raise."""
        record = await self.sdk_short.wait(job_id, timeout_s=ANSWER_TIMEOUT_S)
        self.results["sdk_short"][job_id] = record.model_dump(mode="json")


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, Any]]:
    name = None
    async for line in lines:
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield str(name), json.loads(line.removeprefix("data: "))


async def start_workers(settings: FleetSettings, model: str, url: str) -> list[tuple[Worker, Any, RedisStore]]:
    """Each worker with a broker and a store of its own, as if it were its own process."""
    started = []
    for i in range(WORKERS):
        broker, store = make_broker(settings), RedisStore(url, job_ttl_s=settings.job_ttl_s)
        await broker.connect()
        await store.connect()
        handler = with_name(SleepHandler, model)()
        worker = Worker(handler, broker, store, settings=settings, worker_id=f"outage-{i}")
        await worker.start()
        started.append((worker, broker, store))
    return started


async def stop_workers(workers: list[tuple[Worker, Any, RedisStore]]) -> None:
    for worker, broker, store in workers:
        await worker.stop()
        await store.close()
        await broker.close()


async def test_every_waiter_gets_its_terminal_record_through_a_redis_restart(
    redis_aof: AofRedis, nats_url: str, unique: str
) -> None:
    refs, (sleep,) = model_refs(unique, "sleep")
    settings = FleetSettings.model_validate(
        {"broker_url": nats_url, "store_url": redis_aof.url, "models": refs, "heartbeat_interval_s": 0.5}
    )
    store = RedisStore(redis_aof.url, job_ttl_s=settings.job_ttl_s)  # the gateway's
    await store.connect()
    broker = make_broker(settings)
    await broker.connect()
    app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
    workers: list[tuple[Worker, Any, RedisStore]] = []
    try:
        limits = httpx.Limits(max_connections=4 * JOBS)
        async with (
            served(app) as base,
            httpx.AsyncClient(base_url=base, timeout=ANSWER_TIMEOUT_S, limits=limits) as http,
            FleetClient(base, timeout_s=10) as sdk,
            FleetClient(base, timeout_s=10, long_poll_s=0.5) as sdk_short,
        ):
            workers = await start_workers(settings, sleep, redis_aof.url)
            job_ids = []
            for i in range(JOBS):
                body = {"model": sleep, "input": {"mean_ms": SERVICE_MS}, "job_id": f"outage-{unique}-{i}"}
                response = await http.post("/v1/jobs", json=body)
                assert response.status_code == 202, response.text
                job_ids.append(response.json()["job_id"])
            waiters = Waiters(base, job_ids, http, [sdk, sdk_short])
            tasks = waiters.tasks()
            await asyncio.sleep(1.5)  # the waiters are held, the first jobs done, most still queued or running

            before = [await store.get(job_id) for job_id in job_ids]
            unfinished = [r.job_id for r in before if r is not None and not r.terminal]
            assert len(unfinished) >= JOBS // 3, "the outage must fall while many jobs have not ended"
            redis_aof.kill()
            killed_at = time.monotonic()
            await asyncio.sleep(0.3)  # notices already on their way when the server died are read by now
            answered_before = {key for key, t in tasks.items() if t.done()}
            await asyncio.sleep(OUTAGE_S - 0.3)
            answered = {key for key, t in tasks.items() if t.done()} - answered_before
            assert not answered and not waiters.errors, f"answered while Redis was down: {answered} {waiters.errors}"
            await asyncio.to_thread(redis_aof.start)
            assert time.monotonic() - killed_at < 2 * OUTAGE_S + 5

            _, pending = await asyncio.wait(tasks.values(), timeout=ANSWER_TIMEOUT_S)
            for task in pending:
                task.cancel()
            final = {job_id: await store.get(job_id) for job_id in job_ids}
    finally:
        await stop_workers(workers)
        await store.close()
        await broker.close()

    assert store.pubsub.connects >= 2, "the gateway's subscriptions went down with the server and came back"
    assert not pending, f"{len(pending)} waiters never answered; errors: {waiters.errors}"
    assert waiters.errors == [], waiters.errors
    records = {job_id: record for job_id, record in final.items() if record is not None}
    assert sorted(records) == sorted(job_ids), "every accepted job still has its record (AOF)"
    assert all(r.terminal for r in records.values()), {j: r.state for j, r in records.items()}
    for kind in KINDS:
        got = waiters.results[kind]
        assert sorted(got) == sorted(job_ids), f"{kind}: no answer for {sorted(set(job_ids) - set(got))}"
        for job_id, answer in got.items():
            assert JobRecord.model_validate(answer) == records[job_id], f"{kind} {job_id}: not the stored record"
    # The workers' part: an outage must not use up a job's deliveries (consumers/, issue 9 item 2).
    failed = {j: r.error for j, r in records.items() if r.state is JobState.failed}
    assert failed == {}, f"{len(failed)} healthy jobs ended failed: {failed}"
    assert all(r.state is JobState.succeeded for r in records.values())


async def test_a_long_poll_answers_503_only_when_its_own_deadline_passes_in_an_outage(
    redis_aof: AofRedis, unique: str
) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    settings = FleetSettings.model_validate({"store_url": redis_aof.url, "models": refs})
    writer = RedisStore(redis_aof.url, job_ttl_s=60)  # a worker's store elsewhere
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (_, client):
        job_id = (await client.post("/v1/jobs", json={"model": echo, "input": {}})).json()["job_id"]

        async def poll(wait_s: float) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            response = await client.get(f"/v1/jobs/{job_id}", params={"wait": wait_s})
            return response, time.monotonic() - started

        long = asyncio.create_task(poll(30))
        short = asyncio.create_task(poll(1.5))
        await asyncio.sleep(0.3)
        redis_aof.kill()
        late = asyncio.create_task(poll(1.5))  # begins during the outage
        for task in (short, late):
            response, took_s = await asyncio.wait_for(task, 15)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "store_unavailable"
            assert response.headers["retry-after"].isdigit()
            assert took_s >= 1.4, f"answered {took_s:.2f}s into a 1.5 s wait: the outage was not waited out"
        assert not long.done()
        await asyncio.to_thread(redis_aof.start)
        await writer.connect()
        try:
            _, done = await writer.finish(job_id, JobState.succeeded, model=echo, output={"ok": 1})
        finally:
            await writer.close()
        response, _ = await asyncio.wait_for(long, 15)
        assert response.status_code == 200, response.text
        assert JobRecord.model_validate(response.json()) == done


async def test_an_event_stream_opened_while_redis_is_down_waits_and_delivers_the_result(
    redis_aof: AofRedis, unique: str
) -> None:
    """Issue 26 item 6: a stream requested during the outage opens and waits (it answered 503), like a WebSocket."""
    refs, (echo,) = model_refs(unique, "echo")
    settings = FleetSettings.model_validate({"store_url": redis_aof.url, "models": refs})
    writer = RedisStore(redis_aof.url, job_ttl_s=60)  # a worker's store elsewhere
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            job_id = (await http.post("/v1/jobs", json={"model": echo, "input": {}})).json()["job_id"]
            redis_aof.kill()
            async with (
                http.stream("GET", f"/v1/jobs/{job_id}/events") as stream,
                http.stream("GET", f"/v1/jobs/nobody-{unique}/events") as unknown,
            ):
                assert (stream.status_code, unknown.status_code) == (200, 200), await stream.aread()
                events, unknown_events = sse_events(stream.aiter_lines()), sse_events(unknown.aiter_lines())
                assert (await anext(events))[0] == "comment", "keep-alives while Redis is down"
                await asyncio.to_thread(redis_aof.start)
                await writer.connect()
                try:
                    _, done = await writer.finish(job_id, JobState.succeeded, model=echo, output={"ok": 1})
                finally:
                    await writer.close()
                said = [item async for item in events]
                unknown_said = [item async for item in unknown_events if item[0] != "comment"]
    names = [name for name, _ in said if name != "comment"]
    assert names[-1] == "result" and set(names[:-1]) <= {"job"}, said  # "job" if it read the record before the finish
    assert JobRecord.model_validate(said[-1][1]) == done
    assert unknown_said == [("error", unknown_said[0][1])] and unknown_said[0][1]["error"]["type"] == "job_not_found"


async def test_a_run_stream_socket_and_long_poll_opened_while_redis_is_down_wait_for_it(
    redis_aof: AofRedis, unique: str
) -> None:
    """The DAG run's waiters too: its SSE stream and its long-poll answered 503 and its WebSocket an error frame."""
    refs, (echo,) = model_refs(unique, "echo")
    settings = FleetSettings.model_validate({"store_url": redis_aof.url, "models": refs})
    spec = {
        "name": f"wait-{unique}",
        "steps": [{"id": "a", "model": echo, "input": {"x": 1}}],
        "output": "${steps.a.output}",
    }
    async with connected_pair(settings) as (broker, store):
        app = create_app(settings, broker=broker, store=store, limits=FAST_LIMITS)
        async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            assert (await http.post("/v1/dags", json=spec)).status_code == 201
            started = await http.post(f"/v1/dags/{spec['name']}/runs", json={"input": {}})
            run_id = started.json()["run_id"]  # no worker serves it: the run stays running
            redis_aof.kill()
            poll = asyncio.create_task(http.get(f"/v1/runs/{run_id}", params={"wait": 4}))
            async with (
                http.stream("GET", f"/v1/runs/{run_id}/events") as stream,
                ws_connect(ws_url(base, f"/v1/runs/{run_id}/ws")) as ws,
            ):
                assert stream.status_code == 200, await stream.aread()
                events = sse_events(stream.aiter_lines())
                assert (await anext(events))[0] == "comment", "keep-alives while Redis is down"
                first_frame = asyncio.create_task(ws.recv())
                await asyncio.sleep(1.0)
                assert not first_frame.done(), f"the socket answered during the outage: {first_frame.result()}"
                await asyncio.to_thread(redis_aof.start)
                name, data = await anext(item async for item in events if item[0] != "comment")
                frame = json.loads(await asyncio.wait_for(first_frame, 15))
            polled = await poll  # its 4 s passed with the run still running: the current view, no 503
    assert polled.status_code == 200 and polled.json()["run_id"] == run_id, polled.text
    assert (name, data["run"]["run_id"], data["run"]["state"]) == ("run", run_id, "running")
    assert (frame["type"], frame["run"]["run_id"]) == ("run", run_id)
