"""Broker implementations behind the seam in ``fleet.brokers.base``; ``make_broker`` picks one by URL scheme.

Implementations are imported lazily, so the in-memory default needs neither nats-py nor aiokafka at import time.
Beside them: ``prioritized`` (one subscription over a model's priority levels, higher first, by
``fleet.priorities``' weights) and ``events`` (typed control events and the listener that reads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleet.settings import BROKER_SCHEMES, url_scheme

if TYPE_CHECKING:
    from fleet.brokers.base import Broker
    from fleet.settings import FleetSettings

__all__ = ["make_broker"]


def make_broker(settings: FleetSettings) -> Broker:
    """The broker for ``settings.broker_url`` (not yet connected: ``await broker.connect()``).

    ``memory://`` gives the in-process ``MemoryBroker``, ``nats://host:4222`` the ``NatsBroker`` and
    ``kafka://host:9092`` the ``KafkaBroker`` (``tls://host:4222``: NATS over TLS). Credentials and TLS come
    from the ``nats_*`` / ``kafka_*`` settings through ``fleet.links``. Raises ``ConfigError`` for any other scheme.
    """
    scheme = url_scheme(settings.broker_url, BROKER_SCHEMES, "broker")
    if scheme == "memory":
        from fleet.brokers.memory import MemoryBroker

        return MemoryBroker.from_settings(settings)
    if scheme in ("nats", "tls"):
        from fleet.brokers.nats import NatsBroker

        return NatsBroker.from_settings(settings)
    from fleet.brokers.kafka import KafkaBroker

    return KafkaBroker(settings.broker_url, settings=settings)
