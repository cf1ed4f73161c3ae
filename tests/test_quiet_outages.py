"""Outages are quiet and a stop during one is clean: a ``fleet worker`` told to stop while its broker or store is
down exits 0 with no traceback and no ``error:`` line, and an outage is told in two Fleet warnings (its start and its
end, naming the service and its address) while the clients' own repeated errors are held back.

Each test runs a real worker process on a server of its own (``tests.aof_redis.restartable``) that it SIGKILLs
and restarts; the other service is the session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from subprocess import Popen

import pytest

from fleet.brokers import make_broker
from fleet.schemas.jobs import JobState
from fleet.settings import FleetSettings
from fleet.store import make_store
from tests.aof_redis import Restartable, restartable
from tests.infra import TEST_SETTINGS, eventually, publish_requests
from tests.processes import fleet_process, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.slow

KINDS = ["redis", "nats", "kafka"]
OUTAGE_S = 8.0  # how long a measured outage lasts
MAX_LINES_PER_OUTAGE = 40  # everything logged between an outage's start and end warnings


@contextlib.contextmanager
def worker_on(down: str, other_url: str, log: Path, **env: str) -> Iterator[tuple[Restartable, Popen[bytes], dict]]:
    """A ``sleep`` worker on a ``down`` server of this test's own and the session's other service; ready."""
    with restartable(down) as server:
        broker, store = (other_url, server.url) if down == "redis" else (server.url, other_url)
        urls = {"broker_url": broker, "store_url": store}
        port = free_port()
        variables = {"FLEET_BROKER_URL": broker, "FLEET_STORE_URL": store, "FLEET_DRAIN_TIMEOUT_S": "5", **env}
        with fleet_process("worker", "--model", "sleep", "--metrics-port", str(port), env=variables, log=log) as proc:
            wait_http_ready(f"http://127.0.0.1:{port}/readyz", proc, log)
            yield server, proc, urls


def other_service(down: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("nats_url" if down == "redis" else "redis_url"))


def wait_logged(log: Path, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not logged within {timeout_s}s:\n{log.read_text(errors='replace')[-3000:]}")


def outage_started(server: Restartable) -> str:
    return f"outage: {server.what} at 127.0.0.1:{server.port} is unreachable"


def outage_ended(server: Restartable) -> str:
    return f"outage over: {server.what} at 127.0.0.1:{server.port} answers again"


@contextlib.asynccontextmanager
async def clients(urls: dict[str, str]) -> AsyncIterator[tuple]:
    settings = FleetSettings(**{**TEST_SETTINGS, **urls})
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    try:
        yield broker, store
    finally:
        await store.close()
        await broker.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("down", KINDS)
async def test_a_worker_stopped_while_a_service_is_down_exits_0_without_a_traceback(
    down: str, request: pytest.FixtureRequest, unique: str, tmp_path: Path
) -> None:
    """Jobs are in flight when the server dies; on NATS one finishes while it is away, so its ack waits in the
    client's buffer when the worker closes the connection (which nats-py answered with ``Connection lost``)."""
    log = tmp_path / "worker.log"
    with worker_on(down, other_service(down, request), log) as (server, proc, urls):
        async with clients(urls) as (broker, store):
            inputs = [{"mean_ms": 1500 + 500 * i, "distribution": "fixed"} for i in range(4)]
            ids = await publish_requests(broker, "sleep", inputs, unique)

            async def running() -> bool:
                records = [await store.get(j) for j in ids]
                return any(r is not None and r.state is JobState.running for r in records)

            await eventually(running, 30, "a job running")
            server.kill()
            wait_logged(log, outage_started(server))
            if down == "nats":  # a result lands in Redis while NATS is away: its ack is buffered

                async def one_done() -> bool:
                    records = [await store.get(j) for j in ids]
                    return any(r is not None and r.terminal for r in records)

                await eventually(one_done, 30, "a job finished during the NATS outage")
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 90)
            # the test's own client of the dead server closes as the worker's did
    out = log.read_text(errors="replace")
    assert code == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert "error:" not in out, out[-5000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("down", KINDS)
def test_an_outage_is_two_warnings_naming_the_service_and_the_clients_are_held_back(
    down: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with worker_on(down, other_service(down, request), log) as (server, proc, _):
        server.kill()
        wait_logged(log, outage_started(server))
        time.sleep(OUTAGE_S)  # the outage whose lines are counted: its length, not a synchronisation
        server.start()
        wait_logged(log, outage_ended(server), 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text(errors="replace")[-5000:]
    lines = log.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if outage_started(server) in line]
    ends = [i for i, line in enumerate(lines) if outage_ended(server) in line]
    assert len(starts) == 1 and len(ends) == 1, "\n".join(lines[-200:])
    during = lines[starts[0] : ends[0]]
    assert len(during) <= MAX_LINES_PER_OUTAGE, f"{len(during)} lines during an {OUTAGE_S}s outage:\n" + "\n".join(
        during[:200]
    )
