"""Outages of the services a process uses, told twice: once when a service stops answering, once when it is back.

The clients (aiokafka, nats-py, redis-py) retry on their own during an outage and say so, aiokafka about 130
ERROR lines a second; the CLI rate-limits them (``fleet.telemetry``). What an operator needs instead is one line
when the outage starts and one when it ends, naming the service and its address. ``watch_outages`` gives them:
every ``interval_s`` it opens (and at once closes) a TCP connection to each address of each service of the process
(the broker's servers, the store's), and ``OutageLog`` logs a WARNING when every address of a service stops
accepting connections and another when one accepts again, with how long the outage lasted. One ``OutageLog`` per
process: each Fleet process reports its own view, also as the gauge ``fleet_service_up{service}`` (what the
shipped alert rules watch).

A probe is a bare TCP connect, so it sees a server that is down or unreachable, not one that accepts connections
but fails requests; an outage shorter than ``interval_s`` may go unreported. It never sends a byte, so servers do
not log it as a client (a TLS server may note a handshake that never started).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client import Gauge

from fleet.settings import FleetSettings

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "kafka": 9092}
STORE_PORT = 6379

SERVICE_UP = Gauge(
    "fleet_service_up",
    "1 while this process reaches a service it uses (a TCP connect to any of its addresses), 0 during an outage; "
    "by service: nats, kafka or redis",
    ["service"],
)


@dataclass(frozen=True, slots=True)
class Service:
    """A service a process depends on: its kind (``nats``, ``kafka``, ``redis``) and the addresses it answers on."""

    kind: str
    addresses: tuple[tuple[str, int], ...]

    @property
    def where(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.addresses)

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


def services_of(settings: FleetSettings) -> list[Service]:
    """The broker and the store of ``settings``, as far as they are servers (``memory://`` is not)."""
    found = []
    if settings.broker_scheme != "memory":
        kind = "kafka" if settings.broker_scheme == "kafka" else "nats"
        found.append(Service(kind, tuple(_addresses(settings.broker_url, DEFAULT_PORTS.get(kind, 4222)))))
    if settings.store_scheme != "memory":
        found.append(Service("redis", tuple(_addresses(settings.store_url, STORE_PORT))))
    return [s for s in found if s.addresses]


def _addresses(url: str, default_port: int) -> Iterator[tuple[str, int]]:
    """``scheme://[user@]h1:p1,h2:p2/...`` and ``nats://h1:p1,nats://h2:p2`` -> ``(h1, p1), (h2, p2)``."""
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        netloc = urlsplit(part if "://" in part else f"x://{part}").netloc.rsplit("@", 1)[-1]
        host, _, port = netloc.rpartition(":") if not netloc.endswith("]") else (netloc, "", "")
        if not host or not port.isdigit():
            host, port = netloc, str(default_port)
        if host:  # a unix socket has none: nothing to probe
            yield host.strip("[]"), int(port)


class OutageLog:
    """Which services are down, since when; logs each change once (WARNING)."""

    def __init__(self) -> None:
        self._down_since: dict[Service, float] = {}

    def is_down(self, service: Service) -> bool:
        return service in self._down_since

    def down(self, service: Service, cause: str) -> None:
        if service in self._down_since:
            return
        self._down_since[service] = time.monotonic()
        log.warning("outage: %s is unreachable (%s); Fleet keeps retrying and says when it is back", service, cause)

    def up(self, service: Service) -> None:
        since = self._down_since.pop(service, None)
        if since is not None:
            log.warning("outage over: %s answers again after %.1fs", service, time.monotonic() - since)


async def probe(service: Service, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when any address of ``service`` accepts a TCP connection; otherwise why the last one did not."""
    cause = "no address"
    for host, port in service.addresses:
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            cause = _cause(exc)
            continue
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass  # closed either way
        return None
    return cause


def _cause(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer to a connection"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc) or type(exc).__name__


async def watch_outages(
    services: list[Service], outages: OutageLog | None = None, interval_s: float = PROBE_INTERVAL_S
) -> None:
    """Probe ``services`` every ``interval_s`` until cancelled, logging each outage's start and end once."""
    outages = outages or OutageLog()
    while True:
        causes = await asyncio.gather(*(probe(s) for s in services))
        for service, cause in zip(services, causes, strict=True):
            if cause is None:
                outages.up(service)
            else:
                outages.down(service, cause)
            SERVICE_UP.labels(service.kind).set(cause is None)
        await asyncio.sleep(interval_s)
