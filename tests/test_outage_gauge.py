"""``fleet_service_up{service}``: the outage watcher's view as a gauge (what FleetStoreUnreachable and
FleetBrokerUnreachable read), probed over real TCP against a listener this test opens and closes."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import REGISTRY

from fleet.outages import OutageLog, Service, watch_outages
from tests.services import free_port


async def wait_for(service: str, value: float, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while REGISTRY.get_sample_value("fleet_service_up", {"service": service}) != value:
        assert time.monotonic() < deadline, f"fleet_service_up{{service={service!r}}} never read {value}"
        await asyncio.sleep(0.02)


async def test_the_gauge_is_1_while_a_service_accepts_connections_and_0_during_an_outage() -> None:
    port = free_port()
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", port)
    dead = Service("kafka", (("127.0.0.1", free_port()),))  # nothing listens there
    watcher = asyncio.create_task(
        watch_outages([Service("redis", (("127.0.0.1", port),)), dead], OutageLog(), interval_s=0.05)
    )
    try:
        await wait_for("redis", 1)
        await wait_for("kafka", 0)
        server.close()
        await server.wait_closed()
        await wait_for("redis", 0)
        server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", port)
        await wait_for("redis", 1)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        server.close()
        await server.wait_closed()
