"""The CLI's log limits (``fleet.telemetry.RepeatLimiter``) and the addresses the outage watch probes."""

from __future__ import annotations

import logging

import pytest

from fleet.outages import Service, services_of
from fleet.settings import FleetSettings
from fleet.telemetry import RepeatLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(name: str, msg: str, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_client_template_passes_its_burst_per_window_and_the_next_window_says_how_many_were_held() -> None:
    clock = Clock()
    limiter = RepeatLimiter(window_s=60, fleet_burst=10, client_burst=2, clock=clock)
    passed = [limiter.filter(record("aiokafka", "Unable connect to node with id %s: %s", 1, i)) for i in range(1300)]
    assert sum(passed) == 2
    assert limiter.filter(record("aiokafka", "Unable to update metadata from %s", [1]))  # another template
    clock.now = 61
    late = record("aiokafka", "Unable connect to node with id %s: %s", 1, "x")
    assert limiter.filter(late)
    assert "[1298 more like this held back in 60s]" in late.getMessage()


def test_fleet_loggers_get_a_larger_burst_and_levels_are_counted_apart() -> None:
    limiter = RepeatLimiter(window_s=60, fleet_burst=10, client_burst=2, clock=Clock())
    assert sum(limiter.filter(record("fleet.consumers.worker", "heartbeat not sent: %s", i)) for i in range(50)) == 10
    assert limiter.filter(record("fleet.consumers.worker", "heartbeat not sent: %s", 0, level=logging.INFO))


@pytest.mark.parametrize(
    ("broker", "store", "expected"),
    [
        ("nats://a:4222,nats://b:5222", "redis://r:6380/0", ["nats at a:4222,b:5222", "redis at r:6380"]),
        ("kafka://k1,k2:9093", "rediss://u@r/1", ["kafka at k1:9092,k2:9093", "redis at r:6379"]),
        ("tls://[::1]:4222", "memory://", ["nats at ::1:4222"]),
        ("memory://", "memory://", []),
    ],
)
def test_the_outage_watch_probes_every_server_of_the_broker_and_the_store(
    broker: str, store: str, expected: list[str]
) -> None:
    settings = FleetSettings(broker_url=broker, store_url=store)
    services: list[Service] = services_of(settings)
    assert [str(s) for s in services] == expected
