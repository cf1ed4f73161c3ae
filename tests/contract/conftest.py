"""The ``broker`` fixture: every contract test runs once per broker kind in ``BROKER_KINDS``.

A kind ``k`` other than ``memory`` needs a session fixture ``{k}_url`` (tests/conftest.py) giving a running server.
Every broker is built from ``FleetSettings`` by ``make_broker``, exactly as Fleet builds it, with a short ack wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.settings import FleetSettings

# The one list of broker kinds the contract runs on.
BROKER_KINDS = ["memory", "nats", "kafka"]
# Kinds that talk to a server over the network (a closed port must fail fast).
NETWORK_KINDS = [kind for kind in BROKER_KINDS if kind != "memory"]
# Kinds that deliver one subject first-in first-out to a single consumer.
FIFO_KINDS = [kind for kind in BROKER_KINDS if kind in ("memory", "nats")]
# Kinds where several groups may read one request subject, each getting every message. On NATS the request
# stream is a work queue: a request subject has exactly one group (a second one is a ConfigError).
FAN_OUT_KINDS = [kind for kind in BROKER_KINDS if kind in ("memory", "kafka")]

ACK_WAIT_S = 1.0
DEDUP_WINDOW_S = 60.0
MAX_MESSAGE_BYTES = 64 * 1024


def broker_settings(url: str) -> FleetSettings:
    return FleetSettings.model_validate(
        {
            "broker_url": url,
            "ack_wait_s": ACK_WAIT_S,
            "dedup_window_s": DEDUP_WINDOW_S,
            "max_message_bytes": MAX_MESSAGE_BYTES,
        }
    )


def server_url(request: pytest.FixtureRequest, kind: str) -> str:
    return "memory://" if kind == "memory" else str(request.getfixturevalue(f"{kind}_url"))


@pytest.fixture(params=BROKER_KINDS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """A connected broker of one kind, closed after the test."""
    instance = make_broker(broker_settings(server_url(request, request.param)))
    await instance.connect()
    try:
        yield instance
    finally:
        await instance.close()


@pytest.fixture
def model(unique: str) -> str:
    """A model name of this test alone (so its subjects and groups are too)."""
    return f"t{unique}"
