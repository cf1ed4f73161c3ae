"""Infrastructure failures are not job failures: a worker outlives an outage of its store or its broker.

Each test runs a real worker on NATS + Redis with ``max_deliveries=1``: if a single delivery that the outage cost
were counted as a run, its job would end ``failed``. The servers are this test's own, killed with SIGKILL and
restarted on the same port from their data (Redis from its append-only file, NATS from its JetStream directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumers.handlers import with_name
from consumers.worker import Worker
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.settings import FleetSettings
from fleet.store import make_store
from schemas.jobs import JobState
from tests import kafka_service, services
from tests.handlers_for_tests import Items
from tests.infra import TEST_SETTINGS, eventually, request_bytes, wait_terminal


class Restartable:
    """A server of this test alone that can be SIGKILLed and started again on the same port and data."""

    def __init__(self, argv: list[str], port: int, workdir: Path, what: str) -> None:
        self.argv, self.port, self.workdir, self.what = argv, port, workdir, what
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc, log = services.start_server(self.argv, self.workdir)
        if self.what.startswith("kafka"):
            kafka_service._wait_ready(f"127.0.0.1:{self.port}", self.proc, log)
        else:
            services.wait_port("127.0.0.1", self.port, self.proc, log, 20, self.what)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            services.stop_server(self.proc)


@contextlib.contextmanager
def restartable(kind: str) -> Iterator[tuple[str, Restartable]]:
    port = services.free_port()
    with tempfile.TemporaryDirectory(prefix=f"fleet-{kind}-outage-") as tmp:
        if kind == "kafka":
            java = services.require_binary("java", "openjdk-17-jre-headless", "Apache Kafka")
            jars = kafka_service.kafka_jars()
            config = kafka_service.write_config(Path(tmp), port, services.free_port())
            kafka_service.format_storage(java, jars, Path(tmp), config)
            argv = [*kafka_service._java_argv(java, jars, Path(tmp), "kafka.Kafka"), str(config)]
            url = f"kafka://127.0.0.1:{port}"
        elif kind == "redis":
            binary = services.require_binary("redis-server", "redis-server")
            argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp]
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
            url = f"redis://127.0.0.1:{port}/0"
        else:
            binary = services.require_binary("nats-server", "nats-server")
            argv = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", tmp]
            url = f"nats://127.0.0.1:{port}"
        server = Restartable(argv, port, Path(tmp), f"{kind} (outage test)")
        server.start()
        try:
            yield url, server
        finally:
            server.stop()


def outage_settings(broker_url: str, store_url: str) -> FleetSettings:
    values = {**TEST_SETTINGS, "broker_url": broker_url, "store_url": store_url, "max_deliveries": 1}
    return FleetSettings(**values)


async def _run_through_outage(settings: FleetSettings, server: Restartable, unique: str, jobs: int) -> list[str]:
    """Publish ``jobs`` slow-ish jobs, SIGKILL ``server`` while they run, restart it after 2 s; the states seen."""
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"items-{unique}"
    states: list[str] = []
    try:
        await broker.ensure_model(model)
        ids = [f"{unique}-{i}" for i in range(jobs)]
        for i, job_id in enumerate(ids):
            body = request_bytes(model, job_id, {"value": i, "sleep_ms": 20})
            await broker.publish(c.request_subject(model), body, msg_id=job_id)
        worker = Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=4, max_wait_ms=5)
        async with worker:

            async def running() -> bool:
                return worker.stats.items >= 8

            await eventually(running, 30, "the first batches")
            server.kill()
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                states.append(worker.state)
                await asyncio.sleep(0.05)
            server.start()
            records = await wait_terminal(store, ids, timeout_s=60)
        wrong = {k: (r.state.value, r.error and r.error.message) for k, r in records.items() if r.state != "succeeded"}
        assert not wrong, f"healthy jobs that did not succeed through the outage: {wrong}"
        assert all(r.state is JobState.succeeded for r in records.values())
        assert worker.stats.items >= jobs
    finally:
        await store.close()
        await broker.close()
    return states


@pytest.mark.timeout(180)
async def test_a_redis_restart_mid_run_fails_no_job_and_the_worker_says_it_is_degraded(nats_url, unique) -> None:
    with restartable("redis") as (redis_url, server):
        states = await _run_through_outage(outage_settings(nats_url, redis_url), server, unique, 80)
    assert "degraded" in states, f"the worker must say it is degraded while its store is away; saw {set(states)}"


@pytest.mark.timeout(180)
async def test_a_nats_restart_mid_run_fails_no_job(redis_url, unique) -> None:
    with restartable("nats") as (nats_url, server):
        await _run_through_outage(outage_settings(nats_url, redis_url), server, unique, 80)


@pytest.mark.timeout(300)
async def test_a_kafka_restart_mid_run_fails_no_job(redis_url, unique) -> None:
    with restartable("kafka") as (kafka_url, server):
        await _run_through_outage(outage_settings(kafka_url, redis_url), server, unique, 80)
