"""Session-wide services and per-test factories.

``redis_url`` and ``nats_url`` are real servers (see ``tests/services.py``). ``broker_kind`` and ``store_kind``
parametrize a test over every implementation of a seam, so one suite runs unchanged on each.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests import services


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with services.redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A real 3-primary Redis Cluster (``tests/services.py``): a ``redis+cluster://`` URL naming its nodes."""
    with services.redis_cluster() as url:
        yield url


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with services.nats_server() as url:
        yield url


@pytest.fixture
def unique() -> str:
    """A short unique token for subjects, model names and keys of one test."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    """A real Apache Kafka 4.x (single KRaft node, see ``tests/kafka_service.py``) or FLEET_TEST_KAFKA_URL."""
    from tests.kafka_service import kafka_server

    with kafka_server() as url:
        yield url
